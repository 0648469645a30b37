"""A DeepSeek sparse attention (DSA) layer's core attention kernels: the lightning indexer, its
top-k and the sparse attention, as megatron-core's PyTorch path runs them (--dsa-kernel-backend
none; transformer/experimental_attention_variant/dsa.py, lines at 0.19.2 unless said).

- The indexer (`DSAIndexer.forward_before_topk`, dsa.py:1248-1322) on every tensor-parallel
  rank, over the whole sequence (its inputs all-gathered under sequence parallelism):
  linear_wq_b q_lora -> heads x head dim, linear_wk h -> head dim, linear_weights_proj h ->
  heads. Its scores (`_compute_index_scores`, dsa.py:517-560): an einsum of q.float() and
  k.float(), an fp32 GEMM of s x s x head dim per indexer head, then ReLU (with
  --dsa-indexer-scoring-relu, megatron's default), the weights' multiply and the sum over heads,
  passes over those fp32 scores; the causal mask's add and `topk` over the [b, s, s] sum
  (`fused_qk_topk_naive`, dsa.py:563-609), priced as passes reading it.
- The sparse attention on the rank's heads computes every score in fp32 and masks all but the
  top-k keys: 0.19's `_unfused_absorbed_dsa_fn` (dsa.py:59-112; the query kv_lora + r wide
  against one latent key head, the output kv_lora wide, then the up_v einsum to v a head),
  0.18's `unfused_dsa_fn` (dsa.py:920-970 at 0.18.2; MLA's per-head query and key c + r wide,
  value v). Scores: an fp32 GEMM; the mask: `torch.full` of [b, s, s], the top-k scatter, its
  add to every head's scores; softmax: 0.19's `dsa_masking.masked_softmax` (three masked_fills
  with a new bool mask each, max, subtract, exp, sum, divide: read and write fp32), 0.18's
  torch softmax; P V in bf16. Its backward: the P V GEMMs' two, the softmax chain's gradients
  as passes of the same bytes, the fp32 scores GEMM's two.
- The indexer's loss (0.18 always, 0.19 with --dsa-indexer-loss-coeff: job/dsa.py
  `indexer_loss`): `compute_dsa_indexer_loss` (dsa.py:384-515) recomputes every head's fp32
  attention scores and softmax for its KL target, and its backward (`bwd_fused_indexer_loss_
  naive`, dsa.py:664-893) both the target and the index scores, then the indexer's GEMM
  gradients (q and k through the fp32 scores einsum; the three linears' weight gradients: x and
  qr are detached, dsa.py:1886-1888, so no data gradient leaves the indexer). Without the
  loss nothing of the indexer runs backward.
Megatron-LM's FLOPs formula leaves the indexer and the scores out (formulas/hybrid_flops.py);
these kernels are the time, not the counted FLOPs.
"""

from __future__ import annotations

from inspector.formulas.kernels import Gemm, Memory, Op
from inspector.job.dims import ModelDims
from inspector.job.dsa import absorbed, indexer_loss

FP32, BF16, MASK = 4, 2, 1
# bytes read and written per score by the masking and softmax, forward (0.19: scale 8, index
# mask add 12, three `~mask` 2 and masked_fill 9 each, max 4, subtract 8, exp 8, sum 4, divide
# 12, the bf16 cast 6; 0.18: scale 8, mask add 12, softmax 8, cast 6); backward about the same
SOFTMAX_BYTES = {True: 8 + 12 + 3 * (2 + 9) + 4 + 8 + 8 + 4 + 12 + 6, False: 8 + 12 + 8 + 6}


def dsa_core_ops(dims: ModelDims, tp: int, micro_batch: int) -> tuple[list[Op], list[Op]]:
    """Return a DSA core attention's forward and backward kernels on one rank (module
    docstring), the backward in running order."""
    s, b, h = dims.seq_length, micro_batch, dims.hidden_size
    n, d = dims.dsa_indexer_n_heads or 0, dims.dsa_indexer_head_dim or 0
    heads = max(1, dims.num_attention_heads // tp) * b
    tokens = s * b
    fused = absorbed()
    r = dims.qk_pos_emb_head_dim
    qk, pv = (dims.kv_lora_rank + r, dims.kv_lora_rank) if fused else (dims.qk_head_dim + r, dims.v_head_dim)
    q_in = dims.q_lora_rank or h
    projections = [Gemm("indexer wq_b", tokens, n * d, q_in, "fwd"), Gemm("indexer wk", tokens, d, h, "fwd"),
                   Gemm("indexer weights", tokens, n, h, "fwd")]  # fmt: skip
    index = Gemm("indexer scores (fp32)", s * n, s, d, "fwd", b, fp32=True)
    index_passes = Memory("indexer relu, weights, head sum", "copy", b * n * s * s, 3 * FP32 + 2 * FP32)
    topk = Memory("indexer mask and top-k", "copy", b * s * s, 3 * FP32 + FP32)
    scores = Gemm("DSA Q K^T (fp32)", s, s, qk, "fwd", heads, fp32=True)
    mask = Memory("DSA index mask", "copy", b * s * s, 2 * FP32 + 8)
    softmax = Memory("DSA masked softmax", "copy", heads * s * s, SOFTMAX_BYTES[fused])
    values = Gemm("DSA P V", s, pv, s, "fwd", heads)
    forward: list[Op] = [*projections, index, index_passes, topk, scores, mask, softmax, values]
    backward: list[Op] = [Gemm("DSA dP", s, s, pv, "dgrad", heads), Gemm("DSA dV", s, pv, s, "wgrad", heads),
                          Memory("DSA masked softmax backward", "copy", heads * s * s, SOFTMAX_BYTES[fused]),
                          Gemm("DSA dQ (fp32)", s, qk, s, "dgrad", heads, fp32=True),
                          Gemm("DSA dK (fp32)", s, qk, s, "wgrad", heads, fp32=True)]  # fmt: skip
    if fused:  # output.einsum("sbhc,hdc->sbhd", up_v_weight): per head kv_lora -> v
        up_v = Gemm("DSA up_v", tokens, dims.v_head_dim, pv, "fwd", heads // b)
        forward.append(up_v)
        backward[:0] = [Gemm("DSA up_v dgrad", tokens, pv, dims.v_head_dim, "dgrad", heads // b),
                        Gemm("DSA up_v wgrad", pv, dims.v_head_dim, tokens, "wgrad", heads // b)]  # fmt: skip
    if indexer_loss(dims):
        forward += _loss_target(dims, heads, s, qk)
        backward += [*_loss_target(dims, heads, s, qk), index, index_passes,
                     Memory("indexer loss gradient", "copy", b * n * s * s, 4 * FP32 + MASK),
                     Gemm("indexer dq (fp32)", s * n, d, s, "dgrad", b, fp32=True),
                     Gemm("indexer dk (fp32)", s, d, s * n, "wgrad", b, fp32=True),
                     *(Gemm(g.name + " wgrad", g.k, g.n, tokens, "wgrad") for g in projections)]  # fmt: skip
    return forward, backward


def _loss_target(dims: ModelDims, heads: int, s: int, qk: int) -> list[Op]:
    """Return the indexer loss's target: every head's fp32 scores and softmax, summed over heads
    (`compute_dsa_indexer_loss`, dsa.py:470-505)."""
    return [Gemm("indexer loss Q K^T (fp32)", s, s, qk, "fwd", heads, fp32=True),
            Memory("indexer loss softmax and KL", "copy", heads * s * s, 5 * FP32)]  # fmt: skip
