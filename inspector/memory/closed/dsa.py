"""A DeepSeek sparse attention (DSA) layer's core attention bytes: what megatron's PyTorch path
keeps for backward, and the most its backward holds at once (our extension, Korthikanti et al.'s
method: every tensor autograd saves, counted once).

megatron-core runs DSA's own PyTorch path (--dsa-kernel-backend none, its default; the fused
TileLang and cuDNN kernels are refused by name): the "sparse" attention computes every score of
the sequence in fp32 and masks all but the indexer's top-k keys, so its bytes grow with s^2 per
head, like unfused attention's (transformer/experimental_attention_variant/dsa.py):

- megatron-core 0.19 (AbsorbedMLASelfAttention, `_unfused_absorbed_dsa_fn`, dsa.py:59-112 at
  0.19.2): the scores `matmul(q.float(), k.float())` keep the fp32 copy of the absorbed query
  (kv_lora + r wide a head; the key is one latent head) ; `dsa_masking.masked_softmax`
  (dsa_masking.py:356-373) keeps three bool masks (`~valid_mask`, one per `masked_fill`: 1 byte
  each), the exp's output and the divide's numerator (fp32, 4 each), its max's int64 index and
  the row sum (8 + 4 + 4 a row); the P V product keeps the bf16 probabilities (2): 13 bytes a
  score. Its backward holds four fp32 scores at once in the divide's gradient (torch's
  DivBackward0: grad / other and -grad * self / other^2, with their operands): 16 bytes a score.
- megatron-core 0.18 (MLASelfAttention around DSAttention, `unfused_dsa_fn`, dsa.py:920-970 at
  0.18.2): `bmm(query.float(), key.float())` keeps both fp32 copies (c + r wide a head each),
  the fp32 softmax keeps its output (4) and the P V bmm the bf16 copy (2): 6 bytes a score;
  its backward the fp32 gradient of the probabilities and the softmax's, the bf16 copy freed
  first (6 bytes a score more than kept).
- the indexer's loss (0.18: every training step, dsa.py:1066-1081 at 0.18.2; 0.19 with
  --dsa-indexer-loss-coeff above 0, dsa.py:1888-1894 at 0.19.2): FusedDSAIndexerLoss saves the
  indexer's q (bf16, heads x head dim), its weights (bf16, a head), its k (bf16, head dim) and
  the top-k indices (int64, topk a row) (dsa.py:944 at 0.19.2) and the query and key it reads
  (detached views: 0.19's absorbed query and latent key, which nothing else keeps, stay; 0.18's
  are MLA's query and key, `_mla_attention` counts them), and the indexer's k_norm
  its fp32 statistics, and under sequence parallelism linear_wk and linear_wq_b their
  all-gathered inputs x and qr (h and q_lora wide); its backward recomputes the scores
  (`bwd_fused_indexer_loss_naive`): 13 bytes a score per indexer head (tests/test_dsa.py
  measures them), after the attention's own saved scores are freed (the loss's gradient runs
  after the attention's backward).
Without the loss (0.19) the top-k runs under no_grad and nothing of the indexer is kept.
The indexer runs on the whole sequence on every tensor-parallel rank (its inputs all-gathered,
dsa.py:1273-1275 at 0.19.2); the attention on the rank's heads. Context parallelism is refused
for DSA (job/dsa.py), so s is the whole sequence here.
"""

from __future__ import annotations

from inspector.job.dims import ModelDims
from inspector.job.dsa import absorbed, indexer_loss
from inspector.job.layout import Layout

FP32, BF16, INDEX = 4, 2, 8
LN_STATS = 2 * FP32  # the indexer's k_norm (a LayerNorm) keeps its fp32 mean and rstd a row
KEPT_SCORE = {True: 13, False: 6}  # bytes a score kept, absorbed (0.19) or not (0.18)
BACKWARD_SCORE = {True: 16, False: 6}  # bytes a score the attention's backward holds at once
INDEXER_BACKWARD_SCORE = 13  # bytes a score per indexer head, the loss's recomputing backward


def _scores(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return the scores a rank computes: its heads x b x s^2 (sb = s b)."""
    return dims.num_attention_heads // par.tp * sb * dims.seq_length


def dsa_core_bytes(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return the bytes the DSA core attention and its indexer keep for backward."""
    fused = absorbed()
    heads = dims.num_attention_heads // par.tp
    c, r = dims.qk_head_dim, dims.qk_pos_emb_head_dim
    if fused:  # the fp32 absorbed query; the masked softmax's max index, row sum and its clamp
        rows = sb * heads * (FP32 * (dims.kv_lora_rank + r) + INDEX + 2 * FP32)
    else:  # the fp32 query and key
        rows = sb * heads * 2 * FP32 * (c + r)
    kept = KEPT_SCORE[fused] * _scores(dims, par, sb) + rows
    if indexer_loss(dims):
        n, d = dims.dsa_indexer_n_heads or 0, dims.dsa_indexer_head_dim or 0
        kept += sb * (BF16 * (n * d + n + d) + INDEX * (dims.dsa_indexer_topk or 0) + LN_STATS)
        if fused:  # 0.19's absorbed query and latent key (0.18's q and k: `_mla_attention`'s)
            kept += sb * BF16 * (dims.kv_lora_rank + r) * (heads + 1)
        if par.sequence_parallel and par.tp > 1:  # linear_wk and linear_wq_b keep the inputs
            kept += sb * BF16 * (dims.hidden_size + (dims.q_lora_rank or dims.hidden_size))
    return kept


def dsa_backward_bytes(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return the most a DSA core attention's backward holds at once beyond what it kept."""
    fused = absorbed()
    scores = _scores(dims, par, sb)
    attention = BACKWARD_SCORE[fused] * scores
    if not indexer_loss(dims):
        return attention
    indexer = INDEXER_BACKWARD_SCORE * (dims.dsa_indexer_n_heads or 0) * sb * dims.seq_length
    return max(attention, indexer - KEPT_SCORE[fused] * scores)


def dsa_rebuild_bytes(dims: ModelDims, par: Layout, mbs: int, recompute: str,
                      modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return what a DSA layer's backward holds at once beyond the activations kept (none for a
    model without DSA layers): `dsa_backward_bytes`, and with the core attention recomputed
    (--recompute-modules core_attn; megatron's MLA checkpoints DSAttention whole,
    `checkpoint_core_attention`) its kept bytes rebuilt first."""
    if dims.experimental_attention_variant != "dsa":
        return 0.0
    sb = dims.seq_length / par.cp * mbs
    rebuilt = dsa_core_bytes(dims, par, sb) if recompute == "selective" and "core_attn" in modules else 0.0
    return rebuilt + dsa_backward_bytes(dims, par, sb)
