"""Model presets: published architectures in Megatron-LM's argument names (`--model NAME`).

Each preset is architecture only (no parallel sizes), gives the source of its configuration and
the published total parameter count that tests/test_presets.py checks it against (within 0.5%).
Vocabularies are padded as Megatron-LM pads them (to a multiple of 128 x tp).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.presets_gdn import GDN_PRESETS
from inspector.inputs.presets_hybrid import HYBRID_PRESETS


@dataclass(frozen=True)
class Preset:
    """A published model configuration."""

    name: str
    summary: str  # key sizes, one line
    source: str  # where the configuration is published
    args: Mapping[str, Any]  # Megatron-LM arguments (underscores), architecture only
    published_params: float  # total parameters as published
    published_source: str  # where that count is stated


_LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
)
# DeepSeek-V3's architecture (HF deepseek-ai/DeepSeek-V3 config.json), with the flags of
# Megatron-LM's DeepSeek-V3 recipe; DeepSeek-V3.2 adds its indexer to it
_DEEPSEEK_V3 = dict(
    num_layers=61, hidden_size=7168, num_attention_heads=128, kv_channels=128,
    ffn_hidden_size=18432, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
    qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
    rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
    num_experts=256, moe_layer_freq="([0]*3+[1]*58)", moe_router_topk=8,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_num_groups=8, moe_router_group_topk=4,  # HF n_group, topk_group; the recipe's
    moe_grouped_gemm=True, mtp_num_layers=1, seq_length=4096, max_position_embeddings=4096,
    vocab_size=129280, make_vocab_size_divisible_by=1280, **_LLAMA,
    transformer_impl="transformer_engine",
)


# GLM-5's architecture (HF zai-org/GLM-5 config.json, glm_moe_dsa), with the flags Megatron-Bridge's
# glm_moe_dsa/glm5_bridge.py sets (its MTP layer off); GLM-5.2 shares its indexer's top-k
_GLM_5 = dict(
    num_layers=78, hidden_size=6144, num_attention_heads=64, ffn_hidden_size=12288,
    multi_latent_attention=True, q_lora_rank=2048, kv_lora_rank=512, qk_head_dim=192,
    qk_pos_emb_head_dim=64, v_head_dim=256, qk_layernorm=True, rotary_scaling_factor=1.0,
    mscale=1.0, mscale_all_dim=1.0,
    num_experts=256, moe_layer_freq="([0]*3+[1]*75)", moe_router_topk=8,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_pre_softmax=True, moe_grouped_gemm=True,
    experimental_attention_variant="dsa", dsa_indexer_n_heads=32, dsa_indexer_head_dim=128,
    dsa_indexer_topk=2048, no_rope_fusion=True,  # as deepseek-v3.2: DSAttention refuses it
    seq_length=4096, max_position_embeddings=202752, vocab_size=154880,
    make_vocab_size_divisible_by=1280, **_LLAMA, transformer_impl="transformer_engine",
)


def _preset(
    name: str, summary: str, source: str, count: float, count_source: str, **args: Any
) -> Preset:
    return Preset(name, summary, source, MappingProxyType(args), count, count_source)


_ALL = [
    _preset(
        "gpt2-small", "12 layers, hidden 768, 12 heads, seq 1024, vocab 50257, tied (the default)",
        "Radford et al. 2019, GPT-2 (HF openai-community/gpt2 config.json); Megatron-LM GPT-2 recipe",
        124.44e6, "HF openai-community/gpt2: 124,439,808 parameters",
        num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=1024,
        max_position_embeddings=1024, vocab_size=50257,
    ),
    _preset(
        "gpt2-medium", "24 layers, hidden 1024, 16 heads, seq 1024, vocab 50257, tied",
        "Radford et al. 2019, GPT-2 (HF openai-community/gpt2-medium config.json)",
        354.82e6, "HF openai-community/gpt2-medium: 354,823,168 parameters",
        num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
        max_position_embeddings=1024, vocab_size=50257,
    ),
    _preset(
        "gpt3-175b", "96 layers, hidden 12288, 96 heads, seq 2048, vocab 50257, tied",
        "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1; Megatron-LM "
        "examples/gpt3/train_gpt3_175b_distributed.sh",
        175.0e9, "Brown et al. 2020, Table 2.1: 175.0B",
        num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
        max_position_embeddings=2048, vocab_size=50257,
    ),
    _preset(
        "llama2-7b", "32 layers, hidden 4096, 32 heads, ffn 11008, vocab 32000, RMSNorm/SwiGLU/RoPE",
        "Touvron et al. 2023, Llama 2 (HF meta-llama/Llama-2-7b-hf config.json)",
        6.74e9, "HF meta-llama/Llama-2-7b-hf: 6,738,415,616 parameters",
        num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
        seq_length=4096, max_position_embeddings=4096, vocab_size=32000, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "llama2-70b", "80 layers, hidden 8192, 64 heads (8 KV groups), ffn 28672, vocab 32000",
        "Touvron et al. 2023, Llama 2 (HF meta-llama/Llama-2-70b-hf config.json)",
        68.98e9, "HF meta-llama/Llama-2-70b-hf: 68,976,648,192 parameters",
        num_layers=80, hidden_size=8192, num_attention_heads=64, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=28672, seq_length=4096, max_position_embeddings=4096,
        vocab_size=32000, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "llama3-8b", "32 layers, hidden 4096, 32 heads (8 KV groups), ffn 14336, vocab 128256",
        "Meta 2024, The Llama 3 Herd of Models, Table 3 (HF meta-llama/Meta-Llama-3-8B config.json)",
        8.03e9, "HF meta-llama/Meta-Llama-3-8B: 8,030,261,248 parameters",
        num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=14336, seq_length=8192, max_position_embeddings=8192,
        vocab_size=128256, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "llama3-70b", "80 layers, hidden 8192, 64 heads (8 KV groups), ffn 28672, vocab 128256",
        "Meta 2024, The Llama 3 Herd of Models, Table 3 (HF meta-llama/Meta-Llama-3-70B config.json)",
        70.55e9, "HF meta-llama/Meta-Llama-3-70B: 70,553,706,496 parameters",
        num_layers=80, hidden_size=8192, num_attention_heads=64, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=28672, seq_length=8192, max_position_embeddings=8192,
        vocab_size=128256, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "llama3.1-405b", "126 layers, hidden 16384, 128 heads (8 KV groups), ffn 53248, vocab 128256",
        "Meta 2024, The Llama 3 Herd of Models, Table 3 (HF meta-llama/Llama-3.1-405B config.json)",
        405.85e9, "HF meta-llama/Llama-3.1-405B: 405,853,388,800 parameters",
        num_layers=126, hidden_size=16384, num_attention_heads=128, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=53248, seq_length=8192, max_position_embeddings=8192,
        vocab_size=128256, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "mixtral-8x7b", "32 layers, hidden 4096, 32 heads (8 KV groups), 8 experts top-2, ffn 14336",
        "Jiang et al. 2024, Mixtral of Experts (HF mistralai/Mixtral-8x7B-v0.1 config.json)",
        46.70e9, "Jiang et al. 2024: 47B total (HF mistralai/Mixtral-8x7B-v0.1: 46,702,792,704)",
        num_layers=32, hidden_size=4096, num_attention_heads=32, group_query_attention=True,
        num_query_groups=8, ffn_hidden_size=14336, num_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=14336, seq_length=4096, max_position_embeddings=32768,
        vocab_size=32000, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "qwen1.5-moe-a2.7b",
        "24 layers, hidden 2048, 16 heads, 60 experts top-4 (ffn 1408) + shared expert 5632",
        "Qwen team 2024, Qwen1.5-MoE (HF Qwen/Qwen1.5-MoE-A2.7B config.json)",
        14.3e9, "Qwen team 2024, Qwen1.5-MoE-A2.7B model card: 14.3B total parameters",
        num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
        num_experts=60, moe_router_topk=4, moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=5632, moe_shared_expert_gate=True, add_qkv_bias=True,
        seq_length=8192, max_position_embeddings=8192, vocab_size=151936, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "deepseek-v3",
        "61 layers (3 dense), hidden 7168, 128 heads, MLA, 256 experts top-8 + 1 shared, MTP 1",
        "DeepSeek-AI 2024, DeepSeek-V3 Technical Report, arXiv:2412.19437 (HF "
        "deepseek-ai/DeepSeek-V3 config.json); flags as Megatron-LM's DeepSeek-V3 recipe "
        "(docs/discussions/megatron-fsdp-user-guide/example-scripts/sbatch_mfsdp_deepseek_v3.sh)",
        685e9, "HF deepseek-ai/DeepSeek-V3 model card: 685B = 671B main model + 14B MTP module",
        **_DEEPSEEK_V3,
    ),
    _preset(
        "deepseek-v3.2",
        "DeepSeek-V3 with DSA: lightning indexer (64 heads of 128, top-2048) on every MLA layer",
        "DeepSeek-AI 2025, DeepSeek-V3.2-Exp (HF deepseek-ai/DeepSeek-V3.2-Exp config.json: "
        "index_n_heads 64, index_head_dim 128, index_topk 2048); megatron-core 0.18+ builds it",
        685e9, "HF deepseek-ai/DeepSeek-V3.2-Exp model card: 685B params",
        **_DEEPSEEK_V3,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=64, dsa_indexer_head_dim=128,
        dsa_indexer_topk=2048,
        # megatron's DSAttention refuses fused RoPE; Megatron-Bridge's DeepSeek bridge turns it
        # off (deepseek/deepseek_v3_bridge.py: apply_rope_fusion False)
        no_rope_fusion=True,
    ),
    _preset(
        "glm-5",
        "78 layers (3 dense), hidden 6144, 64 heads, MLA, DSA indexer (32 heads of 128, "
        "top-2048), 256 experts top-8 + 1 shared",
        "Zhipu AI 2026, GLM-5: from Vibe Coding to Agentic Engineering (HF zai-org/GLM-5 "
        "config.json, glm_moe_dsa); flags as Megatron-Bridge's glm_moe_dsa/glm5_bridge.py sets "
        "them (its MTP layer off); megatron-core 0.18+ builds it",
        744e9, "GLM-5 technical report, architecture table: 744B total parameters, 40B activated",
        **_GLM_5,
    ),
    _preset(
        "glm-5.2",
        "GLM-5 with IndexShare: the DSA indexer on 21 of 78 layers (1-3, then 7, 11, ..., 75), "
        "the others reuse its top-k",
        "Zhipu AI 2026, GLM-5.2 (HF zai-org/GLM-5.2 config.json: GLM-5's sizes, index_topk_freq "
        "4, index_skip_topk_offset 3; IndexShare, arXiv:2603.12201); flags as Megatron-Bridge's "
        "glm_moe_dsa/glm5_bridge.py sets them (dsa_indexer_topk_freq, "
        "dsa_indexer_skip_topk_offset; its MTP layer off); megatron-core 0.19+ builds it",
        744e9, "GLM-5 technical report, architecture table: 744B total, 40B activated, the "
        "backbone GLM-5.2 keeps (its 57 shared layers hold no indexer: 0.53B fewer; HF "
        "zai-org/GLM-5.2 lists 753B, its MTP layer included)",
        **dict(_GLM_5, max_position_embeddings=1048576),  # its 1M context (RoPE: no tensor)
        dsa_indexer_topk_freq=4, dsa_indexer_skip_topk_offset=3,
    ),
    _preset(
        "qwen3-30b-a3b",
        "48 layers, hidden 2048, 32 heads (4 KV groups, head 128), 128 experts top-8 (ffn 768)",
        "Qwen team 2025, Qwen3 Technical Report, arXiv:2505.09388 (HF Qwen/Qwen3-30B-A3B "
        "config.json)",
        30.5e9, "HF Qwen/Qwen3-30B-A3B model card: 30.5B total parameters, 3.3B activated",
        num_layers=48, hidden_size=2048, num_attention_heads=32, group_query_attention=True,
        num_query_groups=4, kv_channels=128, qk_layernorm=True, ffn_hidden_size=6144,
        num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768, moe_grouped_gemm=True,
        seq_length=4096, max_position_embeddings=40960, vocab_size=151936, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "qwen3-235b-a22b",
        "94 layers, hidden 4096, 64 heads (4 KV groups, head 128), 128 experts top-8 (ffn 1536)",
        "Qwen team 2025, Qwen3 Technical Report, arXiv:2505.09388 (HF Qwen/Qwen3-235B-A22B "
        "config.json)",
        235e9, "HF Qwen/Qwen3-235B-A22B model card: 235B total parameters, 22B activated",
        num_layers=94, hidden_size=4096, num_attention_heads=64, group_query_attention=True,
        num_query_groups=4, kv_channels=128, qk_layernorm=True, ffn_hidden_size=12288,
        num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1536, moe_grouped_gemm=True,
        seq_length=4096, max_position_embeddings=40960, vocab_size=151936, **_LLAMA,
        transformer_impl="transformer_engine",
    ),
    _preset(
        "nemotron-3-nano-30b-a3b",
        "hybrid: 52 layers (23 Mamba-2, 23 MoE, 6 attention), hidden 2688, 128 experts top-6 "
        "+ shared",
        "NVIDIA 2025, Nemotron 3 Nano; flags as Megatron-LM's examples/post_training/modelopt/conf/"
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh (core_v0.16.1); vocab 131072 (HF "
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json)",
        31.6e9, "HF nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 model card: 31.6B total parameters",
        num_layers=52, hidden_size=2688, num_attention_heads=32, group_query_attention=True,
        num_query_groups=2, kv_channels=128, ffn_hidden_size=1856,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        is_hybrid_model=True, mamba_num_heads=64, mamba_head_dim=64,
        num_experts=128, moe_router_topk=6, moe_shared_expert_intermediate_size=3712,
        moe_grouped_gemm=True, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
        normalization="RMSNorm", position_embedding_type="none",
        untie_embeddings_and_output_weights=True, disable_bias_linear=True,
        seq_length=8192, max_position_embeddings=8192, vocab_size=131072,
        make_vocab_size_divisible_by=1, transformer_impl="transformer_engine",
    ),
]  # fmt: skip

# Kimi-K2, gpt-oss: a block of their own.
_GPT_OSS = dict(
    hidden_size=2880, num_attention_heads=64, group_query_attention=True, num_query_groups=8,
    kv_channels=64, ffn_hidden_size=2880, moe_ffn_hidden_size=2880, moe_router_topk=4,
    moe_grouped_gemm=True, moe_router_load_balancing_type="none", normalization="RMSNorm",
    quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
    softmax_type="learnable", window_size="127,0", window_attn_skip_freq=2,
    position_embedding_type="yarn", rotary_scaling_factor=32.0,
    untie_embeddings_and_output_weights=True, seq_length=4096, max_position_embeddings=131072,
    vocab_size=201088, transformer_impl="transformer_engine",
)
_ALL += [
    _preset(
        "kimi-k2",
        "61 layers (1 dense), hidden 7168, 64 heads, MLA, 384 experts top-8 + 1 shared",
        "Moonshot AI 2025, Kimi K2: Open Agentic Intelligence, arXiv:2507.20534 (HF "
        "moonshotai/Kimi-K2-Instruct config.json, DeepSeek-V3's architecture); flags as "
        "Megatron-Bridge's kimi/kimi_bridge.py sets them",
        1026.5e9, "HF moonshotai/Kimi-K2-Instruct: 1026.5B parameters (model card: 1T total)",
        num_layers=61, hidden_size=7168, num_attention_heads=64, ffn_hidden_size=18432,
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, rotary_scaling_factor=32.0,
        mscale=1.0, mscale_all_dim=1.0,
        num_experts=384, moe_layer_freq="([0]*1+[1]*60)", moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=1, moe_router_group_topk=1, moe_grouped_gemm=True,
        seq_length=4096, max_position_embeddings=131072, vocab_size=163840,
        make_vocab_size_divisible_by=1280, **_LLAMA, transformer_impl="transformer_engine",
    ),
    _preset(
        "gpt-oss-20b",
        "24 layers, hidden 2880, 64 heads (8 KV groups), 32 experts top-4, sinks, window 128",
        "OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925 (HF "
        "openai/gpt-oss-20b config.json); flags as Megatron-LM's examples/gptoss/02_train.sh "
        "and Megatron-Bridge's gpt_oss/gpt_oss_bridge.py set them",
        20.91e9, "OpenAI, gpt-oss model card (arXiv:2508.10925), Table 1: 20.91B total",
        num_layers=24, num_experts=32, **_GPT_OSS,
    ),
    _preset(
        "gpt-oss-120b",
        "36 layers, hidden 2880, 64 heads (8 KV groups), 128 experts top-4, sinks, window 128",
        "OpenAI 2025, gpt-oss-120b & gpt-oss-20b Model Card, arXiv:2508.10925 (HF "
        "openai/gpt-oss-120b config.json); flags as Megatron-LM's examples/gptoss/02_train.sh "
        "and Megatron-Bridge's gpt_oss/gpt_oss_bridge.py set them",
        116.83e9, "OpenAI, gpt-oss model card (arXiv:2508.10925), Table 1: 116.83B total",
        num_layers=36, num_experts=128, **_GPT_OSS,
    ),
]  # fmt: skip

_ALL += [_preset(name, summary, source, count, count_source, **args)
         for name, summary, source, count, count_source, args in GDN_PRESETS + HYBRID_PRESETS]  # fmt: skip

PRESETS: dict[str, Preset] = {preset.name: preset for preset in _ALL}
DEFAULT = "gpt2-small"


def get_preset(name: str) -> Preset:
    """Return a preset by name, or raise ConfigError suggesting the closest names."""
    if name in PRESETS:
        return PRESETS[name]
    close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.5)
    hint = f" (closest: {', '.join(close)})" if close else ""
    return _unknown(name, hint)


def _unknown(name: str, hint: str) -> Preset:
    raise ConfigError(f"unknown --model {name!r}{hint}; `inspect-model models` lists the presets")
