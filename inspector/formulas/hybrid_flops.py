"""Model FLOPs of a hybrid (Mamba) model, per layer kind, as Megatron-LM counts them.

Source: `num_floating_point_operations` in `megatron/training/training.py`, tag core_v0.16.1,
its hybrid branch (taken with `--is-hybrid-model`): `attn_layer_flops`, `mlp_layer_flops`,
`moe_layer_flops`, `mamba_layer_flops` and the logits, forward FLOPs times 3 (`hybrid_flops`).
Written per layer so that a stage sums its own layers; for the whole model it is Megatron-LM's
number. A Mamba layer counts its in and out projections (with d_in = 2 h, as there, whatever
--mamba-num-heads says) and 7 B s d_in N for the scan.
"""

from __future__ import annotations

from collections.abc import Iterable

from inspector.job.dims import ModelDims
from inspector.job.model import ModelConfig

PASSES = 3  # `flops_fwd * 3`: forward, and a backward of twice its work


def hybrid_layer_flops(model: ModelConfig, dims: ModelDims, symbol: str, sequences: int) -> float:
    """Return one layer's FLOPs (forward and backward) over `sequences` sequences."""
    head_dim = model.mamba_head_dim or 64
    mamba = (model.mamba_num_groups or 8, model.mamba_state_dim or 128,
             model.mamba_num_heads or 2 * dims.hidden_size // head_dim)  # fmt: skip
    return PASSES * forward_flops(dims, symbol, sequences * dims.seq_length, mamba)


def forward_flops(dims: ModelDims, symbol: str, tokens: int, mamba: tuple[int, int, int]) -> float:
    """Return one layer's forward FLOPs over `tokens` tokens; `mamba`: the Mamba layers' groups,
    state size and heads."""
    h, s = dims.hidden_size, dims.seq_length
    scale = 3.0 / 2.0 if dims.gated_multiplier == 2 else 1.0  # swiglu
    if symbol == "*":
        heads = dims.num_attention_heads
        p = dims.head_dim * heads / h
        return 4 * tokens * h * p * (h + h * (dims.query_groups / heads) + s / 2)
    if symbol == "-":
        return 4 * (dims.ffn / h) * scale * tokens * h**2
    if symbol == "E":
        routed = 4 * tokens * h * dims.expert_ffn * dims.moe_router_topk * scale
        return routed + 4 * tokens * h * dims.shared_expert_ffn * scale
    d_in = 2 * h  # "M"
    groups, state, heads = mamba
    return (2 * tokens * h * (2 * d_in + 2 * groups * state + heads)
            + 7 * tokens * d_in * state + 2 * tokens * d_in * h)  # fmt: skip


def hybrid_stage_flops(model: ModelConfig, dims: ModelDims, symbols: Iterable[str],
                       sequences: int, has_output_layer: bool) -> float:  # fmt: skip
    """Return a stage's FLOPs: its layers (megatron's layer symbols) and maybe the logits."""
    total = sum(hybrid_layer_flops(model, dims, symbol, sequences) for symbol in symbols)
    if has_output_layer:
        total += PASSES * 2 * sequences * dims.seq_length * dims.hidden_size * dims.vocab_size
    return total
