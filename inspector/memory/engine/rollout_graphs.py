"""The GRPO rollout engine's CUDA graphs (`--cuda-graph-impl local` under train_rl.py
--perform-rl-step): what they keep allocated through the training step, from megatron-core's code.

- Which graphs: the engine captures one graph per batch size of the context's list
  (`DynamicInferenceContext.cuda_graph_batch_dimensions_list`, megatron's own, read off the
  context built on meta: --inference-dynamic-batching-num-cuda-graphs,
  --inference-dynamic-batching-cuda-graph-sizing-distribution, the mixed-prefill count,
  --decode-only-cuda-graphs) and per transformer layer: with --inference-cuda-graph-scope layer
  (local's default) each TransformerLayer's CudaGraphManager captures its own runner for the
  step's `padded_batch_dimensions` (transformer/cuda_graphs.py `CudaGraphManager.__call__`,
  the inference branch; 0.19.2 L1971-2016, 0.16.1 L1556-1593).
- What a graph keeps allocated: its output, the layer's hidden states [tokens, 1, hidden] in the
  params' dtype (/ tensor-parallel size with sequence parallelism), from the graphs' pool:
  `create_fwd_graph` keeps `fwd_graph_outputs` and turns them into weak references only for a
  training graph (`if self.training and torch.is_grad_enabled()`), so an inference graph's
  output stays allocated; the next layer reads it in place (`previous_runner`). The first layer
  of each chunk (`annotate_first_last_layer`) copies its hidden states into a buffer of its own
  (`clone_inputs=runner.is_first_layer`): one per graph on 0.19+
  (`alloc_tensor_from_graph_mempool`), one for all before (`TensorReusePool.get`, returned to
  the reuse pool after each capture and taken again by the next). The first layer's other
  inputs (its rope table, KiBs) and the capture's temporaries (freed to the pool: reserved, not
  allocated) are not counted.
- Whether they stay: the engine's `suspend()` deletes them (`delete_cuda_graphs`) by a test
  of the context's attributes, read off the context built on meta: 0.17+ only for a KV cache
  moved off the GPU without static pointers (never with persist, the one modelled); 0.16 only
  with unified memory level 0 and without --rl-training-cuda-graphs (its
  `persist_cuda_graphs`). Megatron-LM 0.16's --rl-reset-cuda-graphs deletes them too when the
  policy's graphs are toggled off for training (core_v0.16.1 megatron/rl/rl_utils.py L1431,
  transformer/utils.py `toggle_cuda_graphs` L446-448), so not with --rl-training-cuda-graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inspector.job.rollout import RolloutContext
from inspector.memory.engine.allocator import rounded


@dataclass(frozen=True)
class EngineGraphs:
    """The rollout engine's graphs kept through the training step on one rank."""

    graphs: int  # batch sizes captured (the context's list)
    layers: int  # graphed transformer layers on the rank, every chunk's
    bytes: int  # their outputs and the first layers' input copies, allocated


def engine_graphs(context: Any, config: Any, rollout: RolloutContext, layers: int,
                  chunks: int) -> EngineGraphs:  # fmt: skip
    """Return what the rollout engine's CUDA graphs keep allocated through the training step on a
    rank whose `chunks` model chunks hold `layers` transformer layers, `context` the
    DynamicInferenceContext built for it (inference_context.py)."""
    dims = list(getattr(context, "cuda_graph_batch_dimensions_list", None) or ())
    if not rollout.cuda_graphs or not dims or not _kept(context, rollout):
        return EngineGraphs(0, layers, 0)
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    itemsize = config.params_dtype.itemsize
    hidden = [rounded(d.token_count // tp * config.hidden_size * itemsize) for d in dims]
    # before 0.19 the reuse pool holds one first-layer copy per shape for all graphs
    copies = hidden if _copies_per_graph() else sorted(set(hidden))
    return EngineGraphs(len(dims), layers, layers * sum(hidden) + chunks * sum(copies))


def _copies_per_graph() -> bool:
    """Whether each graph's first layer has its own input copy (0.19+'s graph-pool buffers)."""
    from megatron.core.transformer import cuda_graphs

    return hasattr(cuda_graphs, "alloc_tensor_from_graph_mempool")


def _kept(context: Any, rollout: RolloutContext) -> bool:
    """Return whether the graphs survive the engine's suspend before the training step."""
    if rollout.reset_graphs and not rollout.training_graphs:  # Megatron-LM 0.16's rl_utils
        return False
    return not _suspend_deletes_graphs(context)


def _suspend_deletes_graphs(context: Any) -> bool:
    """Return whether the installed engine's `suspend()` deletes the graphs, by its own test on
    the context's attributes: 0.17+ `kv_cache_management_mode != PERSIST and not
    static_kv_memory_pointers` (dynamic_engine.py, core_v0.17.1 L710-714, 0.19.2 L859-863);
    0.16 `unified_memory_level == 0 and not persist_cuda_graphs` (0.16.1 L617, the engine
    copying both from the context, L191-192). The engine itself is not imported: 0.16's package
    registers a faulthandler on SIGTERM at import (data_parallel_inference_coordinator.py L32-33)."""
    mode = getattr(context, "kv_cache_management_mode", None)
    if mode is not None:
        return mode.value != "persist" and not context.static_kv_memory_pointers
    return context.unified_memory_level == 0 and not context.persist_cuda_graphs
