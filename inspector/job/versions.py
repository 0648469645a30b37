"""What the installed megatron-core builds where its versions differ, asked by a Job's checks and by
`plan` (which reads no inputs): one home, each read from the package metadata (no megatron import,
inputs/versions.py) and each checked against megatron itself in tests/test_versions.py."""

from __future__ import annotations

from inspector.inputs.versions import (
    ARGUMENT_VERSIONS,
    LAYER_WISE_RELEASES,
    MUON_REGISTRY_SINCE,
    MUON_RELEASES,
    megatron_core_version,
    within,
)

# megatron-core's first version whose TransformerConfig has `moe_flex_dispatcher_backend`
# (core_v0.16.0 transformer_config.py; 0.13-0.15 run DeepEP only, behind `moe_enable_deepep`)
FLEX_BACKEND_SINCE = ARGUMENT_VERSIONS["--moe-flex-dispatcher-backend"][0]
# megatron-core's first version whose TransformerConfig has `moe_latent_size` (LatentMoE:
# core_v0.16.0 moe_layer.py fc1_latent_proj / fc2_latent_proj; none at core_v0.15.3)
LATENT_MOE_SINCE = ARGUMENT_VERSIONS["--moe-latent-size"][0]

# megatron-core's first version whose MoEFlexTokenDispatcher asserts TPxEP > 1 for DeepEP only,
# not HybridEP (core_v0.17.1, 0.18.2 and 0.19.2 token_dispatcher.py: "DeepEP dispatcher requires
# TPxEP > 1" in the deepep branch; core_v0.16.1 asserts "Flex token dispatcher requires TPxEP > 1"
# for every backend; tests/test_flex_dispatch.py reads the installed source)
HYBRIDEP_ONE_RANK_SINCE = (0, 17)


def megatron_version() -> tuple[int, int]:
    """Return the installed megatron-core's (major, minor)."""
    return megatron_core_version()


def hsdp_expert_groups() -> bool:
    """Return whether megatron-core's Megatron-FSDP shards expert buckets under HSDP
    (--num-distributed-optimizer-instances > 1): 0.13's custom_fsdp over the intra partial expert
    group, 0.17 on over the same group (mcore_fsdp_adapter.py `_init_dist_index`: `expt_dp_group
    = get_expert_data_parallel_group(partial_expert_data_parallel=True)`); core_v0.14.0-0.16.1's
    HSDP branch gives FSDPDistributedIndex no expert mesh, so `get_fsdp_group(is_expert_parallel=
    True)` is None and `_init_each_parameter_group_buffers` fails on its `.size()`."""
    version = megatron_version()
    return version < (0, 14) or version >= (0, 17)


def fsdp_with_pipeline() -> bool:
    """Return whether megatron-core's Megatron-FSDP runs with pipeline parallelism: 0.13's
    custom_fsdp builds no device mesh; core_v0.14.0 to 0.19.2's FullyShardedDataParallel
    (mcore_fsdp_adapter.py `_init_dist_index`) lays `torch.arange(dist.get_world_size())` out as
    "(dp_cp ep tp)" in `_get_dp_tp_mesh` (and `_get_hsdp_tp_mesh`), so with pp > 1 the world
    holds pp times more ranks than the mesh and einops stops ("Shape mismatch"). Megatron-LM's
    validate_args (core_v0.16.1, core_v0.19.0) has no check of its own: the run stops there."""
    return megatron_version() < (0, 14)


def router_padding_field() -> str:
    """Return the TransformerConfig field the router's fp8 padding sets: from 0.16
    `moe_router_padding_for_quantization` (--moe-router-padding-for-fp8 turns it on, with a
    warning that the fp8 name is going away); 0.13-0.15 only `moe_router_padding_for_fp8`."""
    since = ARGUMENT_VERSIONS["--moe-router-padding-for-quantization"][0]
    quantization = megatron_version() >= since
    return "moe_router_padding_for_quantization" if quantization else "moe_router_padding_for_fp8"


def mtp_in_layouts() -> bool:
    """Return whether megatron-core builds MTP from a layout string: 0.14 on; 0.13's
    PipelineParallelLayerLayout raises "MTP layer is not supported for flexible pipeline layout"."""
    return megatron_version() >= (0, 14)


def etp_bias_refused() -> bool:
    """Return whether megatron-core refuses MoE biases at expert tensor parallel above 1:
    TransformerConfig.__post_init__ asserts "Bias in Moe is only supported when ETP==1" in 0.16.1,
    not in 0.13.1; from 0.14 on it is assumed (a layout not offered rather than one megatron
    refuses)."""
    return megatron_version() >= (0, 14)


def hybrid_moe_layers() -> bool:
    """Return whether megatron-core's hybrid layer pattern has MoE layers (`E`): 0.16 on
    (ssm/mamba_hybrid_layer_allocation.py `Symbols.VALID`; core_v0.13.1-0.15.0: M, *, - only)."""
    return megatron_version() >= (0, 16)


def experts_flagged_without_ep() -> bool:
    """Return whether megatron-core marks expert weights for the expert data-parallel buffer
    (allreduce=False) when --expert-tensor-parallel-size differs from --tp, even at ep 1: 0.19 on
    (tensor_parallel/layers.py and extensions/transformer_engine.py `use_expert_pgs`); before,
    only with expert parallelism (`not (is_expert and self.expert_parallel)`)."""
    return megatron_version() >= (0, 19)


def hybrid_pattern_separators() -> bool:
    """Return whether megatron-core's hybrid layer pattern takes `|` (pipeline stage boundaries)
    and `/` (MTP depths): 0.17 on (ssm/mamba_hybrid_layer_allocation.py `Symbols.PIPE`,
    `MTP_SEPARATOR`, `select_pipeline_segment` at core_v0.17.0; models/hybrid/ from 0.18)."""
    return megatron_version() >= (0, 17)


def hybrid_stage_sizes_read() -> bool:
    """Return whether megatron-core's MambaStack reads --decoder-first/last-pipeline-num-layers:
    0.16 (ssm/mamba_block.py `num_layers_in_first_pipeline_stage`); core_v0.13.1 splits evenly
    whatever they say (0.14-0.15 not checked)."""
    return megatron_version() >= (0, 16)


def hybrid_gdn_layers() -> bool:
    """Return whether megatron-core's hybrid layer pattern has gated delta net layers (`G`): 0.17
    on (ssm/mamba_hybrid_layer_allocation.py `Symbols.GDN` and MambaStack's `gdn_layer`
    at core_v0.17.0; HybridStack's from 0.18)."""
    return megatron_version() >= (0, 17)


def muon_modelled(layer_wise: bool = False) -> bool:
    """Return whether the installed megatron-core builds Muon (`layer_wise`: with megatron's
    LayerWiseDistributedOptimizer) as this tool runs it (memory/engine/muon.py)."""
    return within(LAYER_WISE_RELEASES if layer_wise else MUON_RELEASES, megatron_version())


def muon_registry() -> bool:
    """Return whether megatron-core builds Muon through optimizer/emerging_optimizers.py's
    registry and get_megatron_optimizer (0.18+; 0.16's optimizer/muon.py before)."""
    return megatron_version() >= MUON_REGISTRY_SINCE


# megatron-core's first version checked to have TransformerConfig.fp4 (--fp4-format) and
# fp4_utils.py: 0.16 (core_v0.16.1 has both; core_v0.13.1 neither; 0.14-0.15 not checked)
FP4_SINCE = (0, 16)


def packed_checked() -> bool:
    """Return whether packed sequences (--sft) are modelled on the installed megatron-core: the
    engine's THD counts were checked on core_v0.16.1 and 0.19.2; core_v0.13.1 holds a different
    rotary and attention split, 0.14-0.15 are not checked."""
    return megatron_version() >= (0, 16)


def gdn_conv_keeps_projection() -> bool:
    """Return whether megatron-core's GatedDeltaNet keeps in_proj's whole output for backward:
    0.18 on pass fla's `causal_conv1d` a [b, s, d] view of it, which the kernel saves; 0.16-0.17
    copy q, k and v to a contiguous [b, d, s] for causal-conv1d's `causal_conv1d_fn`, so in_proj's
    output is freed (ssm/gated_delta_net.py `forward`; tests/test_plan_hybrid.py measures both)."""
    return megatron_version() >= (0, 18)
