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
MXFP8 (TE 2.15+, followed at v2.17.1 4329ff84, what megatron-core 0.19 locks; sm100+ only):
- forward (backends.py 1383-1496): `combine_and_quantize` (utils.py 2781-2842) takes the fast
  path for sbhd/bshd: each of q, k, v quantized on its own, row- and column-wise (the QKV
  quantizer asks both, utils.py 2515-2524), by `mxfp8_quantize_fast_path` (2626-2778): uint8 data
  both ways in the tensor's shape, and its E8M0 scales re-laid as [b, h, s, round_up(d/32, 4)]
  row-wise and [b, h, s/32, round_up(d, 128)] column-wise, each direction ONE uint8 buffer for
  the three (`_build_outputs`); the quantizer's own scales are dropped. It asserts s % 128 == 0
  and d % 32 == 0. O comes back in 16 bits and is saved so (bwd_requires_o_f16); aux_ctx_tensors
  are the softmax Stats, fp32 [b, heads, s_q, 1], and the rng state (fused_attn_fp8.cu 1129-1145).
- backward (1638-1830): d_out contiguous, quantized both ways by the same fast path; dQ, dK, dV
  come back in 16 bits, each its own tensor.
Not counted: the attention module's own scaling state (a few fp32 scalars per layer).
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.kernels.attention_functions import begin_fused
from inspector.world.te.kernels.quantize import MX_BLOCK, quantize


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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mxfp8_fast_path(tensors: tuple[torch.Tensor, ...], qkv_format: str) -> list[torch.Tensor]:
    """utils.py mxfp8_quantize_fast_path, both directions: each tensor's uint8 data row- and
    column-wise, then one row-wise and one column-wise scale buffer for all, in BHSD."""
    kept: list[torch.Tensor] = []
    dropped = []
    for t in tensors:
        s, b, heads, d = t.shape if qkv_format == "sbhd" else (t.shape[1], t.shape[0], *t.shape[2:])
        assert s % 128 == 0 and d % 32 == 0, (
            "MXFP8 quantization requires s_q % 128 == 0, s_kv % 128 == 0, d_qk % 32 == 0, d_v % 32"
            f" == 0. Found s={s}, d={d}."
        )
        rows = s if qkv_format == "sbhd" else b * s  # the 2-D view quantized
        made = quantize(rows, t.numel() // rows, "mxfp8", rowwise=True, columnwise=True)
        kept += [made.rowwise[0].view(t.shape), made.columnwise[0].view(t.shape)]
        dropped += [made.rowwise[1], made.columnwise[1]]
    shapes = [(t.shape[1], t.shape[0]) if qkv_format == "sbhd" else t.shape[:2] for t in tensors]
    heads_d = [(t.shape[2], t.shape[3]) for t in tensors]
    row = sum(sb[0] * sb[1] * h * _round_up(d // MX_BLOCK, 4) for sb, (h, d) in zip(shapes, heads_d))
    col = sum(sb[0] * sb[1] // MX_BLOCK * h * _round_up(d, 128) for sb, (h, d) in zip(shapes, heads_d))
    scales = [torch.empty((n,), dtype=torch.uint8, device=tensors[0].device) for n in (row, col)]
    del dropped
    return kept + scales


class FP8FusedAttnFunction(torch.autograd.Function):
    """FusedAttnFunc with fp8 (see the module docstring); `scaling`: "delayed", "current" or
    "mxfp8"."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str,
                softmax_offset: torch.Tensor | None, scaling: str) -> torch.Tensor:  # fmt: skip
        stats_shape = begin_fused(ctx, q, qkv_format, softmax_offset)
        ctx.scaling, ctx.shapes, ctx.dtype = scaling, (q.shape, k.shape, v.shape), q.dtype
        ctx.qkv_format = qkv_format
        o_shape = (*q.shape[:3], v.shape[3])
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        if scaling == "mxfp8":
            qkv = _mxfp8_fast_path((q, k, v), qkv_format)
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
            stats = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
            ctx.save_for_backward(*qkv, out, stats, rng_state)
            return out
        data, scale_inv, _ = _combine_and_quantize(q, k, v)
        stats_pair = [torch.empty(stats_shape, dtype=torch.float32, device=q.device)
                      for _ in ("M", "ZInv")]  # fmt: skip
        if scaling == "delayed":
            out_fp8, out_scale = _quantized(o_shape, q.device)
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)  # out_.dequantize()
            saved = (data, scale_inv, out_fp8, out_scale)
        else:
            out = torch.empty(o_shape, dtype=q.dtype, device=q.device)
            amax = torch.empty((1,), dtype=torch.float32, device=q.device)
            saved = (data, scale_inv, out, amax)
        ctx.save_for_backward(*saved, *stats_pair, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        device = ctx.saved_tensors[0].device
        d_out = d_out.contiguous()
        if ctx.scaling == "mxfp8":
            d_out_fp8: Any = _mxfp8_fast_path((d_out,), ctx.qkv_format)
        else:
            d_out_fp8 = _quantized(d_out.shape, d_out.device)
        if ctx.scaling == "delayed":
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
