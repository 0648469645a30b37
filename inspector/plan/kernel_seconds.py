"""The kernel seconds of cost.py's compute terms, each priced once per process.

A layer's kernels (formulas/ops.py) depend on the model, how a rank cuts the layer (`Shard`: tp,
cp, ep, expert tp, sequence parallel, micro-batch size) and whether it is an MoE layer; their
seconds on a GPU (formulas/kernels.py) on the device besides. A search prices thousands of
layouts that share a few hundred such cuts, and an MoE layer sums hundreds of kernels (each
expert's GEMMs), so each sum is kept here (in caches.py's care) instead of being added up again
for every layout and layer. Same numbers, computed once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import inspector.caches as caches
from inspector.formulas.determinism import nan_fill
from inspector.formulas.embedding_ops import embedding_kernels
from inspector.formulas.kernels import Gemm, Op, ops_seconds
from inspector.formulas.ops import LayerOps, Shard, layer_ops, layer_seconds, output_ops
from inspector.formulas.optimizer import OptimizerStep, optimizer_ops
from inspector.job.dims import ModelDims
from inspector.job.hardware import Gpu
from inspector.job.job import Recompute
from inspector.job.layout import Layout
from inspector.memory.closed.activations import recompute_plan
from inspector.memory.compose.stage_activations import first_of_kind
from inspector.plan.network import Network, collective


def compute_seconds(flops: float, kernels: Callable[[Gpu], float], lay: Layout, net: Network,
                    rate: float) -> float:  # fmt: skip
    """Return a rank's seconds for one piece of compute: the compute term of the time model.

    By default (`rate` 0) `kernels`' seconds on the GPU (formulas/kernels.py's measured tables
    scaled to the hardware record's dense 16-bit peak and HBM bandwidth); with --efficiency,
    Megatron-LM's `flops` split over the layer's tp x cp ranks at `rate` FLOP/s. Every other
    term is communication.
    """
    if rate:
        return flops / (lay.tp * lay.cp) / rate
    return kernels(net.gpu)


@caches.memo(maxsize=1024)
def layer_kernels(dims: ModelDims, shard: Shard, moe: bool) -> LayerOps:
    """Return formulas/ops.py's kernels of one layer on one rank (layers of a kind share them);
    a Transformer Engine layer under --deterministic-mode adds torch's NaN fill of the tensors
    it allocates (formulas/determinism.py `nan_fill`), again wherever its forward runs again."""
    ops = layer_ops(dims, shard, moe)
    if not (dims.deterministic and dims.te_attention):
        return ops
    tokens = dims.seq_length * shard.micro_batch // shard.cp
    local = tokens // shard.tp if shard.sequence_parallel else tokens
    fill = nan_fill(dims, ops.forward, ops.backward, tokens, local, shard.tp, moe)
    return replace(ops, forward=(*ops.forward, fill[0]), backward=(fill[1], *ops.backward))


@caches.memo(maxsize=256)
def output_kernels(dims: ModelDims, shard: Shard) -> LayerOps:
    """Return formulas/ops.py's final norm, output layer and loss on one rank."""
    return output_ops(dims, shard)


@caches.memo(maxsize=4096)
def kernel_seconds(dims: ModelDims, shard: Shard, moe: bool, device: Gpu, recompute: str,
                   modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return one layer's seconds for one micro-batch on one rank (formulas/ops.py
    `layer_seconds`, under megatron's recomputation of `modules`)."""
    return layer_seconds(layer_kernels(dims, shard, moe), device, recompute, modules)


@caches.memo(maxsize=4096)
def column_dgrads(dims: ModelDims, shard: Shard, moe: bool, device: Gpu, rate: float,
                  overlapped: tuple[str, ...] = ()) -> tuple[tuple[int, float], ...]:  # fmt: skip
    """Return each column-parallel linear's input width and data-gradient seconds (per kernel,
    or its FLOPs at `rate`): QKV or multi-latent attention's up projections, fc1 of the MLP or
    the shared experts (the routed experts run without tensor-parallel collectives); not the
    linears named in `overlapped` (their gathers run in TE's userbuffers: plan/userbuffers.py)."""
    h = dims.hidden_size
    q_width, kv_width = dims.mla_gathered(False)
    widths = {"QKV": h, "q up projection": q_width, "kv up projection": kv_width, "MLP fc1": h,
              "shared expert fc1": h}
    found = []
    for op in layer_kernels(dims, shard, moe).backward:
        name = op.name.removesuffix(" dgrad")
        if isinstance(op, Gemm) and name in widths and name != op.name and name not in overlapped:
            found.append((widths[name], gemm_seconds(op, device, rate)))
    return tuple(found)


def gemm_seconds(op: Gemm, device: Gpu, rate: float) -> float:
    """Return a GEMM's seconds: its FLOPs at --efficiency's `rate`, else the kernel tables'."""
    return op.flops / rate if rate else ops_seconds((op,), device)


@caches.memo(maxsize=4096)
def core_seconds(dims: ModelDims, shard: Shard, moe: bool, device: Gpu) -> float:
    """Return core attention's forward seconds on one rank (formulas/ops.py LayerOps.core)."""
    return ops_seconds(layer_kernels(dims, shard, moe).core, device)


@caches.memo(maxsize=4096)
def output_seconds(dims: ModelDims, shard: Shard, device: Gpu) -> float:
    """Return the final norm, output layer and loss seconds on one rank, never recomputed."""
    return layer_seconds(output_kernels(dims, shard), device, "none")


def embedding_time(dims: ModelDims, lay: Layout, net: Network, rate: float,
                   mbs: int) -> tuple[float, float]:  # fmt: skip
    """Return the word embedding's compute and tensor-parallel seconds for one micro-batch: its
    kernels (formulas/embedding_ops.py; no FLOPs of Megatron-LM's count: nothing under
    --efficiency) and its sum over tensor-parallel ranks (VocabParallelEmbedding: an all-reduce,
    or with sequence parallelism a reduce-scatter and its backward all-gather: two ring
    collectives of the rank's s b / c tokens either way)."""
    shard = Shard(lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.sequence_parallel, mbs)
    tokens = dims.seq_length * mbs / lay.cp
    compute = compute_seconds(0, lambda d: embedding_seconds(dims, shard, d), lay, net, rate)
    return compute, collective(2, tokens * dims.hidden_size, dims.activation_bytes, lay.tp,
                               net.tensor_link(lay))  # fmt: skip


@caches.memo(maxsize=256)
def embedding_ops(dims: ModelDims, shard: Shard) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """Return the word embedding's forward and backward kernels on one rank
    (formulas/embedding_ops.py)."""
    tokens = dims.seq_length * shard.micro_batch // shard.cp
    local = tokens // shard.tp if shard.sequence_parallel else tokens
    forward, backward = embedding_kernels(
        tokens, local, dims.vocab_size // shard.tp, dims.hidden_size, shard.tp, shard.micro_batch,
        dims.activation_bytes, dims.hidden_dropout)
    return tuple(forward), tuple(backward)


@caches.memo(maxsize=256)
def embedding_seconds(dims: ModelDims, shard: Shard, device: Gpu) -> float:
    """Return the word embedding's forward and backward seconds on one rank, never recomputed."""
    forward, backward = embedding_ops(dims, shard)
    return ops_seconds(forward, device) + ops_seconds(backward, device)


@caches.memo(maxsize=65536)
def optimizer_step_seconds(updated: int, step: OptimizerStep, device: Gpu) -> float:
    """Return formulas/optimizer.py's passes over `updated` elements on `device`."""
    return ops_seconds(optimizer_ops(updated, step), device)


@caches.memo(maxsize=256)
def first_layers(dims: ModelDims) -> dict[bool | str, int]:
    """Return each kind's first layer (activations.first_of_kind), once per model: a layer is
    priced by its kind alone (ModelDims.layer_kind), so every stage asks for the same one."""
    return first_of_kind(dims)


@caches.memo(maxsize=4096)
def stage_kinds(dims: ModelDims, chunks: tuple[tuple[int, ...], ...], recompute: Recompute, method: str,
                num_layers: int) -> tuple[tuple[tuple[Recompute, bool | str], tuple[int, int]], ...]:
    """Return the stage's (recomputed or not, kind) -> (its first layer in the model, the count)
    pairs under megatron's recomputation (activations.recompute_plan), once per stage shape."""
    first, kinds = first_layers(dims), {}  # type: ignore[var-annotated]  # the return's
    for group, how in (pair for groups in recompute_plan(0, chunks, recompute, method, num_layers)
                       for pair in groups):  # fmt: skip
        for i in group:
            kind = dims.layer_kind(i)
            kinds.setdefault((how, kind), [first[kind], 0])[1] += 1
    return tuple((key, (i, count)) for key, (i, count) in kinds.items())
