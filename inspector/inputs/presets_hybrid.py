"""Presets of NVIDIA's hybrid (Mamba-2 + attention) models: Nemotron-H and Nemotron 3.

presets.py registers them (`--model NAME`); kept here, data only, beside the other families.
Megatron-Bridge builds them with HybridModelProvider (models/hybrid/hybrid_provider.py): RMSNorm,
squared-ReLU MLPs (a numerics-only choice here), no position embedding, no linear biases,
untied output layer. Nemotron-H's vocabulary is its Hugging Face tokenizer's (131072).
"""

from __future__ import annotations

from typing import Any

_HYBRID = dict(
    is_hybrid_model=True, normalization="RMSNorm", position_embedding_type="none",
    untie_embeddings_and_output_weights=True, disable_bias_linear=True, group_query_attention=True,
    kv_channels=128, mamba_head_dim=64, mamba_num_groups=8, seq_length=8192,
    max_position_embeddings=8192, vocab_size=131072, make_vocab_size_divisible_by=128,
    transformer_impl="transformer_engine",
)
# Nemotron 3 Super's and Ultra's LatentMoE layers: 512 experts top-22, sigmoid routing with expert
# bias, sequence-level auxiliary loss (as Megatron-Bridge's nemotron_h_bridge.py sets them); the
# vocabulary unpadded
_LATENT_MOE = dict(
    num_experts=512, moe_router_topk=22, moe_grouped_gemm=True, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
    make_vocab_size_divisible_by=1,
)

# (name, summary, source, published count, its source, Megatron-LM arguments)
HYBRID_PRESETS: list[tuple[str, str, str, float, str, dict[str, Any]]] = [
    (
        "nemotron-h-8b",
        "hybrid: 52 layers (24 Mamba-2, 24 MLP, 4 attention), hidden 4096, 32 heads (8 KV groups)",
        "NVIDIA 2025, Nemotron-H, arXiv:2504.03624 (HF nvidia/Nemotron-H-8B-Base-8K); sizes as "
        "Megatron-Bridge's recipes/nemotronh/h100/nemotronh.py nemotronh_8b_pretrain builds it",
        8e9, "HF nvidia/Nemotron-H-8B-Base-8K model card: 8B model parameters (rounded)",
        dict(
            _HYBRID, num_layers=52, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
            ffn_hidden_size=21504, mamba_num_heads=128, mamba_state_dim=128,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        ),
    ),
    (
        "nemotron-h-56b",
        "hybrid: 118 layers (54 Mamba-2, 54 MLP, 10 attention), hidden 8192, 64 heads (8 KV "
        "groups)",
        "NVIDIA 2025, Nemotron-H, arXiv:2504.03624 (HF nvidia/Nemotron-H-56B-Base-8K); sizes as "
        "Megatron-Bridge's recipes/nemotronh/h100/nemotronh.py nemotronh_56b_pretrain builds it",
        56e9, "HF nvidia/Nemotron-H-56B-Base-8K model card: 56B model parameters (rounded)",
        dict(
            _HYBRID, num_layers=118, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
            ffn_hidden_size=32768, mamba_num_heads=256, mamba_state_dim=256,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-"
            "M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        ),
    ),
    (
        "nemotron-3-super-120b-a12b",
        "hybrid: 88 layers (40 Mamba-2, 40 LatentMoE, 8 attention), hidden 4096, 512 experts "
        "top-22 in latent 1024 + shared (its MTP layer not included)",
        "NVIDIA 2026, Nemotron 3 Super (HF nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16); flags "
        "as Megatron-LM's tests/functional_tests/test_cases/nemotron/"
        "nemotron3_super_release_gb200/model_config.yaml; LatentMoE (--moe-latent-size, "
        "megatron-core 0.16+)",
        120.6e9, "NVIDIA, Nemotron 3 Super technical report (research.nvidia.com/labs/nemotron/"
        "Nemotron-3-Super): 120.6B total parameters, 12.7B active",
        dict(
            _HYBRID, num_layers=88, hidden_size=4096, num_attention_heads=32, num_query_groups=2,
            ffn_hidden_size=2688, mamba_num_heads=128, mamba_state_dim=128,
            hybrid_override_pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*"
            "EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
            **_LATENT_MOE, moe_latent_size=1024, moe_shared_expert_intermediate_size=5376,
        ),
    ),
    (
        "nemotron-3-ultra-550b-a55b",
        "hybrid: 108 layers (48 Mamba-2, 48 LatentMoE, 12 attention), hidden 8192, 512 experts "
        "top-22 in latent 2048 + shared (its MTP layer not included)",
        "NVIDIA 2026, Nemotron 3 Ultra, arXiv:2606.15007 (HF "
        "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16 config.json: 108 layers, hidden 8192, 64 "
        "heads, 2 KV heads of 128, mamba_num_heads 256, mamba_head_dim 64, ssm_state_size 128, "
        "n_groups 8, 512 routed experts top-22 of 5120, moe_latent_size 2048, shared expert "
        "10240, vocab 131072); the pattern as NVIDIA's Nemotron 3 Ultra pretraining script gives "
        "pretrain_hybrid.py (--hybrid-layer-pattern); LatentMoE (--moe-latent-size, "
        "megatron-core 0.16+)",
        550e9, "NVIDIA, Nemotron 3 Ultra technical report (arXiv:2606.15007): 550B total "
        "parameters, 55B active",
        dict(
            _HYBRID, num_layers=108, hidden_size=8192, num_attention_heads=64, num_query_groups=2,
            ffn_hidden_size=5120, mamba_num_heads=256, mamba_state_dim=128,
            hybrid_override_pattern="MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*"
            "EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
            **_LATENT_MOE, moe_latent_size=2048, moe_shared_expert_intermediate_size=10240,
        ),
    ),
]  # fmt: skip

