"""TE's CuTe DSL fused grouped MLP in MXFP8 on meta tensors: what it allocates, saves and frees.
TE 2.14's `ForwardGroupedMLP_CuTeGEMMSwiGLU_MXFP8` / `BackwardGroupedMLP_CuTeGEMMDSwiGLU_MXFP8`
(the `v2.14` tag: ops/fused/forward_grouped_mlp.py, backward_grouped_mlp.py), and where the
stand-in declares TE 2.17 (megatron-core 0.19) its successor `GroupedMLP_CuTeGEMMGLU` /
`GroupedMLP_CuTeGEMMUnary` (the `v2.17.1` tag: ops/fused/grouped_mlp.py, "gm" below), which adds
gpt-oss's clamped quick-GEGLU, Nemotron 3's squared ReLU (ScaledSReLU), biases and the squared
ReLU's recompute.

TE's fuser replaces `GroupedLinear, activation, GroupedLinear` with the fused operation
(2.14: ops/_common.py `fuse_grouped_mlp_ops` 103-180; 2.17: gm 681-760 with
`validate_grouped_mlp_dims` 648-678) when NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0, the GPU's compute
capability is 10.x and cuDNN front-end's sm100 kernels import (`is_supported`, gm 802-819), and
the recipe is MXFP8. TE 2.14 takes SwiGLU without biases, every feature count a multiple of 256; TE 2.17 takes
ScaledSwiGLU, ScaledClampedQGeGLU or ScaledSReLU, with or without biases, every feature count a
multiple of 64; a GLU interleaved by 32 in both. MXFP8 runs on Blackwell GPUs only; the tool
takes a datacenter Blackwell (compute capability 10.x), where the kernel is taken.

Sizes, with N permuted rows, H the hidden size, F the expert FFN size, A the activation's input
width (2F for a GLU, F for squared ReLU) and G local experts (2.14 fwd/bwd lines, then gm's):
- fwd 285-295 (gm 1019-1069) `group_quantize` of the input: MXFP8 row- and column-wise [N, H];
- fwd 230-282 (gm 963-1005) each expert's weight quantized (row- and column-wise) unless it is
  already an MXFP8 parameter;
- gm 1130-1131, 293-305: each biased GroupedLinear's biases stacked [G, out] for the kernels;
- fwd 373-386 (gm 1134-1252) the fc1 kernel: `c_tensor` (the activation's input) bf16 [N, A],
  fc2's input MXFP8 [N, F] both ways; the probs in the compute dtype;
- fwd 449-453 (gm 1366-1425) the fc2 kernel: its probs (fc2's bias scales, else ones) fp32 [N],
  the output [N, H] in the compute dtype;
- fwd 455-510 (gm 1428-1493) saved: the split sizes and points, the quantized weights, the
  column-wise halves of fc1's and fc2's inputs, the activation's input and the probs; fc2's
  input is not kept where the squared ReLU recomputes it (gm 1432-1443,
  `activation_recompute_in_mlp`); `mark_grouped_tensor` marks them for megatron's paged stash;
- bwd 335-360 (gm 1566-1605) the output gradient group-quantized (row- and column-wise [N, H]);
  388-390 (gm 1669-1671) the probs in fp32 and their gradient's zeros [N]; 449-460 (gm
  1673-1797) the dactivation kernel: fc1's output gradient MXFP8 [N, A] both ways (and, when it
  recomputes fc2's input, that input column-wise, gm 1799-1843); fc1's bias gradient [G, A],
  taken to be fp32 as the kernel's accumulator (gm 1875-1882 casts it to the compute dtype);
- gm 1848-1872: fc2's biases scaled by the probs: the biases stacked [G, H], triton's fp32
  [G, H] bias gradient (triton/grouped_dbias_dscales.py 77-128), cast to the compute dtype;
- bwd 485-510 (gm 1916-1944) fc2's weight gradients (into main_grad, or new), fc2's input
  cleared; 512-575 (gm 1946-2055) fc1's input gradient [N, H]; fc1's weight gradients, fc1's
  input cleared;
- bwd 127-160 (gm 590-620) with delayed weight gradients each GEMM waits in its
  GroupedLinear's `wgrad_store` (ops.py) with its operands, the inputs not cleared; megatron's
  TEGroupedMLP.backward_dw runs and frees them.
The small split tensors follow 2.14's layout (2.17 packs them in one allocation: gm 924-938).
No TE code is copied here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from inspector.world.te import release as te_release  # a name tests/test_fused_mlp.py replaces
from inspector.world.te.kernels import quantize
from inspector.world.te.kernels.functions import (
    clear_tensor_data,
    delayed_wgrad_gemm,
    grouped_wgrad,
)

FUSED_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"  # forward_grouped_mlp.py 74, gm 806
DIM_MULTIPLE = {(2, 14): 256, (2, 17): 64}  # _common.py 156-160; gm 650-658: every feature count
GLU_INTERLEAVE = 32  # _common.py 162, gm 674-678: the GLU's interleave (--moe-mlp-glu-interleave-size)
GLUS = ("ScaledSwiGLU", "ScaledClampedQGeGLU")  # gm 643-645 `is_glu_activation`
MXFP8 = "mxfp8"


def fused_rules() -> tuple[int, int]:
    """Which fused grouped MLP the declared release has: 2.14's, or 2.17's (gm)."""
    return (2, 17) if te_release() >= (2, 17) else (2, 14)


def taken(ops: list[Any], recipe: str | None) -> bool:
    """Whether TE's fuser replaces the three operations with the CuTe DSL kernels
    (2.14 _common.py `fuse_grouped_mlp_ops`, gm 681-760; the GPU is taken to be compute
    capability 10.x)."""
    if recipe != MXFP8 or int(os.environ.get(FUSED_ENV, "0")) <= 0 or len(ops) != 3:
        return False
    fc1, act, fc2 = ops
    names = [type(op).__name__ for op in ops]
    rules = fused_rules()
    glu = names[1] in GLUS
    acts = GLUS + ("ScaledSReLU",) if rules >= (2, 17) else ("ScaledSwiGLU",)
    dims = (fc1.in_features, fc1.out_features, fc2.in_features, fc2.out_features)
    biases = rules >= (2, 17) or not (fc1.use_bias or fc2.use_bias)
    return (names[0] == names[2] == "GroupedLinear" and names[1] in acts and biases
            and fc1.num_groups == fc2.num_groups and all(d % DIM_MULTIPLE[rules] == 0 for d in dims)
            and fc1.out_features == (2 if glu else 1) * fc2.in_features
            and (not glu or act.glu_interleave_size == GLU_INTERLEAVE))  # fmt: skip


def recomputes(ops: list[Any]) -> bool:
    """gm 1432-1443: the squared ReLU asked to recompute (`activation_recompute_in_mlp`) keeps
    no fc2 input; the dSReLU kernel makes it again (cuDNN front-end's dSReLU and wgrad kernels
    are taken to import, as `is_supported` is)."""
    return type(ops[1]).__name__ == "ScaledSReLU" and ops[1].activation_recompute_in_mlp


def _mxfp8(rows: int, cols: int, weight: bool = False) -> quantize.Quantized:
    return quantize.quantize(rows, cols, MXFP8, True, True, weight=weight)


def _biases(op: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """gm 293-305 `_pack_grouped_linear_bias_for_cudnn` (and 1851's `torch.stack`): a biased
    GroupedLinear's biases stacked [G, out]."""
    if not op.use_bias:
        return None
    return torch.stack([getattr(op, f"bias{i}").to(dtype) for i in range(op.num_groups)])


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
    split_sizes, scales = extras[0], extras[1]
    n, g, dtype, device = x.shape[0], fc1.num_groups, fc1.weight0.dtype, x.device
    h, f, a = fc1.in_features, fc2.in_features, fc1.out_features
    sizes = split_sizes.to(dtype=torch.int64, device=device)  # fwd 192-205
    points = torch.empty(g, dtype=torch.int32, device=device)
    fc1_offsets = torch.empty(g + 1, dtype=torch.int64, device=device)
    fc2_offsets = torch.empty(g + 1, dtype=torch.int64, device=device)
    w1, w2 = _weights(fc1), _weights(fc2)
    fc1_x = _mxfp8(n, h)
    b1, b2 = _biases(fc1, dtype), _biases(fc2, dtype)
    probs = scales.detach().to(dtype=dtype)  # fwd 334: the kernel's prob_tensor
    act_in = torch.empty(n, a, dtype=torch.bfloat16, device=device)
    fc2_x = _mxfp8(n, f)
    del probs
    if getattr(fc2, "_scale_bias", False):  # gm 1366-1370: the bias's scales in fp32
        fc2_probs = extras[3].detach().to(dtype=torch.float32)
    else:
        fc2_probs = torch.empty(n, dtype=torch.float32, device=device)  # fwd 433: ones
    out = torch.empty(n, fc2.out_features, dtype=dtype, device=device)
    del fc2_probs, b1, b2
    _mark(fc1_x, act_in, scales, fc2_x)
    kept = [t for q in (*w1, *w2) if q is not None for t in q.tensors()]
    fc2_kept = (None, None) if recomputes(ops) else fc2_x.columnwise
    to_save = [sizes, points, *fc1_x.columnwise, fc1_offsets, act_in, scales,
               *fc2_kept, fc2_offsets, *kept]  # fmt: skip
    return out, to_save, (n, h, f, a, dtype)


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
    """Run the fused backward: return the input's gradient, the parameters' (fc1's weights and
    biases, then fc2's) and the extra inputs' (split sizes, probs, split sizes, fc2's scales)."""
    fc1, _, fc2 = ops
    n, h, f, a, dtype = state
    device = dy.device
    fc1_x_col, scales, fc2_x_col = list(saved[2:4]), saved[6], list(saved[7:9])
    scale_bias = bool(getattr(fc2, "_scale_bias", False))
    if fc2.use_bias and not scale_bias:  # gm 1588-1596: megatron-core scales fc2's biases
        raise NotImplementedError("TE's bgrad_group_quantize (fc2 biases not scaled) is not simulated")
    dy_q = _mxfp8(n, fc2.out_features)  # bwd 335-360
    probs = scales.detach().to(dtype=torch.float32)
    dprobs = torch.zeros_like(probs)
    fc1_dy = _mxfp8(n, a)  # the dactivation kernel's d_row/d_col tensors
    if recomputes(ops):  # gm 1822-1843: the kernel's d_srelu_tensor, column-wise MXFP8
        fc2_x_col = list(quantize.quantize(n, f, MXFP8, False, True).columnwise)
    dbias1 = torch.empty(fc1.num_groups, a, dtype=torch.float32, device=device) if fc1.use_bias else None
    bias_grads2: list[Any] = []
    if scale_bias:  # gm 1848-1858, triton/grouped_dbias_dscales.py 77-128: fp32, then cast
        packed = _biases(fc2, dtype)  # noqa: F841 (alive until the return, as in TE)
        dbias2 = torch.zeros(fc2.num_groups, h, dtype=torch.float32, device=device).to(dtype=dtype)
        bias_grads2 = [dbias2[i] for i in range(fc2.num_groups)]
    grad_scales = dprobs.view(-1).to(dtype=dtype)
    del probs
    bias_grads1 = []
    if dbias1 is not None:  # gm 1875-1882
        cast = dbias1.to(dtype=dtype)
        bias_grads1 = [cast[i] for i in range(fc1.num_groups)]
    grads2 = _wgrads(fc2, fc2_x_col, dy_q, dy)
    ones = torch.empty(n, dtype=torch.float32, device=device)
    grad_input = torch.empty(n, h, dtype=dtype, device=device)
    del ones
    grads1 = _wgrads(fc1, fc1_x_col, fc1_dy, dy)
    del fc1_dy, dprobs, dy_q, dbias1  # the kernels' outputs, alive until TE's backward returns
    extra = [None, grad_scales, None] + ([None] if scale_bias else [])
    return grad_input, [*grads1, *bias_grads1, *grads2, *bias_grads2], extra
