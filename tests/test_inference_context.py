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
