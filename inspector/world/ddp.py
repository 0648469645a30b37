"""megatron-core's DistributedDataParallel, built on the meta device to read its buffer layout.

Megatron-LM wraps every model chunk in megatron's DistributedDataParallel; its constructor lays
the chunk's parameters into grad (and, with the distributed optimizer, param) buffers. Here that
constructor runs for real on the meta device. Two things are simulated, each in one place:
`torch.cuda.current_device()` answers "meta" inside `cuda_current_device_on_meta()`, and the
data-parallel process groups are `StandInGroup`s whose size() is dp, so no world of tp*pp*dp
ranks is ever set up and dp costs nothing. What it laid out becomes plain records (shards.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from inspector.world.setup import one_rank_world
from inspector.world.shards import (
    BucketLayout,
    BufferLayout,
    DistOptLayout,
    DistOptSettings,
    ParamShards,
    owned_numel,
    resolve_bucket_size,
)
from inspector.world.te.float8_tensor import kept_bytes


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

    # When the engine runs a backward, megatron-core 0.13's distributed optimizer issues its
    # bucketed reduce-scatter through torch's _coalescing_manager, which calls these methods of the
    # group itself (torch/distributed/distributed_c10d.py, _coalescing_manager). On meta tensors
    # there is nothing to move: each is a finished no-op, as the outputs already exist.
    def reduce_scatter_single_coalesced(self, *args: object) -> _Done:
        return _Done()

    def all_gather_single_coalesced(self, *args: object) -> _Done:
        return _Done()

    def allreduce_coalesced(self, *args: object) -> _Done:
        return _Done()


class _Done:
    """A collective's work handle that has already finished."""

    def wait(self, *args: object) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


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


class MetaStream:
    """A CUDA stream or event as megatron uses them: ordering only, no memory (one stream runs
    everything here)."""

    def wait_stream(self, *args: Any) -> None:
        """Order nothing."""

    def record_event(self, *args: Any) -> MetaStream:
        """Return an event that is already complete."""
        return self

    def synchronize(self) -> None:
        """Wait for nothing."""

    def wait(self, *args: Any) -> None:
        """Return at once: the event is complete (Megatron-FSDP's reduce queue waits on it)."""


META_STREAM = MetaStream()


@contextmanager
def cuda_streams_on_meta() -> Iterator[None]:
    """Give megatron a stream where it makes or waits on one: DDP's communication stream with
    several distributed-optimizer instances (distributed_data_parallel.py, `torch.cuda.Stream`;
    param_and_grad_buffer.py `finish_grad_sync`, `torch.cuda.default_stream().wait_stream`)."""
    saved = torch.cuda.Stream, torch.cuda.default_stream, torch.cuda.stream
    torch.cuda.Stream = lambda *args, **kwargs: META_STREAM  # type: ignore[assignment,misc]
    torch.cuda.default_stream = lambda *args, **kwargs: META_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.default_stream, torch.cuda.stream = saved  # type: ignore[misc]


@contextmanager
def _params_left_untouched(model: torch.nn.Module) -> Iterator[None]:
    """Undo what megatron's DDP does to the parameters (re-pointed .data, main_grad)."""
    saved = {p: p.data for p in model.parameters()}
    # an fp8 parameter's bytes are its `_data`, which DDP re-points (TE's replace_raw_data)
    raw = {p: p._data for p in model.parameters() if hasattr(p, "_data")}
    try:
        yield
    finally:
        for param, data in saved.items():
            param.data = data
            # ... and what the layer-wise layout's tagging adds (`_layer_wise_layout`)
            for attr in ("main_grad", "grad_added_to_main_grad", LAYER_WISE_TAG):
                if hasattr(param, attr):
                    delattr(param, attr)
        for param, data in raw.items():
            param._data = data


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
    if settings.instances > 1:
        # parallel_state.initialize_model_parallel's partial data-parallel groups: each instance
        # is dp_cp / N consecutive data-parallel ranks, which shard the optimizer among them
        instances = settings.instances
        groups.update(
            intra_dp_cp=StandInGroup(settings.dp_cp_size // instances),
            intra_expt_dp=StandInGroup(settings.expert_dp_size // instances),
            inter_dist_opt=StandInGroup(instances),
            intra_dist_opt=StandInGroup(settings.dp_cp_size // instances),
        )
    if "pg_collection" in inspect.signature(DistributedDataParallel.__init__).parameters:
        collection = pgc.ProcessGroupCollection()
        for name, group in groups.items():
            setattr(collection, name, group)
        return {"pg_collection": collection}
    grad, model = pgc.GradCommProcessGroups(), pgc.ModelCommProcessGroups()
    for name in ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp", "inter_dist_opt"):
        if name in groups:
            setattr(grad, name, groups[name])
    for name in ("tp", "pp", "ep"):
        setattr(model, name, groups[name])
    return {"grad_comm_pgs": grad, "model_comm_pgs": model}


def wrap_in_megatron_ddp(
    model: torch.nn.Module,
    settings: DistOptSettings,
    *,
    pipeline_rank: int = 0,
    chunk: int = 0,
    running: bool = False,
) -> Any:
    """Wrap one model chunk in megatron's DistributedDataParallel on meta.

    Args:
        model: one pipeline stage's (one virtual chunk's) model, e.g. a GPTModel or the
            Float16Module around it; it is left as it was found.
        settings: the data-parallel sizes and DDP flags.
        pipeline_rank: the stage; megatron's DDP buckets only on stage 0.
        chunk: the virtual-pipeline chunk; Megatron-LM buckets only chunk 0.
        running: keep the parameters in DDP's buffers, with `main_grad` and DDP's hooks, for a
            model that will run (inspector/memory/engine); otherwise they are left as found.

    Returns the DistributedDataParallel: its `buffers` and `expert_parallel_buffers` are the
    layout.
    """
    from megatron.core.distributed import DistributedDataParallel

    config: Any = model.config
    ddp_config = _ddp_config(config, settings)
    groups = _stand_in_groups(settings, pipeline_rank)
    with one_rank_world(), cuda_current_device_on_meta(), _no_buffer_logging(), cuda_streams_on_meta():
        kept = contextlib.nullcontext() if running else _params_left_untouched(model)
        with kept:
            layout = {}
            if settings.layer_wise:
                first = chunk == 0 and pipeline_rank == 0
                layout["full_param_layout"] = _layer_wise_layout(model, ddp_config, settings, first)
            # Megatron-LM (training.py get_model) disables bucketing for chunks after the first.
            return DistributedDataParallel(
                config, ddp_config, model, disable_bucketing=chunk > 0, **groups, **layout
            )


LAYER_WISE_TAG = "is_managed_by_layer_wise_optimizer"  # layer_wise_optimizer.py's parameter tag


def _layer_wise_layout(model: torch.nn.Module, ddp_config: Any, settings: DistOptSettings,
                       first_bucketed: bool) -> Any:  # fmt: skip
    """Return the layer-wise optimizer's layout of `model`, as Megatron-LM 0.18+ computes it
    before DDP (training.py `wrap_model_chunks_with_ddp`): megatron's
    `tag_params_for_buffer_routing` sends the 2-D weights that are not embeddings or the output
    layer to buffers of their own, and `LayerWiseDistributedOptimizer.compute_full_param_layout`
    packs each of those buckets into dp shards of whole matrices (the other buffers get the
    DistributedOptimizer's layout), at the bucket size DDP takes: Megatron-LM's
    `resolve_ddp_bucket_size`, None past the first chunk and stage (`per_chunk_bucket_sizes`)."""
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    tag_params_for_buffer_routing([model])
    bucketed = first_bucketed and ddp_config.overlap_grad_reduce
    return LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in model.parameters() if p.requires_grad],
        ddp_config.bucket_size if bucketed else None,
        settings.dp_cp_size,  # one optimizer instance (job/optimizers.py refuses more)
        ddp_config,
        expert_data_parallel_world_size=settings.expert_dp_size,
    )


def _ddp_config(config: Any, settings: DistOptSettings) -> Any:
    """Return megatron's DistributedDataParallelConfig for these settings and the model's dtype."""
    from megatron.core.distributed import DistributedDataParallelConfig

    fp32_grads = settings.grad_reduce_in_fp32
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.bf16 if fp32_grads is None else fp32_grads,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        # the layer-wise layout turns it on (training.py wrap_model_chunks_with_ddp: "needed for
        # reduce-scatter")
        use_distributed_optimizer=settings.use_distributed_optimizer or settings.layer_wise,
        # Without overlap DDP replaces any bucket size by None itself; a concrete value keeps
        # megatron-core 0.13-0.15 from asking parallel_state for a default first.
        bucket_size=resolve_bucket_size(
            settings.bucket_size,
            overlap_grad_reduce=True,
            dp_cp_size=settings.dp_cp_size,
        ),
        pad_buckets_for_high_nccl_busbw=settings.pad_buckets_for_high_nccl_busbw,
        # Megatron-LM's get_model copies --fp8-param-gather in; 0.17+ DistributedOptimizer casts
        # the fp8 weights' main shards only when it is set (0.13-0.16 ask each parameter)
        fp8_param_gather=bool(getattr(config, "fp8_param", False)),
        num_distributed_optimizer_instances=settings.instances,
        reuse_grad_buf_for_mxfp8_param_ag=settings.reuse_grad_buf_for_mxfp8_param_ag,
        # Megatron-LM copies --fp4-param-gather in (a field of megatron-core 0.17+, where alone
        # --fp4-param-gather is modelled): the DistributedOptimizer then casts NVFP4 main shards
        **({"fp4_param_gather": True} if getattr(config, "fp4_param", False) else {}),
    )


def _layout_buffer(
    buffer: Any, index: int, expert: bool, names: dict[torch.nn.Parameter, str], layer_wise: bool
) -> tuple[BufferLayout, list[ParamShards]]:
    """Return one megatron buffer's layout and where each of its parameters sits.

    Without the distributed optimizer megatron all-reduces whole buckets and pads nothing
    (param_and_grad_buffer.py asserts numel == numel_unpadded), so a bucket need not divide by
    dp: each rank's "shard" is then the whole bucket and every rank updates every element.
    """
    dp_size = buffer.data_parallel_world_size
    sharded = buffer.ddp_config.use_distributed_optimizer
    shards = []
    for param, (start, end, bucket_id) in buffer.param_index_map.items():
        bucket = buffer.buckets[bucket_id]
        shard = bucket.grad_data.numel() // (dp_size if sharded else 1)  # _build_model_gbuf_range
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
        owned_numel=(
            owned_numel(shards, dp_size) if sharded else (buffer.numel_unpadded,) * dp_size
        ),
        kept=sum(kept_bytes(param) for param in buffer.param_index_map),
        shared=hasattr(buffer, "shared_buffer"),  # set only for MXFP8 weights (779-793)
        # NVFP4 weights' packed param buffer (0.18+ `nvfp4_packed_numel`, set only with them)
        param_numel=getattr(buffer, "nvfp4_packed_numel", None),
        layer_wise=layer_wise,
    )
    return layout, shards


def layout_from_ddp(ddp: Any, model: torch.nn.Module) -> DistOptLayout:
    """Return the layout of a megatron DistributedDataParallel built around `model`."""
    names = {param: name for name, param in model.named_parameters()}
    order = {name: i for i, name in enumerate(names.values())}
    buffers: list[BufferLayout] = []
    params: list[ParamShards] = []
    tagged = [(b, False) for b in ddp.buffers] + [(b, True) for b in ddp.expert_parallel_buffers]
    # the layer-wise optimizer's parameters: those of the layout's buffers its key marks (0.18+)
    layouts = getattr(getattr(ddp, "full_param_layout", None), "layouts", {})
    layer_wise = {p for key, layout in layouts.items()
                  if getattr(key, LAYER_WISE_TAG, False) for p in layout.param_index_map}  # fmt: skip
    for index, (buffer, expert) in enumerate(tagged):
        first = next(iter(buffer.param_index_map))
        layout, shards = _layout_buffer(buffer, index, expert, names, first in layer_wise)
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
