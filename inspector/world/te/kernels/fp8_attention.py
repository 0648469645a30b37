"""TE's fused attention in fp8 (`--fp8-dot-product-attention`): what it allocates and saves.

Mirrors Transformer Engine 2.11 `FusedAttnFunc` (pytorch/attention/dot_product_attention/
backends.py) where `fp8` is set, the FP8 cuDNN backend, for megatron's separate q, k, v
(layout sbhd_sbhd_sbhd), with `NVTE_FP8_DPA_BWD` at its default 1:
- forward (1139-1245): `combine_and_quantize` (utils.py 2157-2202, three groups) concatenates
  the flattened q, k, v (a 16-bit temporary) and quantizes them into ONE uint8 buffer with an
  fp32 scale_inv [1]; q, k, v are views of it. `fused_attn_fwd` (csrc attention.cpp
  `quantizer_helper`) writes O: in fp8 (uint8 + scale_inv) under delayed scaling, which is then
  dequantized to the 16-bit output returned; in 16 bits (with an fp32 amax [1]) under current
  scaling (`NVTE_DPA_FP8CS_O_in_F16` defaults to 1, backends.py 154). aux_ctx_tensors are M and
  ZInv, fp32 [b, heads, s_q, 1] each, and the rng state (cpp_extensions/fused_attn.py 245-251).
  Saved (1270-1290): the fp8 q, k, v (the one buffer and its scale), the fp8 O (delayed) or the
  16-bit O (current), M, ZInv, rng state. The 16-bit q, k, v are not saved.
- backward (1448-1560): d_out contiguous, quantized by the dO quantizer (row-wise only,
  utils.py 2092-2094): uint8 like it + scale_inv; `fused_attn_bwd` allocates dQ, dK, dV
  separately (attention.cpp, NVTE_HD_HD_HD) in uint8 (delayed) or 16 bits (current scaling);
  fp8 ones go through `combine_and_dequantize` (utils.py 2205-2250): their data concatenated
  (uint8) and dequantized into one 16-bit buffer, of which dq, dk, dv are views.
Not counted: the attention module's own scaling state (a few fp32 scalars per layer).
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.kernels.attention_functions import begin_fused


def _quantized(shape: Any, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 tensor as a Float8Quantizer makes it row-wise: uint8 data, fp32 scale_inv [1]."""
    data = torch.empty(shape, dtype=torch.uint8, device=device)
    return data, torch.empty((1,), dtype=torch.float32, device=device)


def _combine_and_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
    """utils.py combine_and_quantize, three groups: one uint8 buffer, q/k/v views of it."""
    flat = torch.cat([t.reshape(-1) for t in (q, k, v)], dim=0)
    data, scale_inv = _quantized(flat.shape, flat.device)
    del flat
    edges = [0, q.numel(), q.numel() + k.numel(), q.numel() + k.numel() + v.numel()]
    views = tuple(data[edges[i] : edges[i + 1]].view(t.shape) for i, t in enumerate((q, k, v)))
    return data, scale_inv, views


class FP8FusedAttnFunction(torch.autograd.Function):
    """FusedAttnFunc with fp8 (see the module docstring); `delayed`: the recipe's scaling."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
                softmax_offset: torch.Tensor | None, delayed: bool) -> torch.Tensor:  # fmt: skip
        stats_shape = begin_fused(ctx, q, qkv_format, softmax_offset)
        ctx.delayed, ctx.shapes, ctx.dtype = delayed, (q.shape, k.shape, v.shape), q.dtype
        data, scale_inv, _ = _combine_and_quantize(q, k, v)
        o_shape = (*q.shape[:3], v.shape[3])
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        stats = [torch.empty(stats_shape, dtype=torch.float32, device=q.device)
                 for _ in ("M", "ZInv")]  # fmt: skip
        if delayed:
            out_fp8, out_scale = _quantized(o_shape, q.device)
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)  # out_.dequantize()
            saved = (data, scale_inv, out_fp8, out_scale)
        else:
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
            amax = torch.empty((1,), dtype=torch.float32, device=q.device)
            saved = (data, scale_inv, out, amax)
        ctx.save_for_backward(*saved, *stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        device = ctx.saved_tensors[0].device
        d_out = d_out.contiguous()
        d_out_fp8 = _quantized(d_out.shape, d_out.device)
        if ctx.delayed:
            parts = [torch.empty(shape, dtype=torch.uint8, device=device) for shape in ctx.shapes]
            flat = torch.cat([t.reshape(-1) for t in parts], dim=0)
            del parts
            whole = torch.empty(flat.shape, dtype=ctx.dtype, device=device)  # dequantize
            del flat
            ends = [0]
            for shape in ctx.shapes:
                ends.append(ends[-1] + torch.Size(shape).numel())
            grads = [whole[ends[i] : ends[i + 1]].view(shape) for i, shape in enumerate(ctx.shapes)]
        else:
            grads = [torch.empty(shape, dtype=ctx.dtype, device=device) for shape in ctx.shapes]
        del d_out_fp8
        offset = ctx.offset and torch.empty(ctx.offset, dtype=torch.float32, device=device)
        return (*grads, None, offset, None)
