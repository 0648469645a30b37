"""Megatron-FSDP's buffers for one model chunk, laid out by megatron's own code on meta tensors.

Megatron-LM wraps each chunk in `FullyShardedDataParallel` (megatron/core/distributed/fsdp/
mcore_fsdp_adapter.py) with --use-megatron-fsdp. Building it here would need a CUDA DeviceMesh
and DTensors, so the two pure functions that decide the layout run instead, on the chunk's meta
parameters (megatron_fsdp/param_and_grad_buffer.py, megatron-core 0.16.1; custom_fsdp/ in 0.13):

- `_get_parameter_groups(module, BucketingPolicy(...))`: which parameters share a bucket. Under
  optim_grads_params every TransformerLayer is an FSDP unit (the adapter's `fsdp_unit_modules`),
  the other parameters are bucketed by the suggested bucket size; buckets split by dtype and
  expert (`".experts." in name`);
- `build_data_parallel_buffer_index(shapes, rank, dp, ...)`: where each parameter sits in its
  bucket and the bucket's padded size (0.16: a multiple of dp x the bucket's row size; 0.13:
  of lcm(dp, 128); no padding with no_shard). Rank r's shard is `[r*size/dp, (r+1)*size/dp)`
  (`_get_dp_buffer_shard_bucket_index`).

Simulated (the smallest piece): which of the three buffers each strategy shards, as
`ParamAndGradBuffer._init_each_parameter_group_buffers` sets `is_*_distributed`, and what the
optimizer updates: the parameters' pieces inside the rank's shard of the fp32 main-weight buffer
(`_init_distributed_params`). Dense buckets shard over dp x cp (`pg_collection.dp_cp`), expert
buckets over the expert data-parallel group (`pg_collection.expt_dp`); with N optimizer instances
(HSDP) over the intra partial groups, dp x cp / N and expert dp / N (`pg_collection.intra_dp_cp`,
`intra_expt_dp`; world/build.py passes the sizes).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

SHARDED = {  # ParamAndGradBuffer._init_each_parameter_group_buffers: (weights, main, grads)
    "fsdp2": (True, True, True),
    "no_shard": (False, False, False),
    "optim": (False, True, False),
    "optim_grads": (False, True, True),
    "optim_grads_params": (True, True, True),
}


def buckets_each_backward(strategy: str) -> bool:
    """Return whether Megatron-FSDP makes its unsharded gradient buckets in every backward and
    frees them at its end (the main grads sharded: optim_grads, optim_grads_params); under
    no_shard and optim the buffer is whole and persistent, reduced on the last micro-batch."""
    return strategy != "fsdp2" and SHARDED[strategy][2]

@dataclass(frozen=True)
class FsdpBucket:
    """One Megatron-FSDP bucket (parameter group): its padded size and its parameters' places."""

    unit: int | None  # the FSDP unit (TransformerLayer) it belongs to, None outside units
    expert: bool  # sharded over the expert data-parallel group
    numel: int  # bucket size, padding included
    dp: int  # ranks sharing it
    items: tuple[tuple[int, int], ...]  # (start, numel) of each parameter in the bucket
    param_itemsize: int
    grad_itemsize: int
    names: tuple[str, ...] = ()  # the parameters' names, as items
    # fp8 weights (--fp8-param-gather): a column-wise buffer beside the row-wise one (MXFP8),
    # the Float8Tensor transpose each backward makes of its gathered weights, and the bytes TE
    # keeps on every rank outside megatron's buffers (the scales)
    transpose: bool = False
    backward_transpose: bool = False
    kept: int = 0
    # megatron's (item_index_map, bucket_index, shard_bucket_index) of the bucket, for its rank 0
    index: Any = field(default=None, compare=False, repr=False)

    @property
    def shard_numel(self) -> int:
        """Return one rank's shard of the bucket (padding included, equal on every rank)."""
        return self.numel // self.dp

    def owners(self) -> dict[str, tuple[int, ...]]:
        """Return each parameter's ranks: those whose shard holds some of its elements."""
        shard = self.shard_numel
        return {
            name: tuple(range(start // shard, (start + size - 1) // shard + 1)) if size else ()
            for name, (start, size) in zip(self.names, self.items, strict=True)
        }

    @property
    def parameters(self) -> int:
        """Return the parameter elements in the bucket (no padding)."""
        return sum(size for _, size in self.items)

    @cached_property
    def owned_numel(self) -> tuple[int, ...]:
        """Return, per rank, the parameter elements inside its shard (what its optimizer updates)."""
        shard = self.shard_numel
        edges = [0] * (self.dp + 1)
        partial = [0] * self.dp
        for start, size in self.items:
            if size == 0:
                continue
            end = start + size
            first, last = start // shard, (end - 1) // shard
            if first == last:
                partial[first] += size
                continue
            partial[first] += (first + 1) * shard - start
            partial[last] += end - last * shard
            if last - first > 1:
                edges[first + 1] += shard
                edges[last] -= shard
        return tuple(a + b for a, b in zip(itertools.accumulate(edges), partial, strict=False))


@dataclass(frozen=True)
class FsdpLayout:
    """Every bucket of one chunk, in megatron's order, under one sharding strategy."""

    strategy: str  # a --data-parallel-sharding-strategy, or fsdp2 (PyTorch FSDP2)
    buckets: tuple[FsdpBucket | Fsdp2Unit, ...]
    groups: tuple[tuple[int, ...], ...] = ()  # each bucket's reduce-scatter group (bucket ids)
    backward: tuple[tuple[int, int], ...] = ()  # (bucket, item) as the backward makes gradients
    capacity: int = 0  # MegatronFSDP's suggested_RS_queue_capacity, in elements
    backward_names: tuple[str, ...] = ()  # the parameters' names, in `backward`'s order


def buffer_module() -> Any:
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer
    except ImportError:  # megatron-core 0.13/0.14: custom_fsdp
        from megatron.core.distributed.custom_fsdp import (  # type: ignore[no-redef,unused-ignore]
            param_and_grad_buffer,
        )
    return param_and_grad_buffer


def fsdp_layout(
    module: Any,
    strategy: str,
    dp_cp: int,
    expert_dp: int,
    bucket_size: int | None,
    grad_reduce_in_fp32: bool,
) -> FsdpLayout:
    """Lay out `module`'s Megatron-FSDP buckets with megatron's own grouping and index.

    Args:
        module: the chunk's GPTModel on meta tensors (cast to 16 bits as Float16Module does).
        strategy: --data-parallel-sharding-strategy.
        dp_cp, expert_dp: the sizes of the dense and expert sharding groups.
        bucket_size: the suggested bucket size in elements (None: one bucket per group).
        grad_reduce_in_fp32: gradients in fp32 (else in the parameters' dtype), as
            `ParamAndGradBuffer` makes its main grad buffer.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer

    buffers = buffer_module()
    units = [TransformerLayer] if strategy == "optim_grads_params" else []
    policy = buffers.BucketingPolicy(
        suggested_bucket_size=bucket_size,
        fsdp_unit_modules=units,
        data_parallel_sharding_strategy=strategy,
    )
    groups, param_group, bucket_group = buffers._get_parameter_groups(module, policy, {})
    names = {p: name for name, p in module.named_parameters()}
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    takes_factor = "chunk_size_factor" in inspect.signature(
        buffers.build_data_parallel_buffer_index
    ).parameters
    sharded = strategy != "no_shard"
    result = []
    for bucket_id, group in enumerate(groups):
        dp = expert_dp if group.is_expert_param else dp_cp
        extra = {"chunk_size_factor": group.chunk_size_factor} if takes_factor else {}
        index, bucket, shard_index = buffers.build_data_parallel_buffer_index(
            [p.shape for p in group.params], 0, dp, sharded and dp > 1, config,
            bucket_id=bucket_id, **extra,
        )  # fmt: skip
        entries = index.values() if isinstance(index, dict) else index
        placed = sorted((i.global_data_index, i.size, names[group.params[i.item_id]]) for i in entries)
        items = tuple((start, size) for start, size, _ in placed)
        itemsize = group.params[0].dtype.itemsize  # a quantized weight's: the model's 16 bits
        result.append(
            FsdpBucket(
                unit=group.fsdp_unit_id,
                expert=bool(group.is_expert_param),
                numel=int(bucket.size),
                dp=dp,
                items=items,
                param_itemsize=1 if group.dtype == FLOAT8 else itemsize,
                grad_itemsize=4 if grad_reduce_in_fp32 else itemsize,
                names=tuple(name for _, _, name in placed),
                index=(index, bucket, shard_index),
                **(_fp8_bucket(buffers, group.params) if group.dtype == FLOAT8 else {}),
            )
        )
    # the backward makes gradients from the last parameter to the first (each parameter's
    # post-accumulate-grad hook, or TE's fused wgrad asking for its main_grad)
    item = {id(p): i for group in groups for i, p in enumerate(group.params)}
    backward = tuple((param_group[p], item[id(p)]) for p in reversed(list(module.parameters())))
    return FsdpLayout(
        strategy, tuple(result), tuple(tuple(bucket_group[i]) for i in range(len(groups))),
        backward, _queue_capacity(module, units, bucket_size),
        tuple(names[p] for p in reversed(list(module.parameters()))),
    )  # fmt: skip


# _get_parameter_groups' dtype of a group of TE's quantized weights: megatron makes its model
# weight buffer (and the MXFP8 column-wise one) torch.uint8, its main grads bf16
FLOAT8 = "float8"


def _fp8_bucket(buffers: Any, params: Sequence[Any]) -> dict[str, Any]:
    """Return what a bucket of quantized weights holds besides its uint8 model weight buffer,
    asked of megatron's own mixed_precision helpers on the TE stand-in's tensors.

    `_init_each_parameter_group_buffers` adds a column-wise buffer where
    `fp8_need_transpose_data` (an MXFP8Tensor); a Float8Tensor's transpose is dropped after the
    reset (`fp8_discard_transpose_cache`, keep_fp8_transpose_cache False) and made again for the
    backward of its gathered weights (megatron_fsdp.py `fp8_create_transpose_cache`: TE's
    `post_all_gather_processing`, a transpose on Hopper, none on Blackwell), dropped at their release. What
    `fp8_set_raw_data` does not point into megatron's buffers stays on every rank: the scales.
    """
    from inspector.world.te.cuda import is_non_tn_fp8_gemm_supported
    from inspector.world.te.float8_tensor import ALLOCATOR_BLOCK

    transpose = bool(buffers.fp8_need_transpose_data(params[0]))
    kept = 0
    for param in params:
        stored = {id(buffers.fp8_get_raw_data(param)), id(getattr(param, "_transpose", None))}
        if transpose:
            stored.add(id(buffers.fp8_get_raw_data(param, True)))
        kept += sum(-(-t.numel() * t.element_size() // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK
                    for t in param.kept_tensors() if id(t) not in stored)  # fmt: skip
    # TE's post_all_gather_processing makes the transpose on Hopper only (te/float8_tensor.py)
    backward = not transpose and hasattr(params[0], "_transpose") and not is_non_tn_fp8_gemm_supported()
    return {"transpose": transpose, "backward_transpose": backward, "kept": kept}


def _queue_capacity(module: Any, units: list[Any], bucket_size: int | None) -> int:
    """Return MegatronFSDP's suggested_RS_queue_capacity with Megatron-LM's default (no
    suggested_communication_unit_size): twice a unit's mean elements under units, else the
    bucket size, else 1e9, and at least 1e9 (megatron_fsdp.py, MegatronFSDP.__init__)."""
    kinds = tuple(units)
    sizes = [sum(p.numel() for p in m.parameters()) for m in module.modules()
             if kinds and isinstance(m, kinds)]  # fmt: skip
    if sizes:
        suggested = sum(sizes) // len(sizes) * 2
    else:
        suggested = bucket_size if bucket_size is not None else 1_000_000_000
    return max(1_000_000_000, suggested)


@dataclass(frozen=True)
class Fsdp2Unit:
    """One module PyTorch FSDP2 shards (`fully_shard`): its parameters' rows over the ranks.

    FSDP2 splits every parameter along dim 0 into `ceil(rows / dp)`-row chunks, padded so each
    rank allocates one full chunk (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    `_init_sharded_param`: torch.chunk, then `padded_sharded_param_size`); the optimizer sees the
    unpadded local rows.
    """

    unit: int | None
    expert: bool
    shapes: tuple[tuple[int, int], ...]  # (rows, elements per row) of each parameter
    dp: int
    param_itemsize: int
    grad_itemsize: int
    names: tuple[str, ...] = ()  # the parameters' names, as shapes

    def owners(self) -> dict[str, tuple[int, ...]]:
        """Return each parameter's ranks: those holding some of its rows."""
        return {
            name: tuple(range(min(self.dp, -(-rows // -(-rows // self.dp)))))
            for name, (rows, _) in zip(self.names, self.shapes, strict=True)
        }

    @property
    def shard_numel(self) -> int:
        """Return one rank's padded shard of the unit's parameters."""
        return sum(-(-rows // self.dp) * row for rows, row in self.shapes)

    @property
    def numel(self) -> int:
        """Return the unit's elements when gathered (padding included)."""
        return self.shard_numel * self.dp

    @property
    def parameters(self) -> int:
        """Return the unit's parameter elements."""
        return sum(rows * row for rows, row in self.shapes)

    @cached_property
    def owned_numel(self) -> tuple[int, ...]:
        """Return, per rank, its local (unpadded) rows' elements."""
        owned = [0] * self.dp
        for rows, row in self.shapes:
            chunk = -(-rows // self.dp)
            full, rest = divmod(rows, chunk)
            for rank in range(min(full, self.dp)):
                owned[rank] += chunk * row
            if rest and full < self.dp:
                owned[full] += rest * row
        return tuple(owned)


def fsdp2_layout(module: Any, dp_cp: int, local_spec: bool) -> FsdpLayout:
    """Group `module`'s parameters by the module megatron's TorchFullyShardedDataParallel shards.

    megatron/core/distributed/torch_fully_sharded_data_parallel.py calls `fully_shard` on every
    TransformerLayer, LanguageModelEmbedding, RotaryEmbedding and (not with the local spec)
    tensor_parallel.ColumnParallelLinear, then on the root: a parameter belongs to its innermost
    such module. Units are in module order; the root's own parameters come first.
    """
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    kinds: tuple[type, ...] = (TransformerLayer, LanguageModelEmbedding, RotaryEmbedding)
    if not local_spec:
        kinds += (tensor_parallel.ColumnParallelLinear,)
    owner: dict[str, int | None] = {}
    units: list[int | None] = [None]
    for name, sub in module.named_modules():
        if name and isinstance(sub, kinds):
            units.append(len(units) - 1)
            for pname, _ in module.get_submodule(name).named_parameters():
                owner[f"{name}.{pname}"] = units[-1]
    shapes: dict[int | None, list[tuple[int, int]]] = {unit: [] for unit in units}
    names: dict[int | None, list[str]] = {unit: [] for unit in units}
    itemsize = 2
    for name, param in module.named_parameters():
        rows = param.shape[0] if param.dim() else 1
        shapes[owner.get(name)].append((rows, param.numel() // max(rows, 1)))
        names[owner.get(name)].append(name)
        itemsize = param.dtype.itemsize
    return FsdpLayout(
        "fsdp2",
        tuple(
            Fsdp2Unit(
                unit, False, tuple(shapes[unit]), dp_cp, itemsize, itemsize, tuple(names[unit])
            )
            for unit in units
            if shapes[unit]
        ),
    )
