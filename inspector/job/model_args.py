"""Megatron-LM arguments into a validated ModelConfig (model.py): each refusal names the flag.

The checks follow Megatron-LM's `validate_args` (`megatron/training/arguments.py`) and the
asserts megatron-core's model classes make, as each cites.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.arguments import BY_NAME
from inspector.inputs.ignored import IGNORED
from inspector.inputs.unmodelled import MEGATRON_LM_REFUSES, REFUSED, RENAMED
from inspector.job import fp4, fp8
from inspector.job.checks import MAX_SIZE, check_at_least_one, check_heads, check_query_groups
from inspector.job.dsa import infer_from_pattern, validate_dsa
from inspector.job.fp8_attention import check_fp8_attention
from inspector.job.hybrid_model import check_ratios
from inspector.job.lora import lora_values
from inspector.job.model import MODEL_FIELDS, ModelConfig
from inspector.job.moe_pattern import parse_moe_layer_freq
from inspector.job.versions import LATENT_MOE_SINCE, megatron_version


def make_model_config(args: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from Megatron-LM arguments (unknown names are a programming error)."""
    values = {name: value for name, value in args.items() if name in MODEL_FIELDS}
    if values.get("moe_layer_freq") is not None:
        values["moe_layer_freq"] = parse_moe_layer_freq(values["moe_layer_freq"])
    else:
        values.pop("moe_layer_freq", None)
    if values.get("window_attn_skip_freq") is not None:
        values["window_attn_skip_freq"] = parse_moe_layer_freq(
            values["window_attn_skip_freq"], "--window-attn-skip-freq"
        )
    if values.get("linear_attention_freq") is not None:
        values["linear_attention_freq"] = parse_moe_layer_freq(
            values["linear_attention_freq"], "--linear-attention-freq"
        )
    if values.get("window_size") is not None:
        values["window_size"] = parse_window_size(values["window_size"])
    for name in ("glu_linear_offset", "softmax_type"):
        if values.get(name) is None:
            values.pop(name, None)
    for name in ("moe_router_score_function", "moe_router_load_balancing_type",
                 "moe_router_pre_softmax", "moe_router_dtype", "fp8_recipe", "fp8_amax_history_len",
                 "fp4_recipe",
                 "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):  # fmt: skip
        if values.get(name) is None:
            values.pop(name, None)
    values.pop("lora_target_modules", None)
    values.update(lora_values(args))
    infer_from_pattern(values)
    config = ModelConfig(**values)
    validate_model(config)
    return config


def parse_window_size(value: Any) -> tuple[int, int]:
    """Return --window-size as Megatron-LM's `tuple_type` reads it ("127,0" or "(127,0)"; a
    config file's list), checked as TE's `check_set_window_size` takes it: two integers >= -1."""
    text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    try:
        window = tuple(int(part) for part in text.strip("()").split(","))
    except ValueError:
        window = ()
    if len(window) != 2 or min(window) < -1:
        raise ConfigError(f"--window-size needs two integers (left,right, -1 for unbounded) such "
                          f"as 127,0, got {text!r}")  # fmt: skip
    return window[0], window[1]


def _flag(name: str) -> str:
    return BY_NAME[name].flag if name in BY_NAME else "--" + name.replace("_", "-")


def _require_positive(config: ModelConfig) -> None:
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "vocab_size",
        "make_vocab_size_divisible_by",
        "padded_vocab_size",
        "moe_router_topk",
        "ffn_hidden_size",
        "num_query_groups",
        "kv_channels",
        "max_position_embeddings",
        "num_experts",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_latent_size",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "mamba_state_dim",
        "mamba_head_dim",
        "mamba_num_groups",
        "mamba_num_heads",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        value = getattr(config, name)
        if value is not None and not 1 <= value <= MAX_SIZE:  # the flag's name only for errors
            check_at_least_one(_flag(name), value)


def _check_widths(config: ModelConfig) -> None:
    """Raise ConfigError for a linear layer wider than one dimension may be (MAX_SIZE): each flag
    is bounded alone, their products here (the QKV projection's, a gated MLP's fc1)."""
    heads, groups, head = config.num_attention_heads, config.query_groups, config.head_dim
    size = "--kv-channels" if config.kv_channels is not None else "head size (--hidden-size / heads)"
    widths = [(f"the QKV projection's width (--num-attention-heads {heads} + 2 x "
               f"--num-query-groups {groups}) x {size} {head}", (heads + 2 * groups) * head)]
    if config.swiglu:
        widths.append((f"fc1's width 2 x MLP size {config.ffn_size} (--swiglu)", 2 * config.ffn_size))
    for words, width in widths:
        if width > MAX_SIZE:
            raise ConfigError(f"{words} = {width} is larger than this tool can simulate (at most "
                              f"{MAX_SIZE} a dimension)")  # fmt: skip


def validate_model(config: ModelConfig) -> None:
    """Raise ConfigError for an architecture megatron would reject or silently change."""
    _require_positive(config)
    heads, hidden = config.num_attention_heads, config.hidden_size
    check_heads(hidden, heads, config.kv_channels)
    if config.num_query_groups is not None and not config.group_query_attention:
        raise ConfigError(
            f"--num-query-groups {config.num_query_groups} has no effect without "
            "--group-query-attention (Megatron-LM ignores it); pass both or neither"
        )
    check_query_groups(heads, config.query_groups)
    _check_widths(config)
    if config.ffn_size < 1:
        raise ConfigError(
            f"--swiglu with --hidden-size {hidden} gives an MLP size of int(4 * {hidden} * 2 / 3 / 64) "
            f"* 64 = {config.ffn_size} (Megatron-LM's rule); pass --ffn-hidden-size"
        )
    if config.bf16 and config.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive; pass one of them")
    if (
        config.position_embedding_type == "learned_absolute"
        and config.max_positions < config.seq_length
    ):
        raise ConfigError(
            f"--max-position-embeddings {config.max_positions} is smaller than --seq-length "
            f"{config.seq_length}: learned positions need one row per token"
        )
    check_ratios(config)
    _validate_gpt_oss(config)
    _validate_moe(config)
    _validate_moe_layer_freq(config)
    _validate_mla(config)
    validate_dsa(config)
    _validate_mtp(config)
    _validate_backend(config)
    fp8.validate_fp8(
        config.fp8_format, config.fp8_recipe, config.fp8_amax_history_len,
        config.transformer_impl, config.fp8_param_gather, config.reuse_grad_buf_for_mxfp8_param_ag,
    )
    fp4.validate_fp4(config.fp4_format, config.fp4_recipe, config.fp8_format,
                     config.transformer_impl)
    mla = config.mla_args() if config.multi_latent_attention else None
    head_dims = ((mla["qk_head_dim"] + mla["qk_pos_emb_head_dim"], mla["v_head_dim"]) if mla
                 else (config.head_dim,))  # fmt: skip
    check_fp8_attention(config.fp8_format, config.fp8_recipe, config.fp8_dot_product_attention,
                        config.seq_length, head_dims)  # fmt: skip
    fp4.check_bf16_layers(config.num_layers, config.num_layers_at_start_in_bf16,
                          config.num_layers_at_end_in_bf16)


def _validate_moe(config: ModelConfig) -> None:
    experts = config.num_experts
    moe_only = (
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_latent_size",
        "moe_grouped_gemm",
        "moe_router_enable_expert_bias",
        "moe_router_num_groups",
        "moe_router_group_topk",
    )
    if experts is None:
        if config.moe_layer_freq != 1:
            raise ConfigError("--moe-layer-freq needs --num-experts")
        if config.moe_router_score_function != "softmax":
            raise ConfigError("--moe-router-score-function needs --num-experts")
        for name in moe_only:
            if getattr(config, name):
                raise ConfigError(f"{_flag(name)} needs --num-experts")
        return
    if config.moe_latent_size and megatron_version() < LATENT_MOE_SINCE:
        version = ".".join(map(str, megatron_version()))
        raise ConfigError(f"--moe-latent-size needs megatron-core 0.16 or newer (LatentMoE's "
                          f"projections, moe_layer.py): {version} has no moe_latent_size")  # fmt: skip
    if config.moe_shared_expert_gate and not config.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (it gates the "
            "shared experts)"
        )
    if config.moe_grouped_gemm and not config.disable_bias_linear and not _te(config):
        raise ConfigError(
            "--moe-grouped-gemm needs --disable-bias-linear (megatron-core's GroupedMLP has no "
            "biases; Transformer Engine's TEGroupedMLP, --transformer-impl transformer_engine, has)"
        )
    if config.moe_router_topk > experts:
        raise ConfigError(
            f"--moe-router-topk {config.moe_router_topk} is larger than --num-experts {experts}"
        )
    _validate_groups(config, experts)


def _validate_groups(config: ModelConfig, experts: int) -> None:
    """Reject what megatron-core's TransformerConfig.__post_init__ rejects of node-limited
    routing (0.13.1-0.16.1, the `if self.moe_router_group_topk:` block), and a top-k larger than
    the picked groups hold, where moe_utils.py `group_limited_topk`'s final torch.topk would
    pick experts its mask set to -inf (our refusal: megatron runs it)."""
    groups, picked, topk = config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk
    if picked is None:
        return  # megatron reads the groups only with a group top-k (moe_utils.py _compute_topk)
    if groups is None:
        raise ConfigError(
            f"--moe-router-group-topk {picked} needs --moe-router-num-groups (megatron-core's "
            "TransformerConfig: 'When using group limited routing, moe_router_num_groups must "
            "be specified.')"
        )
    if experts % groups:
        raise ConfigError(
            f"--num-experts {experts} is not divisible by --moe-router-num-groups {groups} "
            f"({experts} % {groups} = {experts % groups}; megatron-core's TransformerConfig "
            "asserts it)"
        )
    if picked > groups:
        raise ConfigError(
            f"--moe-router-group-topk {picked} is larger than --moe-router-num-groups {groups} "
            "(megatron-core's TransformerConfig asserts moe_router_group_topk <= "
            "moe_router_num_groups)"
        )
    if topk > picked * (experts // groups):
        raise ConfigError(
            f"--moe-router-topk {topk} is more than the experts of the --moe-router-group-topk "
            f"{picked} groups a token picks ({picked} x {experts} / {groups} = "
            f"{picked * (experts // groups)}): megatron's group-limited top-k would pick experts "
            "outside them, which is not modelled"
        )


def _te(config: ModelConfig) -> bool:
    return config.transformer_impl == "transformer_engine"


def _validate_gpt_oss(config: ModelConfig) -> None:
    """Megatron-LM's checks of gpt-oss's arguments (arguments.py `core_transformer_config_from_args`
    asserts `not args.swiglu` with --quick-geglu) and where they act."""
    if config.quick_geglu and config.swiglu:
        raise ConfigError("--quick-geglu and --swiglu are mutually exclusive (Megatron-LM asserts "
                          "not args.swiglu with --quick-geglu)")  # fmt: skip
    if config.window_attn_skip_freq is not None and config.window_size is None:
        raise ConfigError("--window-attn-skip-freq needs --window-size (megatron-core windows no "
                          "layer without one)")  # fmt: skip
    freq = config.window_attn_skip_freq
    if isinstance(freq, int):
        check_at_least_one("--window-attn-skip-freq", freq)
    elif freq is not None and len(freq) != config.num_layers:
        raise ConfigError(f"--window-attn-skip-freq lists {len(freq)} layers but --num-layers is "
                          f"{config.num_layers}")  # fmt: skip


_MLA_ONLY = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
)


# Megatron-LM 0.19 argument_utils.py `_apply_yarn_config_from_args`: YaRN outside MLA reads these
_YARN = ("rotary_scaling_factor", "mscale", "mscale_all_dim")


def _validate_moe_layer_freq(config: ModelConfig) -> None:
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        check_at_least_one("--moe-layer-freq", pattern)
        return
    if len(pattern) != config.num_layers:
        raise ConfigError(
            f"--moe-layer-freq lists {len(pattern)} layers but --num-layers is {config.num_layers}"
        )
    if any(value not in (0, 1) for value in pattern):
        raise ConfigError("--moe-layer-freq lists must hold only 0 (dense) and 1 (MoE) per layer")


def _validate_mla(config: ModelConfig) -> None:
    if not config.multi_latent_attention:
        yarn = config.position_embedding_type == "yarn"
        for name in _MLA_ONLY:
            if getattr(config, name) is not None and not (yarn and name in _YARN):
                raise ConfigError(f"{_flag(name)} needs --multi-latent-attention")
        if config.rope_type == "yarn":
            raise ConfigError(
                "--rope-type yarn needs --multi-latent-attention (Megatron-LM's other attention "
                "takes rope only)"
            )
        return
    for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        check_at_least_one(_flag(name), getattr(config, name))
    if config.transformer_impl != "transformer_engine":
        raise ConfigError(
            "--multi-latent-attention needs --transformer-impl transformer_engine (megatron-core's "
            "local attention cannot build MLA)"
        )
    if config.group_query_attention:
        raise ConfigError(
            "--multi-latent-attention and --group-query-attention are mutually exclusive "
            "(Megatron-LM refuses both)"
        )


def _validate_mtp(config: ModelConfig) -> None:
    if config.mtp_num_layers is None:
        return
    check_at_least_one("--mtp-num-layers", config.mtp_num_layers)
    if config.position_embedding_type == "learned_absolute":
        raise ConfigError(
            "--mtp-num-layers needs --position-embedding-type rope or none (Megatron-LM's "
            "multi-token prediction does not support learned_absolute)"
        )


def _validate_backend(config: ModelConfig) -> None:
    if config.apex and config.normalization != "LayerNorm":
        raise ConfigError(
            f"--apex with --normalization {config.normalization} cannot build: megatron-core's "
            "final_layernorm would be apex FusedLayerNorm, which supports LayerNorm only "
            "(NVIDIA/Megatron-LM#1658); drop --apex to get the torch norms megatron uses for RMSNorm"
        )


def refuse_latent_moe(config: ModelConfig, command: str) -> None:
    """Refuse LatentMoE (--moe-latent-size) in a command that prices layers by formulas: megatron
    builds and runs it (moe_layer.py's fc1/fc2_latent_proj around experts on the latent width, the
    dispatcher moving latent-wide tokens), `tree`, `params`, `diff` and `memory` measure it."""
    if config.moe_latent_size:
        raise ConfigError(
            f"{command} does not price --moe-latent-size yet (its latent projections and the "
            "dispatcher's smaller volume); tree, params, diff and memory build and run it"
        )


def megatron_lm_spelling(flag: str) -> str | None:
    """Return FLAG as a Megatron-LM argument: itself, its `--no-` form (a TransformerConfig
    switch on by default, `--bias-dropout-fusion` -> `--no-bias-dropout-fusion`), or None."""
    tables = (IGNORED, REFUSED, RENAMED, MEGATRON_LM_REFUSES)
    for spelling in (flag, "--no-" + flag.removeprefix("--")):
        if BY_NAME.get(spelling[2:].replace("-", "_")) or any(spelling in t for t in tables):
            return spelling
    return None
