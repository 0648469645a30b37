"""The tests' one parameter-count formula, written out from the architecture, independently of
megatron-core and of inspector (which never counts parameters itself)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def parameter_count(a: Mapping[str, Any], tp: int = 1) -> int:
    """Return the total parameters of a GPT / Llama / MoE model given Megatron-LM arguments.

    Every layer: two norms, QKV (GQA-aware) and output projections, and an MLP — dense, or a
    router (E x h, plus E biases when biases are on) and E expert MLPs plus an optional shared
    expert. Around them: the word embeddings padded to a multiple of 128 x tp, learned positions
    unless RoPE, the final norm, and an output layer when untied.
    """
    h, layers, heads = a["hidden_size"], a["num_layers"], a["num_attention_heads"]
    groups = (a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    kv = a.get("kv_channels") or h // heads
    multiple = a.get("make_vocab_size_divisible_by", 128) * tp
    vocab = math.ceil(a["vocab_size"] / multiple) * multiple
    bias = not a.get("disable_bias_linear", False)
    qkv_bias = bias or a.get("add_qkv_bias", False)
    gated = 2 if a.get("swiglu") else 1
    norm = h if a.get("normalization") == "RMSNorm" else 2 * h
    attention = (
        h * (heads + 2 * groups) * kv + qkv_bias * (heads + 2 * groups) * kv + heads * kv * h + bias * h
    )

    def mlp(ffn: int) -> int:
        return h * ffn * gated + bias * ffn * gated + ffn * h + bias * h

    if a.get("num_experts"):
        e = a["num_experts"]
        ffn_layer = e * h + bias * e + e * mlp(a["moe_ffn_hidden_size"])
        if a.get("moe_shared_expert_intermediate_size"):
            ffn_layer += mlp(a["moe_shared_expert_intermediate_size"])
            ffn_layer += h if a.get("moe_shared_expert_gate") else 0  # gate weight [1, h]
    else:
        swiglu_rule = int((4 * h * 2 / 3) / 64) * 64  # Megatron-LM's default ffn with SwiGLU
        ffn_layer = mlp(a.get("ffn_hidden_size") or (swiglu_rule if a.get("swiglu") else 4 * h))
    total = vocab * h + layers * (2 * norm + attention + ffn_layer) + norm
    if a.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        total += (a.get("max_position_embeddings") or a["seq_length"]) * h
    if a.get("untie_embeddings_and_output_weights"):
        total += vocab * h
    return total
