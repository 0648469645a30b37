"""The tests' one parameter-count formula, written out from the architecture, independently of
megatron-core and of inspector (which never counts parameters itself)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def parameter_count(a: Mapping[str, Any], tp: int = 1, mtp_indexer: bool = True) -> int:
    """Return the total parameters of a GPT / Llama / MoE model given Megatron-LM arguments.

    Every layer: two norms, QKV (GQA-aware) and output projections (and a learned softmax
    offset per head with softmax_type learnable), and an MLP — dense, or a
    router (E x h, plus E biases when biases are on) and E expert MLPs plus an optional shared
    expert. Around them: the word embeddings padded to a multiple of 128 x tp, learned positions
    unless RoPE, the final norm, and an output layer when untied. `mtp_indexer`: whether a DSA
    model's MTP layer has its own indexer (the published counts', megatron-core 0.19's).
    """
    h, heads = a["hidden_size"], a["num_attention_heads"]
    groups = (a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    kv = a.get("kv_channels") or h // heads
    multiple = a.get("make_vocab_size_divisible_by", 128) * tp
    vocab = math.ceil(a["vocab_size"] / multiple) * multiple
    bias = not a.get("disable_bias_linear", False)
    qkv_bias = bias or a.get("add_qkv_bias", False)
    gated = 2 if a.get("swiglu") or a.get("quick_geglu") else 1
    norm = h if a.get("normalization") == "RMSNorm" else 2 * h
    gate = heads if a.get("attention_output_gate") else 0  # a gate per query channel
    attention = (
        h * (heads + 2 * groups + gate) * kv + qkv_bias * (heads + 2 * groups + gate) * kv
        + heads * kv * h + bias * h
    )  # fmt: skip
    if a.get("multi_latent_attention"):
        attention = _mla_attention(a, h, heads)
    elif a.get("qk_layernorm"):
        attention += 2 * kv * (norm // h)  # q and k norms over one head
    if a.get("softmax_type") == "learnable":
        attention += heads  # one learned softmax offset per head (gpt-oss's attention sinks)

    def mlp(ffn: int) -> int:
        return h * ffn * gated + bias * ffn * gated + ffn * h + bias * h

    swiglu_rule = int((4 * h * 2 / 3) / 64) * 64  # Megatron-LM's default ffn with SwiGLU
    dense_layer = mlp(a.get("ffn_hidden_size") or (swiglu_rule if a.get("swiglu") else 4 * h))
    moe_layer = 0
    if a.get("num_experts"):
        e = a["num_experts"]
        # --moe-ffn-hidden-size defaults to --ffn-hidden-size (Megatron-LM arguments.py)
        moe_ffn = a.get("moe_ffn_hidden_size") or a["ffn_hidden_size"]
        moe_layer = e * h + bias * e + e * mlp(moe_ffn)
        if a.get("moe_latent_size"):
            # LatentMoE (megatron-core moe_layer.py): routed experts work in the latent size,
            # between a down (h -> latent) and an up (latent -> h) projection; router and
            # shared expert stay in h
            latent = a["moe_latent_size"]
            moe_layer += e * (latent - h) * (gated + 1) * moe_ffn + 2 * h * latent
        if a.get("moe_shared_expert_intermediate_size"):
            moe_layer += mlp(a["moe_shared_expert_intermediate_size"])
            moe_layer += h if a.get("moe_shared_expert_gate") else 0  # gate weight [1, h]
    hybrid = a.get("hybrid_override_pattern") or a.get("hybrid_layer_pattern")
    mtp_depths: list[int] = []
    if hybrid:
        kinds = {"M": norm + _mamba2_mixer(a, h), "*": norm + attention,
                 "-": norm + dense_layer, "E": norm + moe_layer,
                 "G": norm + _gated_delta_net(a, h)}  # fmt: skip
        main, *depths = hybrid.split("/")  # Megatron-LM 0.17+: MTP depths after `/`
        per_layer = [kinds[symbol] for symbol in main.replace("|", "")]
        mtp_depths = [sum(kinds[symbol] for symbol in depth) for depth in depths]
        mtp_layer = per_layer[-1]
    else:
        pattern = moe_pattern(a)
        mixers = [_gated_delta_net(a, h) if gdn else attention for gdn in gdn_pattern(a)]
        # DSA's top-k shared across layers: a layer that reuses it holds no indexer
        shared = _dsa_indexer(a, h, a.get("q_lora_rank") or h)
        mixers = [mixer - shared * _reuses_topk(a, i + 1) for i, mixer in enumerate(mixers)]
        per_layer = [2 * norm + mixer + (moe_layer if moe else dense_layer)
                     for mixer, moe in zip(mixers, pattern, strict=True)]  # fmt: skip
        # an MTP layer is numbered from 1 again, so it computes its own top-k (`mtp_indexer`
        # False: Megatron-LM core_v0.18.2's gpt_builders gives it the last decoder spec's MLA
        # without the indexer; 0.19 the DSA layer: world/dsa.py dsa_mtp_layer_spec)
        mtp_layer = per_layer[-1] + shared * _reuses_topk(a, len(per_layer))
        mtp_layer -= 0 if mtp_indexer else shared
    total = vocab * h + sum(per_layer) + norm
    # Multi-token prediction: per depth, enorm, hnorm, eh_proj (2h -> h), a transformer layer like
    # the decoder's last, and a final norm; the embedding and output layer are shared.
    # A hybrid model's MTP depth holds its pattern's layers instead.
    if mtp_depths:
        total += sum(3 * norm + 2 * h * h + depth for depth in mtp_depths)
    else:
        total += (a.get("mtp_num_layers") or 0) * (3 * norm + 2 * h * h + mtp_layer)
    if a.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        total += (a.get("max_position_embeddings") or a["seq_length"]) * h
    if a.get("untie_embeddings_and_output_weights"):
        total += vocab * h
    return total


def moe_pattern(a: Mapping[str, Any]) -> list[bool]:
    """Return, per layer, whether it is MoE: --moe-layer-freq N (i % N == 0) or a 0/1 list."""
    layers = a["num_layers"]
    if not a.get("num_experts"):
        return [False] * layers
    freq = a.get("moe_layer_freq", 1)
    if isinstance(freq, str) and "[" in freq:
        # The tests' own reading of Megatron-LM's list form: "([0]*3+[1]*58)" and the like.
        dense, _, moe = freq.strip("()").partition("+")
        counts = [int(part.split("*")[1]) for part in (dense, moe)]
        values = [int(part.split("]")[0].strip("[")) for part in (dense, moe)]
        return [bool(v) for v, n in zip(values, counts) for _ in range(n)]
    return [i % int(freq) == 0 for i in range(layers)]


def gdn_pattern(a: Mapping[str, Any]) -> list[bool]:
    """Return, per layer, whether it is a gated delta net: --linear-attention-freq N (every N-th
    layer, i + 1 divisible by N, full attention) or a 1/0 list (1: gated delta net)."""
    layers = a["num_layers"]
    if a.get("experimental_attention_variant") != "gated_delta_net":
        return [False] * layers
    freq = a["linear_attention_freq"]
    if isinstance(freq, str) and "[" in freq:
        return [bool(int(x)) for x in freq.strip("()[]").split(",")]
    return [(i + 1) % int(freq) != 0 for i in range(layers)]


def _gated_delta_net(a: Mapping[str, Any], h: int) -> int:
    """Return a gated delta net mixer's parameters (Yang, Kautz & Hatamizadeh 2024, Gated Delta
    Networks; Qwen3-Next's Qwen3NextGatedDeltaNet; TransformerConfig's defaults: 16 query/key
    heads and 32 value heads of 128, convolution width 4).

    Input projections h -> q, k (n_k d_k each), v, z (n_v d_v each), beta and alpha (n_v each); a
    depthwise causal convolution without bias over q, k, v; per value head dt bias and A; an
    RMSNorm over one value head; an output projection n_v d_v -> h. No linear biases.
    """
    d_k, d_v = a.get("linear_key_head_dim") or 128, a.get("linear_value_head_dim") or 128
    n_k, n_v = a.get("linear_num_key_heads") or 16, a.get("linear_num_value_heads") or 32
    width = a.get("linear_conv_kernel_dim") or 4
    qk, v = n_k * d_k, n_v * d_v
    return h * (2 * qk + 2 * v + 2 * n_v) + (2 * qk + v) * width + 2 * n_v + d_v + v * h


def _mla_attention(a: Mapping[str, Any], h: int, heads: int) -> int:
    """Return an MLA block's parameters (DeepSeek-V2 paper, Section 2.1.2; Megatron-LM defaults).

    Queries: down h -> q_lora, norm, up q_lora -> heads (qk + rope) (or one h -> heads (qk + rope)
    without q_lora); keys/values: down h -> kv_lora + rope, norm, up kv_lora -> heads (qk + v);
    output heads v -> h. The two latent norms exist with --qk-layernorm.
    """
    q_lora, kv_lora = a.get("q_lora_rank"), a.get("kv_lora_rank", 32)
    qk, rope, v = a.get("qk_head_dim", 128), a.get("qk_pos_emb_head_dim", 64), a.get("v_head_dim", 128)
    norms = bool(a.get("qk_layernorm"))
    if q_lora:
        query = h * q_lora + norms * q_lora + q_lora * heads * (qk + rope)
    else:
        query = h * heads * (qk + rope)
    key_value = h * (kv_lora + rope) + norms * kv_lora + kv_lora * heads * (qk + v)
    return query + key_value + heads * v * h + _dsa_indexer(a, h, q_lora or h)


def _dsa_indexer(a: Mapping[str, Any], h: int, q_lora: int) -> int:
    """Return DeepSeek-V3.2's lightning indexer (DeepSeek-V3.2-Exp inference/model.py `Indexer`):
    query heads x head from the query latent, one key head from h with a LayerNorm (weight and
    bias), and one weight per head from h; none without --experimental-attention-variant dsa."""
    if a.get("experimental_attention_variant") != "dsa":
        return 0
    n, d = a["dsa_indexer_n_heads"], a["dsa_indexer_head_dim"]
    return q_lora * n * d + h * d + 2 * d + h * n


def _reuses_topk(a: Mapping[str, Any], number: int) -> bool:
    """Return whether layer `number` (from 1) reuses an earlier layer's top-k (GLM-5.2's
    IndexShare, Zhipu AI's config keys index_topk_freq and index_skip_topk_offset): past the
    offset (at least 1), a layer computes its own only every freq-th layer."""
    freq = a.get("dsa_indexer_topk_freq") or 1
    offset = max(a.get("dsa_indexer_skip_topk_offset") or 0, 1)
    return max(number - offset, 0) % freq != 0


def _mamba2_mixer(a: Mapping[str, Any], h: int) -> int:
    """Return a Mamba-2 mixer's parameters (Dao & Gu 2024, Transformers are SSMs, Section 7 and
    Figure 6; Megatron-LM's argument defaults: state 128, head 64, 8 groups, heads 2h / head).

    One input projection h -> (z, x, B, C, dt): 2 d_inner + 2 groups x state + heads; a depthwise
    causal convolution of width 4 with bias over (x, B, C); per head dt bias, A and D; a gated
    RMSNorm over d_inner; an output projection d_inner -> h. No linear biases.
    """
    head_dim, state = a.get("mamba_head_dim") or 64, a.get("mamba_state_dim") or 128
    groups = a.get("mamba_num_groups") or 8
    heads = a.get("mamba_num_heads") or 2 * h // head_dim
    inner = heads * head_dim
    conv_channels = inner + 2 * groups * state
    return (h * (2 * inner + 2 * groups * state + heads) + conv_channels * (4 + 1)
            + 3 * heads + inner + inner * h)  # fmt: skip
