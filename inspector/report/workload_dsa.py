"""A DeepSeek sparse attention (DSA) layer's lightning indexer as SimAI workload records.

A DSA layer is megatron-core 0.19's AbsorbedMLASelfAttention
(transformer/experimental_attention_variant/absorbed_mla.py) around DSAttention, which holds the
DSAIndexer (dsa.py there). The attention's own collectives are MLA's (workload_layers.py
`_attention_column`): with sequence parallelism, which AbsorbedMLA requires above one
tensor-parallel rank (absorbed_mla.py:171-173), `linear_q_up_proj` gathers q's latent and the
attention gathers the RoPE key (:498-500) and kv's latent (:523-524); `linear_proj`
reduce-scatters. So DSAttention receives query and key of the whole sequence and gathers neither
(dsa.py:1782-1800 run only on sequence-local rows). The indexer adds, at megatron-core 0.19.2:

- `dsa_indexer_gather`: DSAIndexer.forward_before_topk all-gathers its inputs over the
  tensor-parallel group (dsa.py:1273-1275), the hidden states x (h wide) and q's latent qr
  (q_lora_rank wide). DSAttention detaches both first (dsa.py:1886-1888: "to prevent gradients
  of indexer from flowing back to the main model"), so the backward has no reduce-scatter.
- `dsa_indexer_loss`, with --dsa-indexer-loss-coeff above 0 (dsa.py:1890-1894, training only):
  the indexer's KL target sums the attention probabilities of this rank's heads, (b, s, s) in
  fp32, and all-reduces them over the tensor-parallel group, in the forward
  (`compute_dsa_indexer_loss`, dsa.py:503-505, through `fwd_fused_indexer_loss_naive`) and
  again when the backward recomputes them (`bwd_fused_indexer_loss_naive`, dsa.py:772-774),
  both from FusedDSAIndexerLoss (dsa.py:896), the PyTorch path megatron runs by default
  (`use_fused_dsa_kernels` is False with --dsa-kernel-backend none, tests/test_dsa.py).

The loss tracker's all-reduces (dsa.py:315-335) run once a step when megatron logs, not per
micro-batch, and are not written. Compute: these records carry none; the indexer's projections
and scores are left out of the layer's FLOPs, as Megatron-LM's own count leaves them out
(core_v0.19.0 training.py, formulas/hybrid_flops.py).
"""

from __future__ import annotations

from inspector.report.simai import Record
from inspector.report.workload_inputs import Context

SCORE_BYTES = 4  # dsa.py:490-505: the attention probabilities are summed in fp32 (`.float()`)


def dsa_indexer_records(job: Context, prefix: str = "") -> list[Record]:
    """Return the indexer's tensor-parallel collectives of one DSA layer for one micro-batch
    on one rank (none on one tensor-parallel rank)."""
    dims = job.dims
    if job.par.tp == 1:
        return []
    width = dims.hidden_size + (dims.q_lora_rank or dims.hidden_size)
    gather = dims.activation_bytes * job.tokens * width
    records = [Record(prefix + "dsa_indexer_gather", fwd_comm="ALLGATHER", fwd_bytes=gather)]
    if dims.dsa_indexer_loss_coeff:
        scores = SCORE_BYTES * job.tokens * dims.seq_length  # (b, s, s): cp is 1 (job/dsa.py)
        records.append(Record(prefix + "dsa_indexer_loss", fwd_comm="ALLREDUCE", fwd_bytes=scores,
                              ig_comm="ALLREDUCE", ig_bytes=scores))  # fmt: skip
    return records
