"""DeepSeek sparse attention (DSA): the layer specs Megatron-LM's gpt_builders gives megatron-core.

megatron-core has DSA's modules from 0.16 (transformer/experimental_attention_variant/dsa.py:
`DSAIndexer`, the lightning indexer, and `DSAttention`, its top-k sparse core attention inside
MLA), but only 0.18 and later build them from a config: `get_experimental_attention_variant_module_spec`
of 0.16-0.17 knows only gated_delta_net (job/dsa.py refuses those versions by name). The indexer's
one CUDA package, fast_hadamard_transform, is a stand-in (world/hadamard.py).
"""

from __future__ import annotations

import sys
from typing import Any

from inspector.job.model import ModelConfig
from inspector.job.versions import megatron_version


def dsa_block_spec(config: Any, vp_stage: int | None) -> Any:
    """Return megatron's decoder block spec for a DSA model, as Megatron-LM's gpt_builders picks
    it for --experimental-attention-variant (core_v0.18.2 and core_v0.19.0 gpt_builders.py:
    `get_transformer_block_with_experimental_attention_variant_spec`, this stage's layers)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    return specs.get_transformer_block_with_experimental_attention_variant_spec(
        config=config, vp_stage=vp_stage
    )


def dsa_mtp_layer_spec(config: Any, model: ModelConfig) -> Any:
    """Return the layer spec Megatron-LM gives a DSA model's MTP layers, None where it gives the
    dense one: core_v0.19.0 gpt_builders.py takes the last of
    `get_transformer_layer_with_experimental_attention_variant_spec` (a DSA layer);
    core_v0.18.2 the last of `get_gpt_decoder_layer_specs` (MLA without the indexer)."""
    if not model.dsa or megatron_version() < (0, 19):
        return None
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    return specs.get_transformer_layer_with_experimental_attention_variant_spec(config=config)[-1]


def fresh_dsa_state() -> None:
    """Clear what megatron's DSA keeps on its classes, as a fresh Megatron-LM process has it:
    the indexer-loss tracker (`DSAIndexerLossLoggingHelper.tracker`, a tensor of num_layers made
    at the first save) and the loss scale (`DSAIndexerLossAutoScaler.main_loss_backward_scale`,
    made at the first backward). One process runs many jobs here: a second one would index the
    first's tracker and skip the scale's allocation."""
    dsa = sys.modules.get("megatron.core.transformer.experimental_attention_variant.dsa")
    if dsa is not None:
        dsa.DSAIndexerLossLoggingHelper.tracker.clear()
        dsa.DSAIndexerLossAutoScaler.main_loss_backward_scale = None
