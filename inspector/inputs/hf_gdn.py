"""Qwen3-Next's Hugging Face config (`Qwen3NextForCausalLM`, model_type qwen3_next), mapped as
Megatron-Bridge's qwen/qwen3_next_bridge.py maps it (NVIDIA-NeMo/Megatron-Bridge 067f987): the
gated delta net's keys, `provider_bridge`'s fixed settings (RMSNorm, SwiGLU, RoPE, no linear
biases, QK norms, gated attention, grouped-GEMM experts with a gated shared expert, GPTModel's
experimental attention variant gated_delta_net) and its layer pattern
(conversion/transformers_compat.py `full_attention_interval_from_hf`: `full_attention_interval`,
or transformers 5.5+'s `layer_types`).
"""

from __future__ import annotations

from typing import Any

from inspector.inputs.hf_values import value_of
from inspector.inputs.refusals import Refused

FIXED: dict[str, Any] = {
    "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
    "disable_bias_linear": True, "hidden_dropout": 0.0, "qk_layernorm": True,
    "moe_grouped_gemm": True, "moe_shared_expert_gate": True, "attention_output_gate": True,
    "experimental_attention_variant": "gated_delta_net", "transformer_impl": "transformer_engine",
}  # fmt: skip

# provider_bridge's gated delta net keys (HF key -> Megatron-LM argument)
MAPPED: dict[str, tuple[str, Any]] = {
    "linear_conv_kernel_dim": ("linear_conv_kernel_dim", int),
    "linear_key_head_dim": ("linear_key_head_dim", int),
    "linear_value_head_dim": ("linear_value_head_dim", int),
    "linear_num_key_heads": ("linear_num_key_heads", int),
    "linear_num_value_heads": ("linear_num_value_heads", int),
    "shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", int),
}
PATTERN_KEYS = ("full_attention_interval",)  # read by `gdn_rule`, with "layer_types"
_LAYER_TYPES = {"linear_attention": 1, "full_attention": 0}


def gdn_rule(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Map Qwen3-Next's own keys and its pattern of gated delta net and attention layers."""
    if data.get("model_type") != "qwen3_next":
        return []
    for key, (name, kind) in MAPPED.items():
        if data.get(key) is not None:
            args[name] = value_of(data, key, kind, path, least=1)
    kinds = value_of(data, "layer_types", list, path)
    if kinds:
        unknown = sorted({str(kind) for kind in kinds if kind not in _LAYER_TYPES})
        if unknown:
            reason = "Megatron-Bridge maps linear_attention and full_attention layers only"
            return [Refused("model", path, f'"layer_types": {unknown[0]}', "not modelled", reason)]
        args["linear_attention_freq"] = "[" + ",".join(str(_LAYER_TYPES[k]) for k in kinds) + "]"
    else:  # the bridge's default interval is 4
        args["linear_attention_freq"] = value_of(data, "full_attention_interval", int, path, 4, least=1)
    return []
