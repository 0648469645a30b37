"""megatron-core's own per-layer CUDA graphs (`--cuda-graph-impl local` without
`--cuda-graph-scope`): what they keep beside Transformer Engine's, from megatron-core's
CudaGraphManager (transformer/cuda_graphs.py, 0.16.1; the same in 0.19.2).

- Which layers: GraphableMegatronModule.__init__ gives every TransformerLayer and MambaLayer a
  CudaGraphManager (`create_mcore_cudagraph_manager`: the whole layer without a scope), the
  layers `_layer_is_graphable` picks for Transformer Engine's path too.
- When: the first training iteration runs eagerly and records each runner's first forward and
  backward in execution order (`_CudaGraphRunner.record_graph_capture`,
  `_CudagraphGlobalRecord`); `create_cudagraphs()` at the end of the schedule's
  forward-backward (pipeline_parallel/schedules.py) captures them in that order, the schedule's,
  into ONE memory pool (`CudaGraphManager.global_mempool`). So an eager iteration always runs
  before the capture, whatever `--cuda-graph-warmup-steps` (there the number of times each
  runner runs its layer on zeros before capturing it, transient blocks not modelled). Both come
  before the first optimizer step, so before Adam's moments exist (torch's and Transformer
  Engine's Adam make them lazily in their first step): a job starting afresh, as the tool takes
  every job (an optimizer state loaded from a checkpoint would hold them already).
- How many: without a pipeline a layer's micro-batches run one at a time and share one runner
  (`reuse_cudagraphs`: one graph pair per layer); with one, a runner per (layer, micro-batch)
  (`get_cudagraph_runner`), as Transformer Engine's path captures (cuda_graphs.py
  `captured_microbatches`).
- Static inputs (`create_fwd_graph` `_resolve_input_buffer`, `TensorReusePool`): a layer whose
  input is the previous graph's output reads that output in place (in the pool); the first
  layer's hidden states and each tensor many layers share (mask, rope table) get a buffer from
  the reuse pool, allocated outside the graphs' pool and held for good; a buffer nobody reads
  after a forward returns to the reuse pool, and the last layer's static grad output takes a
  returned one of its shape (`create_bwd_graph`: `tensor_reuse_pool.get`). So the buffers held
  are one sample's tensors, one per shape and dtype (`local_static_inputs`), not one per
  (layer, micro-batch) as Transformer Engine's; with Transformer Engine installed the rest are
  weak references into the pool (`make_weak_ref`), as in its own path.
- megatron-core 0.19 (0.19.2 cuda_graphs.py `alloc_tensor_from_graph_mempool`, replacing
  TensorReusePool) allocates those buffers and the last layer's static grad output in the
  graphs' pool itself: nothing is held outside it, and each micro-batch's first-layer sample
  stays in the pool until its backward is captured (a strong reference until `create_bwd_graph`
  turns it weak), so the pool's high-water mark takes one sample per micro-batch then in flight.

The pool is then Transformer Engine's model (cuda_graphs.py `graphed_peak`): the graphed layers'
live blocks over the capture order, which is the schedule's.
"""

from __future__ import annotations

from inspector.job.job import Job
from inspector.memory.engine.allocator import rounded
from inspector.memory.engine.cuda_graphs import (
    StaticInputs,
    _graphable,
    _graphs_configured,
    _sample_arguments,
    _tensors,
)


def local_static_inputs(job: Job, stage: int) -> StaticInputs:
    """Return the reuse pool's buffers for `stage`'s graphs: one per shape and dtype among the
    samples of the first chunk's graphed layers (TransformerLayer.get_layer_static_inputs, the
    rope table: what a layer is called with, megatron's own `_get_sample_arguments` on the
    built stage)."""
    from megatron.core.transformer import cuda_graphs

    from inspector.memory.engine.cuda import cuda_on_meta
    from inspector.memory.engine.cuda_graphs import captured_microbatches
    from inspector.memory.engine.runtime import runtime_config
    from inspector.world.stage import stage_world

    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime_config(job))
    with world as built, cuda_on_meta():
        chunks = [chunk.module for chunk in built]
        with _graphs_configured(chunks[0].config, ()):
            callables = _graphable(chunks)
            # one micro-batch of the first chunk: its forward then its backward
            args, kwargs = _sample_arguments(chunks, callables, job, 1, [1, -1])
        # a buffer per shape and dtype the first chunk's layers are called with: each returns
        # to the reuse pool for the next that asks for its shape (a hybrid's Mamba and
        # attention layers ask for different ones)
        sizes: dict[tuple[object, ...], int] = {}
        for index in range(len(callables[0])):
            for tensor in _tensors((args[index], kwargs[index])):
                sizes[(tuple(tensor.shape), tensor.dtype)] = rounded(tensor.untyped_storage().nbytes())
        graphs = sum(len(c) for c in callables) * captured_microbatches(job)
        in_pool = hasattr(cuda_graphs, "alloc_tensor_from_graph_mempool")  # megatron-core 0.19+
        return StaticInputs(graphs, len(sizes), sum(sizes.values()), (), in_pool=in_pool)
