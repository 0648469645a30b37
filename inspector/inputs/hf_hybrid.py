"""Nemotron-H's Hugging Face config (`NemotronHForCausalLM`, model_type nemotron_h), mapped as
Megatron-Bridge's nemotronh/nemotron_h_bridge.py maps it (NVIDIA-NeMo/Megatron-Bridge 067f987):
its CONFIG_MAPPING's Mamba keys, and `provider_bridge`'s fixed settings (no position
embeddings, squared-ReLU MLPs, a hybrid model; with experts sigmoid routing with expert bias,
sequence aux loss, grouped GEMM). Nemotron-H and Nemotron 3 (Nano) share the format.
"""

from __future__ import annotations

from typing import Any

from inspector.inputs.hf_values import value_of
from inspector.inputs.refusals import Refused

# provider_bridge: position_embedding_type "none", is_hybrid_model True; Megatron-Bridge's
# base mapping gives RMSNorm for these configs and no linear biases unless use_bias / mlp_bias
FIXED: dict[str, Any] = {"normalization": "RMSNorm", "position_embedding_type": "none",
                         "disable_bias_linear": True, "is_hybrid_model": True,
                         "hidden_dropout": 0.0}  # fmt: skip

# provider_bridge's MoE settings, for a config with routed experts
MOE_FIXED: dict[str, Any] = {"moe_router_score_function": "sigmoid",
                             "moe_router_enable_expert_bias": True,
                             "moe_router_load_balancing_type": "seq_aux_loss",
                             "moe_grouped_gemm": True}  # fmt: skip

# CONFIG_MAPPING's Mamba keys (HF key -> Megatron-LM argument)
MAPPED: dict[str, tuple[str, Any]] = {
    "hybrid_override_pattern": ("hybrid_override_pattern", str),
    "mamba_head_dim": ("mamba_head_dim", int),
    "mamba_num_heads": ("mamba_num_heads", int),
    "n_groups": ("mamba_num_groups", int),
    "ssm_state_size": ("mamba_state_dim", int),
    "attention_head_dim": ("kv_channels", int),  # provider_bridge: head_dim or attention_head_dim
    "moe_shared_expert_intermediate_size": ("moe_shared_expert_intermediate_size", int),
    "hidden_dropout": ("hidden_dropout", float),  # MegatronModelBridge.CONFIG_MAPPING
}

# what megatron-core's MambaMixer builds whatever the config says (ssm/mamba_mixer.py defaults
# d_conv 4, expand 2, conv bias on, no projection bias): another value builds another model
FIXED_BY_MEGATRON: dict[str, Any] = {"conv_kernel": 4, "use_conv_bias": True,
                                     "mamba_proj_bias": False}  # fmt: skip

IGNORED: dict[str, str] = {
    key: reason
    for reason, keys in {
        "numerics only (same tensors)": "layer_norm_epsilon rescale_prenorm_residual "
        "time_step_min time_step_max time_step_floor time_step_limit time_step_rank "
        "mamba_hidden_act mlp_hidden_act chunk_size expand residual_in_fp32",
        "tokens, generation and library settings": "use_mamba_kernels num_logits_to_keep",
    }.items()
    for key in keys.split()
}


def hybrid_rule(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Map Nemotron-H's own keys; refuse what MambaMixer would not build as the config says."""
    if data.get("model_type") != "nemotron_h":
        return []
    for key, (name, kind) in MAPPED.items():
        if data.get(key) is not None:
            args[name] = value_of(data, key, kind, path)
    if value_of(data, "use_bias", bool, path, False):
        args["disable_bias_linear"] = False
    if args.get("num_experts"):
        args.update(MOE_FIXED)
    refused = []
    for key, value in FIXED_BY_MEGATRON.items():
        if key in data and data[key] != value:
            refused.append(Refused("model", path, f'"{key}": {data[key]}', "not modelled",
                                   f"megatron-core's MambaMixer builds {key} {value}"))  # fmt: skip
    if value_of(data, "residual_in_fp32", bool, path, False):
        refused.append(Refused("model", path, '"residual_in_fp32": true', "not modelled",
                               "an fp32 residual stream (--fp32-residual-connection) is not "
                               "modelled"))  # fmt: skip
    return refused
