"""DistributedOptimizer shard arithmetic: which rank's optimizer shard holds which elements.

megatron-core's DistributedDataParallel lays one model chunk's parameters into contiguous buffers,
one per (param dtype, grad dtype) and a separate set for expert-parallel parameters
(distributed/distributed_data_parallel.py). Each _ParamAndGradBuffer takes the parameters in
reverse order, starts each at a multiple of 64 elements, closes a bucket once it holds
`bucket_size` elements, gives a `shared_embedding` parameter a bucket of its own, and pads every
bucket to a multiple of lcm(dp, 128) (distributed/param_and_grad_buffer.py). The
DistributedOptimizer then gives data-parallel rank r the r-th of dp equal slices of every bucket
(optimizer/distrib_optimizer.py, `_build_model_gbuf_range`).

ddp.py reads that layout off megatron's own DistributedDataParallel; this module holds it as plain
records and does the interval arithmetic, reproducing `_build_model_gbuf_param_range_map` once per
parameter instead of once per rank (tests/test_distopt.py checks it against megatron's own). It
imports neither torch nor megatron.

Words: "rank" below is a rank inside the group that shards the buffer: the data-parallel x
context-parallel group for dense parameters, the expert data-parallel group for expert ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inspector.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from inspector.job.job import Job

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
    # bytes Transformer Engine keeps beside the buffer's fp8 parameters (transposes, scales;
    # te/float8_tensor.py), on every rank: 0 without --fp8-param-gather
    kept: int = 0
    # MXFP8 weights under the distributed optimizer: the param buffer is a bf16 view of the grad
    # buffer (param_and_grad_buffer.py 779-793 `shared_buffer`), so it adds no bytes
    shared: bool = False
    # NVFP4 weights (--fp4-param-gather, megatron-core 0.18+): the uint8 param buffer holds two
    # values a byte, laid out apart from the grad buffer's `numel` (param_and_grad_buffer.py
    # `_compute_nvfp4_packed_layout`): its elements; None where it has `numel` of them
    param_numel: int | None = None
    # megatron-core 0.18+'s layer-wise parameter layout (dist_muon): the buffer of the matrices
    # the layer-wise optimizer updates, each whole in one rank's shard (layer_wise_optimizer.py
    # `_compute_per_buffer_param_layout`); the others' buffers are the DistributedOptimizer's
    layer_wise: bool = False

    @property
    def param_buffer_bytes(self) -> int:
        """Return the bytes of the param buffer megatron allocates (under the distributed
        optimizer; 0 where it is a view of the grad buffer)."""
        if self.shared:
            return 0
        numel = self.numel if self.param_numel is None else self.param_numel
        return numel * self.param_dtype.itemsize

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
        reuse_grad_buf_for_mxfp8_param_ag: --reuse-grad-buf-for-mxfp8-param-ag (MXFP8 weights
            all-gathered through the grad buffer).
        layer_wise: dist_muon's parameter layout on megatron-core 0.18+ (Training's
            layer_wise_param_layout): the distributed optimizer's buffers, the matrices apart.
    """

    dp_size: int
    expert_dp_size: int = 1
    bucket_size: int | None = None
    overlap_grad_reduce: bool = False
    context_parallel_size: int = 1
    pad_buckets_for_high_nccl_busbw: bool = False
    grad_reduce_in_fp32: bool | None = None
    use_distributed_optimizer: bool = True
    instances: int = 1  # --num-distributed-optimizer-instances: shards over dp_cp / instances
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    layer_wise: bool = False

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
    def for_job(cls, job: Job, **flags: Any) -> DistOptSettings:
        """Return the settings a Job implies; `flags` sets the remaining fields."""
        layout, training = job.layout, job.training
        return cls(
            dp_size=layout.dp,
            expert_dp_size=layout.expert_dp,
            bucket_size=training.ddp_bucket_size,
            overlap_grad_reduce=training.overlap_grad_reduce,
            context_parallel_size=layout.cp,
            instances=layout.num_distributed_optimizer_instances,
            reuse_grad_buf_for_mxfp8_param_ag=reuses_grad_buf(job),
            layer_wise=training.layer_wise_param_layout,
            **flags,
        )

    @property
    def dp_cp_size(self) -> int:
        """Return the size of the group that shards dense parameters."""
        return self.dp_size * self.context_parallel_size


def reuses_grad_buf(job: Job) -> bool:
    """Return megatron DDP's reuse_grad_buf_for_mxfp8_param_ag for the job: its flag, or on under
    Megatron-FSDP, whose jobs run their passes and step in megatron's DDP (the memory engine;
    FSDP's own buffers are counted from world/fsdp.py), where an MXFP8 weight takes the one place
    TE lets DDP point it: the grad buffer's view."""
    model = job.model
    fsdp_mxfp8 = job.training.megatron_fsdp and model.fp8_param_gather and model.fp8_recipe == "mxfp8"
    return model.reuse_grad_buf_for_mxfp8_param_ag or fsdp_mxfp8


def owned_numel(shards: list[ParamShards], dp_size: int) -> tuple[int, ...]:
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


