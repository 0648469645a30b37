"""Gated delta net (GDN) in GPTModel: the decoder block spec Megatron-LM's gpt_builders gives it.

Megatron-LM core_v0.16.1 (and 0.19.0) gpt_builders.py: with --experimental-attention-variant,
`get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage)`, megatron's
block of GDN layers where `linear_attention_freq` says 1 and Transformer Engine attention
layers where it says 0, dense or MoE MLPs by `moe_layer_freq`, sliced to this stage. GDN's CUDA
packages (flash-linear-attention, causal-conv1d) are stand-ins (world/ssm).
"""

from __future__ import annotations

import contextlib
from typing import Any

from inspector.job.model import ModelConfig
from inspector.world.hybrid import rng_forks_nothing


def gdn_block_spec(config: Any, vp_stage: int | None) -> Any:
    """Return megatron's decoder block spec of a GDN model for this stage (or chunk)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    return specs.get_transformer_block_with_experimental_attention_variant_spec(
        config=config, vp_stage=vp_stage
    )


def is_gdn_layer(layer: Any) -> bool:
    """Return whether a built decoder layer's mixer is megatron's GatedDeltaNet."""
    return type(getattr(layer, "self_attention", None)).__name__ == "GatedDeltaNet"


def gdn_building(model: ModelConfig) -> contextlib.AbstractContextManager[None]:
    """Let GatedDeltaNet's `reset_parameters` fork megatron's model-parallel RNG stream, which
    Megatron-LM adds before building, while a GDN model builds on meta (world/hybrid.py)."""
    return rng_forks_nothing() if model.gdn else contextlib.nullcontext()
