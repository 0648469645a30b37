"""What Megatron-LM's --deterministic-mode adds to a layer's kernels: the attention backward's.

Megatron-LM's validate_args (megatron/training/arguments.py) requires NCCL_ALGO to name one
algorithm (Tree, Ring, ...) and calls `torch.use_deterministic_algorithms(True)`; megatron-core's
TEDotProductAttention refuses deterministic mode unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
(extensions/transformer_engine.py). Transformer Engine then keeps cuDNN's fused attention on Hopper
(attention/dot_product_attention/utils.py `get_attention_backend`, its determinism table:
sub-backend 1 "workspace optimization path and sm90+: yes") and asks cuDNN for its deterministic
backward (common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu:
`sdpa_backward_options.set_deterministic_algorithm(deterministic)`). On Hopper that backward is
cuDNN's dP-workspace decomposition (NVIDIA/cudnn-frontend#398, "SDPA bwd: linear-workspace
deterministic path on Hopper (cuDNN 9.25+)": `use_deterministic_algorithm` "always forced the
dP-workspace decomposition. Its workspace is quadratic in sequence length (b * h * s_q_pad *
s_kv_pad * 2 bytes)"): the gradients of the scores go out to that workspace and a separate product
reads them back for dQ, where the default kernel adds each tile's dQ into an fp32 buffer with
atomics, in no fixed order. The FLOPs are the same; the workspace's traffic is added: one write and
one read of its causal half (the tiles the causal mask keeps, as the flash FLOPs count them), 2
bytes an element each way, at the measured copy rate. Other GPUs are priced the same, as a stand-in:
Blackwell's deterministic backward runs a separate dQ kernel instead (NVIDIA/cudnn-frontend#895),
and before Hopper Transformer Engine drops its fused attention under determinism (flash-attn 2's
deterministic kernel or the unfused path run instead).

Published measurements of deterministic attention backward kernels on an H100 at head dim 128,
causal, sequence 8192 (Dao-AILab/flash-attention#1893): FlashAttention-3 non-deterministic 574.7
TFLOP/s, deterministic 474.0 (shortest-processing-time schedule) to 361.3 (naive order), 0.63-0.82
of the default. This price gives 0.65 at the same shape against the H100 table's backward.
"""

from __future__ import annotations

from inspector.formulas.kernels import Memory

WORKSPACE_BYTES = 2 + 2  # a 16-bit score gradient written, then read by the dQ product


def workspace_pass(heads: int, rows: int, squares_per_row: int) -> Memory:
    """Return the deterministic backward's dP-workspace traffic: `heads` (x micro-batch) heads of
    `rows` query rows, each attending to `squares_per_row` keys before the causal half."""
    return Memory("deterministic attention dP workspace", "copy", heads * rows * squares_per_row // 2,
                  WORKSPACE_BYTES)
