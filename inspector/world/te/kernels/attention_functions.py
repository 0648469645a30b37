"""What TE's attention kernels allocate and save for backward, as autograd Functions.

Like functions.py (whose docstring says how each Function mirrors TE 2.11's): cuDNN's fused
attention (`FusedAttnFunc`), its context-parallel p2p ring (`AttnFuncWithCPAndKVP2P`) and the fused
RoPE (`FusedRoPEFunc`), which megatron's TE attention and rotary embeddings run.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from inspector.world.te import cpu_offload


def begin_fused(
    ctx: Any, q: torch.Tensor, qkv_format: str, softmax_offset: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """Note the softmax offset's shape on `ctx` and return the softmax statistics' shape, fp32
    [b, heads, s_q, 1]. softmax_offset: fp32 [1, heads, 1, 1] for softmax_type off-by-one or
    learnable (the attention sinks), an input of fused_attn_fwd; its gradient is backward's
    d_softmax_offset."""
    ctx.offset = None if softmax_offset is None else softmax_offset.shape
    s, b, heads = q.shape[0], q.shape[1], q.shape[2]
    if qkv_format == "bshd":
        s, b = b, s
    return b, heads, s, 1


class FusedAttnFunction(torch.autograd.Function):
    """TE `FusedAttnFunc` (pytorch/attention/dot_product_attention/backends.py 1086-1610, v2.11),
    the cuDNN F16_arbitrary_seqlen path that `get_attention_backend` prefers over flash-attn on
    Hopper and newer (dot_product_attention/utils.py): `fused_attn_fwd` returns the output and
    `aux_ctx_tensors` = [softmax statistics, fp32 [b, heads, s_q, 1]; rng state, int64 [2]];
    the s x s probabilities are never stored (dropout is regenerated from the rng state).
    flash-attn keeps the same: q, k, v, out, fp32 softmax_lse [b, heads, s_q] and rng_state."""

    # prepare_for_saving, backends.py 1322-1333 (no fp8: the fp8 slots are None; cu_seqlens are
    # None for the sbhd format without padding)
    SAVED = (
        "q", "k", "v", "out", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded", "softmax_stats", "rng_state",
    )  # fmt: skip

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qkv_format: str = "sbhd",
        softmax_offset: torch.Tensor | None = None,
    ) -> torch.Tensor:
        stats_shape = begin_fused(ctx, q, qkv_format, softmax_offset)
        if cpu_offload.is_cpu_offload_enabled():  # backends.py 1131-1132: q, k, v's base goes
            cpu_offload.start_offload(q, k, v, offload_base_tensor=True)
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
        stats = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, None, None, None, None, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        q, k, v, *_ = ctx.saved_tensors
        d_out = d_out.contiguous()
        # fused_attn_bwd (pytorch/csrc/extensions/attention.cpp): dQ, dK, dV like Q, K, V for the
        # separate sbhd_sbhd_sbhd layout megatron's q, k, v take
        # ... and, with a softmax offset, d_softmax_offset like it (backends.py 1602-1604)
        offset = ctx.offset and torch.empty(ctx.offset, dtype=torch.float32, device=q.device)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, offset


class P2PAttnFunction(torch.autograd.Function):
    """TE `AttnFuncWithCPAndKVP2P` (pytorch/attention/dot_product_attention/context_parallel.py
    1232-2730, v2.11), cp_comm_type "p2p", 16-bit, fused backend, sbhd/bshd, on one cp rank.

    Forward (1245-1967): K and V are packed into one ring buffer (`torch.cat`, 1543), and one
    more buffer like it is allocated per step to receive the next rank's KV (1554); all stay
    until the forward returns, the last is saved. Each step's `fused_attn_fwd` writes a partial
    output and fp32 softmax statistics [b, h, s_step, 1] and an rng state (1614-1700): with a
    causal mask step 0 is the diagonal (the local q against its own KV), a step i <= rank the
    lower triangle (all of q against the first half of the received KV, a view), a later step
    the upper triangle (the second half of q, 1/2 the rows). Step 1 clones step 0's statistics
    as the merged `softmax_lse` (1729); `flash_attn_fwd_out_correction_init` writes the merged
    output, in q's dtype (105-115), which is also what is returned (1886). The per-step outputs
    and statistics go when the forward returns; the corrections' fused temporaries are left out.
    Saved (1956-1967): three fp8 slots (None), q, the last KV buffer, out, softmax_lse, the
    padded and per-step cu_seqlens (TE's cached tensors, `_get_cu_seqlens_info_with_cp`, shared
    by every layer: None here), cp rng states and cp attention biases (None).

    Backward (2020-2730, non-fp8 branch 2204-2211): dq like q, two ring buffers of [2, KV] (KV
    and its gradient, sent together), one step's partial dq, dk, dv from `fused_attn_bwd`
    (held one step at a time here); dk and dv are views of the last step's buffer (2644-2650).
    """

    SAVED = (
        "q_fp8", "kv_fp8", "out_fp8", "q", "kv", "out", "softmax_lse", "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded", "*cu_seqlens_q_per_step", "*cu_seqlens_kv_per_step",
        "*rng_states", "*attn_biases",
    )  # fmt: skip

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ring: tuple[int, int, bool],
        qkv_format: str = "sbhd",
    ) -> torch.Tensor:
        cp_size, rank, causal = ring
        seq_dim = qkv_format.index("s")
        s, b, heads = q.shape[seq_dim], q.shape[1 - seq_dim], q.shape[2]
        if s % 2 != 0:  # 1431-1433
            raise AssertionError("Sequence length per GPU needs to be divisible by 2!")
        buffers = [torch.cat((k.reshape(-1), v.reshape(-1)))]
        outs, stats, rng_states = [], [], []
        for i in range(cp_size):
            if i < cp_size - 1:
                buffers.append(torch.empty_like(buffers[i]))
            rows = s // 2 if causal and i > rank else s  # the upper triangle: half of q
            shape = (rows, b) if qkv_format == "sbhd" else (b, rows)
            outs.append(q.new_empty((*shape, heads, v.shape[3])))
            stats.append(torch.empty((b, heads, rows, 1), dtype=torch.float32, device=q.device))
            rng_states.append(torch.empty((2,), dtype=torch.int64, device=q.device))
            if i == 1:
                softmax_lse = stats[0].squeeze(-1).clone()
        out = torch.empty_like(outs[0])
        cu_seqlens = [None] * (2 + 2 * cp_size)
        ctx.save_for_backward(None, None, None, q, buffers[-1], out, softmax_lse, *cu_seqlens,
                              *rng_states, *[None] * cp_size)  # fmt: skip
        ctx.ring, ctx.k_shape, ctx.v_shape = ring, k.shape, v.shape
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        q, kv = ctx.saved_tensors[3], ctx.saved_tensors[4]
        cp_size = ctx.ring[0]
        dq = torch.empty_like(q)
        buffers = [kv.new_empty((2, *kv.shape)), kv.new_empty((2, *kv.shape))]
        partial = [q.new_empty(shape) for shape in (q.shape, ctx.k_shape, ctx.v_shape)]
        del partial
        dkv = buffers[cp_size % 2][1]  # the last step's, (i + 1) % 2 at i = cp_size - 1
        k_numel = math.prod(ctx.k_shape)
        dk, dv = dkv[:k_numel].view(ctx.k_shape), dkv[k_numel:].view(ctx.v_shape)
        return dq, dk, dv, None, None


class FusedRoPEFunction(torch.autograd.Function):
    """TE `FusedRoPEFunc` (pytorch/attention/rope.py 112-175, v2.11): `tex.fused_rope_forward`
    writes a new output; only the frequencies are saved (with cu_seqlens and start_positions,
    None for sbhd); `fused_rope_backward` returns a new input gradient."""

    SAVED = ("freqs", "cu_seqlens", "start_positions")  # rope.py 152

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs, None, None)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        return torch.empty(grad_output.shape, dtype=grad_output.dtype, device=grad_output.device), None


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Any = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    start_positions: Any = None,
) -> torch.Tensor:
    """TE's `apply_rotary_pos_emb` (pytorch/attention/rope.py, v2.11) for megatron's fused path."""
    if not fused or tensor_format != "sbhd" or cu_seqlens is not None:
        raise NotImplementedError(
            "the simulated Transformer Engine runs only the fused sbhd RoPE megatron calls"
        )
    out: torch.Tensor = FusedRoPEFunction.apply(t, freqs)
    return out
