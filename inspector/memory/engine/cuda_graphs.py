"""Transformer Engine's per-layer CUDA graphs (`--cuda-graph-impl transformer_engine`): their
capture order and the static inputs megatron makes for them, from megatron-core's own code.

Megatron-LM captures the graphs once, after `--cuda-graph-warmup-steps` eager iterations, with
megatron-core's TECudaGraphHelper (transformer/cuda_graphs.py, 0.16.1):

- `create_cudagraphs` captures one graph per (graphable layer, micro-batch) with TE's
  make_graphed_callables; without a pipeline (and without the MoE all-to-all overlap) one
  micro-batch is captured, else every micro-batch of the iteration (`_get_cuda_graph_input_data`:
  `self.num_microbatches = 1` / `get_num_microbatches()`);
- the capture follows the schedule's order (`convert_schedule_table_to_order` of
  pipeline_parallel/schedules.py's `get_pp_rank_microbatches` and `get_schedule_table`): chunk
  c's forward is c+1, its backward -(c+1);
- each (layer, micro-batch) gets static inputs (`_get_sample_arguments`): the layer's
  `get_layer_static_inputs` (hidden states, and the attention mask where attention is in the
  graph's scope) and the rope table (one per sequence length, cached); a forward whose
  signature matches a sample whose backward has run reuses that sample's tensors, so the
  buffers are what the order holds in flight. They live as long as the graphs.

`static_inputs` runs megatron's own `_get_sample_arguments` and order functions on a stage the
tool builds (meta tensors, engine/cuda.py) and counts the distinct storages the samples hold.

TE's make_graphed_callables (transformer_engine/pytorch/graph.py, `_order` given) captures every
forward and backward graph into ONE private pool in that order: a forward's saved activations and
outputs stay in the pool until its backward is captured, then return to it. So the pool's size is
the high-water mark of the graphed parts' live blocks over the schedule, and the rest of the step
cannot use those blocks, nor the graphs the rest's (`split_trace`, `graphed_peak`). A stand-in
of the eager trace: its blocks are given to the pool they were allocated in; the copy of a
graphed layer's input into its static input is not replayed (the caller's tensor a layer saves
is counted until that layer's backward, as eagerly). notes/cuda-graphs.md has the sources.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from inspector.job.job import Job
from inspector.memory.engine.allocator import Event, rounded
from inspector.memory.engine.graph_steps import PREPROCESS
from inspector.memory.engine.microbatch import Trace, _routing
from inspector.memory.engine.schedule import Peak, iteration_peak


@dataclass(frozen=True)
class StaticInputs:
    """The static inputs of one stage's per-layer graphs."""

    graphs: int  # (layer, micro-batch) pairs captured
    buffers: int  # distinct tensors among their inputs (reused ones counted once)
    bytes: int  # what those tensors take on the GPU (the caching allocator's blocks)
    order: tuple[int, ...]  # the capture order megatron gives TE (chunk+1 forward, -(chunk+1))
    grad_output_bytes: int = 0  # one hidden-state output's gradient in the model's dtype
    in_pool: bool = False  # allocated in the graphs' pool (megatron-core 0.19's CudaGraphManager)


def capture_order(pp: int, rank: int, chunks: int, num_microbatches: int,
                  group_size: int | None = None) -> list[int]:  # fmt: skip
    """Return the order megatron gives make_graphed_callables (`_get_cuda_graph_input_data`)."""
    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    group = group_size or pp
    # the p2p communicator is read for its pipeline group's size and rank and the virtual size
    # (get_pp_rank_microbatches), as parallel_state would give them on that rank
    p2p = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
    )
    _, _, warmup, _ = get_pp_rank_microbatches(num_microbatches, chunks, group, False,
                                               p2p_communicator=p2p)  # fmt: skip
    table = get_schedule_table(num_microbatches, chunks, group)
    return list(convert_schedule_table_to_order(warmup, chunks, table))


def captured_microbatches(job: Job) -> int:
    """Return the micro-batches megatron captures per layer (`_get_cuda_graph_input_data`)."""
    if job.layout.pp == 1 and not job.training.ep_overlap:
        return 1
    return job.schedule().num_microbatches


def static_inputs(job: Job, stage: int, scope: tuple[str, ...] = ()) -> StaticInputs:
    """Return the static inputs megatron makes for `stage`'s graphs (`scope`: the
    `--cuda-graph-scope` words; empty is the whole layer)."""
    from inspector.memory.engine.cuda import cuda_on_meta
    from inspector.memory.engine.runtime import runtime_config
    from inspector.world.stage import stage_world

    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime_config(job))
    with world as built, cuda_on_meta():
        chunks = [chunk.module for chunk in built]
        microbatches = captured_microbatches(job)
        # megatron's default micro-batch group, the pipeline size (the tool refuses another)
        order: list[Any] = capture_order(job.layout.pp, stage, len(chunks), microbatches)
        with _graphs_configured(chunks[0].config, scope):
            callables = _graphable(chunks)
            layer_ids = None
            if job.training.ep_overlap:
                order, layer_ids = overlap_order(job, order, [len(c) for c in callables], scope)
            args, kwargs = _sample_arguments(chunks, callables, job, microbatches, order, layer_ids)
            # under the overlap each graphed layer is a chunk of its own (its samples together)
            per_chunk = [[layer] for c in callables for layer in c] if layer_ids else callables
            output = _grad_output_bytes(job, per_chunk, microbatches, args, kwargs)
        storages: dict[int, int] = {}
        for tensor in _tensors((args, kwargs)):
            storage = tensor.untyped_storage()
            storages[storage._cdata] = rounded(storage.nbytes())
        return StaticInputs(len(args), len(storages), sum(storages.values()), tuple(order), output)


def overlap_order(job: Job, order: list[int], layers: list[int],
                  scope: tuple[str, ...]) -> tuple[list[float], list[Any]]:  # fmt: skip
    """Return the capture order under the MoE all-to-all overlap, one graphed layer a chunk, and
    each forward's (chunk, layer) (`_get_cuda_graph_input_data`: megatron-core's
    get_overlap_moe_expert_parallel_comm_order, layer by layer as the combined 1F1B step runs
    them; with --delay-wgrad-compute and attention or the shared experts in the graphs, their
    weight-gradient graphs at -(layer + 0.5))."""
    from megatron.core.transformer.cuda_graphs import get_overlap_moe_expert_parallel_comm_order

    shared = job.model.moe_shared_expert_intermediate_size is not None  # no shared-expert overlap
    wgrad = job.training.delay_wgrad and ("attn" in scope or ("moe_router" in scope and shared))
    new, layer_ids = get_overlap_moe_expert_parallel_comm_order(order, layers, wgrad)
    return list(new), list(layer_ids)


@contextlib.contextmanager
def _graphs_configured(config: Any, scope: tuple[str, ...]) -> Iterator[None]:
    """Give the built chunks' config the job's graphs (the tool builds without them): the
    implementation and the scope as megatron-core's enum."""
    from megatron.core.transformer import enums

    # megatron-core 0.19 renamed the scope `cuda_graph_modules` (enums.CudaGraphModule)
    field = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    kind = enums.CudaGraphModule if field == "cuda_graph_modules" else enums.CudaGraphScope
    saved = getattr(config, field), config.cuda_graph_impl
    setattr(config, field, [kind[word] for word in scope])
    config.cuda_graph_impl = "transformer_engine"
    try:
        yield
    finally:
        setattr(config, field, saved[0])
        config.cuda_graph_impl = saved[1]


def _graphable(chunks: list[Any]) -> list[list[Any]]:
    """Return each chunk's layers TECudaGraphHelper.__init__ graphs (`_layer_is_graphable`)."""
    from megatron.core.transformer.cuda_graphs import _layer_is_graphable

    callables: list[list[Any]] = []
    for chunk in chunks:
        layers = list(chunk.decoder.layers)
        if getattr(chunk, "mtp", None) is not None:
            # megatron-core 0.19 names an MTP layer's transformer layer `mtp_model_layer`
            layers += [getattr(m, "mtp_model_layer", None) or m.transformer_layer
                       for m in chunk.mtp.layers]  # fmt: skip
        callables.append([layer for layer in layers if _layer_is_graphable(layer, chunk.config)])
    return callables


def _sample_arguments(chunks: list[Any], callables: list[list[Any]], job: Job, microbatches: int,
                      order: list[Any], layer_ids: list[Any] | None = None,
                      ) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """Run megatron's TECudaGraphHelper._get_sample_arguments on the built chunks (under the
    overlap, `layer_ids` from `overlap_order`: as many chunks as graphed layers, one layer each,
    as `_get_cuda_graph_input_data` sets them)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    layers = [len(c) for c in callables]
    if layer_ids is not None:
        layers = [1] * sum(layers)
    helper = SimpleNamespace(
        num_model_chunks=len(layers), num_microbatches=microbatches, config=chunks[0].config,
        seq_length=job.model.seq_length, micro_batch_size=job.training.micro_batch_size,
        callables_per_chunk=callables, num_layers_per_chunk=layers,
        flattened_callables=[layer for chunk in callables for layer in chunk],
        chunks_with_decoder=chunks,
    )  # fmt: skip
    # megatron-core's TransformerLayer.get_layer_static_inputs builds the attention mask on the
    # host (`torch.tril(torch.ones((s / cp, s)))`, then `.to(cuda)`): only its shape is kept here,
    # so the host's factory calls make meta tensors too (a [8192, 8192] float each layer, else)
    with torch.device("meta"):
        return TECudaGraphHelper._get_sample_arguments(helper, order, layer_ids)


def _grad_output_bytes(job: Job, callables: list[list[Any]], microbatches: int, args: list[Any],
                       kwargs: list[Any]) -> int:  # fmt: skip
    """Return the static grad outputs TE makes (graph.py, `static_grad_outputs_dict`): one
    `empty_like` per output that requires grad, one set per signature of those outputs.

    A graph's outputs are its layer's `_te_cuda_graph_capture` on its first sample, run as
    megatron captures it (`is_graph_capturing()`): the hidden states for a whole layer, and with
    moe_router the router's outputs (the norm's output, probabilities, routing map, residual;
    with moe_preprocess the dispatcher's preprocessed tokens and attributes)."""
    from megatron.core.transformer import cuda_graphs

    signatures: dict[Any, int] = {}
    seen: set[Any] = set()
    first = 0  # a chunk's samples: its layers' for micro-batch 0 first (graph.py's indexing)
    with _routing(job):  # megatron's router on meta tensors (engine/moe.py)
        for layers in callables:
            for number, layer in enumerate(layers):
                index = first + number
                # a Mamba layer (a hybrid model's) has no MLP: its own type keys it
                kind = (type(getattr(layer, "mlp", layer)),
                        *((tuple(a.shape), a.dtype) for a in _tensors(args[index])))
                if kind in seen:  # a layer of the same kind and inputs: the same outputs
                    continue
                seen.add(kind)
                cuda_graphs._set_capture_start()
                try:
                    outputs = layer._te_cuda_graph_capture(*args[index], **kwargs[index])
                finally:
                    cuda_graphs._set_capture_end()
                # GraphableMegatronModule._te_cuda_graph_capture is the layer's forward: one
                # tensor for a Mamba layer, a tuple for TransformerLayer's
                outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
                grads = [o for o in outputs if o.requires_grad]
                key = tuple((tuple(o.shape), o.dtype) for o in grads)
                signatures[key] = sum(rounded(o.numel() * o.element_size()) for o in grads)
                del outputs, grads
            first += len(layers) * microbatches
    return sum(signatures.values())


def _tensors(tree: Any) -> list[Any]:
    import torch
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# A layer's label, as allocator.Tracker writes it ("decoder.layers.3.mlp.linear_fc1", in backward
# "decoder.layers.3.mlp: SwiGLUFunctionBackward") or compose.py renames it ("layer 17 mlp..."),
# and an MTP block's layer ("mtp.layers.0.transformer_layer..."): the layer, the part inside it
_IN_LAYER = re.compile(
    r"^(decoder\.layers\.\d+|layer \d+|mtp\.layers\.\d+\.transformer_layer)(?:[. ]([^:]*))?(?::|$)"
)
# TransformerLayer._get_submodules_under_cudagraphs: the submodules each scope word graphs
_ATTENTION = ("input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention")
_ROUTER = ("mlp.router", "mlp.shared_experts")  # with moe_router, beside pre_mlp_layernorm
_MAMBA = ("mixer", "norm")  # MambaLayer: norm, mixer, mamba_bda (graphed whole with mamba)
# what the graphs keep, as RunMemory.persistent names it (the timeline draws it as its own band)
GRAPHS = "CUDA graphs' "
# the label of a graphs' memory pool among them: once captured, its blocks are free to the caching
# allocator (reserved for the graphs, not allocated: see `allocated_peak`)
POOL = f"{GRAPHS}memory pool"


def _part(rest: str) -> str | None:
    """Return which part of a layer a label inside it names: attention, the MLP's norm, the
    router, the dispatcher's preprocessing, the MLP, a Mamba layer's norm and mixer (MambaLayer's
    submodules), or None for the layer's own ops (residual adds, bias-dropout-add)."""
    if rest.startswith(_MAMBA):
        return "mamba"
    if rest.startswith(_ATTENTION):
        return "attn"
    if rest.startswith(f"mlp.{PREPROCESS}"):
        return "preprocess"
    if rest.startswith(_ROUTER):
        return "router"
    if rest.startswith("pre_mlp_layernorm"):
        return "norm"
    if rest.startswith("mlp"):
        return "mlp"
    return None


def _graphed_part(part: str, scope: tuple[str, ...], moe: bool) -> bool:
    """Return whether a part of a layer (`moe`: a MoE layer's) runs inside its graph
    (TransformerLayer._te_cuda_graph_capture: _forward_attention with attn, _forward_mlp with
    mlp for a dense layer and moe for a MoE layer; with moe_router the MLP's norm and the router
    (MoELayer.route, shared experts), with moe_preprocess the preprocessing too, the MoE layer
    returning early: moe_utils.py maybe_skip_or_early_return_by_cudagraph)."""
    if not scope:
        return True
    if part == "mamba":  # megatron's _layer_is_graphable: a MambaLayer with mamba, whole
        return "mamba" in scope
    if part == "attn":
        return "attn" in scope
    whole = "moe" in scope if moe else "mlp" in scope
    if part == "router" or (part == "norm" and moe):
        return whole or "moe_router" in scope
    if part == "preprocess":
        return whole or "moe_preprocess" in scope
    return whole


def pool_of(events: Sequence[Event], scope: tuple[str, ...], backward: bool) -> list[bool]:
    """Return, for each event of a pass, whether its block is in the graphs' pool: allocated while
    a graphed part of a layer ran (a free: its allocation's label, allocator.Event.origin).

    A layer's own ops (its bias-dropout-adds) belong to the part they follow in the forward
    (`_forward_attention` ends with the attention's, `_forward_mlp` with the MLP's), so in the
    backward to the part that runs after them. A layer whose router runs is a MoE layer."""
    labels = [event.origin if event.bytes < 0 and event.origin else event.where for event in events]
    inside = [_IN_LAYER.match(label) for label in labels]
    parts: list[str | None] = [None if m is None else _part(m.group(2) or "") for m in inside]
    moe = {m.group(1) for m, part in zip(inside, parts) if m is not None and part == "router"}
    mamba = {_layer(m) for m, part in zip(inside, parts) if m is not None and part == "mamba"}
    order = range(len(events) - 1, -1, -1) if backward else range(len(events))
    current: str | None = None
    for index, m in ((i, inside[i]) for i in order):
        if m is None:
            current = None
        elif _layer(m) in mamba:  # a Mamba layer's own ops (its bias-dropout-add): its graph's
            parts[index] = "mamba"
        elif parts[index] is None:
            parts[index] = current or "attn"
        else:
            current = parts[index]
    return [m is not None and _graphed_part(part or "attn", scope, m.group(1) in moe)
            for m, part in zip(inside, parts)]  # fmt: skip


def _layer(match: re.Match[str]) -> str:
    """The layer a label names, in the backward's spelling (`layer N`) for either spelling."""
    return re.sub(r"^decoder\.layers\.(\d+)$", r"layer \1", match.group(1))


def split_trace(trace: Trace, scope: tuple[str, ...]) -> tuple[Trace, Trace]:
    """Return (the graphs' pool's part, the rest) of a micro-batch's trace, running totals
    recomputed for each: the two pools' blocks never serve each other (notes/cuda-graphs.md)."""
    pooled = pool_of(trace.forward, scope, False), pool_of(trace.backward, scope, True)
    halves = []
    for keep in (True, False):
        phases = []
        total = 0
        for events, flags in zip((trace.forward, trace.backward), pooled):
            out = []
            for event, flag in zip(events, flags):
                if flag == keep:
                    total += event.bytes
                    out.append(Event(event.bytes, total, event.where, event.origin))
            phases.append(tuple(out))
        halves.append(Trace(phases[0], phases[1], trace.persistent if not keep else (),
                            retained=trace.retained if not keep else ()))
    return halves[0], halves[1]


def allocated_peak(peak: Peak, pool: int, eager: bool) -> int:
    """Return the peak above the allocated static memory (static less the graphs' pool) as
    `torch.cuda.max_memory_allocated` sees it, what Megatron-LM logs as mem-max-allocated-bytes.

    A graph's blocks are allocated during its capture and freed when the capture no longer needs
    them (TE graph.py, `_reuse_graph_input_output_buffers`: "we just deallocate them" by
    `make_weak_ref`; torch.cuda.graph frees the full iteration's temporaries the same way):
    PyTorch's caching allocator keeps them reserved for the private pool, not allocated. So the
    allocated bytes reach the pool's high-water mark while the graphs are captured, and later
    replays allocate nothing (the rest of the step's peak alone); an eager iteration before the
    capture allocates everything, the pool's part included."""
    return peak.bytes + pool if eager else max(peak.bytes, pool)


def graphed_peak(job: Job, stage: int, traces: Sequence[Trace], step: Sequence[Event], extra: int = 0,
                 moments: int = 0, given: StaticInputs | None = None,
                 ) -> tuple[Peak, tuple[tuple[str, int], ...], tuple[Trace, ...], int]:  # fmt: skip
    """Return a stage's peak above static with Transformer Engine's per-layer graphs, what the
    graphs keep for good (static inputs, static grad outputs, their memory pool) and the traces
    of the rest of the step (the graphed parts taken out: they live in the pool).

    Megatron-LM runs `--cuda-graph-warmup-steps` iterations eagerly, then captures: the GPU's
    high-water mark is the higher of the eager iteration (today's engine peak) and the graphed
    one, where the pool's high-water mark (the graphed parts' live blocks over the capture
    order, which is the schedule's) is held beside the rest of the step's own peak. Last, the
    peak as PyTorch counts allocations (`allocated_peak`). With `--cuda-graph-warmup-steps 0`
    no eager iteration runs (training.py captures at the first iteration) and the capture comes
    before the first optimizer step, before its `moments` (the bytes it makes) exist; megatron-
    core's own graphs (local) record in the first iteration and capture at its end, so both that
    eager iteration and the capture come before them."""
    schedule = job.schedule()
    scope, pp, count = job.training.cuda_graph_scope, job.layout.pp, schedule.num_microbatches
    eager = iteration_peak(tuple(traces), stage, pp, count, step=tuple(step), extra=extra)
    halves = [split_trace(trace, scope) for trace in traces]
    pool = iteration_peak(tuple(h[0] for h in halves), stage, pp, count, extra=extra)
    rest = iteration_peak(tuple(h[1] for h in halves), stage, pp, count, step=tuple(step),
                          extra=extra)  # fmt: skip
    # megatron-core's CudaGraphManager: its reuse pool's buffers given (local_graphs.py)
    local = job.training.cuda_graph_impl == "local"
    inputs = given or static_inputs(job, stage, scope)
    if inputs.in_pool:  # held in the pool from each micro-batch's first graph to its backward
        pool = Peak(pool.bytes + inputs.bytes * pool.micro_batches, pool.held, pool.micro_batches,
                    pool.moment)  # fmt: skip
    kept: tuple[tuple[str, int], ...] = (
        (f"{GRAPHS}static inputs ({inputs.buffers} tensors for {inputs.graphs} graphs)",
         inputs.bytes),
        # TE graph.py: one `empty_like` per output signature (static_grad_outputs_dict): the
        # layers' hidden-state output
        (f"{GRAPHS}static grad outputs", inputs.grad_output_bytes),
        (f"{POOL} (high-water mark at the capture of the {pool.moment})", pool.bytes),
    )  # fmt: skip
    if local:  # megatron-core's: its grad outputs and its 0.19 inputs are pool blocks (local_graphs.py)
        gone = ("static grad outputs", "static inputs") if inputs.in_pool else ("static grad",)
        kept = tuple(row for row in kept if not row[0].startswith(tuple(GRAPHS + g for g in gone)))
    held = sum(size for _, size in kept)
    others = tuple(h[1] for h in halves)
    # local graphs are recorded in the first iteration, run eagerly, and captured at its end
    # (create_cudagraphs() closes the schedule's forward-backward), both before the first
    # optimizer step makes Adam's moments (local_graphs.py)
    warm = local or job.training.cuda_graph_warmup_steps > 0
    early = moments if local else 0
    if warm and eager.bytes - early > held + rest.bytes:
        moment = f"a warm-up iteration before the graphs are captured (eager): {eager.moment}"
        peak = Peak(eager.bytes - early - held, eager.held, eager.micro_batches, moment)
        return peak, kept, others, allocated_peak(peak, pool.bytes, True)
    moment = (f"{rest.moment}, beside the CUDA graphs' memory pool, which reached its size at the "
              f"graph of the {pool.moment}")  # fmt: skip
    peak = Peak(rest.bytes, rest.held, rest.micro_batches, moment)
    before = early if local else (0 if warm else moments)  # the capture, before the moments
    return peak, kept, others, allocated_peak(peak, pool.bytes - before, False)
