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

from dataclasses import dataclass, field
from typing import Any

from inspector.errors import InputError
from inspector.inputs import hf_gdn, hf_hybrid
from inspector.inputs.hf_values import value_of
from inspector.inputs.refusals import Refused
from inspector.inputs.sources import ScriptArgs, parse_config
from inspector.output import read_text

_LLAMA_LIKE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
               "disable_bias_linear": True, "hidden_dropout": 0.0}  # fmt: skip


_DEEPSEEK_V3 = {**_LLAMA_LIKE, "qk_layernorm": True, "multi_latent_attention": True,
                "untie_embeddings_and_output_weights": True, "moe_grouped_gemm": True,
                "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                "make_vocab_size_divisible_by": 1280}  # fmt: skip


# transformers' LlamaConfig takes a missing num_key_value_heads as num_attention_heads and a missing
# head_dim as hidden_size / num_attention_heads (what the tool does); the other families' classes
# put a number of their own there (MistralConfig, MixtralConfig, Qwen3Config, GptOssConfig, ...).
# The same for the experts and MLA's sizes (MixtralConfig num_local_experts=8, Qwen3MoeConfig
# num_experts=128, DeepseekV3Config n_routed_experts=256, first_k_dense_replace=3, q_lora_rank=1536,
# ...): where the key is absent. A null is the file's own word (q_lora_rank null: no query LoRA).
_GROUPS = ("num_key_value_heads",)
_GROUPS_HEAD = ("num_key_value_heads", "head_dim")
_EXPERTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
_DEEPSEEK = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
             "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
             "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group")  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture Megatron-Bridge maps: its name and the arguments its bridge fixes."""

    name: str
    bridge: str  # the bridge file under Megatron-Bridge's src/megatron/bridge/models/
    fixed: dict[str, Any] = field(default_factory=dict)
    # keys whose absence transformers' config class fills with its own default model's value
    # (MistralConfig num_key_value_heads=8, Qwen3Config head_dim=128, ...), which the Bridge then
    # reads: an error naming the key, never another model's number
    needs: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "llama/llama_bridge.py", _LLAMA_LIKE),
    "mistral": Family("Mistral", "mistral/mistral_bridge.py", _LLAMA_LIKE, _GROUPS),
    "mixtral": Family("Mixtral", "mixtral/mixtral_bridge.py",
                      {**_LLAMA_LIKE, "moe_grouped_gemm": True},
                      (*_GROUPS, "num_local_experts", "num_experts_per_tok")),  # fmt: skip
    "qwen2": Family("Qwen2", "qwen/qwen2_bridge.py", {**_LLAMA_LIKE, "add_qkv_bias": True}, _GROUPS),
    "qwen3": Family("Qwen3", "qwen/qwen3_bridge.py", {**_LLAMA_LIKE, "qk_layernorm": True},
                    _GROUPS_HEAD),  # fmt: skip
    "qwen3_moe": Family("Qwen3-MoE", "qwen/qwen3_moe_bridge.py",
                        {**_LLAMA_LIKE, "qk_layernorm": True, "moe_grouped_gemm": True},
                        (*_GROUPS_HEAD, *_EXPERTS)),  # fmt: skip
    "deepseek_v3": Family("DeepSeek-V3", "deepseek/deepseek_v3_bridge.py", _DEEPSEEK_V3, _DEEPSEEK),
    # Kimi-K2's config.json says DeepseekV3ForCausalLM with model_type kimi_k2; its bridge sets
    # what DeepSeek-V3's does (scoring_func sigmoid comes from the file, through MAPPED)
    "kimi_k2": Family("Kimi-K2", "kimi/kimi_bridge.py", _DEEPSEEK_V3, _DEEPSEEK),
    # DeepSeek-V3.2: DeepSeek-V3 with the lightning indexer on every MLA layer (config.json's
    # index_* keys, MAPPED); Megatron-Bridge has no bridge for it (as of 1ee926b34; its GLM-5
    # bridge, glm_moe_dsa/glm5_bridge.py, sets these three fields from the same keys; RoPE
    # unfused, as deepseek/deepseek_v3_bridge.py sets it and megatron's DSAttention needs)
    "deepseek_v32": Family("DeepSeek-V3.2", "glm_moe_dsa/glm5_bridge.py",
                           {**_DEEPSEEK_V3, "experimental_attention_variant": "dsa",
                            "no_rope_fusion": True},
                           (*_DEEPSEEK, "index_n_heads", "index_head_dim", "index_topk")),  # fmt: skip
    # gpt_oss_bridge.py `provider_bridge` (as of 0e4d6ed60): biases everywhere, quick-GELU GLU
    # clamped at 7 with offset 1, attention sinks, every other layer a window, YaRN positions;
    # the sliding window, YaRN factor and experts' size from the file (_gpt_oss)
    "gpt_oss": Family("gpt-oss", "gpt_oss/gpt_oss_bridge.py", {
        "normalization": "RMSNorm", "quick_geglu": True, "glu_linear_offset": 1.0,
        "activation_func_clamp_value": 7.0, "softmax_type": "learnable",
        "window_attn_skip_freq": 2, "position_embedding_type": "yarn",
        "untie_embeddings_and_output_weights": True, "moe_grouped_gemm": True,
        "moe_router_load_balancing_type": "none", "hidden_dropout": 0.0,
        "transformer_impl": "transformer_engine"},
        (*_GROUPS_HEAD, "num_local_experts", "num_experts_per_tok")),  # fmt: skip
    "nemotron_h": Family("Nemotron-H", "nemotronh/nemotron_h_bridge.py", hf_hybrid.FIXED, _GROUPS),
    "qwen3_next": Family("Qwen3-Next", "qwen/qwen3_next_bridge.py", hf_gdn.FIXED,
                         (*_GROUPS_HEAD, *_EXPERTS, *hf_gdn.MAPPED)),  # fmt: skip
}

# Architectures Megatron-Bridge maps that this tool's layer specs cannot build, and why.
NOT_MODELLED: dict[str, str] = {
    "gemma": "Gemma's gated tanh-GELU MLP and zero-centred norms are not modelled (only --swiglu)",
    "gemma2": "Gemma 2's sliding-window layers, logit soft-capping and extra norms are not modelled",
    "gemma3": "Gemma 3's sliding-window layers and extra norms are not modelled",
    # glm_moe_dsa/glm5_bridge.py: dsa_indexer_rotate_activation False, rope interleaved, ...
    "glm_moe_dsa": "GLM-5's sparse-attention indexer (no Hadamard rotation, interleaved RoPE, "
    "its own k-norm epsilon, the top-k shared across layers) is not modelled; DeepSeek-V3.2's is",
}

_INT = int
# HF key -> (Megatron-LM argument, JSON type): MegatronModelBridge.CONFIG_MAPPING, as arguments.
MAPPED: dict[str, tuple[str, type]] = {
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
    "index_n_heads": ("dsa_indexer_n_heads", _INT),
    "index_head_dim": ("dsa_indexer_head_dim", _INT),
    "index_topk": ("dsa_indexer_topk", _INT),
}

# Keys every config.json of these families holds; one missing would leave the model to a default
# of somebody else's, so it is an error naming the key (transformers' LlamaConfig would take its
# own 7B's 32 layers silently).
# max_position_embeddings is the sequence length, as Megatron-Bridge maps it (without it the
# default model's 1024 was taken).
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
            "intermediate_size", "max_position_embeddings")  # fmt: skip
_FLAG_OF = {"max_position_embeddings": "seq_length", "num_key_value_heads": "num_query_groups",
            "first_k_dense_replace": "moe_layer_freq",
            "n_shared_experts": "moe_shared_expert_intermediate_size"}  # fmt: skip
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
    missing = [key for key in REQUIRED if data.get(key) is None]
    missing += [key for key in family.needs if key not in data]
    if missing:
        key = missing[0]
        flag = "--" + _FLAG_OF.get(key, MAPPED.get(key, hf_gdn.MAPPED.get(key, ("",)))[0])
        shown = "missing (or null)" if key in REQUIRED else (
            "missing, and transformers would put its default model's value there")
        raise InputError(f'{path}: "{key}" is {shown}; every {family.name} config.json gives it '
                         f"(Megatron-LM's {flag.replace('_', '-')})")  # fmt: skip
    args: dict[str, Any] = dict(family.fixed)
    for key, (name, kind) in MAPPED.items():
        value = value_of(data, key, kind, path, least=1, most=1.0)  # a size of 0, a rate above 1
        if value is not None and not (name in args or name in _ruled_names(family)):
            args[name] = value
    refused: list[Refused] = []
    for rule in _RULES:
        refused += rule(data, args, path)
    ignored = tuple(key for key in data if key in IGNORED_KEYS)
    known = (MAPPED, RULED, IGNORED_KEYS, hf_hybrid.MAPPED, hf_hybrid.FIXED_BY_MEGATRON, ("use_bias",),
             hf_gdn.MAPPED, hf_gdn.PATTERN_KEYS)  # fmt: skip
    unknown = [k for k in data if not any(k in table for table in known)]
    notes = [f"{family.name} mapped as Megatron-Bridge's {family.bridge} maps it; --seq-length is "
             f"max_position_embeddings ({args.get('seq_length')}), as there: give --seq-length "
             "for the length you train"]  # fmt: skip
    if unknown:
        notes.append("keys this tool does not know (check they change nothing a GPU holds): "
                     + " ".join(unknown))  # fmt: skip
    return ScriptArgs(args, ignored, notes=tuple(notes), refused=tuple(refused))


def _family(data: dict[str, Any], path: str) -> Family:
    model_type = value_of(data, "model_type", str, path, "")
    architectures = value_of(data, "architectures", list, path, [])
    if not all(isinstance(name, str) for name in architectures):
        raise InputError(f'{path}: "architectures" must be a list of class names, got '
                         f"{architectures!r:.40}")  # fmt: skip
    if isinstance(data.get("text_config"), dict):  # a multimodal model: its language model's keys
        raise InputError(f'{path}: "text_config" holds a multimodal model\'s language model, which '
                         "--hf-config does not read; give a text model's config.json")  # fmt: skip
    shown = ", ".join(architectures) or model_type
    _check_class(architectures, model_type, path)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in NOT_MODELLED:
        raise InputError(f"{path}: {shown} (model_type {model_type}) is not modelled: "
                         f"{NOT_MODELLED[model_type]}")  # fmt: skip
    names = ", ".join(f"{f.name} ({t})" for t, f in FAMILIES.items())
    raise InputError(f"{path}: {shown} (model_type {model_type!r}) is not an architecture this "
                     f"tool maps; it maps {names}, as Megatron-Bridge does")  # fmt: skip


# The model types each causal-LM class of a mapped family comes with (the fixtures' config.json;
# Kimi-K2's says DeepseekV3ForCausalLM with model_type kimi_k2)
_CLASSES: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("llama",), "MistralForCausalLM": ("mistral",),
    "MixtralForCausalLM": ("mixtral",), "Qwen2ForCausalLM": ("qwen2",),
    "Qwen3ForCausalLM": ("qwen3",), "Qwen3MoeForCausalLM": ("qwen3_moe",),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2"), "DeepseekV32ForCausalLM": ("deepseek_v32",),
    "GptOssForCausalLM": ("gpt_oss",), "NemotronHForCausalLM": ("nemotron_h",),
    "Qwen3NextForCausalLM": ("qwen3_next",),
}  # fmt: skip


def _check_class(architectures: list[str], model_type: str, path: str) -> None:
    """Refuse a class of one family with another's model_type: Megatron-Bridge picks its bridge by
    the first causal-LM class in "architectures" (auto_bridge.py `_causal_lm_architecture`), and
    transformers builds the config by model_type, so the bridge would read the other's keys."""
    arch = next((name for name in architectures if name.endswith("ForCausalLM")), None)
    if arch not in _CLASSES or model_type not in FAMILIES or model_type in _CLASSES[arch]:
        return
    bridge = FAMILIES[_CLASSES[arch][0]].name
    raise InputError(f'{path}: "architectures" names {arch} (Megatron-Bridge\'s {bridge} bridge) but '
                     f'"model_type" is {model_type!r} ({FAMILIES[model_type].name}, the config '
                     "transformers builds); give the class and model type of one model")  # fmt: skip


def _ruled_names(family: Family) -> set[str]:
    # Mixtral's bridge takes kv_channels = hidden / heads, whatever head_dim says.
    return {"kv_channels"} if family.name == "Mixtral" else set()


def _refuse(path: str, key: str, value: Any, reason: str) -> list[Refused]:
    return [Refused("model", path, f'"{key}": {value}', "not modelled", reason)]


_DTYPES = ("bfloat16", "float16", "float32")


def _attention(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Key/value heads, positions, tied embeddings, biases, precision."""
    heads = data["num_attention_heads"]
    groups = value_of(data, "num_key_value_heads", int, path, least=1)
    if groups is not None and heads % groups and not args.get("multi_latent_attention"):
        raise InputError(f'{path}: "num_key_value_heads" {groups} does not divide '
                         f'"num_attention_heads" {heads} ({heads} % {groups} = {heads % groups})')
    if groups is not None and groups != heads and not args.get("multi_latent_attention"):
        args.update(group_query_attention=True, num_query_groups=groups)
    positions = value_of(data, "max_position_embeddings", int, path, least=1)
    args["seq_length"] = args["max_position_embeddings"] = positions
    # transformers' config classes of every family mapped here default tie_word_embeddings to
    # False (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, DeepseekV3Config, ...; the
    # Bridge reads the class's attribute), not PretrainedConfig's True
    tied = value_of(data, "tie_word_embeddings", bool, path, False)
    if "untie_embeddings_and_output_weights" not in args:
        args["untie_embeddings_and_output_weights"] = not tied
    if value_of(data, "mlp_bias", bool, path, False):
        args["disable_bias_linear"] = False
    key = "torch_dtype" if data.get("torch_dtype") is not None else "dtype"
    dtype = value_of(data, key, str, path)
    if dtype not in (None, *_DTYPES):
        raise InputError(f'{path}: "{key}" must be one of {", ".join(_DTYPES)}, got {dtype!r} '
                         "(the precision the model trains in: --bf16, --fp16, or neither)")  # fmt: skip
    if dtype in ("bfloat16", "float16"):
        args["bf16" if dtype == "bfloat16" else "fp16"] = True
    return []


def _activation_and_window(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """SwiGLU only; no sliding window; RoPE scaling as numerics, or YaRN for MLA."""
    if data.get("model_type") == "gpt_oss":
        return _gpt_oss(data, args, path)
    refused: list[Refused] = []
    act = value_of(data, "hidden_act", str, path, "silu")
    if act != "silu" and not (act == "relu2" and data.get("model_type") == "nemotron_h"):
        refused += _refuse(path, "hidden_act", act, "a gated MLP with another activation is not "
                           "modelled; --swiglu (silu) is")  # fmt: skip
    window = value_of(data, "sliding_window", int, path)
    if window is not None and value_of(data, "use_sliding_window", bool, path, True):
        refused += _refuse(path, "sliding_window", window, "sliding-window attention changes "
                           "attention FLOPs and scores (--window-size is refused)")  # fmt: skip
    scaling = value_of(data, "rope_scaling", dict, path, {})
    kind = value_of(scaling, "type", str, path) or value_of(scaling, "rope_type", str, path)
    if kind == "yarn" and args.get("multi_latent_attention"):
        args["rotary_scaling_factor"] = value_of(scaling, "factor", float, path, 40.0)
        args["mscale"] = value_of(scaling, "mscale", float, path, 1.0)
        args["mscale_all_dim"] = value_of(scaling, "mscale_all_dim", float, path, 0.0)
    elif kind == "yarn":
        refused += _refuse(path, "rope_scaling", "yarn", "YaRN positions outside MLA are not "
                           "modelled")  # fmt: skip
    return refused


def _gpt_oss(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """gpt-oss's window, clamp, YaRN factor and expert size, as gpt_oss_bridge.py reads them."""
    refused: list[Refused] = []
    window = value_of(data, "sliding_window", int, path, 128, least=1)
    args["window_size"] = f"{window - 1},0"  # the bridge: (sliding_window - 1, 0)
    kinds = value_of(data, "layer_types", list, path)
    if kinds is not None and kinds != ["sliding_attention", "full_attention"] * (len(kinds) // 2):
        refused += _refuse(path, "layer_types", "...", "a window pattern other than the bridge's "
                           "(every other layer, the first windowed) would build another model")  # fmt: skip
    limit = value_of(data, "swiglu_limit", float, path, 7.0)
    if limit != args["activation_func_clamp_value"]:
        refused += _refuse(path, "swiglu_limit", limit, "the bridge clamps at 7.0")
    scaling = value_of(data, "rope_scaling", dict, path, {})
    args["rotary_scaling_factor"] = value_of(scaling, "factor", float, path, 32.0)
    if "intermediate_size" in data:
        args["moe_ffn_hidden_size"] = value_of(data, "intermediate_size", int, path)
    return refused


def _experts(data: dict[str, Any], args: dict[str, Any], path: str) -> list[Refused]:
    """Mixtral's expert size, DeepSeek's dense layers, shared experts and MTP; Qwen3-MoE's layout."""
    if data.get("model_type") == "mixtral":
        args["moe_ffn_hidden_size"] = data["intermediate_size"]
    dense = value_of(data, "first_k_dense_replace", int, path, 0)
    if dense > data["num_hidden_layers"]:
        raise InputError(f'{path}: "first_k_dense_replace" {dense} is more than '
                         f'"num_hidden_layers" {data["num_hidden_layers"]}')  # fmt: skip
    if dense:
        args["moe_layer_freq"] = f"([0]*{dense}+[1]*{data['num_hidden_layers'] - dense})"
    shared_experts = value_of(data, "n_shared_experts", int, path, 0)
    if shared_experts:
        if data.get("moe_intermediate_size") is None:
            raise InputError(f'{path}: "n_shared_experts" needs "moe_intermediate_size" (the '
                             "size of each expert), and it is missing")  # fmt: skip
        args["moe_shared_expert_intermediate_size"] = args["moe_ffn_hidden_size"] * shared_experts
    mtp = value_of(data, "num_nextn_predict_layers", int, path, 0)
    if mtp:
        args["mtp_num_layers"] = mtp
    refused: list[Refused] = []
    for key, default in (("moe_layer_freq", 1), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
        if data.get(key, default) != default:
            refused += _refuse(path, key, data[key], "a dense/MoE layer pattern other than "
                               "Megatron-Bridge's (every layer MoE after the first dense ones) "
                               "would build another model")  # fmt: skip
    return refused


_RULES = (_attention, _activation_and_window, _experts, hf_hybrid.hybrid_rule, hf_gdn.gdn_rule)
