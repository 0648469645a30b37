"""Packed sequences (TE's `thd` format): cuDNN's fused attention per document and the fused RoPE.

megatron hands Transformer Engine packed sequences through `PackedSeqParams`
(megatron/core/packed_seq_params.py): q, k, v squeezed to [t, heads, d] (transformer/attention.py
`if packed_seq_params ... qkv_format == 'thd'`: `query.squeeze(1)`), `qkv_format="thd"`,
`cu_seqlens_q/kv` (int32 [documents + 1]) and their padded twins, `max_seqlen_q/kv`, and the
causal mask as `padding_causal` (extensions/transformer_engine.py TEDotProductAttention.forward:
"thd format uses flash attention with cuDNN kernel which requires is_padding=True"). TE v2.11
then runs `FusedAttnFunc` (dot_product_attention/backends.py 1086-1610) whose
`prepare_for_saving` (1322-1333) keeps q, k, v, out, the four cu_seqlens and `aux_ctx_tensors`;
for thd on cuDNN >= 9.6 the softmax statistics are fp32 [t, heads, 1], one row per token
(common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu `fused_attn_arbitrary_seqlen_fwd`:
`if (q_format == NVTE_QKV_Format::NVTE_THD && cudnn_runtime_version >= 90600) output_S->data.shape
= {max_tokens_q, num_attn_heads, 1}`), and an int64 [2] rng state. No document attends to
another, so a step's attention costs the sum of its documents' squares, not s^2.

The fused RoPE (pytorch/attention/rope.py `FusedRoPEFunc` 112-175) with `tensor_format="thd"`
restarts each document's positions at its cu_seqlens offset and saves freqs and cu_seqlens.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.kernels import attention_functions
from inspector.world.te.kernels.attention_functions import FusedAttnFunction


class ThdFusedAttnFunction(torch.autograd.Function):
    """TE `FusedAttnFunc` in the thd format: what forward allocates and saves, backward's grads."""

    SAVED = FusedAttnFunction.SAVED  # prepare_for_saving, backends.py 1322-1333: the same slots

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> torch.Tensor:
        q, k, v, cu_seqlens = inputs  # cu_seqlens: q, kv, q padded, kv padded
        t, heads = q.shape[0], q.shape[1]
        out = torch.empty((t, heads, v.shape[2]), dtype=q.dtype, device=q.device)
        stats = torch.empty((t, heads, 1), dtype=torch.float32, device=q.device)
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, *cu_seqlens, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        # fused_attn_bwd: dQ, dK, dV like Q, K, V (thd_thd_thd layout); d_out arrives contiguous
        # (megatron's reshape of the output to [t, 1, h])
        return (*(torch.empty_like(t) for t in ctx.saved_tensors[:3]), None)


def thd_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    """Run TE's DotProductAttention.forward for thd q, k, v: [t, heads * d] out (FusedAttention
    .forward's final `output.view(*output.shape[:-2], -1)`, backends.py v2.11)."""
    q_lens = kwargs.get("cu_seqlens_q")
    kv_lens = kwargs.get("cu_seqlens_kv")
    if q_lens is None or kv_lens is None:  # dot_product_attention.py: thd needs both
        raise AssertionError("cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd!")
    padded = tuple(
        kwargs.get(f"cu_seqlens_{side}_padded") for side in ("q", "kv")
    )  # megatron passes them (TE >= 1.10); without, the unpadded ones
    padded = tuple(p if p is not None else u for p, u in zip(padded, (q_lens, kv_lens)))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out: torch.Tensor = ThdFusedAttnFunction.apply(q, k, v, (q_lens, kv_lens, *padded))
    return out.view(out.shape[0], -1)


class ThdRoPEFunction(torch.autograd.Function):
    """TE `FusedRoPEFunc` (rope.py 112-175) in thd: a new output, freqs and cu_seqlens saved."""

    SAVED = ("freqs", "cu_seqlens", "start_positions")  # rope.py 152

    @staticmethod
    def forward(
        ctx: Any, t: torch.Tensor, freqs: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(freqs, cu_seqlens, None)
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        grad = torch.empty(grad_output.shape, dtype=grad_output.dtype, device=grad_output.device)
        return grad, None, None


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd", **kwargs: Any
) -> torch.Tensor:
    """TE's `apply_rotary_pos_emb` (rope.py, v2.11): thd with cu_seqlens (megatron's
    `fused_apply_rotary_pos_emb_thd`, no context parallelism) here, the rest as
    attention_functions runs it."""
    lens = kwargs.get("cu_seqlens")
    if kwargs.get("fused") and tensor_format == "thd" and lens is not None:
        if kwargs.get("cp_size", 1) == 1:
            out: torch.Tensor = ThdRoPEFunction.apply(t, freqs, lens)
            return out
    return attention_functions.apply_rotary_pos_emb(t, freqs, tensor_format, **kwargs)
