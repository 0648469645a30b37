"""The host's pace: the CPU time megatron's Python spends launching a layer's kernels, and what
the GPU waits for it where the host is the slower of the two (issue #45 item 2).

A micro-batch's pass through a layer is Python on the host (megatron's TransformerLayer calling
its modules, Transformer Engine's and torch's dispatch of each kernel) feeding a stream of
kernels to the GPU. The GPU runs them no faster than the host launches them: where a layer's
kernels are small (the functional tests' 1,024-4,096 wide layers), the host, not the GPU, sets
the pace. The model, per stage and micro-batch:

  host seconds = KERNEL x kernels + MOE_PASS x MoE layer passes   (a local-spec layer's kernels
                                                                    at their own cost)

- kernels: the kernels formulas/ops.py prices for the layer (forward, backward, and the forward
  kernels recomputation runs again), the output layer and loss, the embedding: what the host
  launches, counted as the GPU time is priced. Megatron's code dispatches more operations than
  that (views, copies, autograd's; bench/host_ops.py counts 76-297 aten operations per dense
  layer and micro-batch), so KERNEL is the host's time per priced kernel with the operations
  around it, not one launch;
- MoE layer passes: each time megatron's Python runs an MoE layer (forward, backward, the forward
  again under full recomputation, tensor_parallel/random.py CheckpointFunction): its router's,
  token dispatcher's and permutation's Python beyond the kernels, the wait for the split sizes.

The GPU waits for the host where the host is slower: per micro-batch slot the stage takes
max(GPU, host). The host may run ahead of the GPU (kernels queue on the stream) except where
megatron synchronises it with the GPU: the all-to-all token dispatcher copies the tokens' split
sizes to the host and waits for them once per MoE layer forward (megatron-core
token_dispatcher.py `_maybe_dtoh_and_synchronize`, `d2h_event.synchronize()`; not with a
capacity factor's fixed sizes, `drop_and_pad`), so a host lead built over one layer is lost
there: each such MoE layer is a segment of its own, max(GPU, host) within it, and the rest of
the stage is one more segment. Under CUDA graphs (`--cuda-graph-impl`) a graphed layer's
kernels are replayed by one launch: its host cost is left out (`graphed`).

COSTS holds the three fitted constants (their one home, below, with their provenance); what
the model does not see: the data loader, the optimizer's host loops, logging, Python's garbage
collector, the CPU's clock (docs/how-time-is-computed.md, "The host's pace").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import inspector.caches as caches
from inspector.formulas.kernels import Gemm
from inspector.formulas.ops import LayerOps, Shard
from inspector.job.dims import ModelDims
from inspector.job.job import Training
from inspector.plan.hybrid import gdn_layer_ops, hybrid_kernels
from inspector.plan.kernel_seconds import embedding_ops, layer_kernels, output_kernels

# The host's seconds per unit (UNITS), fitted by bench/host_fit.py (least squares of the relative
# step-time error) on the 71 timed H100 functional tests of Megatron-LM (golden_values_dev_dgx_h100.json,
# `iteration-time` past the warm-up; megatron-core 0.16.1, 2026-12-07): bench/RESULTS.md `hostpace`
# and session 21. Three are priced: a kernel formulas/ops.py prices in a Transformer Engine layer
# and one in a local-spec layer (--transformer-impl local), each with the Python, dispatch and launch
# around it (megatron's code dispatches some 4 aten operations per priced kernel, bench/host_ops.py;
# a TE module's Python per kernel is the heavier), and an MoE layer's pass (its router's, token
# dispatcher's and permutation's Python, with the host's wait for the split sizes); GEMMs and layer
# passes are counted too, not priced: their fitted costs did not lower the held-out error.
# Leave-one-out mean |error| 17.1%, split-half 16.6% (one kernel cost for both specs: 21.2%, 20.6%).
UNITS = ("kernels", "gemms", "passes", "moe_passes", "local_kernels")
COSTS = (1.60e-4, 0.0, 0.0, 8.05e-4, 1.09e-4)


@dataclass(frozen=True)
class HostSegment:
    """Work the host cannot run ahead across: the GPU's seconds, the host's counts (UNITS)."""

    gpu: float
    units: tuple[float, ...]
    sync: bool = False  # it ends at a host synchronisation (the all-to-all dispatcher's)
    count: int = 1  # this many such segments, one after the other (a stage's synchronising layers)

    def host(self, costs: tuple[float, ...] = COSTS) -> float:
        """Return the host's seconds for one of the segments."""
        return sum(c * n for c, n in zip(costs, self.units, strict=True))


@dataclass(frozen=True)
class HostWork:
    """A stage's host work per micro-batch, in segments (one per synchronising MoE layer, then
    the rest)."""

    segments: tuple[HostSegment, ...] = ()

    def host(self, costs: tuple[float, ...] = COSTS) -> float:
        """Return the host's seconds per micro-batch."""
        return sum(s.count * s.host(costs) for s in self.segments)

    def wait(self, costs: tuple[float, ...] = COSTS) -> float:
        """Return the seconds the GPU waits for the host per micro-batch: each segment's
        max(GPU, host) less its GPU time."""
        return sum(s.count * max(0.0, s.host(costs) - s.gpu) for s in self.segments)


def layer_units(ops: LayerOps, recompute: str, modules: tuple[str, ...], moe: bool,
                local: bool = False) -> tuple[float, ...]:  # fmt: skip
    """Return a layer's host counts per micro-batch (UNITS) under megatron's recomputation: the
    kernels formulas/ops.py prices (`layer_seconds`'s, counted instead of priced; a local-spec
    layer's, `local`, apart), the GEMMs among them, the passes of megatron's Python over the layer
    (forward, backward, the forward again under full recomputation), an MoE layer's passes apart."""
    kernels = [*ops.forward, *ops.backward]
    if recompute == "full":
        kernels += ops.forward
    elif recompute == "selective":
        kernels += ops.recomputed(modules)
    runs = 3 if recompute == "full" else 2
    n, gemms = len(kernels), sum(isinstance(op, Gemm) for op in kernels)
    return (0 if local else n, gemms, runs, runs if moe else 0, n if local else 0)


def layer_segments(units: tuple[float, ...], gpu: float, count: int, syncs: bool,
                   graphed: bool = False) -> tuple[HostSegment, ...]:  # fmt: skip
    """Return `count` layers' segments: one per layer where it synchronises the host (`syncs`,
    `count` of them), else one for all; a graphed layer launches one graph replay per pass and
    runs no Python."""
    if graphed:
        units = (units[2], 0, 0, 0, 0)
    if syncs:
        return (HostSegment(gpu, units, True, count),)
    return (HostSegment(gpu * count, tuple(n * count for n in units)),)


def merge(segments: Iterable[HostSegment], rest_gpu: float, rest: tuple[float, ...]) -> HostWork:
    """Return the stage's host work: the synchronising segments apart, every other one merged
    with the stage's other GPU seconds and counts (embedding, output layer, communication)."""
    kept, gpu, units = [], rest_gpu, list(rest)
    for seg in segments:
        if seg.sync:
            kept.append(seg)
        else:
            gpu += seg.gpu * seg.count
            units = [a + b * seg.count for a, b in zip(units, seg.units, strict=True)]
    return HostWork((*kept, HostSegment(gpu, tuple(units))))


def kind_segments(dims: ModelDims, shard: Shard, recompute: str, i: int, gpu: float, count: int,
                  modules: tuple[str, ...], syncs: bool,
                  graphed: bool) -> tuple[HostSegment, ...]:  # fmt: skip
    """Return the segments of `count` layers of layer `i`'s kind, each taking `gpu` seconds per
    micro-batch; `syncs`: an MoE layer synchronises the host (`host_syncs`). A hybrid model's
    layer is its pattern symbol's one module (Mamba mixer, attention, MLP, MoE, ...), counted by
    the kernels plan/hybrid.py prices for it, at the same costs."""
    moe, units = _layer_units_of(dims, shard, recompute, i, modules)
    return layer_segments(units, gpu, count, syncs and moe, graphed)


@caches.memo(maxsize=4096)
def _layer_units_of(dims: ModelDims, shard: Shard, recompute: str, i: int,
                    modules: tuple[str, ...]) -> tuple[bool, tuple[float, ...]]:  # fmt: skip
    """Return whether layer `i` is MoE and its `layer_units`, once per layer asked: the plan's
    search asks tens of thousands of times, always for a kind's first layer (cost.stage_work)."""
    if dims.layer_symbols:
        symbol = dims.layer_symbols[i]
        moe, ops = symbol == "E", hybrid_kernels(dims, shard, symbol)
    else:
        moe = dims.is_moe_layer(i)
        ops = gdn_layer_ops(dims, shard, moe) if dims.is_gdn_layer(i) else layer_kernels(dims, shard, moe)
    return moe, layer_units(ops, recompute, modules, moe, not dims.te_attention)


@caches.memo(maxsize=4096)
def edge_units(dims: ModelDims, shard: Shard, has_output: bool, has_embedding: bool) -> tuple[float, ...]:
    """Return the host counts of the stage outside its layers per micro-batch (UNITS): the output
    layer and loss on the last stage, the word embedding on the first."""
    kernels = []
    if has_output:
        out = output_kernels(dims, shard)
        kernels += [*out.forward, *out.backward]
    if has_embedding:
        kernels += [op for ops in embedding_ops(dims, shard) for op in ops]
    n, local = len(kernels), not dims.te_attention
    return (0 if local else n, sum(isinstance(op, Gemm) for op in kernels), 0, 0, n if local else 0)


def host_syncs(training: Training) -> bool:
    """Return whether an MoE layer's forward waits on the host for the GPU: the all-to-all
    dispatcher's `_maybe_dtoh_and_synchronize` unless a capacity fixes the sizes (`drop_and_pad`,
    --moe-pad-expert-input-to-capacity), the all-gather dispatcher's `tokens_per_expert ...
    .cpu()`, the flex dispatcher's `tokens_per_expert.sum().item()` (megatron-core
    token_dispatcher.py)."""
    pads = training.moe_token_dispatcher_type == "alltoall" and training.moe_pad_expert_input_to_capacity
    return not pads


def graphed_layers(training: Training) -> bool:
    """Return whether CUDA graphs capture whole layers (`--cuda-graph-impl` with the whole-layer
    scope or `full_iteration`): their kernels replayed by one launch, no Python per pass. A
    partial scope (attn, mlp, moe_router, ...) is not modelled: its host cost is kept."""
    scope = training.cuda_graph_scope
    return training.cuda_graph_impl != "none" and (not scope or "full_iteration" in scope)
