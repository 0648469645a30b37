"""The rollout engine's KV cache, as megatron-core's DynamicInferenceContext allocates it, on meta.

Megatron-LM's `train_rl.py` (GRPO) generates its rollouts with megatron-core's dynamic inference
engine, whose context allocates, once, a block pool for the KV cache and the per-request and
per-token tables beside it (megatron/core/inference/contexts/dynamic_context.py,
`allocate_all_tensors` / `initialize_all_tensors`): `buffer_size_gb * 1024**3 // block_size_bytes`
blocks, each `2 (K, V) x layers x block tokens x query groups per tensor-parallel rank x head
dim x dtype` bytes. With --rl-kv-cache-management-mode persist (the default) the pool stays on
the GPU through training (`deallocate_inference_state_buffers` returns early), so it is part of
what every rank holds when the training step is logged.

Here the context itself is constructed, inside the engine's CUDA-on-meta world (cuda.py) and the
allocator model (allocator.py), with the arguments Megatron-LM passes it:
- megatron-core 0.16 (`DynamicInferenceContext(params_dtype=..., num_layers=..., ...)`): as
  Megatron-LM core_v0.16.1's megatron/rl/inference/megatron.py L142-170 calls it;
- megatron-core 0.17+ (`DynamicInferenceContext(model_config, inference_config)`): the built
  model's TransformerConfig and an InferenceConfig with the fields Megatron-LM's
  `InferenceSetupConfig.to_inference_config` fills from the same arguments (d98e8a6
  megatron/training/config/inference_config.py L254).
With --inference-dynamic-batching-unified-memory-level 1 the pool comes from a
cudaMallocManaged MemPool (`create_unified_mempool`, a CUDA extension compiled at run time):
the pool is replaced by no pool, so the same tensors are made where the tracker sees them. The
caching allocator counts a MemPool's blocks in `allocated_bytes` as any other (the 8B GRPO
functional tests' goldens hold the 20 GiB pool).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from inspector.errors import ConfigError
from inspector.job.layout import Layout
from inspector.job.rollout import RolloutContext
from inspector.memory.engine.allocator import Tracker
from inspector.memory.engine.cuda import cuda_on_meta
from inspector.memory.engine.rollout_graphs import EngineGraphs, engine_graphs
from inspector.world.setup import simulated_rank
from inspector.world.stage import stage_rank


@dataclass(frozen=True)
class ContextBytes:
    """What the rollout engine keeps on the GPU: the context's KV block pool and everything else
    it made, and the text generation controller's sampling buffers."""

    kv_cache: int
    tables: int  # the request and token tables, the attention metadata's buffers
    sampling: int  # the controller's (0.17+: the CUDA-graphed logits buffer, max_requests x vocab)
    blocks: int
    block_bytes: int
    graphs: EngineGraphs  # its CUDA graphs' outputs, kept through the training step

    @property
    def total(self) -> int:
        return self.kv_cache + self.tables + self.sampling + self.graphs.bytes


def context_bytes(config: Any, rollout: RolloutContext, layout: Layout, stage: int,
                  vocab_size: int, layers: tuple[int, ...] = (1,)) -> ContextBytes:  # fmt: skip
    """Construct megatron-core's DynamicInferenceContext for `config` on meta, as a rank of
    pipeline stage `stage` of `layout` does (0.17+ reads its layers and groups from
    parallel_state), then the sampling buffers its text generation controller makes for it
    (`vocab_size`: the model's padded vocabulary), and count what they allocate, and what the
    engine's CUDA graphs keep (`layers`: the transformer layers of each of the rank's chunks,
    rollout_graphs.py)."""
    rank = stage_rank(layout, stage, 0)
    with simulated_rank(layout, rank, None) as ps, cuda_on_meta(), _no_unified_pool():
        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

        with Tracker() as tracker:
            try:
                context = _construct(DynamicInferenceContext, config, rollout)
            except AssertionError as error:  # megatron's own checks of the arguments
                raise ConfigError(
                    f"megatron-core's DynamicInferenceContext refuses the rollout engine's "
                    f"arguments: '{error}' (--inference-dynamic-batching-buffer-size-gb "
                    f"{rollout.buffer_size_gb} gives one request a block; set "
                    "--inference-dynamic-batching-max-requests or -max-tokens)") from None
        kv = context.memory_buffer
        kv_bytes = kv.numel() * kv.element_size()
        allocator = getattr(context, "kv_block_allocator", None) or context.block_allocator
        blocks, block_bytes = allocator.total_count, context.block_size_bytes
        with Tracker() as sampling:
            controller = _sampling_tensors(context, config, rollout, vocab_size, ps)
        graphs = engine_graphs(context, config, rollout, sum(layers), len(layers))
        found = ContextBytes(kv_bytes, tracker.allocated - kv_bytes, sampling.allocated, blocks,
                             block_bytes, graphs)  # fmt: skip
        del context, kv, controller
    return found


def _sampling_tensors(context: Any, config: Any, rollout: RolloutContext, vocab_size: int,
                      ps: Any) -> Any:  # fmt: skip
    """Run megatron-core's TextGenerationController._init_dynamic_sampling_tensors, which the
    controller's constructor calls for a dynamic context, on an instance holding what it reads
    (the rest of the constructor loads a tokenizer and wraps the model: nothing on the GPU).
    The model's config says `--cuda-graph-impl local` where the engine graphs (the policy's
    graphs are turned off for the training step only, job/rollout.py)."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    model_config = _engine_config(config, rollout)
    controller = TextGenerationController.__new__(TextGenerationController)
    controller.model_config = model_config
    controller.vocab_size = vocab_size
    controller.num_speculative_tokens = 0  # --num-speculative-tokens is refused by name
    controller.sampling_rng = torch.Generator()
    controller.pp_group = ps.get_pipeline_model_parallel_group()
    controller.inference_wrapped_model = SimpleNamespace(
        inference_context=context, config=model_config, model=torch.nn.Module(),
        tp_group=ps.get_tensor_model_parallel_group(),
        # megatron-core 0.16's InferenceWrapperConfig
        inference_wrapper_config=SimpleNamespace(params_dtype=config.params_dtype,
                                                 padded_vocab_size=vocab_size))  # fmt: skip
    controller._init_dynamic_sampling_tensors()
    return controller


def _construct(cls: Any, config: Any, rollout: RolloutContext) -> Any:
    """Call the installed context's constructor as Megatron-LM's RL inference set-up does."""
    if "inference_config" not in inspect.signature(cls.__init__).parameters:
        heads = config.num_query_groups or config.num_attention_heads
        return cls(
            params_dtype=config.params_dtype,
            num_layers=config.num_layers // config.pipeline_model_parallel_size,
            kv_channels=config.kv_channels,
            num_attention_heads=heads,
            max_sequence_length=rollout.max_sequence_length,
            num_cuda_graphs=rollout.num_cuda_graphs if rollout.cuda_graphs else None,
            use_cuda_graphs_for_non_decode_steps=not rollout.decode_only_graphs,
            cuda_graph_mixed_prefill_count=rollout.mixed_prefill_count,
            persist_cuda_graphs=rollout.training_graphs,
            block_size_tokens=rollout.block_size_tokens,
            buffer_size_gb=rollout.buffer_size_gb,
            paused_buffer_size_gb=rollout.paused_buffer_size_gb,
            max_requests=rollout.max_requests,
            max_tokens=rollout.max_tokens,
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            unified_memory_level=rollout.unified_memory_level,
        )
    from megatron.core.inference.config import InferenceConfig

    # the graphs' spacing (0.19+; Megatron-LM passes its choice, default exponential)
    sizing = {} if rollout.graph_sizing is None else {
        "cuda_graph_sizing_distribution": type(
            InferenceConfig.__dataclass_fields__["cuda_graph_sizing_distribution"].default)(
            rollout.graph_sizing)}
    inference = InferenceConfig(**sizing,
        block_size_tokens=rollout.block_size_tokens,
        buffer_size_gb=rollout.buffer_size_gb,
        paused_buffer_size_gb=rollout.paused_buffer_size_gb,
        max_requests=rollout.max_requests,
        max_tokens=rollout.max_tokens,
        unified_memory_level=rollout.unified_memory_level,
        num_cuda_graphs=rollout.num_cuda_graphs if rollout.cuda_graphs else None,
        use_cuda_graphs_for_non_decode_steps=not rollout.decode_only_graphs,
        cuda_graph_mixed_prefill_count=rollout.mixed_prefill_count,
        max_sequence_length=rollout.max_sequence_length,
    )
    return cls(_engine_config(config, rollout), inference)


def _engine_config(config: Any, rollout: RolloutContext) -> Any:
    """Return the model's config as the rollout engine sees it: `--cuda-graph-impl local` where
    the engine graphs, its inference scope then `layer` (rl_utils.py `megatron_rl_inference_mode`
    sets both; 0.18+ `normalize_inference_cuda_graph_scope` derives the scope from the impl)."""
    model_config = copy.copy(config)
    model_config.cuda_graph_impl = "local" if rollout.cuda_graphs else "none"
    if hasattr(model_config, "inference_cuda_graph_scope"):
        from megatron.core.transformer.cuda_graph_config import normalize_inference_cuda_graph_scope

        model_config.inference_cuda_graph_scope = normalize_inference_cuda_graph_scope(
            None, model_config.cuda_graph_impl)
    return model_config


@contextlib.contextmanager
def _no_unified_pool() -> Iterator[None]:
    """Make the unified-memory MemPool no pool: its tensors are made (and counted) as others."""
    from megatron.core.inference.contexts import dynamic_context

    saved = [(dynamic_context, "create_unified_mempool", None), (torch.cuda, "use_mem_pool", None)]
    saved = [(owner, name, getattr(owner, name, None)) for owner, name, _ in saved]
    dynamic_context.create_unified_mempool = lambda *a, **k: None
    torch.cuda.use_mem_pool = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
