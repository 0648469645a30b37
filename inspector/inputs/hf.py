"""`--hf-config config.json`: a Hugging Face model config, mapped to Megatron-LM arguments key by key
as Megatron-Bridge maps it (NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/models/).

The common keys follow MegatronModelBridge.CONFIG_MAPPING (conversion/model_bridge.py); each family
adds what its bridge sets (llama/llama_bridge.py, mistral/mistral_bridge.py, qwen/qwen2_bridge.py,
qwen/qwen3_bridge.py, qwen/qwen3_moe_bridge.py, deepseek/deepseek_v3_bridge.py, and mixtral/
mixtral_bridge.py as of commit 1ee926b34; kimi/kimi_bridge.py as of 384dc10f5). Keys that change
nothing a GPU holds are listed as ignored; keys this tool does not know are listed in a note; a
value that would build another model (a sliding window, a non-SwiGLU activation) is refused. The
file is local: nothing downloads. docs/bring-your-job.md holds the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import InputError
from inspector.inputs import hf_hybrid
from inspector.inputs.refusals import Refused
from inspector.inputs.sources import ScriptArgs, parse_config
from inspector.output import read_text

_LLAMA_LIKE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
               "disable_bias_linear": True, "hidden_dropout": 0.0}  # fmt: skip


_DEEPSEEK_V3 = {**_LLAMA_LIKE, "qk_layernorm": True, "multi_latent_attention": True,
                "untie_embeddings_and_output_weights": True, "moe_grouped_gemm": True,
                "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "make_vocab_size_divisible_by": 1280}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture Megatron-Bridge maps: its name and the arguments its bridge fixes."""

    name: str
    bridge: str  # the bridge file under Megatron-Bridge's src/megatron/bridge/models/
    fixed: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "llama/llama_bridge.py", _LLAMA_LIKE),
    "mistral": Family("Mistral", "mistral/mistral_bridge.py", _LLAMA_LIKE),
    "mixtral": Family("Mixtral", "mixtral/mixtral_bridge.py",
                      {**_LLAMA_LIKE, "moe_grouped_gemm": True}),  # fmt: skip
    "qwen2": Family("Qwen2", "qwen/qwen2_bridge.py", {**_LLAMA_LIKE, "add_qkv_bias": True}),
    "qwen3": Family("Qwen3", "qwen/qwen3_bridge.py", {**_LLAMA_LIKE, "qk_layernorm": True}),
    "qwen3_moe": Family("Qwen3-MoE", "qwen/qwen3_moe_bridge.py",
                        {**_LLAMA_LIKE, "qk_layernorm": True, "moe_grouped_gemm": True}),  # fmt: skip
    "deepseek_v3": Family("DeepSeek-V3", "deepseek/deepseek_v3_bridge.py", _DEEPSEEK_V3),
    # Kimi-K2's config.json says DeepseekV3ForCausalLM with model_type kimi_k2; its bridge sets
    # what DeepSeek-V3's does (scoring_func sigmoid comes from the file, through MAPPED)
    "kimi_k2": Family("Kimi-K2", "kimi/kimi_bridge.py", _DEEPSEEK_V3),
    # gpt_oss_bridge.py `provider_bridge` (as of 0e4d6ed60): biases everywhere, quick-GELU GLU
    # clamped at 7 with offset 1, attention sinks, every other layer a window, YaRN positions;
    # the sliding window, YaRN factor and experts' size from the file (_gpt_oss)
    "gpt_oss": Family("gpt-oss", "gpt_oss/gpt_oss_bridge.py", {
        "normalization": "RMSNorm", "quick_geglu": True, "glu_linear_offset": 1.0,
        "activation_func_clamp_value": 7.0, "softmax_type": "learnable",
        "window_attn_skip_freq": 2, "position_embedding_type": "yarn",
        "untie_embeddings_and_output_weights": True, "moe_grouped_gemm": True,
        "moe_router_load_balancing_type": "none", "hidden_dropout": 0.0,
        "transformer_impl": "transformer_engine"}),  # fmt: skip
    "nemotron_h": Family("Nemotron-H", "nemotronh/nemotron_h_bridge.py", hf_hybrid.FIXED),
}

# Architectures Megatron-Bridge maps that this tool's layer specs cannot build, and why.
NOT_MODELLED: dict[str, str] = {
    "gemma": "Gemma's gated tanh-GELU MLP and zero-centred norms are not modelled (only --swiglu)",
    "gemma2": "Gemma 2's sliding-window layers, logit soft-capping and extra norms are not modelled",
    "gemma3": "Gemma 3's sliding-window layers and extra norms are not modelled",
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (megatron-core 0.16's experimental "
    "attention variant dsa, with its indexer) is not modelled",
}

_INT = int
# HF key -> (Megatron-LM argument, conversion): MegatronModelBridge.CONFIG_MAPPING, as arguments.
MAPPED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "num_hidden_layers": ("num_layers", _INT),
    "hidden_size": ("hidden_size", _INT),
    "intermediate_size": ("ffn_hidden_size", _INT),
    "num_attention_heads": ("num_attention_heads", _INT),
    "head_dim": ("kv_channels", _INT),
    "vocab_size": ("vocab_size", _INT),
    "attention_dropout": ("attention_dropout", float),
    "attention_bias": ("add_qkv_bias", bool),
    "use_qk_norm": ("qk_layernorm", bool),
    "num_experts": ("num_experts", _INT),
    "num_local_experts": ("num_experts", _INT),
    "n_routed_experts": ("num_experts", _INT),
    "num_experts_per_tok": ("moe_router_topk", _INT),
    "moe_intermediate_size": ("moe_ffn_hidden_size", _INT),
    "scoring_func": ("moe_router_score_function", str),
    "n_group": ("moe_router_num_groups", _INT),
    "topk_group": ("moe_router_group_topk", _INT),
    "q_lora_rank": ("q_lora_rank", _INT),
    "kv_lora_rank": ("kv_lora_rank", _INT),
    "qk_nope_head_dim": ("qk_head_dim", _INT),
    "qk_rope_head_dim": ("qk_pos_emb_head_dim", _INT),
    "v_head_dim": ("v_head_dim", _INT),
}

# Keys read by a rule of their own (below), not by MAPPED.
RULED = (
    "architectures model_type num_key_value_heads max_position_embeddings tie_word_embeddings "
    "mlp_bias torch_dtype dtype hidden_act rope_scaling sliding_window use_sliding_window "
    "num_nextn_predict_layers first_k_dense_replace n_shared_experts moe_layer_freq "
    "decoder_sparse_step mlp_only_layers layer_types swiglu_limit experts_per_token "
    "initial_context_length"
).split()

IGNORED_KEYS: dict[str, str] = {
    key: reason
    for reason, keys in {
        "numerics only (same tensors)": "rms_norm_eps initializer_range rope_theta "
        "partial_rotary_factor pretraining_tp attention_softmax_in_fp32 max_window_layers",
        "routing math (balanced routing is counted)": "norm_topk_prob router_aux_loss_coef "
        "aux_loss_alpha seq_aux topk_method routed_scaling_factor ep_size "
        "output_router_logits router_jitter_noise",
        "tokens, generation and library settings": "bos_token_id eos_token_id pad_token_id "
        "use_cache transformers_version auto_map _name_or_path",
        "the checkpoint's storage format (training holds the torch_dtype)": "quantization_config",
    }.items()
    for key in keys.split()
} | hf_hybrid.IGNORED


def read_hf_config(path: str) -> ScriptArgs:
    """Read a Hugging Face config.json into Megatron-LM arguments."""
    data = parse_config(read_text(path), path)
    if not isinstance(data, dict) or not ("architectures" in data or "model_type" in data):
        raise InputError(f"{path}: --hf-config takes a Hugging Face config.json (with "
                         "\"architectures\" and \"model_type\")")  # fmt: skip
    return read_hf_mapping(data, path)


def read_hf_mapping(data: dict[str, Any], path: str) -> ScriptArgs:
    """Map a Hugging Face config's keys to Megatron-LM arguments, as Megatron-Bridge does."""
    family = _family(data, path)
    args: dict[str, Any] = dict(family.fixed)
    for key, (name, kind) in MAPPED.items():
        taken = name in args or name in _ruled_names(family)
        if key in data and data[key] is not None and not taken:
            args[name] = kind(data[key])
    refused: list[Refused] = []
    for rule in _RULES:
        refused += rule(data, args, path)
    ignored = tuple(key for key in data if key in IGNORED_KEYS)
    known = (MAPPED, RULED, IGNORED_KEYS, hf_hybrid.MAPPED, hf_hybrid.FIXED_BY_MEGATRON, ("use_bias",))
    unknown = [k for k in data if not any(k in table for table in known)]
    notes = [f"{family.name} mapped as Megatron-Bridge's {family.bridge} maps it; --seq-length is "
             f"max_position_embeddings ({args.get('seq_length')}), as there: give --seq-length "
             "for the length you train"]  # fmt: skip
    if unknown:
        notes.append("keys this tool does not know (check they change nothing a GPU holds): "
                     + " ".join(unknown))  # fmt: skip
    return ScriptArgs(args, ignored, notes=tuple(notes), refused=tuple(refused))


def _family(data: dict[str, Any], path: str) -> Family:
    model_type = str(data.get("model_type", ""))
    shown = ", ".join(map(str, data.get("architectures") or [])) or model_type
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in NOT_MODELLED:
        raise InputError(f"{path}: {shown} (model_type {model_type}) is not modelled: "
                         f"{NOT_MODELLED[model_type]}")  # fmt: skip
    names = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
    raise InputError(f"{path}: {shown} (model_type {model_type!r}) is not an architecture this "
                     f"tool maps; it maps {names}, as Megatron-Bridge does")  # fmt: skip


def _ruled_names(family: Family) -> set[str]:
    # Mixtral's bridge takes kv_channels = hidden / heads, whatever head_dim says.
    return {"kv_channels"} if family.name == "Mixtral" else set()


def _refuse(path: str, key: str, value: Any, reason: str) -> list[Refused]:
    return [Refused("model", path, f'"{key}": {value}', "not modelled", reason)]


def _attention(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Key/value heads, positions, tied embeddings, biases, precision."""
    heads, groups = data.get("num_attention_heads"), data.get("num_key_value_heads")
    if groups is not None and groups != heads and not args.get("multi_latent_attention"):
        args.update(group_query_attention=True, num_query_groups=int(groups))
    if "max_position_embeddings" in data:
        args["seq_length"] = args["max_position_embeddings"] = int(data["max_position_embeddings"])
    if "untie_embeddings_and_output_weights" not in args:
        args["untie_embeddings_and_output_weights"] = not data.get("tie_word_embeddings", True)
    if data.get("mlp_bias"):
        args["disable_bias_linear"] = False
    dtype = data.get("torch_dtype", data.get("dtype"))
    if dtype in ("bfloat16", "float16"):
        args["bf16" if dtype == "bfloat16" else "fp16"] = True
    return []


def _activation_and_window(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """SwiGLU only; no sliding window; RoPE scaling as numerics, or YaRN for MLA."""
    if data.get("model_type") == "gpt_oss":
        return _gpt_oss(data, args, path)
    refused: list[Refused] = []
    act = data.get("hidden_act", "silu")
    if act != "silu" and not (act == "relu2" and data.get("model_type") == "nemotron_h"):
        refused += _refuse(path, "hidden_act", act, "a gated MLP with another activation is not "
                           "modelled; --swiglu (silu) is")  # fmt: skip
    window = data.get("sliding_window")
    if window is not None and data.get("use_sliding_window", True):
        refused += _refuse(path, "sliding_window", window, "sliding-window attention changes "
                           "attention FLOPs and scores (--window-size is refused)")  # fmt: skip
    scaling = data.get("rope_scaling") or {}
    kind = scaling.get("type") or scaling.get("rope_type")
    if kind == "yarn" and args.get("multi_latent_attention"):
        args["rotary_scaling_factor"] = float(scaling.get("factor", 40.0))
        args["mscale"] = float(scaling.get("mscale", 1.0))
        args["mscale_all_dim"] = float(scaling.get("mscale_all_dim", 0.0))
    elif kind == "yarn":
        refused += _refuse(path, "rope_scaling", "yarn", "YaRN positions outside MLA are not "
                           "modelled")  # fmt: skip
    return refused


def _gpt_oss(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """gpt-oss's window, clamp, YaRN factor and expert size, as gpt_oss_bridge.py reads them."""
    refused: list[Refused] = []
    window = int(data.get("sliding_window") or 128)
    args["window_size"] = f"{window - 1},0"  # the bridge: (sliding_window - 1, 0)
    kinds = data.get("layer_types")
    if kinds is not None and kinds != ["sliding_attention", "full_attention"] * (len(kinds) // 2):
        refused += _refuse(path, "layer_types", "...", "a window pattern other than the bridge's "
                           "(every other layer, the first windowed) would build another model")  # fmt: skip
    limit = data.get("swiglu_limit", 7.0)
    if limit != args["activation_func_clamp_value"]:
        refused += _refuse(path, "swiglu_limit", limit, "the bridge clamps at 7.0")
    scaling = data.get("rope_scaling") or {}
    args["rotary_scaling_factor"] = float(scaling.get("factor", 32.0))
    if "intermediate_size" in data:
        args["moe_ffn_hidden_size"] = int(data["intermediate_size"])
    return refused


def _experts(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Mixtral's expert size, DeepSeek's dense layers, shared experts and MTP; Qwen3-MoE's layout."""
    if data.get("model_type") == "mixtral":
        args["moe_ffn_hidden_size"] = int(data["intermediate_size"])
    dense = int(data.get("first_k_dense_replace") or 0)
    if dense and "num_hidden_layers" in data:
        args["moe_layer_freq"] = f"([0]*{dense}+[1]*{int(data['num_hidden_layers']) - dense})"
    if data.get("n_shared_experts"):
        shared = int(data["moe_intermediate_size"]) * int(data["n_shared_experts"])
        args["moe_shared_expert_intermediate_size"] = shared
    if data.get("num_nextn_predict_layers"):
        args["mtp_num_layers"] = int(data["num_nextn_predict_layers"])
    refused: list[Refused] = []
    for key, default in (("moe_layer_freq", 1), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if data.get(key, default) != default:
            refused += _refuse(path, key, data[key], "a dense/MoE layer pattern other than "
                               "Megatron-Bridge's (every layer MoE after the first dense ones) "
                               "would build another model")  # fmt: skip
    return refused


_RULES = (_attention, _activation_and_window, _experts, hf_hybrid.hybrid_rule)
