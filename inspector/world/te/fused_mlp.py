"""TE 2.14's CuTe DSL fused grouped MLP in MXFP8 (`ForwardGroupedMLP_CuTeGEMMSwiGLU_MXFP8`,
`BackwardGroupedMLP_CuTeGEMMDSwiGLU_MXFP8`), on meta tensors: what it allocates, saves and frees.

TE's fuser replaces `GroupedLinear, ScaledSwiGLU, GroupedLinear` with these two fused operations
(ops/_common.py `fuse_grouped_mlp_ops` 103-180) when NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0, the GPU's
compute capability is 10.x and cuDNN front-end's sm100 kernels import (`is_supported`,
forward_grouped_mlp.py 71-84), the recipe is MXFP8, every feature count is a multiple of 256 and
the SwiGLU is interleaved by 32. MXFP8 runs on Blackwell GPUs only; the tool takes a datacenter
Blackwell (compute capability 10.x: B200, GB200, B300, GB300), where the kernel is taken.

Sizes, with N permuted rows, H the hidden size, F the expert FFN size and G local experts, each
from the `v2.14` tag of ops/fused/forward_grouped_mlp.py (fwd) and backward_grouped_mlp.py (bwd):
- fwd 285-295 `group_quantize` of the input: MXFP8 row- and column-wise [N, H] uint8 with E8M0
  scales (kernels/quantize.py's shapes);
- fwd 230-282 each expert's weight quantized (`quantizer(weight)`, row- and column-wise) unless it
  is already an MXFP8 parameter;
- fwd 373-386 the fc1 kernel: `c_tensor` (the SwiGLU's input) bf16 [N, 2F], `d_tensor` and
  `d_col_tensor` (fc2's input) MXFP8 [N, F] with their scales;
- fwd 449-453 the fc2 kernel: the output [N, H] in the compute dtype;
- fwd 455-510 saved: the split sizes and points, the quantized weights, the column-wise halves of
  fc1's and fc2's inputs (data, scales, offsets), the SwiGLU's input and the probs; the row-wise
  halves are freed with the forward's locals. `mark_grouped_tensor(grouped_fc1_x, swiglu_in,
  scales, grouped_fc2_x)` (fwd 455) marks them for megatron's paged stash;
- bwd 335-360 the output gradient group-quantized (row- and column-wise [N, H]); 388-390 the probs
  in fp32 and their gradient's zeros [N]; 449-460 the dSwiGLU kernel: fc1's output gradient
  MXFP8 [N, 2F] row- and column-wise, the probs' gradient cast to the compute dtype; 485-510
  fc2's weight gradients (into main_grad, or new), fc2's saved input cleared; 512-575 fc1's
  input gradient [N, H] in the compute dtype; fc1's weight gradients, fc1's saved input cleared;
- bwd 127-160 with delayed weight gradients each GEMM waits in its GroupedLinear's `wgrad_store`
  (ops.py) with its operands: the saved column-wise input and the MXFP8 output gradient (fc2:
  the quantized output gradient; fc1: the dSwiGLU kernel's), the inputs not cleared (536-539,
  631-634); megatron's TEGroupedMLP.backward_dw runs and frees them.
No TE code is copied here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from inspector.world.te.kernels import quantize
from inspector.world.te.kernels.functions import (
    clear_tensor_data,
    delayed_wgrad_gemm,
    grouped_wgrad,
)

FUSED_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"  # forward_grouped_mlp.py 74
DIM_MULTIPLE = 256  # _common.py 156-160: every in/out feature count
GLU_INTERLEAVE = 32  # _common.py 162: the SwiGLU's interleave (--moe-mlp-glu-interleave-size)
MXFP8 = "mxfp8"


def taken(ops: list[Any], recipe: str | None) -> bool:
    """Whether TE 2.14's fuser replaces the three operations with the CuTe DSL kernels
    (_common.py `fuse_grouped_mlp_ops`; the GPU is taken to be compute capability 10.x)."""
    if recipe != MXFP8 or int(os.environ.get(FUSED_ENV, "0")) <= 0 or len(ops) != 3:
        return False
    fc1, act, fc2 = ops
    names = [type(op).__name__ for op in ops]
    dims = (fc1.in_features, fc1.out_features, fc2.in_features, fc2.out_features)
    return (names == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
            and fc1.num_groups == fc2.num_groups and not fc1.use_bias and not fc2.use_bias
            and all(d % DIM_MULTIPLE == 0 for d in dims)
            and act.glu_interleave_size == GLU_INTERLEAVE)  # fmt: skip


def _mxfp8(rows: int, cols: int, weight: bool = False) -> quantize.Quantized:
    return quantize.quantize(rows, cols, MXFP8, True, True, weight=weight)


def _weights(op: Any) -> list[quantize.Quantized | None]:
    """fwd 230-282: each expert's weight as MXFP8 (row- and column-wise); an MXFP8 parameter is
    its own (None here: nothing new)."""
    from inspector.world.te.mxfp8_tensor import MXFP8Tensor

    out: list[quantize.Quantized | None] = []
    for i in range(op.num_groups):
        w = getattr(op, f"weight{i}")
        out.append(None if isinstance(w, MXFP8Tensor) else _mxfp8(op.out_features, op.in_features, True))
    return out


def _mark(*tensors: torch.Tensor | quantize.Quantized) -> None:
    """TE utils.py `mark_grouped_tensor` (v2.14, 173-193): megatron's paged stash pages what
    carries the mark; a grouped MXFP8 tensor's column-wise data is marked False and its
    column-wise scales True (a 32nd of the rows: paged_stash.py `SCALE_INV_BLOCK_SIZE`), a plain
    tensor False."""
    for tensor in tensors:
        if isinstance(tensor, quantize.Quantized):
            data, scales = tensor.columnwise
            data.grouped_tensor_scale_inv = False  # type: ignore[attr-defined]
            scales.grouped_tensor_scale_inv = True  # type: ignore[attr-defined]
        else:
            tensor.grouped_tensor_scale_inv = False  # type: ignore[attr-defined]


def forward(ops: list[Any], x: torch.Tensor, extras: list[Any]) -> tuple[torch.Tensor, list[Any], Any]:
    """Run the fused forward: return the output, the tensors to save and what backward needs."""
    fc1, _, fc2 = ops
    split_sizes, scales, _ = extras
    n, g, dtype, device = x.shape[0], fc1.num_groups, fc1.weight0.dtype, x.device
    h, f = fc1.in_features, fc2.in_features
    sizes = split_sizes.to(dtype=torch.int64, device=device)  # fwd 192-205
    points = torch.empty(g, dtype=torch.int32, device=device)
    fc1_offsets = torch.empty(g + 1, dtype=torch.int64, device=device)
    fc2_offsets = torch.empty(g + 1, dtype=torch.int64, device=device)
    w1, w2 = _weights(fc1), _weights(fc2)
    fc1_x = _mxfp8(n, h)
    probs = scales.detach().to(dtype=dtype)  # fwd 334: the kernel's prob_tensor
    swiglu_in = torch.empty(n, 2 * f, dtype=torch.bfloat16, device=device)
    fc2_x = _mxfp8(n, f)
    del probs
    ones = torch.empty(n, dtype=torch.float32, device=device)  # fwd 433
    out = torch.empty(n, fc2.out_features, dtype=dtype, device=device)
    del ones
    _mark(fc1_x, swiglu_in, scales, fc2_x)
    kept = [t for q in (*w1, *w2) if q is not None for t in q.tensors()]
    to_save = [sizes, points, *fc1_x.columnwise, fc1_offsets, swiglu_in, scales,
               *fc2_x.columnwise, fc2_offsets, *kept]  # fmt: skip
    return out, to_save, (n, h, f, dtype)


def _wgrads(op: Any, x_col: list[Any], grad: quantize.Quantized, like: torch.Tensor) -> list[Any]:
    """bwd 86-175 `_compute_grad_params`: one GroupedLinear's weight gradients (into main_grad,
    or new), run now and its saved input cleared, or with delayed weight gradients kept with
    their operands for `backward_dw` (the weights then get main_grad's placeholders, or none)."""
    fuse = op._accumulate_into_main_grad
    grads = [grouped_wgrad(getattr(op, f"weight{i}"), fuse, like) for i in range(op.num_groups)]
    if not op.need_backward_dw():
        clear_tensor_data(*x_col)
        return grads
    op.wgrad_store.put([x_col, list(grad.tensors()), grads], delayed_wgrad_gemm)
    return grads if fuse else [None] * op.num_groups


def backward(ops: list[Any], state: Any, saved: tuple[Any, ...], dy: torch.Tensor) -> tuple[Any, ...]:
    """Run the fused backward: return the input's gradient, the weights' (fc1's, then fc2's)
    and the extra inputs' (split sizes, probs, split sizes)."""
    fc1, _, fc2 = ops
    n, h, f, dtype = state
    device = dy.device
    fc1_x_col, swiglu_in, scales, fc2_x_col = saved[2:4], saved[5], saved[6], saved[7:9]
    del swiglu_in
    dy_q = _mxfp8(n, fc2.out_features)  # bwd 335-360
    probs = scales.detach().to(dtype=torch.float32)
    dprobs = torch.zeros_like(probs)
    fc1_dy = _mxfp8(n, 2 * f)  # the dSwiGLU kernel's d_row/d_col tensors
    grad_scales = dprobs.view(-1).to(dtype=dtype)
    del probs
    grads2 = _wgrads(fc2, list(fc2_x_col), dy_q, dy)
    ones = torch.empty(n, dtype=torch.float32, device=device)
    grad_input = torch.empty(n, h, dtype=dtype, device=device)
    del ones
    grads1 = _wgrads(fc1, list(fc1_x_col), fc1_dy, dy)
    del fc1_dy, dprobs, dy_q  # the kernels' outputs, alive until TE's backward returns
    return grad_input, [*grads1, *grads2], [None, grad_scales, None]
