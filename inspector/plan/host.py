"""The host's pace: the CPU time megatron's Python spends launching a layer's kernels, and what
the GPU waits for it where the host is the slower of the two (issue #45 item 2).

A micro-batch's pass through a layer is Python on the host (megatron's TransformerLayer calling
its modules, Transformer Engine's and torch's dispatch of each kernel) feeding a stream of
kernels to the GPU. The GPU runs them no faster than the host launches them: where a layer's
kernels are small (the functional tests' 1,024-4,096 wide layers), the host, not the GPU, sets
the pace. The model, per stage and micro-batch:

  host seconds = LAUNCH x kernels + PASS x layer passes

- kernels: the kernels formulas/ops.py prices for the layer (forward, backward, and the forward
  kernels recomputation runs again), the output layer and loss, the embedding: what the host
  launches, counted the same way the GPU time is priced;
- layer passes: each time megatron's Python runs a layer (its forward; its backward; its forward
  again under full recomputation, tensor_parallel/random.py CheckpointFunction): the module calls
  and autograd bookkeeping around the kernels (bench/host_ops.py counts 15-30 module calls and
  76-359 aten operations per dense or MoE layer and micro-batch in megatron's own forward and
  backward).

The GPU waits for the host where the host is slower: per micro-batch slot the stage takes
max(GPU, host). The host may run ahead of the GPU (kernels queue on the stream) except where
megatron synchronises it with the GPU: the all-to-all token dispatcher copies the tokens' split
sizes to the host and waits for them once per MoE layer forward (megatron-core
token_dispatcher.py `_maybe_dtoh_and_synchronize`, `d2h_event.synchronize()`; not with a
capacity factor's fixed sizes, `drop_and_pad`), so a host lead built over one layer is lost
there: each such MoE layer is a segment of its own, max(GPU, host) within it, and the rest of
the stage is one more segment. Under CUDA graphs (`--cuda-graph-impl`) a graphed layer's
kernels are replayed by one launch: its host cost is left out (`graphed`).

LAUNCH and PASS are the two fitted constants (their one home, below, with their provenance); what
the model does not see: the data loader, the optimizer's host loops, logging, Python's garbage
collector, the CPU's clock (docs/how-time-is-computed.md, "The host's pace").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from inspector.formulas.ops import LayerOps, Shard
from inspector.job.dims import ModelDims
from inspector.job.job import Training
from inspector.plan.hybrid import gdn_layer_ops
from inspector.plan.kernel_seconds import embedding_ops, layer_kernels, output_kernels

# Fitted (least squares of the relative step-time error) on the launch-bound H100 functional
# tests of Megatron-LM (golden_values_dev_dgx_h100.json, `iteration-time` past the warm-up), 2026-12-07,
# by bench/host_fit.py over the plan's own counts: bench/RESULTS.md `hostpace`.
LAUNCH_SECONDS = 0.0  # host seconds per kernel launched (Python, dispatch, launch)
PASS_SECONDS = 0.0  # host seconds per layer pass (megatron's module calls around the kernels)


@dataclass(frozen=True)
class Segment:
    """Work the host cannot run ahead across: the GPU's seconds, the host's launches and passes."""

    gpu: float
    launches: float
    passes: float
    sync: bool = False  # it ends at a host synchronisation (the all-to-all dispatcher's)

    def host(self, launch: float = LAUNCH_SECONDS, per_pass: float = PASS_SECONDS) -> float:
        """Return the host's seconds for the segment."""
        return launch * self.launches + per_pass * self.passes


@dataclass(frozen=True)
class HostWork:
    """A stage's host work per micro-batch, in segments (one per synchronising MoE layer, then
    the rest)."""

    segments: tuple[Segment, ...] = ()

    def host(self, launch: float = LAUNCH_SECONDS, per_pass: float = PASS_SECONDS) -> float:
        """Return the host's seconds per micro-batch."""
        return sum(s.host(launch, per_pass) for s in self.segments)

    def gpu(self) -> float:
        """Return the GPU's seconds per micro-batch the segments hold."""
        return sum(s.gpu for s in self.segments)

    def wait(self, launch: float = LAUNCH_SECONDS, per_pass: float = PASS_SECONDS) -> float:
        """Return the seconds the GPU waits for the host per micro-batch: each segment's
        max(GPU, host) less its GPU time."""
        return sum(max(0.0, s.host(launch, per_pass) - s.gpu) for s in self.segments)


def launches(ops: LayerOps, recompute: str, modules: tuple[str, ...]) -> int:
    """Return the kernels a layer launches per micro-batch under megatron's recomputation
    (formulas/ops.py `layer_seconds`'s kernels, counted instead of priced)."""
    count = len(ops.forward) + len(ops.backward)
    if recompute == "full":
        return count + len(ops.forward)
    if recompute == "selective":
        return count + len(ops.recomputed(modules))
    return count


def passes(recompute: str) -> int:
    """Return how many times megatron's Python runs a layer per micro-batch: forward, backward,
    and the forward again under full recomputation."""
    return 3 if recompute == "full" else 2


def layer_segments(gpu: float, kernels: int, recompute: str, count: int, syncs: bool,
                   graphed: bool = False) -> tuple[Segment, ...]:  # fmt: skip
    """Return `count` layers' segments: one per layer where it synchronises the host (`syncs`),
    else one for all; a graphed layer launches nothing of its own (one graph replay)."""
    if graphed:
        kernels, runs = 1, 0
    else:
        runs = passes(recompute)
    if syncs:
        return tuple(Segment(gpu, kernels, runs, True) for _ in range(count))
    return (Segment(gpu * count, kernels * count, runs * count),)


def merge(segments: Iterable[Segment], rest_gpu: float, rest_launches: float) -> HostWork:
    """Return the stage's host work: the synchronising segments apart, every other one merged
    with the stage's other GPU seconds and launches (embedding, output layer, communication)."""
    kept, gpu, count, runs = [], rest_gpu, rest_launches, 0.0
    for seg in segments:
        if seg.sync:
            kept.append(seg)
        else:
            gpu, count, runs = gpu + seg.gpu, count + seg.launches, runs + seg.passes
    return HostWork((*kept, Segment(gpu, count, runs)))


def kind_segments(dims: ModelDims, shard: Shard, recompute: str, i: int, gpu: float, count: int,
                  modules: tuple[str, ...], syncs: bool, graphed: bool) -> tuple[Segment, ...]:  # fmt: skip
    """Return the segments of `count` layers of layer `i`'s kind, each taking `gpu` seconds per
    micro-batch; `syncs`: an MoE layer synchronises the host (`host_syncs`). A hybrid model's
    layers (Mamba) are not counted: their host work is not modelled."""
    if dims.layer_symbols:
        return ()
    moe = dims.is_moe_layer(i)
    ops = gdn_layer_ops(dims, shard, moe) if dims.is_gdn_layer(i) else layer_kernels(dims, shard, moe)
    return layer_segments(gpu, launches(ops, recompute, modules), recompute, count, syncs and moe, graphed)


def edge_launches(dims: ModelDims, shard: Shard, has_output: bool, has_embedding: bool) -> int:
    """Return the kernels the stage launches outside its layers per micro-batch: the output layer
    and loss on the last stage, the word embedding on the first."""
    count = 0
    if has_output:
        out = output_kernels(dims, shard)
        count += len(out.forward) + len(out.backward)
    if has_embedding:
        count += sum(map(len, embedding_ops(dims, shard)))
    return count


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
