"""megatron-core's MoE paged stash and the arguments it needs: why each is refused.

megatron-core 0.18+ (transformer/moe/paged_stash.py, `--moe-paged-stash`) keeps the routed experts'
activations for backward in pages of buffers it sizes after a first, profiling iteration. Its
saved-tensor hook pages only the tensors Transformer Engine's fused grouped MLP marks for it
(`mark_grouped_tensor`), and megatron opens that hook in one place: TEGroupedMLP._fused_forward
(transformer/moe/experts.py), run only with `--use-transformer-engine-op-fuser`. TransformerConfig
requires the stash to come with `--moe-expert-rank-capacity-factor` (HybridEP's static receive
budget, "there is no need to use paged stashing without it"), and that factor with the hybridep
backend requires the op fuser (transformer_config.py __post_init__, core_v0.18.0 and 0.19.2).
That grouped MLP needs TE 2.14+'s fused operations (`_is_fused_impl_supported`: `is_te_min_version
("2.14.0")`, `transformer_engine.pytorch.ops.GroupedLinear`, ScaledSwiGLU); this tool's Transformer
Engine is 2.11's modules without them (world/te/state.py FusibleOperation), so megatron's own
build would stop ("Fused GroupedMLP is not supported"), and the stash is refused by name with that
reason. With no marked tensor megatron's stash would allocate no page at all. The sizes it would
allocate for one recipe are in bench/RESULTS.md (section `stash`).
"""

from __future__ import annotations

_OP_FUSER = (
    "the experts' fused grouped MLP it runs (TEGroupedMLP._fused_forward) needs Transformer "
    "Engine 2.14+'s fused operations (experts.py _is_fused_impl_supported), which this tool does "
    "not simulate (its Transformer Engine is 2.11's modules)"
)
_PAGED_STASH = (
    "megatron-core 0.18+'s MoE paged stash (transformer/moe/paged_stash.py) pages only the expert "
    "activations that Transformer Engine's fused grouped MLP marks for it, which runs only with "
    "--use-transformer-engine-op-fuser (required with HybridEP by --moe-expert-rank-capacity-factor, "
    "which the stash requires), and that fused grouped MLP needs Transformer Engine 2.14+'s fused "
    "operations, which this tool does not simulate; megatron-core 0.13-0.17 have no paged stash"
)
_STASH_SIZE = "sizes megatron-core's MoE paged stash (--moe-paged-stash), which is not modelled"

# TransformerConfig fields of core_v0.18.0 (Megatron-LM's arguments.py makes each an argument
# through ArgumentGroupFactory(TransformerConfig)): flag -> (group, reason, harmless values: the
# defaults), rows of unmodelled.REFUSED
PAGED_STASH_REFUSED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "--moe-paged-stash": ("training", _PAGED_STASH, ()),
    "--moe-paged-stash-page-size": ("training", _STASH_SIZE, ("64",)),
    "--moe-paged-stash-buffer-size-factor-cuda": ("training", _STASH_SIZE, ("1.1", "1.10")),
    "--moe-paged-stash-buffer-size-factor-cpu": ("training", _STASH_SIZE, ("0", "0.0")),
    "--use-transformer-engine-op-fuser": ("training", _OP_FUSER, ()),
    # token_dispatcher.py _HybridEPManager.setup_metadata: a static budget of permuted tokens
    # (`padded_num_tokens * topk * factor`, rounded up to the quantization alignment) and
    # PagedStashRunner's rerun when a rank goes over it
    "--moe-expert-rank-capacity-factor": (
        "training", "HybridEP's static per-rank budget of received tokens (and the rerun when a "
        "rank goes over it) is not modelled", ()),  # fmt: skip
}
