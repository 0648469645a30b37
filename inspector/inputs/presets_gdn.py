"""Presets of gated delta net (GDN) models: their architecture in Megatron-LM's argument names.

presets.py registers them (`--model NAME`); kept here, data only, beside the other families.
Qwen3-Next is GPTModel with megatron-core 0.16's experimental attention variant gated_delta_net,
as Megatron-Bridge builds it (qwen/qwen3_next_bridge.py `provider_bridge`, 067f987: RMSNorm,
SwiGLU, RoPE, no linear biases, QK norms, gated attention, 512 routed experts with a gated
shared expert, `linear_attention_freq` from `full_attention_interval`).
"""

from __future__ import annotations

from typing import Any

# (name, summary, source, published count, its source, Megatron-LM arguments)
GDN_PRESETS: list[tuple[str, str, str, float, str, dict[str, Any]]] = [
    (
        "qwen3-next-80b-a3b",
        "48 layers (36 gated delta net, 12 gated attention), hidden 2048, 512 experts top-10 "
        "+ shared",
        "Qwen team 2025, Qwen3-Next (HF Qwen/Qwen3-Next-80B-A3B-Instruct config.json); flags as "
        "Megatron-Bridge's qwen/qwen3_next_bridge.py sets them",
        80e9, "HF Qwen/Qwen3-Next-80B-A3B-Instruct model card: 80B in total and 3B activated",
        dict(
            num_layers=48, hidden_size=2048, num_attention_heads=16, group_query_attention=True,
            num_query_groups=2, kv_channels=256, qk_layernorm=True, attention_output_gate=True,
            ffn_hidden_size=5120, num_experts=512, moe_router_topk=10, moe_ffn_hidden_size=512,
            moe_shared_expert_intermediate_size=512, moe_shared_expert_gate=True,
            moe_grouped_gemm=True, experimental_attention_variant="gated_delta_net",
            linear_attention_freq=4, linear_conv_kernel_dim=4, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
            normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
            untie_embeddings_and_output_weights=True, disable_bias_linear=True,
            seq_length=4096, max_position_embeddings=262144, vocab_size=151936,
            transformer_impl="transformer_engine",
        ),
    ),
]  # fmt: skip
