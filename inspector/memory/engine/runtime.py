"""The TransformerConfig fields Megatron-LM sets from a job's runtime flags (the engine's builds).

`runtime_config` is what microbatch.py, stage.py and the optimizer's and graphs' builds pass
world/stage.py: megatron-core then builds the stage as Megatron-LM's run would.
"""

from __future__ import annotations

from typing import Any

from inspector.job.job import FUSIONS, Job, bias_fusions
from inspector.job.versions import FLEX_BACKEND_SINCE, megatron_version, router_padding_field


def runtime_config(job: Job) -> dict[str, Any]:
    """Return the TransformerConfig fields Megatron-LM sets from the job's runtime flags.

    `core_transformer_config_from_args` copies the dropouts and recomputation; its flag defaults
    give `attention_softmax_in_fp32` False (softmax in the 16-bit type), bias-activation and
    bias-dropout fusion on unless `--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion` or
    `--no-bias-dropout-fusion` turn them off. The masked-softmax, rope and gradient-accumulation fusions need
    kernels from apex or Transformer Engine: off for the local spec, as in the GPU runs of
    shared/gpu/jobs; on for Transformer Engine jobs, as Megatron-LM's flags default them
    (`--no-masked-softmax-fusion`, `--no-rope-fusion`, `--no-gradient-accumulation-fusion`
    turn them off; masked softmax is unused by TE's fused attention). MoE
    jobs take their token dispatcher and expert capacity.
    """
    training, model = job.training, job.model
    te = model.transformer_impl == "transformer_engine"
    on = {name: name not in training.unfused for name in FUSIONS}
    bias_activation, bias_dropout = bias_fusions(model, training)
    fields: dict[str, Any] = dict(
        hidden_dropout=training.hidden_dropout,
        attention_dropout=training.attention_dropout,
        attention_softmax_in_fp32=False,
        masked_softmax_fusion=te and on["masked_softmax_fusion"],
        bias_activation_fusion=bias_activation,
        bias_dropout_fusion=bias_dropout,
        apply_rope_fusion=te and model.position_embedding_type in ("rope", "yarn") and on["rope_fusion"],
        gradient_accumulation_fusion=te and on["gradient_accumulation_fusion"],
        deallocate_pipeline_outputs=True,
        cross_entropy_loss_fusion=training.cross_entropy_loss_fusion,
        deterministic_mode=training.deterministic_mode,  # world/stage.py: torch's algorithms too
    )
    if training.defer_embedding_wgrad:
        fields.update(defer_embedding_wgrad_compute=True,
                      wgrad_deferral_limit=training.wgrad_deferral_limit)  # fmt: skip
    if te and not training.flash_attention:
        # --attention-backend unfused (or auto in fp32, the same): megatron's LanguageModule
        # (_set_attention_backend) opts TE out of flash and fused attention, NVTE_FLASH_ATTN=0
        # NVTE_FUSED_ATTN=0, and TE's unfused attention stores the s x s scores (world/te)
        from megatron.core.transformer.enums import AttnBackend

        fields["attention_backend"] = AttnBackend.unfused
    if model.mtp_num_layers:
        # Megatron-LM's --mtp-loss-scaling-factor default (arguments.py: 0.1), which
        # core_transformer_config_from_args copies (megatron-core 0.13's own default is None)
        fields["mtp_loss_scaling_factor"] = 0.1
    if model.num_experts is not None:
        dispatcher = training.moe_token_dispatcher_type
        fields.update(
            moe_token_dispatcher_type=dispatcher,
            moe_expert_capacity_factor=training.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=training.moe_pad_expert_input_to_capacity,
        )
        if dispatcher == "flex":
            fields.update(_flex_fields(training))
        if training.moe_router_padding:
            fields[router_padding_field()] = True  # the version's own spelling
        if training.op_fuser:  # megatron-core 0.18+ (inputs/versions.OP_FUSER_RELEASES)
            fields["use_transformer_engine_op_fuser"] = True
            if not (model.swiglu or model.quick_geglu):
                fields.update(_squared_relu())
        if training.moe_glu_interleave is not None and _has_field("moe_mlp_glu_interleave_size"):
            fields["moe_mlp_glu_interleave_size"] = training.moe_glu_interleave  # 0.18+
        if training.moe_expert_rank_capacity_factor is not None:  # HybridEP's static budget
            fields["moe_expert_rank_capacity_factor"] = training.moe_expert_rank_capacity_factor
        if training.moe_paged_stash:  # megatron-core 0.18+ (engine/paged_stash.py)
            fields.update(moe_paged_stash=True,
                          moe_paged_stash_page_size=training.moe_paged_stash_page_size,
                          moe_paged_stash_buffer_size_factor_cuda=training.moe_paged_stash_factor_cuda,
                          moe_paged_stash_buffer_size_factor_cpu=training.moe_paged_stash_factor_cpu)
    if training.recompute != "none":
        fields["recompute_granularity"] = training.recompute
        fields["recompute_modules"] = list(training.recompute_modules)
    if training.recompute == "full":
        fields["recompute_method"] = training.recompute_method
        fields["recompute_num_layers"] = training.recompute_num_layers
    if training.offloading is not None:  # --fine-grained-activation-offloading (offload.py)
        fields.update(training.offloading.config_fields())
    return fields


def _squared_relu() -> dict[str, Any]:
    """The only experts without a gated unit megatron-core's op fuser builds (0.19.2 experts.py
    `_is_fused_impl_supported`, `_make_fused_ops`: anything else asserts 'Fused GroupedMLP is not
    supported'): Megatron-LM's --squared-relu with --use-fused-weighted-squared-relu, Nemotron
    3's (Megatron-Bridge perf_recipes/nemotronh/common.py sets both), which the tool otherwise
    reads as numerics only; job/checks.py `check_op_fuser` says so."""
    from megatron.core.activations import squared_relu

    return {"activation_func": squared_relu, "use_fused_weighted_squared_relu": True}


def _flex_fields(training: Any) -> dict[str, Any]:
    """The flex dispatcher's TransformerConfig fields: megatron-core 0.16+ names the backend
    (`moe_flex_dispatcher_backend`); 0.13-0.15 know DeepEP alone, by `moe_enable_deepep`."""
    fields: dict[str, Any] = dict(moe_deepep_num_sms=training.moe_deepep_num_sms)
    if megatron_version() >= FLEX_BACKEND_SINCE:
        fields["moe_flex_dispatcher_backend"] = training.moe_flex_backend
    else:
        fields["moe_enable_deepep"] = True
    return fields


def _has_field(name: str) -> bool:
    """Whether the installed TransformerConfig has the field (Megatron-LM before 0.18 has no such
    argument: a note says so, and the job runs without it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return name in TransformerConfig.__dataclass_fields__
