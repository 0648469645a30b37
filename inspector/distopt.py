"""DistributedOptimizer shard ownership, read off megatron-core's own grad-buffer layout.

megatron-core's DistributedDataParallel lays one model chunk's parameters into contiguous buffers,
one per (param dtype, grad dtype) and a separate set for expert-parallel parameters
(distributed/distributed_data_parallel.py). Each _ParamAndGradBuffer takes the parameters in
reverse order, starts each at a multiple of 64 elements, closes a bucket once it holds
`bucket_size` elements, gives a `shared_embedding` parameter a bucket of its own, and pads every
bucket to a multiple of lcm(dp, 128) (distributed/param_and_grad_buffer.py). The
DistributedOptimizer then gives data-parallel rank r the r-th of dp equal slices of every bucket
(optimizer/distrib_optimizer.py, `_build_model_gbuf_range`).

Here megatron's own DistributedDataParallel constructor builds that layout on the meta device. Two
things are simulated, each in one place: `torch.cuda.current_device()` answers "meta" inside
`cuda_current_device_on_meta()`, and the data-parallel process groups are `StandInGroup`s whose
size() is dp, so no world of tp*pp*dp ranks is ever set up and dp costs nothing. Ownership is then
interval arithmetic over the layout, reproducing `_build_model_gbuf_param_range_map` once per
parameter instead of once per rank (tests/test_distopt.py checks it against megatron's own).

Words: "rank" below is a rank inside the group that shards the buffer: the data-parallel x
context-parallel group for dense parameters, the expert data-parallel group for expert ones.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inspector.errors import ConfigError

if TYPE_CHECKING:
    from inspector.topology import Layout


@dataclass(frozen=True)
class ShardSlice:
    """Elements [start, end) of one flattened parameter that one rank's shard holds."""

    rank: int
    start: int
    end: int


@dataclass(frozen=True)
class ParamShards:
    """Where one parameter sits in a grad buffer, and which ranks' shards hold its elements.

    `start`/`end` are buffer offsets; its bucket starts at `bucket_offset` and is cut into
    shards of `shard_numel` elements, rank r's being the r-th (DistributedOptimizer
    `_build_model_gbuf_range`). Owners and slices are computed from these on demand, so a
    parameter spread over many ranks costs nothing until asked.
    """

    name: str
    buffer: int
    bucket: int
    start: int
    end: int
    bucket_offset: int
    shard_numel: int

    @property
    def owners(self) -> tuple[int, ...]:
        """Return the ascending ranks whose shard holds any of this parameter's elements."""
        if self.end <= self.start:
            return ()
        first = (self.start - self.bucket_offset) // self.shard_numel
        last = (self.end - 1 - self.bucket_offset) // self.shard_numel
        return tuple(range(first, last + 1))

    def slice_of(self, rank: int) -> ShardSlice:
        """Return the elements of this parameter (flattened) that `rank`'s shard holds."""
        # _build_model_gbuf_param_range_map: the rank's window clipped to the param ("param").
        window = self.bucket_offset + rank * self.shard_numel
        lo = max(self.start, window)
        hi = min(self.end, window + self.shard_numel)
        return ShardSlice(rank, lo - self.start, max(lo, hi) - self.start)

    @property
    def slices(self) -> tuple[ShardSlice, ...]:
        """Return one non-empty slice per owner, in rank order; together they cover the param."""
        return tuple(self.slice_of(rank) for rank in self.owners)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its offset in the buffer and its size with and without end padding."""

    offset: int
    numel: int
    numel_unpadded: int


@dataclass(frozen=True)
class BufferLayout:
    """One grad buffer of a model chunk, as megatron allocates it on every rank.

    `numel` (padding included) is what every rank allocates for grads, and for params too under
    the distributed optimizer; each rank's shard is `shard_numel` of it; `owned_numel[r]` counts
    the parameter elements in rank r's shard (no padding), i.e. what the optimizer state covers.
    """

    expert: bool
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    dp_size: int
    numel: int
    numel_unpadded: int
    buckets: tuple[BucketLayout, ...]
    owned_numel: tuple[int, ...]

    @property
    def shard_numel(self) -> int:
        """Return the elements (padding included) of one rank's shard; equal on every rank."""
        return self.numel // self.dp_size


@dataclass(frozen=True)
class DistOptLayout:
    """A model chunk's grad buffers and, per parameter, its shard slices."""

    params: tuple[ParamShards, ...]
    buffers: tuple[BufferLayout, ...]
    frozen: tuple[str, ...]
    bucket_size: int | None

    def owners(self) -> dict[str, tuple[int, ...]]:
        """Return parameter name -> owning ranks; parameters without grad map to ()."""
        owners = {p.name: p.owners for p in self.params}
        owners.update((name, ()) for name in self.frozen)
        return owners


class StandInGroup:
    """A process group as megatron's DDP sees it at construction: only size() and rank()."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size = size
        self._rank = rank

    def size(self) -> int:
        """Return the group size."""
        return self._size

    def rank(self) -> int:
        """Return this rank's index in the group."""
        return self._rank


@contextmanager
def cuda_current_device_on_meta() -> Iterator[None]:
    """Make `torch.cuda.current_device()` answer "meta", so megatron allocates buffers on meta."""
    # The only torch.cuda call on the DDP construction path we use: _ParamAndGradBuffer allocates
    # param_data / grad_data with device=torch.cuda.current_device().
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "meta"  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = real


@contextmanager
def _torch_distributed_initialized() -> Iterator[None]:
    """Provide a one-rank fake world if none is set up (megatron's DDP logging asserts one)."""
    if torch.distributed.is_initialized():
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@contextmanager
def _params_left_untouched(model: torch.nn.Module) -> Iterator[None]:
    """Undo what megatron's DDP does to the parameters (re-pointed .data, main_grad)."""
    saved = {p: p.data for p in model.parameters()}
    try:
        yield
    finally:
        for param, data in saved.items():
            param.data = data
            for attr in ("main_grad", "grad_added_to_main_grad"):
                if hasattr(param, attr):
                    delattr(param, attr)


def resolve_bucket_size(
    bucket_size: int | None, *, overlap_grad_reduce: bool, dp_cp_size: int
) -> int | None:
    """Return the bucket size Megatron-LM hands to DDP (None: one bucket per buffer)."""
    # Megatron-LM core_v0.16.1 megatron/training/training.py get_model(): without
    # --ddp-bucket-size, max(40000000, 1000000 * data-parallel size with context parallel);
    # without --overlap-grad-reduce, None.
    if not overlap_grad_reduce:
        return None
    if bucket_size is None:
        return max(40_000_000, 1_000_000 * dp_cp_size)
    return bucket_size


@dataclass(frozen=True)
class DistOptSettings:
    """The Megatron-LM flags that shape the distributed optimizer's buffers, validated.

    Args:
        dp_size: --dp; dense parameters are sharded over dp_size * context_parallel_size ranks.
        expert_dp_size: the expert data-parallel size, which shards expert-parallel parameters.
        bucket_size: --ddp-bucket-size (None: Megatron-LM's default).
        overlap_grad_reduce: --overlap-grad-reduce (off: no bucketing at all).
        context_parallel_size: --context-parallel-size.
        pad_buckets_for_high_nccl_busbw: --ddp-pad-buckets-for-high-nccl-busbw.
        grad_reduce_in_fp32: --accumulate-allreduce-grads-in-fp32 (None: Megatron-LM's default,
            on for bf16 models); sets only the grad dtype, never the layout.
        use_distributed_optimizer: off gives the plain DDP buffers (no padding, no param buffer)
            that `inspect-model memory` sizes without --use-distributed-optimizer.
    """

    dp_size: int
    expert_dp_size: int = 1
    bucket_size: int | None = None
    overlap_grad_reduce: bool = False
    context_parallel_size: int = 1
    pad_buckets_for_high_nccl_busbw: bool = False
    grad_reduce_in_fp32: bool | None = None
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        sizes = (self.dp_size, self.expert_dp_size, self.context_parallel_size)
        if min(sizes) < 1:
            raise ConfigError(
                f"data-parallel sizes must be positive (--dp {self.dp_size}, expert "
                f"data-parallel {self.expert_dp_size}, --context-parallel-size "
                f"{self.context_parallel_size})"
            )
        if self.bucket_size is not None and self.bucket_size < 0:
            raise ConfigError(f"--ddp-bucket-size {self.bucket_size} must not be negative")

    @classmethod
    def for_layout(cls, layout: Layout, **flags: Any) -> DistOptSettings:
        """Return the settings a topology.Layout implies; `flags` sets the remaining fields."""
        return cls(
            dp_size=layout.dp,
            expert_dp_size=layout.expert_dp,
            bucket_size=layout.ddp_bucket_size,
            overlap_grad_reduce=layout.overlap_grad_reduce,
            context_parallel_size=layout.cp,
            **flags,
        )

    @property
    def dp_cp_size(self) -> int:
        """Return the size of the group that shards dense parameters."""
        return self.dp_size * self.context_parallel_size


@contextmanager
def _no_buffer_logging() -> Iterator[None]:
    """Skip the grad buffer's per-stage log line, which asks parallel_state for ranks (0.13-0.14).

    It only logs; the layout is computed before it and does not depend on it.
    """
    from megatron.core.distributed import param_and_grad_buffer

    original = getattr(param_and_grad_buffer, "log_on_each_pipeline_stage", None)
    if original is None:
        yield
        return
    param_and_grad_buffer.log_on_each_pipeline_stage = lambda *args, **kwargs: None
    try:
        yield
    finally:
        param_and_grad_buffer.log_on_each_pipeline_stage = original


def _stand_in_groups(settings: DistOptSettings, pipeline_rank: int) -> dict[str, Any]:
    """Return DDP's process-group arguments, made of stand-in groups.

    megatron-core 0.15+ takes one `pg_collection`; 0.13-0.14 take `grad_comm_pgs` and
    `model_comm_pgs` (tests/test_versions.py runs it on each). DDP reads only rank() of tp, pp and
    ep: tp and dp-cp rank 0 log the buckets, pp rank > 0 disables bucketing.
    """
    from megatron.core import process_groups_config as pgc
    from megatron.core.distributed import DistributedDataParallel

    groups = dict(
        dp=StandInGroup(settings.dp_size),
        dp_cp=StandInGroup(settings.dp_cp_size),
        expt_dp=StandInGroup(settings.expert_dp_size),
        tp=StandInGroup(1),
        pp=StandInGroup(pipeline_rank + 1, pipeline_rank),
        ep=StandInGroup(1),
    )
    if "pg_collection" in inspect.signature(DistributedDataParallel.__init__).parameters:
        collection = pgc.ProcessGroupCollection()
        for name, group in groups.items():
            setattr(collection, name, group)
        return {"pg_collection": collection}
    grad, model = pgc.GradCommProcessGroups(), pgc.ModelCommProcessGroups()
    for name in ("dp", "dp_cp", "expt_dp"):
        setattr(grad, name, groups[name])
    for name in ("tp", "pp", "ep"):
        setattr(model, name, groups[name])
    return {"grad_comm_pgs": grad, "model_comm_pgs": model}


def wrap_in_megatron_ddp(
    model: torch.nn.Module, settings: DistOptSettings, *, pipeline_rank: int = 0, chunk: int = 0
) -> Any:
    """Wrap one model chunk in megatron's DistributedDataParallel on meta.

    Args:
        model: one pipeline stage's (one virtual chunk's) model, e.g. a GPTModel or the
            Float16Module around it; it is left as it was found.
        settings: the data-parallel sizes and DDP flags.
        pipeline_rank: the stage; megatron's DDP buckets only on stage 0.
        chunk: the virtual-pipeline chunk; Megatron-LM buckets only chunk 0.

    Returns the DistributedDataParallel: its `buffers` and `expert_parallel_buffers` are the
    layout.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config: Any = model.config
    fp32_grads = settings.grad_reduce_in_fp32
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.bf16 if fp32_grads is None else fp32_grads,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        # Without overlap DDP replaces any bucket size by None itself; a concrete value keeps
        # megatron-core 0.13-0.15 from asking parallel_state for a default first.
        bucket_size=resolve_bucket_size(
            settings.bucket_size,
            overlap_grad_reduce=True,
            dp_cp_size=settings.dp_cp_size,
        ),
        pad_buckets_for_high_nccl_busbw=settings.pad_buckets_for_high_nccl_busbw,
    )
    groups = _stand_in_groups(settings, pipeline_rank)
    with _torch_distributed_initialized(), cuda_current_device_on_meta(), _no_buffer_logging():
        with _params_left_untouched(model):
            # Megatron-LM (training.py get_model) disables bucketing for chunks after the first.
            return DistributedDataParallel(
                config, ddp_config, model, disable_bucketing=chunk > 0, **groups
            )


def _owned_numel(shards: list[ParamShards], dp_size: int) -> tuple[int, ...]:
    """Return, per rank, how many parameter elements (no padding) its shard of a buffer holds."""
    # Whole shards inside a parameter go through a difference array, so the cost is
    # O(params + dp) however many ranks one parameter spans.
    edges = [0] * (dp_size + 1)
    partial = [0] * dp_size
    for p in shards:
        owners = p.owners
        if not owners:
            continue
        first, last = owners[0], owners[-1]
        for rank in {first, last}:
            piece = p.slice_of(rank)
            partial[rank] += piece.end - piece.start
        if last - first > 1:
            edges[first + 1] += p.shard_numel
            edges[last] -= p.shard_numel
    return tuple(a + b for a, b in zip(itertools.accumulate(edges), partial, strict=False))


def _layout_buffer(
    buffer: Any, index: int, expert: bool, names: dict[torch.nn.Parameter, str]
) -> tuple[BufferLayout, list[ParamShards]]:
    """Return one megatron buffer's layout and where each of its parameters sits."""
    dp_size = buffer.data_parallel_world_size
    shards = []
    for param, (start, end, bucket_id) in buffer.param_index_map.items():
        bucket = buffer.buckets[bucket_id]
        shard = bucket.grad_data.numel() // dp_size  # _build_model_gbuf_range
        shards.append(ParamShards(names[param], index, bucket_id, start, end, bucket.offset, shard))
    buckets = tuple(
        BucketLayout(b.offset, b.grad_data.numel(), b.numel_unpadded) for b in buffer.buckets
    )
    layout = BufferLayout(
        expert=expert,
        param_dtype=buffer.param_dtype,
        grad_dtype=buffer.grad_dtype,
        dp_size=dp_size,
        numel=buffer.numel,
        numel_unpadded=buffer.numel_unpadded,
        buckets=buckets,
        owned_numel=_owned_numel(shards, dp_size),
    )
    return layout, shards


def layout_from_ddp(ddp: Any, model: torch.nn.Module) -> DistOptLayout:
    """Return the layout of a megatron DistributedDataParallel built around `model`."""
    names = {param: name for name, param in model.named_parameters()}
    order = {name: i for i, name in enumerate(names.values())}
    buffers: list[BufferLayout] = []
    params: list[ParamShards] = []
    tagged = [(b, False) for b in ddp.buffers] + [(b, True) for b in ddp.expert_parallel_buffers]
    for index, (buffer, expert) in enumerate(tagged):
        layout, shards = _layout_buffer(buffer, index, expert, names)
        buffers.append(layout)
        params.extend(shards)
    params.sort(key=lambda p: order[p.name])
    held = {p.name for p in params}
    frozen = tuple(name for name in names.values() if name not in held)
    return DistOptLayout(tuple(params), tuple(buffers), frozen, ddp.bucket_size)


def distopt_layout(
    model: torch.nn.Module, settings: DistOptSettings, *, pipeline_rank: int = 0, chunk: int = 0
) -> DistOptLayout:
    """Return megatron's DistributedOptimizer layout for one model chunk."""
    ddp = wrap_in_megatron_ddp(model, settings, pipeline_rank=pipeline_rank, chunk=chunk)
    return layout_from_ddp(ddp, model)


def distopt_owners(
    model: torch.nn.Module, settings: DistOptSettings, *, pipeline_rank: int = 0, chunk: int = 0
) -> dict[str, tuple[int, ...]]:
    """Return parameter name -> ascending ranks whose optimizer shard holds any of its elements."""
    layout = distopt_layout(model, settings, pipeline_rank=pipeline_rank, chunk=chunk)
    return layout.owners()
