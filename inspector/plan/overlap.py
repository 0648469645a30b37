"""The MoE all-to-all hidden behind another micro-batch's compute (`--overlap-moe-expert-parallel-comm`).

megatron-core's combined 1F1B runs the forward of one micro-batch and the backward of another
together, layer pair by layer pair (models/common/model_chunk_schedule_plan.py,
TransformerLayerSchedulePlan.run), on two CUDA streams, each node waiting for the one before it
in its own micro-batch:

    comm stream: combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd
    comp stream: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd (-> attn_bwd_dw)

What each node runs (models/gpt/fine_grained_callables.py): `attn` the input norm, attention,
its bias-dropout-add, the pre-MLP norm, the router, the shared experts and the permutation
before the dispatch; `moe_dispatch` the all-to-all; `mlp` the experts (moe_layer.py
`routed_experts_compute`: with the all-to-all dispatcher's sort of the received tokens by local
expert and back, `dispatch_postprocess` / `combine_preprocess`); `moe_combine` the
all-to-all, the un-permutation and the MLP's bias-dropout-add, on the communication stream.
With `--delay-wgrad-compute` the weight gradients run apart (`backward_dw`), after the node's
data gradient, so the next communication need not wait for them.

`pair_seconds` replays that issue order with those dependencies over a run of identical layer
pairs and returns the steady time of one pair; `merged_share` is the share of a stage's chunk
passes megatron runs merged (every 1F1B step; the warm-up forwards and cool-down backwards run
alone; within a merged step, the layers of the longer chunk beyond the shorter's run alone too,
`alone_passes`). Each node's time comes from the planner's kernels (formulas/ops.py) and network.py's
all-to-all; tensor-parallel collectives are part of the compute stream's nodes (those of an MoE
layer with expert TP 1 all in the attention's, `layer_nodes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import inspector.caches as caches
from inspector.formulas.kernels import Op, ops_seconds
from inspector.formulas.ops import LayerOps, layer_seconds
from inspector.job.dims import ModelDims, schedule_passes, warmup_steps
from inspector.job.hardware import Gpu

MLP_NODE = ("sort chunks", "expert fp8 padding", "expert fc1", "expert activation", "expert fc2",
            "expert fp8 unpadding", "unsort chunks")
COMBINE_NODE = ("unpermute", "MLP bias-dropout-add")
_SUFFIXES = (" backward", " dgrad", " wgrad", " fp8 cast", " fp8 amax", " main_grad.add_")
PAIRS = 8  # layer pairs replayed to reach the steady state (a pair's time is exact past 2)


@dataclass(frozen=True)
class Nodes:
    """Seconds of one layer's nodes on one rank for one micro-batch."""

    attn_f: float
    mlp_f: float
    combine_f: float  # its compute only: the all-to-all is `alltoall`
    attn_b: float
    attn_dw: float
    mlp_b: float
    mlp_dw: float
    combine_b: float
    alltoall: float  # one dispatch or combine exchange
    taken: float = 0.0  # the share of the GPU's SMs an exchange kernel holds while it runs


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return _base(name[: -len(suffix)])
    return name


def _node(op: Op) -> str:
    base = _base(op.name)
    return "mlp" if base in MLP_NODE else "combine" if base in COMBINE_NODE else "attn"


def layer_nodes(
    ops: LayerOps, gpu: Gpu, recomputed: tuple[Op, ...], alltoall: float, tensor: float,
    delay_wgrad: bool, scale: float = 1.0, taken: float = 0.0, attn_tensor: float = 0.5,
) -> Nodes:
    """Return an MoE layer's nodes: its kernels (times `scale`) split as megatron's callables
    split them, the forward repeats of selective recomputation in their node's backward, `tensor`
    (the layer's TP collectives, forward and backward) `attn_tensor` of it in the attention's
    nodes, the rest in the experts'. With expert TP 1 every TP collective of the layer is in the
    attention's nodes (1.0): attention's gather and reduction, and the shared experts', which
    megatron runs there (fine_grained_callables.py `submodule_attn_forward`:
    `shared_experts_compute` before the router); with expert TP the dispatcher's gather and
    reduction of the received tokens run in the experts' node (`dispatch_postprocess`,
    `combine_preprocess`), half by the plan's count."""
    sums = dict.fromkeys(("attn_f", "mlp_f", "combine_f", "attn_b", "attn_dw", "mlp_b",
                          "mlp_dw", "combine_b"), 0.0)  # fmt: skip
    for op in ops.forward:
        sums[_node(op) + "_f"] += ops_seconds((op,), gpu)
    for op in (*ops.backward, *recomputed):
        node = _node(op)
        weight = op.name.endswith((" wgrad", " main_grad.add_"))
        key = f"{node}_dw" if delay_wgrad and weight and node != "combine" else f"{node}_b"
        sums[key] += ops_seconds((op,), gpu)
    sums = {key: value * scale for key, value in sums.items()}
    for node, share in (("attn", attn_tensor), ("mlp", 1 - attn_tensor)):
        sums[f"{node}_f"] += tensor * share / 2
        sums[f"{node}_b"] += tensor * share / 2
    return Nodes(**sums, alltoall=alltoall, taken=taken)


def _run(start: float, work: float, busy: list[tuple[float, float]], taken: float) -> float:
    """Return when `work` seconds of whole-GPU compute started at `start` end, running at
    1 - `taken` of its speed while an exchange kernel of `busy` (start, end) holds its SMs."""
    t, left = start, work
    for b0, b1 in busy:
        if left <= 0 or b1 <= t:
            continue
        if t < b0:
            step = min(left, b0 - t)
            t, left = t + step, left - step
        if left > 0 and t < b1:
            room = (b1 - max(t, b0)) * (1 - taken)
            t, left = (t + left / (1 - taken), 0.0) if left <= room else (b1, left - room)
    return t + left


def _chain(t: Nodes, pairs: int) -> float:
    """Return when `pairs` merged layer pairs end, run in megatron's issue order (each
    exchange's interval computed before the compute beside it, which runs slowed by the SMs
    the exchange kernel holds, `t.taken`)."""
    comp = comm = f_ready = b_ready = 0.0
    a, busy = t.alltoall, [(0.0, 0.0)]

    def exchange(start: float) -> float:
        busy.append((start, start + a))
        del busy[:-4]
        return start + a

    dw_start = None  # the last pair's attention weight gradients, run beside the next exchange
    for _ in range(pairs):
        combine_b = exchange(max(comm, b_ready)) + t.combine_b
        if dw_start is not None:
            comp = _run(dw_start, t.attn_dw, busy, t.taken)
        attn_f = _run(max(comp, f_ready), t.attn_f, busy, t.taken)
        dispatch_f = exchange(max(combine_b, attn_f))
        mlp_b = _run(max(attn_f, combine_b), t.mlp_b, busy, t.taken)
        dispatch_b = exchange(max(dispatch_f, mlp_b))
        mlp_dw = _run(mlp_b, t.mlp_dw, busy, t.taken)
        mlp_f = _run(max(mlp_dw, dispatch_f), t.mlp_f, busy, t.taken)
        combine_f = exchange(max(dispatch_b, mlp_f)) + t.combine_f
        attn_b = _run(max(mlp_f, dispatch_b), t.attn_b, busy, t.taken)
        dw_start = attn_b
        comm, f_ready, b_ready = combine_f, combine_f, attn_b
    comp = _run(dw_start or 0.0, t.attn_dw, busy, t.taken)
    return max(comp, comm)


def pair_seconds(t: Nodes) -> float:
    """Return the steady time of one merged pair: a layer's forward beside another micro-batch's
    backward of a layer of the same kind."""
    return (_chain(t, 2 * PAIRS) - _chain(t, PAIRS)) / PAIRS


def merged_share(stage: int, pp: int, num_microbatches: int, chunks: int) -> float:
    """Return the share of the stage's chunk passes that run merged: the 1F1B steps past the
    warm-up (`warmup_steps` with the overlap's extra forward) of m v forward steps."""
    steps = num_microbatches * chunks
    warmup = warmup_steps(stage, pp, num_microbatches, chunks, pp, extra=1)
    return (steps - warmup) / steps


def alone_seconds(t: Nodes) -> tuple[float, float]:
    """Return a layer's forward and its backward run alone (`TransformerLayerSchedulePlan.run`
    with one side None), each node waiting for the one before it: the forward attention,
    dispatch, experts, combine; the backward combine, experts, then the experts' weight
    gradients on the compute stream beside the dispatch, attention, its weight gradients."""
    forward = t.attn_f + t.alltoall + t.mlp_f + t.alltoall + t.combine_f
    combine = t.alltoall + t.combine_b
    mlp = combine + t.mlp_b
    dispatch = mlp + t.alltoall
    mlp_dw = _run(mlp, t.mlp_dw, [(mlp, dispatch)], t.taken)
    return forward, max(mlp_dw, dispatch) + t.attn_b + t.attn_dw


def merged_times(
    ops: LayerOps, gpu: Gpu, recompute: str, modules: tuple[str, ...],
    times: tuple[float, float], alltoall: float, delay_wgrad: bool, flops_priced: bool,
    taken: float = 0.0, attn_tensor: float = 0.5,
) -> tuple[float, float, float]:
    """Return a merged pair's seconds for an MoE layer whose forward and backward take `times`
    (compute, TP), and its forward and its backward run alone (`alone_seconds`); priced by
    FLOPs (`--efficiency`), each node keeps its kernels' share of the compute; `taken`: the
    share of the SMs the exchange kernels hold (flex.exchange_sm_share); `attn_tensor`: the
    share of the TP collectives in the attention's nodes (`layer_nodes`)."""
    compute, tensor = times
    again = ops.recomputed(modules) if recompute == "selective" else ()
    kernels = layer_seconds(ops, gpu, recompute, modules)
    scale = compute / kernels if flops_priced and kernels else 1.0
    nodes = layer_nodes(ops, gpu, again, alltoall, tensor, delay_wgrad, scale, taken, attn_tensor)
    return (pair_seconds(nodes), *alone_seconds(nodes))


@caches.memo(maxsize=1024)
def _merged_chunks(
    stage: int, pp: int, num_microbatches: int, chunks: int
) -> tuple[tuple[tuple[int, int], int], ...]:
    """Return how many merged steps run each (forward chunk, backward chunk) on the stage:
    megatron's steady 1F1B steps (schedules.py, forward step k + warm-up beside backward step
    k; job.dims.schedule_passes with the overlap's extra warm-up forward)."""
    passes = schedule_passes(stage, pp, num_microbatches, chunks, pp, extra=1)
    warmup = warmup_steps(stage, pp, num_microbatches, chunks, pp, extra=1)
    steady = passes[warmup: warmup + 2 * (num_microbatches * chunks - warmup)]
    counts = Counter((steady[i][1], steady[i + 1][1]) for i in range(0, len(steady), 2))
    return tuple(sorted(counts.items()))


def alone_passes(
    stage: int, pp: int, num_microbatches: int, chunks: Sequence[Sequence[bool]],
) -> tuple[tuple[bool, bool, float], ...]:
    """Return (MoE?, forward?, passes per micro-batch) of the layer passes megatron runs alone
    inside merged steps: `TransformerModelChunkSchedulePlan.run` pairs min(f, b) layers of the
    forward chunk's f and the backward chunk's b, then runs the backward chunk's rest alone
    (its first layers: it pops layers from the end) and the forward chunk's rest (its last).
    `chunks`: each of the stage's chunks as its layers' MoE flags, in order."""
    if len(chunks) < 2:
        return ()
    out: Counter[tuple[bool, bool]] = Counter()
    for (f, b), steps in _merged_chunks(stage, pp, num_microbatches, len(chunks)):
        both = min(len(chunks[f]), len(chunks[b]))
        for is_moe in chunks[f][both:]:
            out[(is_moe, True)] += steps
        for is_moe in chunks[b][: len(chunks[b]) - both]:
            out[(is_moe, False)] += steps
    return tuple((moe, fwd, n / num_microbatches) for (moe, fwd), n in sorted(out.items()))


def stage_alone(
    dims: ModelDims, stage: int, pp: int, num_microbatches: int, chunk_layers: Sequence[Sequence[int]]
) -> tuple[tuple[bool, bool, float], ...]:
    """Return `alone_passes` for the stage's chunks of global layer indices; megatron builds the
    MTP layers into the last stage's last chunk (`TransformerModelChunkSchedulePlan`
    `_build_layer_schedule_plan`): they pair as layers, priced with the output layer as before."""
    chunks = [[dims.is_moe_layer(i) for i in chunk] for chunk in chunk_layers]
    if stage == pp - 1 and dims.mtp_num_layers and chunks:
        chunks[-1] += [False] * dims.mtp_num_layers
    return alone_passes(stage, pp, num_microbatches, chunks) if pp > 1 else ()
