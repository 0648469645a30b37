"""The kernels rotary embedding runs, fused or not, and how multi-latent attention assembles Q, K, V.

With TransformerConfig.apply_rope_fusion (Transformer Engine jobs, unless --no-rope-fusion) RoPE is
one kernel that reads and writes the rotated elements (formulas/ops.py prices it so). Without it,
megatron-core 0.16 runs `_apply_rotary_pos_emb_bshd` (models/common/embeddings/rope_utils.py) on
each of Q and K, eagerly, per element of the rotated part (act bytes a; rotary_percent 1):
  forward: `t * cos_` (read a, write a), `_rotate_half`'s `-x2` on half the elements (a) and
  `torch.cat((-x2, x1))` (2a), `* sin_` (2a), the sum (3a), `torch.cat((t, t_pass))` with an empty
  t_pass (2a): 12a; with multi-latent attention first the de-interleave `torch.cat((t[..., 0::2],
  t[..., 1::2]))` (2a): 14a;
  backward: the two multiplies' gradients (2a each), `neg` (a), the chunk's gradient, a cat (2a),
  the two paths' sum (3a), t_pass's SliceBackward (a zero fill of t, a) added in (3a): 14a; with
  multi-latent attention the two strided slices' SliceBackward (a zero fill, a, and a copy of half
  the elements, a, each) and their sum (3a): 21a.
cos_ and sin_ (per position, not per head and token) are left out. tests/test_rope_ops.py runs
megatron's function under a dispatch recorder and compares.

Multi-latent attention's `qkv_up_proj_and_rope_apply` (transformer/multi_latent_attention.py), on T
tokens and n heads of qk_head_dim c, qk_pos_emb_head_dim r, v_head_dim v:
  unfused: `torch.cat([q_no_pe, q_pos_emb])` and `torch.cat([k_no_pe, k_pos_emb.expand(..n..)])`
  (each reads and writes T n (c + r)), `value.contiguous()` of the strided split (T n v);
  backward: the q and kv `torch.split` gradients, one cat each (T n (c + r) and T n (c + v)), and
  the expand's sum over heads (reads T n r); the cats' own gradients are views;
  fused (fusions/fused_mla_yarn_rope_apply.py, triton): ApplyMLARotaryEmbQ rotates the rotary
  part of q in place (`rotary_fwd_q_kernel`, `rotary_bwd_q_kernel`: read and write T n r, the
  rotary op); ApplyMLARotaryEmbKV (`rotary_fwd_kv_kernel`) reads kv (T n (c + v)) and k_pos_emb
  (T r) and writes the key (`o_key`, T n (c + r): kv's key part and the rotated k_pos_emb
  broadcast to every head) and the value (`o_value`, T n v); its backward
  (`rotary_bwd_kv_kernel`) reads dk (T n (c + r)) and dv (T n v) and writes d_kv (T n (c + v))
  and d_emb (T r, dk's rotary part summed over heads): a T (n (2c + r + 2v) + r) bytes each way.
"""

from __future__ import annotations

from inspector.formulas.bias_ops import Kernels
from inspector.formulas.kernels import Memory

# bytes per rotated element, in units of the activation's bytes (module docstring)
UNFUSED_FORWARD, UNFUSED_BACKWARD = 12, 14
MLA_FORWARD, MLA_BACKWARD = 14, 21


def rotary(elements: int, act: int, fused: bool, mla: bool = False) -> Kernels:
    """Return RoPE's forward and backward kernels over `elements` rotated elements (Q and K)."""
    if fused:
        return ([Memory("rotary Q, K", "copy", elements, 2 * act)],
                [Memory("rotary Q, K backward", "copy", elements, 2 * act)])
    forward, backward = (MLA_FORWARD, MLA_BACKWARD) if mla else (UNFUSED_FORWARD, UNFUSED_BACKWARD)
    return ([Memory("rotary Q, K (unfused)", "copy", elements, forward * act)],
            [Memory("rotary Q, K (unfused) backward", "copy", elements, backward * act)])


def mla_rope(tokens: int, heads: int, dims: tuple[int, int, int], act: int, fused: bool) -> Kernels:
    """Return multi-latent attention's RoPE on the rotary parts of Q (all heads) and K (one), and
    without RoPE fusion its query/key/value assembly (module docstring); dims: (c, r, v)."""
    c, r, v = dims
    th = tokens * heads
    if fused:  # q's rotary part in place, and the kv kernel (module docstring)
        forward, backward = rotary(th * r, act, True)
        moved = th * (2 * c + r + 2 * v) + tokens * r
        return ([*forward, Memory("MLA key, value (fused RoPE)", "copy", moved, act)],
                [*backward, Memory("MLA key, value (fused RoPE) backward", "copy", moved, act)])
    forward, backward = rotary(tokens * (heads + 1) * r, act, False, mla=True)
    forward += [Memory("MLA query, key cat", "copy", 2 * th * (c + r), 2 * act),
                Memory("MLA value contiguous", "copy", th * v, 2 * act)]
    backward += [Memory("MLA q, kv split backward (cat)", "copy", th * (2 * c + r + v), 2 * act),
                 Memory("MLA key expand backward (sum)", "copy", th * r, act)]
    return forward, backward
