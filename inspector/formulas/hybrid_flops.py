"""Model FLOPs of a hybrid (Mamba) model, per layer kind, as Megatron-LM counts them.

Source: `num_floating_point_operations` in `megatron/training/training.py`, tag core_v0.16.1,
its hybrid branch (taken with `--is-hybrid-model`): `attn_layer_flops`, `mlp_layer_flops`,
`moe_layer_flops`, `mamba_layer_flops` (from core_v0.17.0 `gdn_layer_flops` too) and the
logits, forward FLOPs times 3 (`hybrid_flops`).
Written per layer so that a stage sums its own layers; for the whole model it is Megatron-LM's
number. A Mamba layer counts its in and out projections (with d_in = 2 h, as there, whatever
--mamba-num-heads says) and 7 B s d_in N for the scan.
"""

from __future__ import annotations

from collections.abc import Iterable

from inspector.formulas.flops import gdn_token_flops
from inspector.job.dims import ModelDims
from inspector.job.gdn import gdn_shape
from inspector.job.model import ModelConfig

PASSES = 3  # `flops_fwd * 3`: forward, and a backward of twice its work


def hybrid_layer_flops(model: ModelConfig, dims: ModelDims, symbol: str, sequences: int) -> float:
    """Return one layer's FLOPs (forward and backward) over `sequences` sequences."""
    h, s = dims.hidden_size, dims.seq_length
    tokens = sequences * s
    scale = 3.0 / 2.0 if dims.gated_multiplier == 2 else 1.0  # swiglu
    if symbol == "*":
        heads = dims.num_attention_heads
        p = dims.head_dim * heads / h
        forward = 4 * tokens * h * p * (h + h * (dims.query_groups / heads) + s / 2)
    elif symbol == "-":
        forward = 4 * (dims.ffn / h) * scale * tokens * h**2
    elif symbol == "D":
        # core_v0.19.0 training.py counts each layer kind but DSA's (`itemgetter(Symbols.MAMBA,
        # Symbols.GDN, Symbols.ATTENTION, Symbols.MLP, Symbols.MOE)`): D layers add nothing
        forward = 0.0
    elif symbol == "G":  # `gdn_layer_flops` (core_v0.17.0-0.19.0), 2 FLOPs a multiply-add
        forward = 2 * tokens * gdn_token_flops(h, gdn_shape(model))
    elif symbol == "E":
        # `moe_layer_flops`: LatentMoE's routed experts run on moe_latent_size, plus its
        # projections down and up (4 x tokens x h x latent)
        latent = dims.moe_latent_size
        routed = 4 * tokens * (latent or h) * dims.expert_ffn * dims.moe_router_topk * scale
        routed += 4 * tokens * h * latent if latent else 0
        forward = routed + 4 * tokens * h * dims.shared_expert_ffn * scale
    else:  # "M"
        d_in = 2 * h
        state, head_dim = model.mamba_state_dim or 128, model.mamba_head_dim or 64
        groups = model.mamba_num_groups or 8
        heads = model.mamba_num_heads or d_in // head_dim
        forward = (2 * tokens * h * (2 * d_in + 2 * groups * state + heads)
                   + 7 * tokens * d_in * state + 2 * tokens * d_in * h)  # fmt: skip
    return PASSES * forward


def hybrid_stage_flops(model: ModelConfig, dims: ModelDims, symbols: Iterable[str],
                       sequences: int, logits: int) -> float:  # fmt: skip
    """Return a stage's FLOPs: its layers (megatron's layer symbols, its MTP depths' among them:
    `get_hybrid_layer_counts` counts them once a depth) and `logits` output-layer passes (1 on
    the last stage, one more a depth: `vocab_size * (1 + mtp_num_layers)`, core_v0.19.0)."""
    total = sum(hybrid_layer_flops(model, dims, symbol, sequences) for symbol in symbols)
    return total + logits * PASSES * 2 * sequences * dims.seq_length * dims.hidden_size * dims.vocab_size
