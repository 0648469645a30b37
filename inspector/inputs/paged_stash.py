"""megatron-core's MoE paged stash and the arguments it needs: refused before 0.18, by version.

megatron-core 0.18+ (transformer/moe/paged_stash.py, `--moe-paged-stash`) keeps the routed experts'
activations for backward in pages of buffers it sizes after a first, profiling iteration. Its
saved-tensor hook pages only the tensors Transformer Engine's fused grouped MLP marks for it
(`mark_grouped_tensor`), and megatron opens that hook in one place: TEGroupedMLP._fused_forward
(transformer/moe/experts.py), run only with `--use-transformer-engine-op-fuser`. TransformerConfig
requires the stash to come with `--moe-expert-rank-capacity-factor` (HybridEP's static receive
budget, "there is no need to use paged stashing without it"), and that factor with the hybridep
backend requires the op fuser (transformer_config.py __post_init__, core_v0.18.0 and 0.19.2).
All of them are modelled from megatron-core 0.18 (versions.OP_FUSER_RELEASES): the stash itself
runs as megatron wrote it (memory/engine/paged_stash.py: its profiling iteration, its buffers,
its pages); megatron-core 0.13-0.17 have none of them, so they are refused there by version.
job/checks.py `check_paged_stash` refuses what megatron's TransformerConfig refuses, and factors
whose buffers would overflow under balanced routing (the rerun without the stash is not
simulated).
"""

from __future__ import annotations

from typing import Any

from inspector.inputs.versions import OP_FUSER_RELEASES

_OP_FUSER = (
    "megatron-core 0.13-0.17 have no Transformer Engine op fuser for the MoE experts "
    "(TransformerConfig.use_transformer_engine_op_fuser came in 0.18, where it is modelled)"
)
_PAGED_STASH = (
    "megatron-core 0.13-0.17 have no MoE paged stash (transformer/moe/paged_stash.py came in "
    "0.18, where it is modelled)"
)
_STASH_SIZE = ("sizes megatron-core's MoE paged stash (--moe-paged-stash), which megatron-core "
               "0.13-0.17 do not have (modelled from 0.18)")

# TransformerConfig fields of core_v0.18.0 (Megatron-LM's arguments.py makes each an argument
# through ArgumentGroupFactory(TransformerConfig)): flag -> (group, reason, harmless values: the
# defaults[, the releases that model it]), rows of unmodelled.REFUSED
PAGED_STASH_REFUSED: dict[str, tuple[Any, ...]] = {
    "--moe-paged-stash": ("training", _PAGED_STASH, (), OP_FUSER_RELEASES),
    "--moe-paged-stash-page-size": ("training", _STASH_SIZE, ("64",), OP_FUSER_RELEASES),
    "--moe-paged-stash-buffer-size-factor-cuda": (
        "training", _STASH_SIZE, ("1.1", "1.10"), OP_FUSER_RELEASES),
    "--moe-paged-stash-buffer-size-factor-cpu": ("training", _STASH_SIZE, ("0", "0.0"), OP_FUSER_RELEASES),
    "--use-transformer-engine-op-fuser": ("training", _OP_FUSER, (), OP_FUSER_RELEASES),
    # token_dispatcher.py _HybridEPManager.setup_metadata: a static budget of permuted tokens
    # (`padded_num_tokens * topk * factor`, rounded up to the quantization alignment), run by
    # megatron itself where the op fuser is (the budget needs it with hybridep)
    "--moe-expert-rank-capacity-factor": (
        "training", "megatron-core 0.13-0.17 have no static per-rank budget for HybridEP "
        "(TransformerConfig.moe_expert_rank_capacity_factor came in 0.18, where it is modelled)",
        (), OP_FUSER_RELEASES),  # fmt: skip
}
