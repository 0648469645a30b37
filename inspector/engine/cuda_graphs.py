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
What the captured graphs themselves keep (TE's private graph memory pool: the graphed layers'
activations, which the rest of the step cannot reuse) is not here yet: `--cuda-graph-impl`
stays refused by `memory` (inspector/inputs/unmodelled.py) until it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from inspector.engine.allocator import rounded
from inspector.job.job import Job


@dataclass(frozen=True)
class StaticInputs:
    """The static inputs of one stage's per-layer graphs."""

    graphs: int  # (layer, micro-batch) pairs captured
    buffers: int  # distinct tensors among their inputs (reused ones counted once)
    bytes: int  # what those tensors take on the GPU (the caching allocator's blocks)
    order: tuple[int, ...]  # the capture order megatron gives TE (chunk+1 forward, -(chunk+1))


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
    from inspector.engine.cuda import cuda_on_meta
    from inspector.engine.microbatch import runtime_config
    from inspector.world.stage import stage_world

    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime_config(job))
    with world as built, cuda_on_meta():
        chunks = [chunk.module for chunk in built]
        microbatches = captured_microbatches(job)
        # megatron's default micro-batch group, the pipeline size (the tool refuses another)
        order = capture_order(job.layout.pp, stage, len(chunks), microbatches)
        args, kwargs = _sample_arguments(chunks, job, microbatches, order, scope)
        storages: dict[int, int] = {}
        for tensor in _tensors((args, kwargs)):
            storage = tensor.untyped_storage()
            storages[storage._cdata] = rounded(storage.nbytes())
        return StaticInputs(len(args), len(storages), sum(storages.values()), tuple(order))


def _sample_arguments(chunks: list[Any], job: Job, microbatches: int, order: list[int],
                      scope: tuple[str, ...]) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """Run megatron's TECudaGraphHelper._get_sample_arguments on the built chunks, with the
    graphable layers its __init__ would pick (`_layer_is_graphable`)."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper, _layer_is_graphable
    from megatron.core.transformer.enums import CudaGraphScope

    config = chunks[0].config
    saved = config.cuda_graph_scope
    config.cuda_graph_scope = [CudaGraphScope[word] for word in scope]
    try:
        callables: list[list[Any]] = []
        for chunk in chunks:
            layers = list(chunk.decoder.layers)
            if getattr(chunk, "mtp", None) is not None:
                layers += [m.transformer_layer for m in chunk.mtp.layers]
            callables.append([layer for layer in layers if _layer_is_graphable(layer, config)])
        helper = SimpleNamespace(
            num_model_chunks=len(chunks), num_microbatches=microbatches, config=config,
            seq_length=job.model.seq_length, micro_batch_size=job.training.micro_batch_size,
            callables_per_chunk=callables, num_layers_per_chunk=[len(c) for c in callables],
            flattened_callables=[layer for chunk in callables for layer in chunk],
            chunks_with_decoder=chunks,
        )  # fmt: skip
        return TECudaGraphHelper._get_sample_arguments(helper, order)
    finally:
        config.cuda_graph_scope = saved


def _tensors(tree: Any) -> list[Any]:
    import torch
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]
