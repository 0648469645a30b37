"""The GRPO rollout engine's KV cache: megatron-core's DynamicInferenceContext on meta."""

from __future__ import annotations

import pytest

from inspector.job.layout import Layout
from inspector.world.setup import megatron
from tests.test_versions import ROLLOUTS_MODELLED

pytestmark = pytest.mark.skipif(not ROLLOUTS_MODELLED, reason="refused before 0.16 (test_jobs)")


@pytest.fixture(scope="module")
def config():
    megatron()
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    # 4 layers, 8 heads in 2 query groups of dimension 64, tensor-parallel 2: 1 group a rank
    return TransformerConfig(num_layers=4, hidden_size=512, num_attention_heads=8,
                             num_query_groups=2, kv_channels=64, tensor_model_parallel_size=2,
                             params_dtype=torch.bfloat16, bf16=True)  # fmt: skip


def config_tp1(config):
    import dataclasses

    return dataclasses.replace(config, tensor_model_parallel_size=1)


@pytest.mark.parametrize("unified", [0, 1])
def test_the_kv_pool_is_the_buffer_cut_into_blocks_of_every_layer_s_keys_and_values(config, unified):
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.inference_context import context_bytes

    rollout = RolloutContext(buffer_size_gb=0.01, max_sequence_length=512, unified_memory_level=unified)
    found = context_bytes(config, rollout, Layout(tp=2, dp=2), 0, 1024)
    # dynamic_context.py: block bytes = dtype x 2 (K, V) x layers x block tokens x query groups
    # per tensor-parallel rank x head dimension; blocks = int(buffer_size_gb * 1024**3) // that
    block = 2 * 2 * 4 * 256 * (2 // 2) * 64
    assert found.block_bytes == block == 262144
    assert found.blocks == int(0.01 * 1024**3) // block == 40
    assert found.kv_cache == 40 * block
    # the GPU's request and token tables and attention metadata (max_tokens 16384 by default;
    # 0.17+ keeps most bookkeeping in pinned host memory): under a MiB beside the pool
    assert 0 < found.tables < 1024**2


def test_the_pool_follows_the_buffer_size_and_the_rank_s_query_groups(config):
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.inference_context import context_bytes

    small = context_bytes(config, RolloutContext(buffer_size_gb=0.01), Layout(tp=2), 0, 1024)
    double = context_bytes(config, RolloutContext(buffer_size_gb=0.02), Layout(tp=2), 0, 1024)
    assert (small.blocks, double.blocks) == (int(0.01 * 1024**3) // small.block_bytes,
                                             int(0.02 * 1024**3) // small.block_bytes) == (40, 81)
    assert double.kv_cache == 81 * small.block_bytes
    # tensor-parallel 1: both query groups on the rank, blocks twice the bytes
    whole = context_bytes(config_tp1(config), RolloutContext(buffer_size_gb=0.01), Layout(), 0, 1024)
    assert whole.block_bytes == 2 * small.block_bytes and whole.blocks == 20


@pytest.mark.parametrize("graphs", [False, True])
def test_the_controller_s_sampling_buffers(config, graphs):
    from inspector.inputs.versions import megatron_core_version
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.allocator import rounded
    from inspector.memory.engine.inference_context import context_bytes

    rollout = RolloutContext(buffer_size_gb=0.01, cuda_graphs=graphs)
    found = context_bytes(config, rollout, Layout(tp=2), 0, 1024)
    # dynamic_context.py: max_requests = (blocks - 1) // tp * tp // 4 * 4 = 39 -> 38 -> 36
    requests = (40 - 1) // 2 * 2 // 4 * 4
    # text_generation_controller.py `_sampled_tokens_cuda`, int64; megatron-core 0.18 makes it only
    # for speculative (MTP) decoding, otherwise rebinding it to the sampling kernel's output
    # (version fact: 0.16.1, 0.17.1 and 0.19.2 allocate it in __init__)
    tokens = rounded(requests * 8) if megatron_core_version()[:2] != (0, 18) else 0
    # megatron-core 0.18+ (not 0.16.1 or 0.17.1): with CUDA graphs, `_all_logits_cuda` (1,
    # max_requests, vocab) in the params' dtype (materialize_only_last_token_logits: RL skips the
    # prompt's log-probs)
    logits = rounded(requests * 1024 * 2) if graphs and megatron_core_version() >= (0, 18) else 0
    assert found.sampling == tokens + logits


def test_the_engine_s_graphs_keep_each_layer_s_output_per_batch_size(config):
    from inspector.inputs.versions import megatron_core_version
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.inference_context import context_bytes

    # 2 of 4 layers on each of two chunks; the context's own list of graphed batch sizes
    rollout = RolloutContext(buffer_size_gb=0.01, cuda_graphs=True, num_cuda_graphs=1,
                             unified_memory_level=1)  # fmt: skip
    found = context_bytes(config, rollout, Layout(tp=2), 0, 1024, (2, 2))
    graphs = found.graphs
    assert graphs.layers == 4
    # cuda_graphs.py create_fwd_graph: an inference graph's output, [tokens, 1, hidden 512] bf16,
    # is not made a weak reference: 4 per graph; the first layer of each of the 2 chunks copies
    # its input (0.19+: a copy per graph; before, the reuse pool: one for all graphs of one shape).
    # The context's list (max_requests 36 here, dynamic_context.py):
    if megatron_core_version() >= (0, 19):
        # 0.19 bounds the prefill and mixed graphs at cuda_graph_max_tokens 512 (the decode
        # bound, 36 requests, is below it): 7 of 512 tokens, 1 decode-only of 36
        assert graphs.graphs == 8
        assert graphs.bytes == (4 + 2) * (7 * 512 + 36) * 512 * 2
    elif megatron_core_version() < (0, 17):
        # 0.16: 36 tokens each (prefill-only, mixed with 16 prefills, decode-only)
        assert graphs.graphs == 3
        assert graphs.bytes == 4 * 3 * 36 * 512 * 2 + 2 * 36 * 512 * 2
    assert found.total == found.kv_cache + found.tables + found.sampling + graphs.bytes
    # no graphs without --cuda-graph-impl local, nor after Megatron-LM 0.16's
    # --rl-reset-cuda-graphs deleted them for the training step
    for off in (RolloutContext(buffer_size_gb=0.01, num_cuda_graphs=1, unified_memory_level=1),
                RolloutContext(buffer_size_gb=0.01, cuda_graphs=True, num_cuda_graphs=1,
                               unified_memory_level=1, reset_graphs=True)):  # fmt: skip
        assert context_bytes(config, off, Layout(tp=2), 0, 1024, (2, 2)).graphs.bytes == 0


@pytest.mark.parametrize("level", [0, 1])
def test_the_engine_s_suspend_keeps_the_graphs_with_the_kv_cache_persisted(config, level):
    from inspector.inputs.versions import megatron_core_version
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.inference_context import context_bytes

    def kept(**flags):
        rollout = RolloutContext(buffer_size_gb=0.01, cuda_graphs=True, num_cuda_graphs=1,
                                 unified_memory_level=level, **flags)  # fmt: skip
        return context_bytes(config, rollout, Layout(tp=2), 0, 1024, (4,)).graphs.bytes > 0

    # dynamic_engine.py suspend: 0.17+ deletes them only for a KV cache moved off the GPU; 0.16
    # with unified memory level 0 unless --rl-training-cuda-graphs (its persist_cuda_graphs)
    assert kept(training_graphs=True)
    assert kept() == (megatron_core_version() >= (0, 17) or level == 1)


def test_the_spacing_and_the_mixed_steps_choose_the_graphs(config):
    from inspector.inputs.versions import megatron_core_version
    from inspector.job.rollout import RolloutContext
    from inspector.memory.engine.inference_context import context_bytes

    def graphs(**flags):
        rollout = RolloutContext(buffer_size_gb=0.2, cuda_graphs=True, num_cuda_graphs=4,
                                 unified_memory_level=1, **flags)  # fmt: skip
        return context_bytes(config, rollout, Layout(tp=2), 0, 1024, (4,)).graphs.graphs

    # --decode-only-cuda-graphs: decode steps only, fewer graphs than with the mixed ones
    assert graphs(decode_only_graphs=True) < graphs()
    if megatron_core_version() >= (0, 19):  # the sizing distribution's own list
        assert graphs(graph_sizing="linear") != graphs(graph_sizing="exponential")
