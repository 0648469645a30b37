"""TE 2.14's operation fuser (`pytorch/ops`) as megatron-core 0.18+'s op-fuser MoE experts build it.

With `--use-transformer-engine-op-fuser`, megatron's TEGroupedMLP._make_fused_ops
(transformer/moe/experts.py, 0.19.2 402-571) builds `ops.Sequential(GroupedLinear, ScaledSwiGLU,
GroupedLinear)` on its first forward, re-registers its own linear_fc1/linear_fc2 parameters on the
two GroupedLinear shells (made on device "meta": no memory of their own), and keeps the container
in a tuple (not a submodule: `params` and megatron's DDP buffers do not change). TE runs the three
as one autograd Function (ops/fuser.py 53-300, `_OperationFuserAutogradFunction`): each basic op's
`fuser_forward` fills its context, one `save_for_backward` keeps them all, and the backward runs
each op's `fuser_backward` in reverse. This mirrors TE 2.14's basic ops (the `v2.14` tag), what TE
runs wherever its CuTe DSL fused grouped MLP is not taken (that kernel needs MXFP8 on sm100:
ops/fused/forward_grouped_mlp.py 71-84), in 16-bit compute, with two TE 2.15+ additions that
megatron-core 0.19.2 builds for gpt-oss (cited at the `v2.17.1` tag, the release 0.19 locks):
ScaledClampedQGeGLU and GroupedLinear's `scale_bias`, and TE 2.17's ScaledSReLU (Nemotron 3) and
`activation_recompute_in_mlp`, which the basic operations refuse as TE's do. Quantized basic
operations and a single grouped weight are not here. With delayed weight gradients (`delay_wgrad_compute`,
megatron's --delay-wgrad-compute) each GroupedLinear's backward keeps its weight-gradient GEMM's
operands in `wgrad_store` until megatron-core's TEGroupedMLP.backward_dw (experts.py) calls
`backward_dw`, which runs the GEMMs and frees them.
megatron checks NVTE_CUTEDSL_FUSED_GROUPED_MLP before it builds them (world/stage.py sets it).
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import torch

from inspector.world.te import fused_mlp
from inspector.world.te.kernels.functions import (
    clear_tensor_data,
    delayed_wgrad_gemm,
    grouped_wgrad,
)
from inspector.world.te.linear import fp8_recipe_name


def _to(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TE ops/_common.py 25-35 `maybe_dequantize` of a plain tensor: cast, then contiguous."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _shell(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """A parameter of this shape that holds no memory: TE makes the shells on device "meta"."""
    return torch.nn.Parameter(
        torch.empty(0, dtype=dtype, device="meta").as_strided(shape, [0] * len(shape))
    )


class WeightGradStore:
    """TE 2.14 module/_common.py 198-270 `WeightGradStore`: with delayed weight gradients, a queue
    of (operands, GEMM) the backward puts and `backward_dw` pops (running the GEMM)."""

    def __init__(self, delay_wgrad_compute: bool = False) -> None:
        self.enabled = delay_wgrad_compute
        self.context: deque[tuple[list[Any], Any]] | None = deque() if delay_wgrad_compute else None

    def delay_wgrad_compute(self) -> bool:
        """_common.py 223-230: whether the weight gradients wait for `backward_dw`."""
        return self.enabled

    def put(self, tensor_list: list[Any], func: Any) -> None:
        """_common.py 240-249: keep the GEMM's operands and the GEMM."""
        assert self.enabled and self.context is not None, "delay_wgrad_compute is not enabled"
        self.context.append((tensor_list, func))

    def pop(self) -> tuple[Any, list[Any]]:
        """_common.py 251-263: run the oldest kept GEMM; return its result and operands."""
        assert self.enabled and self.context is not None, "delay_wgrad_compute is not enabled"
        if not self.context:
            raise RuntimeError("Pop empty queue. No distributed environment detected.")
        tensor_list, func = self.context.popleft()
        return func(*tensor_list), tensor_list


class BasicOperation(torch.nn.Module):
    """TE ops/op.py `BasicOperation`: extra tensor inputs and outputs it takes and gives."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    def fuser_forward(self, ctx: Any, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """Fill `ctx` (`to_save`, flags) and return the output (op.py `fuser_forward`)."""
        raise NotImplementedError(type(self).__name__)

    def fuser_backward(self, ctx: Any, dy: torch.Tensor) -> tuple[Any, list[Any], list[Any]]:
        """Return the input's, the parameters' and the extra inputs' gradients."""
        raise NotImplementedError(type(self).__name__)


class GroupedLinear(BasicOperation):
    """TE 2.14 ops/basic/grouped_linear.py 40-173 (`__init__` 88-173): `weight{i}` of (out, in)
    per group and `bias{i}` (None without bias), one extra input (the split sizes)."""

    num_extra_inputs = 1

    def __init__(
        self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
        device: Any = None, dtype: torch.dtype | None = None, rng_state_tracker_function: Any = None,
        accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
        single_grouped_bias: bool = False, delay_wgrad_compute: bool = False,
        scale_bias: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        # TE 2.15+ (v2.17.1 grouped_linear.py 132-134): the bias times a per-row scale, which
        # comes as a second extra input
        self._scale_bias = scale_bias and bias
        if self._scale_bias:
            self.num_extra_inputs = 2
        if single_grouped_weight or single_grouped_bias:
            raise NotImplementedError("TE's ops.GroupedLinear with a single grouped weight is "
                                      "not simulated")  # fmt: skip
        dtype = dtype or torch.get_default_dtype()
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"Supported dtypes are float32, float16, bfloat16 (got {dtype})")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias = bias
        for i in range(num_groups):
            self.register_parameter(f"weight{i}", _shell(out_features, in_features, dtype=dtype))
        for i in range(num_groups):
            self.register_parameter(f"bias{i}", _shell(out_features, dtype=dtype) if bias else None)
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)  # grouped_linear.py 105

    def need_backward_dw(self) -> bool:
        """grouped_linear.py 185-187: whether `backward_dw` must run to finish the gradients."""
        return self.wgrad_store.delay_wgrad_compute()

    def _wgrads(self, like: torch.Tensor) -> list[Any]:
        """The weight gradients' buffers (grouped_linear.py 846-889): main_grad, or new ones."""
        fuse = self._accumulate_into_main_grad
        return [grouped_wgrad(getattr(self, f"weight{i}"), fuse, like) for i in range(self.num_groups)]

    def backward_dw(self) -> None:
        """grouped_linear.py 189-222: run the kept GEMMs, free the kept inputs (the gradients go
        with the popped list), set `.grad` unless accumulating into main_grad."""
        if not self.need_backward_dw() or not self.wgrad_store.context:
            return
        grad_weights, tensor_list = self.wgrad_store.pop()
        clear_tensor_data(*tensor_list[0])  # the fused MLP's grouped input: its data and scales
        del tensor_list
        if self._accumulate_into_main_grad:
            return
        for i in range(self.num_groups):
            w = getattr(self, f"weight{i}")
            w.grad = grad_weights[i].to(w.dtype)

    def fuser_forward(self, ctx: Any, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """grouped_linear.py 654-789 in 16 bits: the output, and the input split into views and
        the weights saved (`save_for_backward(split_sizes, *xs, *ws)`, 779)."""
        split_sizes, scales = extra[0], (extra[1] if self._scale_bias else None)
        n = self.num_groups
        weights = [getattr(self, f"weight{i}") for i in range(n)]
        if self._accumulate_into_main_grad and getattr(weights[0], "main_grad", None) is None:
            raise RuntimeError("MAIN GRAD NOT FOUND")
        dtype = weights[0].dtype
        sizes = [int(s) for s in split_sizes.tolist()]
        if len(sizes) != n:
            raise ValueError(f"Expected {n} splits, but got {len(sizes)}.")
        ws: list[Any] = [_to(w, dtype) for w in weights]
        xs: list[Any] = list(torch.split(_to(x, dtype), sizes))
        out = torch.empty([*x.shape[:-1], self.out_features], dtype=dtype, device=x.device)
        if scales is not None:  # v2.17.1 grouped_linear.py 1168-1173: out += bias x scale a group
            for bias, rows, out_rows in zip(self._biases(dtype), torch.split(scales, sizes),
                                            torch.split(out, sizes)):  # fmt: skip
                out_rows.add_(bias.unsqueeze(0) * rows.unsqueeze(-1))
        ctx.input_requires_grad = ctx.requires_grad
        ctx.weight_requires_grad = ctx.requires_grad and weights[0].requires_grad
        if not ctx.input_requires_grad:
            ws = [None] * n
        if not ctx.weight_requires_grad:
            xs = [None] * n
        # v2.17.1 1196-1201: the scales after the split sizes (its two Nones are not kept here)
        ctx.to_save = [split_sizes, *([scales] if scales is not None else []), *xs, *ws]
        ctx.dtype = dtype
        return out

    def _biases(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """v2.17.1 grouped_linear.py 278-287 `_get_bias_tensors`: each group's bias in `dtype`."""
        return [_to(getattr(self, f"bias{i}"), dtype) for i in range(self.num_groups)]

    def fuser_backward(self, ctx: Any, dy: torch.Tensor) -> tuple[Any, list[Any], list[Any]]:
        """grouped_linear.py 791-1004: dgrad (894), a wgrad per group into `main_grad` or a new
        one (881), the saved input views cleared (943); grads in parameter order. With delayed
        weight gradients (912-928) the input views and the gradient's split views are kept in
        `wgrad_store`, nothing is cleared, and the weights get no gradient (988-989)."""
        n, first = self.num_groups, 2 if self._scale_bias else 1
        split_sizes, xs = ctx.saved_tensors[0], ctx.saved_tensors[first : first + n]
        sizes = [int(s) for s in split_sizes.tolist()]
        dy = _to(dy, ctx.dtype)
        grad_biases: list[Any] = []
        grad_scales = None
        if self._scale_bias:
            grad_biases, grad_scales = self._scaled_bias_grads(ctx.saved_tensors[1], dy, ctx.dtype)
        elif self.use_bias:
            grad_biases = [d.reshape(-1, d.size(-1)).sum(dim=0) for d in torch.split(dy, sizes)]
        grad_weights: list[Any] = [None] * n
        grad_input = None
        if ctx.input_requires_grad:
            grad_input = torch.empty(
                [*dy.shape[:-1], self.in_features], dtype=ctx.dtype, device=dy.device
            )
        if ctx.weight_requires_grad:
            grad_weights = self._wgrads(dy)
        delay = ctx.weight_requires_grad and self.need_backward_dw()
        if delay:  # the GEMM (into the buffers) waits for backward_dw
            self.wgrad_store.put([list(xs), list(torch.split(dy, sizes)), grad_weights], delayed_wgrad_gemm)
            grad_weights = [None] * n
        else:
            clear_tensor_data(*xs)
        extra = [None, grad_scales] if self._scale_bias else [None]
        return grad_input, [*grad_weights, *grad_biases], extra

    def _scaled_bias_grads(
        self, scales: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """v2.17.1 grouped_linear.py 1398-1411: the biases stacked, the scales in fp32, and
        triton/grouped_dbias_dscales.py 77-128's fp32 bias [groups, out] and scale [rows]
        gradients; each bias gradient cast back to `dtype`."""
        g, device = self.num_groups, dy.device
        offsets = torch.zeros(g + 1, dtype=torch.int64, device=device)  # noqa: F841 (as in TE)
        packed = torch.stack(self._biases(dtype))  # noqa: F841
        scales_f32 = scales.to(dtype=torch.float32)  # noqa: F841
        dbias = torch.zeros(g, dy.size(-1), dtype=torch.float32, device=device)
        dscales = torch.zeros(dy.numel() // dy.size(-1), dtype=torch.float32, device=device)
        return [dbias[i].to(dtype=dtype) for i in range(g)], dscales


def _refuse_recompute(op: BasicOperation) -> None:
    """TE 2.17 (v2.17.1 swiglu.py 426-430, 488-492; activation.py 396-400, 439-443): the basic
    operation refuses `activation_recompute_in_mlp`, which only the fused grouped MLP reads."""
    if getattr(op, "activation_recompute_in_mlp", False):
        raise RuntimeError(f"{type(op).__name__}(activation_recompute_in_mlp=True) requires the "
                           "fused grouped MLP path.")  # fmt: skip


class ScaledSwiGLU(BasicOperation):
    """TE 2.14 ops/basic/swiglu.py 350-502: SwiGLU times a per-row scale (the router's probs);
    TE 2.17's `activation_recompute_in_mlp` (v2.17.1 375-388), which megatron-core 0.19 passes
    for --recompute-modules moe_act."""

    num_extra_inputs = 1

    def __init__(
        self, glu_interleave_size: int | None = None, *, activation_recompute_in_mlp: bool = False
    ) -> None:
        super().__init__()
        self.glu_interleave_size = glu_interleave_size
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu.py 415-425: gate and linear blocks made contiguous (a copy)."""
        if self.glu_interleave_size is None:
            return x
        size, shape = self.glu_interleave_size, x.size()
        x = x.reshape(-1, shape[-1] // (2 * size), 2, size).transpose(1, 2).contiguous()
        return x.view(shape)

    def fuser_forward(self, ctx: Any, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """swiglu.py 389-443: `tex.swiglu` (half the columns), times the scales; the input and
        the scales in the compute dtype saved."""
        _refuse_recompute(self)
        dtype = x.dtype
        x, scales = _to(x, dtype), _to(extra[0], dtype)
        swiglu_in = self._deinterleave(x)
        swiglu_out = torch.empty([*swiglu_in.shape[:-1], swiglu_in.shape[-1] // 2], dtype=dtype,
                                 device=x.device)  # fmt: skip
        out = swiglu_out * scales.unsqueeze(-1)
        ctx.extra_input_requires_grad = extra[0].requires_grad
        ctx.dtype = dtype
        ctx.to_save = [x, scales]
        return out

    def fuser_backward(self, ctx: Any, dy: torch.Tensor) -> tuple[Any, list[Any], list[Any]]:
        """swiglu.py 445-502: `tex.dswiglu` of the scaled gradient, the scales' gradient from a
        recomputed SwiGLU, the saved input cleared (500)."""
        _refuse_recompute(self)
        x, scales = ctx.saved_tensors
        swiglu_in = self._deinterleave(x)
        dy = _to(dy, ctx.dtype)
        grad_swiglu_out = dy * scales.unsqueeze(-1)  # noqa: F841 (alive until the return, as in TE)
        grad_swiglu_in = torch.empty_like(swiglu_in)  # tex.dswiglu
        grad_input = grad_swiglu_in
        if self.glu_interleave_size is not None:
            grad_input = torch.empty_like(grad_swiglu_in)  # re-interleaved (swiglu.py 482-491)
        grad_extra = None
        if ctx.extra_input_requires_grad:
            swiglu_out = torch.empty([*swiglu_in.shape[:-1], swiglu_in.shape[-1] // 2],
                                     dtype=swiglu_in.dtype, device=swiglu_in.device)  # fmt: skip
            grad_extra = torch.linalg.vecdot(swiglu_out, dy)
        clear_tensor_data(ctx.saved_tensors[0])
        return grad_input, [], [grad_extra]


class ScaledClampedQGeGLU(ScaledSwiGLU):
    """TE 2.15+ ops/basic/swiglu.py (v2.17.1 572-625): gpt-oss's clamped quick-GEGLU times the
    scales; `_ScaledGLU` (375-540) allocates, saves and frees as ScaledSwiGLU does."""

    def __init__(
        self, glu_interleave_size: int | None = None, *, limit: float = 7.0, alpha: float = 1.702,
        glu_linear_offset: float = 1.0, activation_recompute_in_mlp: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(glu_interleave_size, activation_recompute_in_mlp=activation_recompute_in_mlp)
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset


class ScaledSReLU(BasicOperation):
    """TE 2.17 ops/basic/activation.py (v2.17.1 351-463): squared ReLU times a per-row scale,
    Nemotron 3's experts (megatron-core 0.19's --use-fused-weighted-squared-relu)."""

    num_extra_inputs = 1

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__()
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    def fuser_forward(self, ctx: Any, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """activation.py 386-424: `tex.srelu` (the input's shape) times the scales; the input and
        the scales in the compute dtype saved."""
        _refuse_recompute(self)
        dtype = x.dtype
        x, scales = _to(x, dtype), _to(extra[0], dtype)
        out = torch.empty_like(x) * scales.unsqueeze(-1)
        ctx.extra_input_requires_grad = extra[0].requires_grad
        ctx.dtype = dtype
        ctx.to_save = [x, scales]
        return out

    def fuser_backward(self, ctx: Any, dy: torch.Tensor) -> tuple[Any, list[Any], list[Any]]:
        """activation.py 426-463: `tex.dsrelu` of the scaled gradient, the scales' gradient from
        a recomputed SReLU (both alive until the return, TE's locals), the saved input cleared
        (461)."""
        _refuse_recompute(self)
        x, scales = ctx.saved_tensors
        dy = _to(dy, ctx.dtype)
        grad_srelu_out = dy * scales.unsqueeze(-1)  # noqa: F841 (alive until the return)
        grad_input = torch.empty_like(x)  # tex.dsrelu(grad_srelu_out, x)
        grad_extra: Any = None
        srelu_out: Any = None
        if ctx.extra_input_requires_grad:
            srelu_out = torch.empty_like(x)  # tex.srelu(x)
            grad_extra = torch.linalg.vecdot(srelu_out, dy)
        clear_tensor_data(ctx.saved_tensors[0])
        return grad_input, [], [grad_extra]


class _OperationFuserFunction(torch.autograd.Function):
    """TE 2.14 ops/fuser.py 53-300: the basic ops in one autograd Function, their saved tensors
    in one `save_for_backward` (172), inputs and output marked `_do_not_clear` (100, 191)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, ops: list[BasicOperation], *tensors: torch.Tensor
    ) -> torch.Tensor:
        counts = [len(list(op.parameters())) for op in ops]
        extras = list(tensors[sum(counts) :])
        for tensor in (x, *tensors):
            tensor._do_not_clear = True  # type: ignore[attr-defined]
        ctx.ops, ctx.counts, ctx.fused = ops, counts, None
        recipe = fp8_recipe_name()
        if recipe is not None and not fused_mlp.taken(ops, recipe):
            multiple = fused_mlp.DIM_MULTIPLE[fused_mlp.fused_rules()]
            raise NotImplementedError(
                f"Transformer Engine's basic operations in {recipe} (split_quantize) are not "
                f"simulated; only its MXFP8 fused grouped MLP is (feature counts multiples of "
                f"{multiple}, a gated unit interleaved by 32)")  # fmt: skip
        if recipe is not None:  # MXFP8's CuTe DSL kernels (fused_mlp.py)
            x, fused_saved, ctx.fused = fused_mlp.forward(ops, x, extras)
            ctx.save_for_backward(*fused_saved)
            x._do_not_clear = True  # type: ignore[attr-defined]
            return x
        contexts: list[tuple[Any, int, int]] = []
        to_save: list[Any] = []
        for op in ops:
            op_ctx = SimpleNamespace(requires_grad=True)
            x = op.fuser_forward(op_ctx, x, *[extras.pop(0) for _ in range(op.num_extra_inputs)])
            contexts.append((op_ctx, len(to_save), len(to_save) + len(op_ctx.to_save)))
            to_save.extend(op_ctx.to_save)
            op_ctx.to_save = None  # fuser.py 165-167: only the Function keeps them
        ctx.save_for_backward(*to_save)
        ctx.contexts = contexts
        x._do_not_clear = True  # type: ignore[attr-defined]
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        saved = ctx.saved_tensors
        if ctx.fused is not None:
            grad_input, weight_grads, fused_extra = fused_mlp.backward(ctx.ops, ctx.fused, saved, dy)
            return (grad_input, None, *weight_grads, *fused_extra)
        grads: list[Any] = [None] * len(ctx.ops)
        extra_grads: list[Any] = [None] * len(ctx.ops)
        for index in reversed(range(len(ctx.ops))):
            op_ctx, start, stop = ctx.contexts[index]
            op_ctx.saved_tensors = saved[start:stop]
            dy, grads[index], extra_grads[index] = ctx.ops[index].fuser_backward(op_ctx, dy)
            op_ctx.saved_tensors = None
        flat = [g for group in grads for g in group] + [g for group in extra_grads for g in group]
        return (dy, None, *flat)


class Sequential(torch.nn.Module):
    """TE 2.14 ops/sequential.py 17-190: a container of fusible operations, run as one fuser."""

    def append(self, module: BasicOperation) -> Sequential:
        """sequential.py 109-112: add an operation at the end."""
        self.add_module(str(len(self._modules)), module)
        return self

    def forward(self, x: torch.Tensor, *extra_inputs: torch.Tensor) -> torch.Tensor:
        """sequential.py 167-190 with fuser.py 462-510: params, then the extra inputs, to autograd."""
        ops = [op for op in self._modules.values() if isinstance(op, BasicOperation)]
        expected = sum(op.num_extra_inputs for op in ops)
        if len(extra_inputs) != expected:
            raise ValueError(f"Expected {expected} extra inputs but got {len(extra_inputs)}")
        params = [p for op in ops for p in op.parameters()]
        return _OperationFuserFunction.apply(x, ops, *params, *extra_inputs)


# what TE's `transformer_engine.pytorch.ops` exports that megatron-core 0.18+ calls, and the
# release that added an op after 2.13 (ops/basic/__init__.py at the `v2.15` tag)
SINCE = {"ScaledClampedQGeGLU": (2, 15), "ScaledSReLU": (2, 17)}  # v2.17 activation.py 351
OPS = {"BasicOperation": BasicOperation, "GroupedLinear": GroupedLinear,
       "ScaledSwiGLU": ScaledSwiGLU, "ScaledClampedQGeGLU": ScaledClampedQGeGLU,
       "ScaledSReLU": ScaledSReLU, "Sequential": Sequential}  # fmt: skip
