"""megatron's TransformerConfig for one model and layout, as Megatron-LM builds it from its arguments."""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.world.setup import megatron


def _no_values(tensor: Any) -> Any:
    """Initialise nothing: a meta tensor holds no values."""
    return tensor


def _transformer_config(
    model: ModelConfig, layout: Layout, vpp: int | None, runtime: dict[str, Any] | None = None
) -> Any:
    """Return megatron's TransformerConfig as Megatron-LM builds it from these arguments.

    `runtime`: fields that change only how the model runs (dropout, recomputation, fusions), for
    the engine (inspector/engine), which runs it; a structural build leaves megatron's defaults.
    """
    m = megatron()
    torch = m.torch
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        model.dtype_name
    ]
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=layout.account_for_loss_in_pipeline_split,
        use_cpu_initialization=True,
        perform_initialization=True,
        # On meta there are no values to initialise: megatron still runs its initialisation path
        # (which sets the tensor-parallel attributes), but torch's normal_ on meta would import
        # dynamo on first use (~1.2 s) for nothing.
        init_method=_no_values,
        output_layer_init_method=_no_values,
    )
    kwargs.update(runtime or {})
    if layout.pipeline_model_parallel_layout is not None:
        kwargs["pipeline_model_parallel_layout"] = layout.pipeline_model_parallel_layout
    if model.swiglu:
        # Megatron-LM arguments.py: --swiglu sets a gated linear unit with SiLU.
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if model.num_experts is not None:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_grouped_gemm=model.moe_grouped_gemm,
        )
    if model.moe_shared_expert_gate:
        _check_shared_expert_gate(m.TransformerConfig)
        kwargs.update(moe_shared_expert_gate=True)
    kwargs.update(_deepseek_fields(model))
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # Megatron-LM `core_transformer_config_from_args`: --multi-latent-attention picks
        # MLATransformerConfig and copies the MLA arguments into it.
        return MLATransformerConfig(**kwargs, **model.mla_args())
    return m.TransformerConfig(**kwargs)


def _deepseek_fields(model: ModelConfig) -> dict[str, Any]:
    """Return the TransformerConfig fields of MoE layer patterns, routers and MTP, where set."""
    fields: dict[str, Any] = {}
    if model.num_experts is not None:
        freq = model.moe_layer_freq
        fields.update(
            moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        )
    if model.mtp_num_layers is not None:
        fields.update(mtp_num_layers=model.mtp_num_layers)
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
