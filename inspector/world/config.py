"""megatron's TransformerConfig for one model and layout, as Megatron-LM builds it from its arguments."""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.job.model_args import megatron_lm_spelling
from inspector.world.setup import megatron, parallel_sizes

# TransformerConfig fields set from a Megatron-LM flag of another name (Megatron-LM
# core_transformer_config_from_args; ModelConfig.transformer_fields); the others share the name.
_FIELD_FLAGS = {"num_moe_experts": "--num-experts", "gated_linear_unit": "--swiglu",
                "add_bias_linear": "--disable-bias-linear", "fp8": "--fp8-format",
                "layernorm_zero_centered_gamma": "--apply-layernorm-1p",
                "layernorm_epsilon": "--norm-epsilon", "apply_rope_fusion": "--no-rope-fusion",
                "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
                "num_layers_in_first_pipeline_stage": "--decoder-first-pipeline-num-layers",
                "num_layers_in_last_pipeline_stage": "--decoder-last-pipeline-num-layers",
                "fp8_param": "--fp8-param-gather", "fp4_param": "--fp4-param-gather"}  # fmt: skip

# megatron-core refusals that name no field (megatron-core 0.16.1: transformer_config.py
# __post_init__, model_parallel_config.py, moe/experts.py, moe/router.py, moe/token_dispatcher.py,
# transformer_block.py): the Megatron-LM flags that set what they check
_MESSAGE_FLAGS = (
    ("Bias in Moe is only supported when ETP==1", "--expert-tensor-parallel-size --disable-bias-linear"),
    ("Bias is not supported for MoE", "--disable-bias-linear"),  # 0.13-0.14: no MoE biases at all
    ("Cannot use sequence parallelism without tensor parallelism",
     "--sequence-parallel --tensor-model-parallel-size"),
    ("Currently GroupedMLP for MoE only supports bf16", "--moe-grouped-gemm --bf16"),
    ("Activation function must be silu or gelu when using GroupedMLP", "--moe-grouped-gemm --swiglu"),
    ("fp4 and fp8 cannot be used simultaneously", "--fp4-format --fp8-format"),
    ("Delayed scaling does not support first / last layer in BF16",
     "--fp8-recipe --first-last-layers-bf16"),
    ("Delayed scaling does not support moe_act and layernorm recompute", "--fp8-recipe --recompute-modules"),
    ("Storing activation input in FP8 is supported only for SwiGLU", "--swiglu"),
    ("DeepEP backend is only supported with flex token dispatcher",
     "--moe-token-dispatcher-type --moe-enable-deepep"),
    ("Only one backend is supported for flex token dispatcher", "--moe-flex-dispatcher-backend"),
    ("Flex token dispatcher requires TPxEP > 1",
     "--moe-token-dispatcher-type --tensor-model-parallel-size --expert-model-parallel-size"),
    ("Shared expert overlap is not supported in Flex Token Dispatcher",
     "--moe-shared-expert-overlap --moe-token-dispatcher-type"),
    ("Sinkhorn routing does not support aux loss", "--moe-router-load-balancing-type --moe-aux-loss-coeff"),
    ("full scope cannot be used with other scopes", "--cuda-graph-scope"),
    ("moe_preprocess cuda graph is only supported with moe_router cuda graph", "--cuda-graph-scope"),
    ("moe cuda graph is only supported for MoE", "--cuda-graph-scope --num-experts"),
    ("mlp cuda graph is only supported for dense layers", "--cuda-graph-scope"),
    ("moe cuda graph is only supported with drop-padding MoE",
     "--cuda-graph-scope --moe-expert-capacity-factor --moe-pad-expert-input-to-capacity"),
    ("full recompute is only supported with full iteration CUDA graph",
     "--recompute-granularity --cuda-graph-scope"),
    ("attention dropout is not supported with graphed attention recomputation",
     "--attention-dropout --cuda-graph-scope --recompute-modules"),
    ("hidden dropout is not supported with graphed MLP/MoE recomputation",
     "--hidden-dropout --cuda-graph-scope --recompute-modules"),
    ("moe recompute is not supported with moe_router CUDA graph", "--recompute-modules --cuda-graph-scope"),
    ("Output gate is not supported for MLA", "--attention-output-gate --multi-latent-attention"),
    ("Unsupported communication type for context parallelism", "--cp-comm-type"),
    ("With uneven pipelineing the left over layers must be divisible by left over stages",
     "--num-layers --pipeline-model-parallel-size --decoder-first-pipeline-num-layers "
     "--decoder-last-pipeline-num-layers"),
    ("Not enough layers in the first virtual pipeline stage",
     "--decoder-first-pipeline-num-layers --num-virtual-stages-per-pipeline-rank"),
    ("Not enough layers in the last virtual pipeline stage",
     "--decoder-last-pipeline-num-layers --num-virtual-stages-per-pipeline-rank"),
    # refusals megatron's forward raises on the run (memory/engine/microbatch.py megatron_failed):
    # mlp.py's fused bias activation with the experts' per-token probabilities (SequentialMLP)
    ("Only support fusion of swiglu and quick_gelu", "--swiglu --no-bias-gelu-fusion"),
    # torch's meta tensors refuse a tensor of 2^63 bytes or more: the s x s attention scores
    ("Storage size calculation overflowed", "--seq-length --micro-batch-size"),
)  # fmt: skip


def flags_named(reason: str) -> list[str]:
    """Return the Megatron-LM flags behind the TransformerConfig fields a megatron-core message
    names (`num_attention_heads` -> --num-attention-heads), then those behind a known refusal
    that names none (_MESSAGE_FLAGS), each once, in order."""
    import dataclasses
    import re

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = {field.name for field in dataclasses.fields(MLATransformerConfig)}
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", reason)
    named = [w for w in words if w in fields and ("_" in w or w in _FIELD_FLAGS)]
    spelt = [megatron_lm_spelling(_FIELD_FLAGS.get(name, "--" + name.replace("_", "-")))
             for name in named]  # a field no Megatron-LM argument sets names no flag
    flags = [flag for flag in spelt if flag is not None]
    flags += [flag for text, given in _MESSAGE_FLAGS if text in reason for flag in given.split()]
    return list(dict.fromkeys(flags))


def _no_values(tensor: Any) -> Any:
    """Initialise nothing: a meta tensor holds no values."""
    return tensor


def transformer_config(
    model: ModelConfig, layout: Layout, vpp: int | None, runtime: dict[str, Any] | None = None
) -> Any:
    """Return megatron's TransformerConfig as Megatron-LM builds it from these arguments.

    The model's fields come from ModelConfig.transformer_fields (the one map of the model into
    megatron's names); this adds the layout, torch's dtypes and activation, and meta-device set-up.
    `runtime`: fields that change only how the model runs (dropout, recomputation, fusions), for
    the engine (inspector/memory/engine), which runs it; a structural build leaves megatron's defaults.
    """
    m = megatron()
    fields = model.transformer_fields()
    if fields.get("moe_shared_expert_gate"):
        _check_shared_expert_gate(m.TransformerConfig)
    _check_gpt_oss(m.TransformerConfig, model)
    kwargs = {**fields, **_torch_fields(m.torch, model), **_layout_fields(layout, vpp)}
    kwargs.update(runtime or {})
    for name in ("moe_layer_freq", "linear_attention_freq"):
        if isinstance(kwargs.get(name), tuple):
            kwargs[name] = list(kwargs[name])  # megatron-core takes a list
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # Megatron-LM `core_transformer_config_from_args`: --multi-latent-attention picks
        # MLATransformerConfig and copies the MLA arguments into it.
        return MLATransformerConfig(**kwargs)
    config = m.TransformerConfig(**kwargs)
    for name, value in model.yarn_attributes().items():
        setattr(config, name, value)  # attributes, not fields: GPTModel reads them by getattr
    return config


def _torch_fields(torch: Any, model: ModelConfig) -> dict[str, Any]:
    """Return the fields torch and the meta device set: dtypes, SiLU, no initial values."""
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dtype = dtypes[model.dtype_name]
    fields: dict[str, Any] = dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        # On meta there are no values to initialise: megatron still runs its initialisation path
        # (which sets the tensor-parallel attributes), but torch's normal_ on meta would import
        # dynamo on first use (~1.2 s) for nothing.
        init_method=_no_values,
        output_layer_init_method=_no_values,
    )
    if model.swiglu:
        # Megatron-LM arguments.py: --swiglu sets a gated linear unit with SiLU.
        fields["activation_func"] = torch.nn.functional.silu
    elif model.quick_geglu:
        # Megatron-LM arguments.py: --quick-geglu sets a gated linear unit with quick_gelu.
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        fields["activation_func"] = quick_gelu
    return fields


def _layout_fields(layout: Layout, vpp: int | None) -> dict[str, Any]:
    """Return the parallel sizes and the pipeline split as TransformerConfig names them."""
    fields: dict[str, Any] = dict(
        parallel_sizes(layout, vpp),
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=layout.account_for_loss_in_pipeline_split,
    )
    if layout.pipeline_model_parallel_layout is not None:
        fields["pipeline_model_parallel_layout"] = layout.pipeline_model_parallel_layout
    return fields


def _check_shared_expert_gate(config_class: Any) -> None:
    """Raise ConfigError where megatron-core cannot gate shared experts (before 0.16)."""
    import dataclasses

    if "moe_shared_expert_gate" not in {f.name for f in dataclasses.fields(config_class)}:
        from megatron.core import __version__

        raise ConfigError(
            f"--moe-shared-expert-gate needs megatron-core 0.16 or newer: {__version__} builds "
            "shared experts without a gate"
        )


# gpt-oss's arguments and the TransformerConfig field each sets (megatron-core 0.15 added them all)
_GPT_OSS_FIELDS = {"--quick-geglu": ("quick_geglu", "glu_linear_offset"),
                   "--glu-linear-offset": ("glu_linear_offset", "glu_linear_offset"),
                   "--activation-func-clamp-value": ("activation_func_clamp_value",
                                                     "activation_func_clamp_value"),
                   "--softmax-type": ("softmax_type", "softmax_type"),
                   "--window-attn-skip-freq": ("window_attn_skip_freq", "window_attn_skip_freq")}  # fmt: skip


def _check_gpt_oss(config_class: Any, model: ModelConfig) -> None:
    """Raise ConfigError naming the first gpt-oss argument the installed megatron-core lacks."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    defaults = ModelConfig()
    for flag, (attribute, field_name) in _GPT_OSS_FIELDS.items():
        if getattr(model, attribute) != getattr(defaults, attribute) and field_name not in names:
            from megatron.core import __version__

            raise ConfigError(f"{flag} needs megatron-core 0.15 or newer: {__version__} has no "
                              f"TransformerConfig.{field_name}")  # fmt: skip

