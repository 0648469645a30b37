"""Model FLOPs per iteration, per layer and per stage, and the time they imply.

Source: Megatron-LM's throughput formula, `num_floating_point_operations` (its inner
`transformer_flops`) in `megatron/training/training.py`, tag core_v0.16.1, reimplemented layer by
layer so that a caller can sum any stage's actual layer list. For the whole model it equals
Megatron-LM's number; per layer it is the same sum split at the layer boundaries.

What the formula counts (symbols of inspector/job/dims.py, B sequences of s tokens, T = B s):
  - only matrix multiplications, 2 FLOPs per multiply-add, each GEMM 3 times (forward, backward
    data gradient, backward weight gradient): the factor 3 * 2 = 6;
  - attention projections 6T (h d (a + 2g) + a d h): Q, K, V (GQA-aware) and the output;
  - core attention 6 B s^2 a d: Q K^T and scores x V, halved for the causal mask (a sliding
    window's fewer scores too are counted in full, as Megatron-LM counts them);
  - MLP 6T h f (1 + gates) with gates = 2 for a gated MLP, else 1 (Megatron-LM reads
    `args.swiglu` only, core_v0.16.1-0.19.0: with --quick-geglu, gpt-oss's gated MLP, its number
    counts one h -> f GEMM fewer than megatron runs; this counts what megatron runs); an MoE uses
    k * expert f + shared-expert f in place of f (top-k routing, no capacity padding);
  - logits 6T h v; the embedding lookup, norms, softmax, activations and the loss are free.
It is model FLOPs (MFU's numerator): activation recomputation adds hardware work it ignores.
  - multi-latent attention and multi-token prediction: `mla_attention_flops`, `mtp_flops`;
  - gated delta net layers (in place of attention): `gdn_token_flops`;
  - packed sequences (--sft): core attention per document, the documents' sum of squares in
    place of s^2 per sequence, as Megatron-LM's function counts them after core_v0.16.
Not modelled: latent MoE, which Megatron-LM's function also covers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from inspector.errors import ConfigError
from inspector.job.dims import ModelDims
from inspector.job.gdn import GdnShape
from inspector.job.layout import Layout

GEMM_FACTOR = 3 * 2  # forward + two backward GEMMs, times 2 FLOPs per multiply-add


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one transformer layer over a batch, forward and backward."""

    attention: int  # QKV and output projections
    core_attention: int  # Q K^T and scores x V, causal
    mlp: int  # dense MLP, or routed (top-k) plus shared experts

    @property
    def total(self) -> int:
        """Return the layer's FLOPs."""
        return self.attention + self.core_attention + self.mlp


def layer_flops(dims: ModelDims, layer: int, num_sequences: int) -> LayerFlops:
    """Return the FLOPs of 0-based global `layer` over `num_sequences` sequences of s tokens."""
    h, a, g, d = dims.hidden_size, dims.num_attention_heads, dims.query_groups, dims.head_dim
    s = dims.seq_length
    tokens = num_sequences * s
    # "qkv proj" + "out proj" terms of `standard_self_attn_term` (with `gate_projection_size`,
    # a d, for --attention-output-gate)
    gate = a if dims.attention_output_gate else 0
    attention = GEMM_FACTOR * tokens * (h * d * (a + 2 * g + gate) + a * d * h)
    # "core attention": query_projection_size * s / 2 (causal) * 2 (QK^T and (QK^T)V) per token.
    # Packed sequences (--sft): s^2 per sequence becomes the documents' sum of squares.
    core = GEMM_FACTOR * num_sequences * (a * d) * dims.attention_squares()
    if dims.multi_latent_attention:
        attention, core = mla_attention_flops(dims, tokens)
    if dims.is_gdn_layer(layer):
        attention, core = GEMM_FACTOR * tokens * gdn_token_flops(h, dims.gdn_shape()), 0
    # `ffn_expansion_factor`: 3 with SwiGLU (two h->f GEMMs and one f->h), else 2.
    expansion = dims.gated_multiplier + 1
    if dims.is_moe_layer(layer):
        # LatentMoE (--moe-latent-size L): the routed experts run on L instead of h, and the
        # projections down and up add 2 L h (training.py's "Routed experts run on
        # moe_latent_size" and "Up proj and down proj", core_v0.16.1)
        latent = dims.moe_latent_size or h
        routed = latent * dims.expert_ffn * dims.moe_router_topk * expansion
        projections = 2 * h * dims.moe_latent_size if dims.moe_latent_size else 0
        mlp = GEMM_FACTOR * tokens * (routed + projections + h * dims.shared_expert_ffn * expansion)
    else:
        mlp = GEMM_FACTOR * tokens * h * dims.ffn * expansion
    return LayerFlops(attention, core, mlp)


def gdn_token_flops(h: int, shape: GdnShape) -> int:
    """Return a gated delta net layer's forward multiply-adds per token.

    Megatron-LM `num_floating_point_operations`, `linear_self_attn_term` (training.py 493-520
    at core_v0.16.1; `gdn_layer_flops` of its hybrid branch at core_v0.19.0, the same sum): in
    proj h (2 qk + 2 v + 2 n_v), conv1d w (2 qk + v), the gated delta rule n_v d_v^2 x 4
    ("KK^T, VK^T, S(a(I-bKK^T)), and SQ") and out proj h v, with qk = n_k d_k, v = n_v d_v.
    """
    d_v, n_v = shape.value_dim, shape.value_heads
    return h * shape.in_width + shape.conv_kernel * shape.conv_width + n_v * d_v**2 * 4 + h * n_v * d_v


def mla_attention_flops(dims: ModelDims, tokens: int) -> tuple[int, int]:
    """Return multi-latent attention's (projections, core attention) FLOPs over `tokens`.

    Megatron-LM `num_floating_point_operations`, `if args.multi_latent_attention:` branch
    (training.py lines 383-433 at core_v0.16.1). With n heads, q_lora q, kv_lora k, qk head c,
    RoPE head r, value head v, per token times 6:
      q_term  q (h + n (c + r) + 1), or h n (c + r) without a query latent ("q lora + rope + q norm")
      + k (h + n (c + v) + 1) + h r                         ("kv lora + rope + kv norm")
      + n v h                                               ("o proj")
      + s n (c + r) / 2 + s n v / 2                         ("core attn", causal)
    The "+ 1" terms are the latent norms, counted as Megatron-LM counts them.
    """
    h, n, s = dims.hidden_size, dims.num_attention_heads, dims.seq_length
    c, r, v = dims.qk_head_dim, dims.qk_pos_emb_head_dim, dims.v_head_dim
    q, k = dims.q_lora_rank, dims.kv_lora_rank
    q_term = h * n * (c + r) if q is None else q * (h + n * (c + r) + 1)
    projections = q_term + k * (h + n * (c + v) + 1) + h * r + n * v * h
    # 6 * s * n * (c + r + v) / 2, kept exact in integers (packed: s^2 per sequence is the
    # documents' sum of squares; tokens is a whole number of sequences)
    core = 3 * tokens * dims.attention_squares() // s * n * (c + r + v)
    return GEMM_FACTOR * tokens * projections, core


def mla_up_flops(dims: ModelDims, tokens: int) -> int:
    """Return multi-latent attention's up projections' FLOPs over `tokens`, forward and backward.

    The q_lora (h without a query latent) x n (c + r) and kv_lora x n (c + v) terms of
    `mla_attention_flops`: what `--recompute-modules mla_up_proj` runs again (a third of it).
    """
    n, c = dims.num_attention_heads, dims.qk_head_dim
    q = dims.q_lora_rank or dims.hidden_size
    width = q * (c + dims.qk_pos_emb_head_dim) + dims.kv_lora_rank * (c + dims.v_head_dim)
    return GEMM_FACTOR * tokens * n * width


def mtp_flops(dims: ModelDims, num_sequences: int) -> int:
    """Return the FLOPs of the multi-token-prediction layers over `num_sequences` sequences.

    Megatron-LM `num_floating_point_operations` (training.py lines 354-360, 557-573 at
    core_v0.16.1): each MTP layer counts as one more transformer layer of the decoder's last
    layer's kind (MoE when that layer is), plus 6T (3h + 2h^2) for its norms and eh_proj, plus
    one more logits term 6Thv.
    """
    depth = dims.mtp_num_layers
    if not depth:
        return 0
    tokens = num_sequences * dims.seq_length
    h = dims.hidden_size
    layer = layer_flops(dims, dims.num_layers - 1, num_sequences).total
    own = GEMM_FACTOR * tokens * (3 * h + 2 * h * h)
    return depth * (layer + own + logit_flops(dims, num_sequences))


def logit_flops(dims: ModelDims, num_sequences: int) -> int:
    """Return the output layer's FLOPs (Megatron-LM's "Logit" term, 6 T h v)."""
    return GEMM_FACTOR * num_sequences * dims.seq_length * dims.hidden_size * dims.vocab_size


def stage_flops(
    dims: ModelDims,
    layers: Iterable[int],
    num_sequences: int,
    has_output_layer: bool,
    has_mtp: bool = False,
) -> int:
    """Return the FLOPs of a stage holding `layers` (0-based global) and maybe the output layer.

    The embedding costs no FLOPs in Megatron-LM's formula, so the first stage adds nothing;
    the stage holding the multi-token-prediction layers adds `mtp_flops`.
    """
    total = sum(layer_flops(dims, i, num_sequences).total for i in layers)
    total += mtp_flops(dims, num_sequences) if has_mtp else 0
    return total + (logit_flops(dims, num_sequences) if has_output_layer else 0)


def iteration_flops(dims: ModelDims, global_batch_size: int) -> int:
    """Return the FLOPs of one iteration: Megatron-LM's `num_floating_point_operations`."""
    return stage_flops(
        dims, range(dims.num_layers), global_batch_size, has_output_layer=True, has_mtp=True
    )


def rank_flops(stage_total: float, par: Layout) -> float:
    """Return one rank's share of a stage's FLOPs: split over dp * cp * tp ranks.

    Expert parallelism is carved out of those ranks and, with balanced routing, spreads the
    experts' work evenly over them too.
    """
    return stage_total / (par.dp * par.cp * par.tp)


def check_peak(gpu_tflops: float) -> None:
    """Raise ConfigError unless --gpu-tflops is a usable peak."""
    if not (math.isfinite(gpu_tflops) and gpu_tflops > 0):
        raise ConfigError(
            f"--gpu-tflops must be a finite number of TFLOP/s greater than 0, got {gpu_tflops}"
        )


def check_mfu(mfu: float) -> None:
    """Raise ConfigError unless --mfu is a fraction of the peak."""
    if not 0 < mfu <= 1:  # also false for nan
        raise ConfigError(f"--mfu must lie in (0, 1], got {mfu}")


def seconds_for(flops: float, num_gpus: int, gpu_tflops: float, mfu: float) -> float:
    """Return the time `num_gpus` GPUs of `gpu_tflops` peak take for `flops` at `mfu`.

    MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM, Appendix B) is achieved model
    FLOPs per second over peak, so time = flops / (num_gpus * peak * mfu); pipeline bubbles and
    communication are inside the MFU.
    """
    check_peak(gpu_tflops)
    check_mfu(mfu)
    if num_gpus < 1:
        raise ConfigError(f"the number of GPUs must be at least 1, got {num_gpus}")
    return flops / (num_gpus * gpu_tflops * 1e12 * mfu)
