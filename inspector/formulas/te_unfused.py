"""What Transformer Engine's unfused attention adds to megatron's: the causal mask it rebuilds.

With the Transformer Engine spec and `--attention-backend unfused`, megatron-core sets
NVTE_UNFUSED_ATTN=1 (models/common/language_module/language_module.py) and TEDotProductAttention
runs Transformer Engine's UnfusedDotProductAttention (attention/dot_product_attention/backends.py),
whose forward calls `dpa_utils.get_full_mask` on every call, a causal mask included, before the
same baddbmm, fused scale-mask-softmax and bmm that megatron's own DotProductAttention runs.
get_full_mask (utils.py) over [s_q, s_kv] positions, once a call (not per head): `torch.arange`
differences in int32 (write 4 bytes), `swa_left` and `swa_right` (read 4, write 4 each), `swa_left
<= 0` and `swa_right < 0` (read 4, write 1 each), two `torch.where(cond, 1, 0)` into int64 (read 1,
write 8 each), their difference (read 8 + 8, write 8) and `logical_not` (read 8, write 1).
"""

from __future__ import annotations

from inspector.formulas.kernels import Memory

FULL_MASK_BYTES = 4 + 2 * (4 + 4) + 2 * (4 + 1) + 2 * (1 + 8) + (8 + 8 + 8) + (8 + 1)


def full_mask_pass(rows: int, keys: int) -> Memory:
    """Return get_full_mask's passes over a [rows, keys] causal mask, once per attention call."""
    return Memory("causal mask (Transformer Engine)", "copy", rows * keys, FULL_MASK_BYTES)
