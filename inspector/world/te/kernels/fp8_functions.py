"""TE's linear autograd Functions under fp8: what `_Linear` and `_LayerNormLinear` allocate and save.

Mirrors the `fp8` branches of TE 2.11 (`v2.11` tag) `pytorch/module/linear.py` (`_Linear.forward`
172-440, `backward` 560-830) and `layernorm_linear.py` (`_LayerNormLinear`), on Hopper:
- the input is quantized (row-wise for the forward GEMM, column-wise for wgrad); under sequence
  parallelism Float8 quantizers all-gather row-wise fp8 data only (`supports_only_rowwise_all_gather`);
- the weight is the module's cached fp8 workspace (`get_weight_workspace`, cache "weight"),
  quantized once per step, held by the module (module.py here);
- saved for backward (linear.py 386-439): the input's column-wise fp8 copy (row-wise when it must
  be all-gathered again in backward), the fp8 weight, the weight and bias;
- backward quantizes the output gradient (row-wise for dgrad, column-wise for wgrad); GEMM outputs
  (forward output, dgrad) stay in the activation dtype; wgrad goes to `main_grad` as without fp8.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te import cpu_offload
from inspector.world.te.kernels import quantize as q
from inspector.world.te.kernels.functions import (
    RETURN_GATHERED,
    RETURN_LOCAL,
    GemmSetup,
    _dgrad,
    _gemm_out,
    _grad_output,
    _weight_grads,
    gather_along_first_dim,
    reduce_scatter_along_first_dim,
)


def _quantize_input(
    rows: int, cols: int, setup: GemmSetup, needs_input: bool
) -> tuple[q.Quantized, q.Quantized, q.Quantized | None]:
    """Quantize a GEMM input (linear.py 172-240): (local, GEMM operand, saved for backward)."""
    recipe = str(setup.fp8)
    only_rowwise = q.only_rowwise_all_gather(recipe)
    if setup.gathers_input:
        local = q.quantize(rows, cols, recipe, True, needs_input and not only_rowwise)
        total = q.gather(local.keep(True, False), setup.tp_size, recipe)
    else:
        local = q.quantize(rows, cols, recipe, True, needs_input)
        total = local
    if not needs_input:
        return local, total, None
    if setup.gathers_input and only_rowwise:  # linear.py 390-396: gathered again in backward
        return local, total, local.keep(True, False)
    return local, total, local.keep(False, True)  # 397-399: row-wise data discarded


def _forward(total: q.Quantized, weight: torch.Tensor, setup: GemmSetup, like: torch.Tensor) -> Any:
    """The fp8 GEMM: output in the activation dtype, reduce-scattered for row parallel + SP."""
    out = _gemm_out(total.rows, weight.shape[0], like)
    if setup.scatters_output:
        out = reduce_scatter_along_first_dim(out, setup.tp_size)
    return out


def _backward_gemms(
    ctx: Any, grad_output: torch.Tensor, saved_in: tuple[torch.Tensor, ...], weight: torch.Tensor,
    bias: torch.Tensor,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """dgrad and wgrad with the output gradient quantized (linear.py 560-830)."""
    setup: GemmSetup = ctx.setup
    recipe = str(setup.fp8)
    grad = _grad_output(ctx, grad_output)
    grad_q = q.quantize(grad.shape[0], grad.shape[1], recipe, ctx.requires_dgrad, ctx.requires_wgrad)
    gemm_out, dgrad = _dgrad(ctx, grad, weight)
    total = None
    if ctx.requires_wgrad and setup.gathers_input:  # the saved input gathered again
        rows = ctx.in_rows * setup.tp_size
        total = q.quantize(rows, ctx.in_cols, recipe, True, True)
    wgrad, grad_bias = _weight_grads(ctx, weight, bias, grad)
    del grad_q, total, gemm_out, saved_in
    return dgrad, wgrad, grad_bias


class Fp8LinearFunction(torch.autograd.Function):
    """TE `_Linear` with fp8 (linear.py, v2.11); saves (*input fp8, *weight fp8, weight, bias)."""

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, setup: GemmSetup,
        weight_q: q.Quantized,
    ) -> torch.Tensor:  # fmt: skip
        inputmat = inp.reshape(-1, inp.shape[-1])
        rows, cols = inputmat.shape
        _, total, saved = _quantize_input(rows, cols, setup, weight.requires_grad)
        out = _forward(total, weight, setup, inputmat)
        del total
        saved_in = saved.tensors() if saved is not None else ()
        if cpu_offload.is_cpu_offload_enabled():  # linear.py 420-431: mark_not_offload
            cpu_offload.mark_not_offload(weight, *weight_q.tensors(), bias)
        ctx.save_for_backward(*saved_in, *weight_q.tensors(), weight, bias)
        ctx.weight_object = weight  # under offloading hooks, as LinearFunction (functions.py)
        ctx.n_saved_in = len(saved_in)
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
        ctx.in_rows, ctx.in_cols = rows, cols
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weight.requires_grad
        return out.view(-1, *inp.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        saved = ctx.saved_tensors
        bias = saved[-1]
        dgrad, wgrad, grad_bias = _backward_gemms(
            ctx, grad_output, saved[: ctx.n_saved_in], ctx.weight_object, bias
        )
        dgrad = None if dgrad is None else dgrad.view(ctx.inp_shape)
        return dgrad, wgrad, grad_bias, None, None


class Fp8LayerNormLinearFunction(torch.autograd.Function):
    """TE `_LayerNormLinear` with fp8 (layernorm_linear.py, v2.11): the norm writes `ln_out`
    quantized (`with_quantized_norm`), which is the GEMM input and is saved in fp8; the norm's
    input (16-bit) and fp32 statistics are saved as without fp8."""

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor | None,
        weight: torch.Tensor, bias: torch.Tensor, setup: GemmSetup, weight_q: q.Quantized,
        ret_ln: int = 0,
    ) -> Any:  # fmt: skip
        inputmat = inp.view(-1, inp.shape[-1])
        rows, cols = inputmat.shape
        mu = None
        if setup.normalization == "LayerNorm":
            mu = torch.empty((rows,), dtype=torch.float32, device=inp.device)
        rsigma = torch.empty((rows,), dtype=torch.float32, device=inp.device)
        ln_return = None
        if ret_ln:
            # layernorm_linear.py 244-292 (TE 2.20.2): a returned norm output is not quantized by
            # the norm (`with_quantized_norm` off): written in high precision (gathered so, when
            # returned gathered), then quantized as the GEMM's input
            ln_return = torch.empty_like(inputmat)
            if ret_ln == RETURN_GATHERED and setup.gathers_input:
                ln_return = gather_along_first_dim(ln_return, setup.tp_size)
        _, total, saved = _quantize_input(rows, cols, setup, weight.requires_grad)
        out = _forward(total, weight, setup, inputmat)
        del total
        saved_ln = saved.tensors() if saved is not None else ()
        ctx.save_for_backward(
            inputmat, *weight_q.tensors(), weight, bias, ln_weight, *saved_ln, mu, rsigma
        )
        ctx.n_saved_ln = len(saved_ln)
        ctx.weight_object = weight  # layernorm_linear.py, as LinearFunction's
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
        ctx.in_rows, ctx.in_cols = rows, cols
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weight.requires_grad
        ctx.has_ln_bias = ln_bias is not None
        ctx.n_weight_q = len(weight_q.tensors())
        ctx.ret_ln = ret_ln
        out = out.view(-1, *inp.shape[1:-1], weight.shape[0])
        if ln_return is None:
            return out
        return out, ln_return.view(-1, *inp.shape[1:])  # 619-625

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *grad_ln: Any) -> Any:
        saved = ctx.saved_tensors
        inputmat = saved[0]
        # 1134-1135: a returned local norm output's gradient added to dgrad (a new tensor)
        residual = None
        if ctx.ret_ln == RETURN_LOCAL and grad_ln and grad_ln[0] is not None:
            residual = torch.empty_like(inputmat)
        at = 1 + ctx.n_weight_q
        bias, ln_weight = saved[at + 1], saved[at + 2]
        saved_ln = saved[at + 3 : at + 3 + ctx.n_saved_ln]
        _, wgrad, grad_bias = _backward_gemms(ctx, grad_output, saved_ln, ctx.weight_object, bias)
        # tex.layernorm_bwd / rmsnorm_bwd (layernorm_linear.py 968-992): dx, dgamma (, dbeta)
        dx = torch.empty_like(inputmat)
        dgamma = torch.empty_like(ln_weight)
        dbeta = torch.empty_like(ln_weight) if ctx.has_ln_bias else None
        del residual
        return dx.view(ctx.inp_shape), dgamma, dbeta, wgrad, grad_bias, None, None, None


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """TE `_GroupedLinear` with fp8 (grouped_linear.py, v2.11, `forward` 66-304): the input split
    and quantized per GEMM (`tex.split_quantize`, row-wise and column-wise), the cached fp8 weight
    of each GEMM (`get_weight_workspace`, cache "weight{i}"); saved (250-256): each input's
    column-wise copy (232-233), the fp8 weights, the weights and biases. Backward quantizes the
    output gradient per GEMM (both directions) before the dgrad and wgrad GEMMs."""

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, m_splits: list[int], fuse_wgrad: bool, recipe: str,
        weights_q: list[q.Quantized], *params: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        n = len(m_splits)
        weights, biases = params[:n], params[n:]
        cols = inp.shape[-1]
        needs_input = weights[0].requires_grad
        inputmats = [q.quantize(m, cols, recipe, True, needs_input) for m in m_splits]
        out = torch.empty((sum(m_splits), weights[0].shape[0]), dtype=inp.dtype, device=inp.device)
        saved = [x.keep(False, True).tensors() for x in inputmats] if needs_input else []
        del inputmats
        flat_in = [t for tensors in saved for t in tensors]
        flat_w = [t for w in weights_q for t in w.tensors()]
        if cpu_offload.is_cpu_offload_enabled():  # grouped_linear.py 218-219
            cpu_offload.mark_not_offload(*flat_w, *weights)
        ctx.save_for_backward(*flat_in, *flat_w, *weights, *biases)
        ctx.n_saved = len(flat_in) + len(flat_w)
        ctx.weight_objects = weights  # grouped_linear.py under cpu_offloading, as GroupedLinearFunction
        ctx.m_splits, ctx.inp_shape, ctx.fuse, ctx.recipe = m_splits, inp.shape, fuse_wgrad, recipe
        ctx.use_bias = biases[0].numel() > 0
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, needs_input
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        from inspector.world.te.kernels.functions import grouped_wgrad

        n = len(ctx.m_splits)
        rest = ctx.saved_tensors[ctx.n_saved :]
        weights, biases = rest[:n], rest[n:]
        grad = grad_output.contiguous().view(-1, grad_output.shape[-1])
        grads_q = [q.quantize(m, grad.shape[1], ctx.recipe, True, True) for m in ctx.m_splits]
        grad_biases: list[Any] = [None] * n
        if ctx.use_bias:
            grad_biases = [g.sum(dim=0) for g in torch.split(grad, ctx.m_splits)]
        dgrad = None
        if ctx.requires_dgrad:
            shape = (grad.shape[0], weights[0].shape[1])
            dgrad = torch.empty(shape, dtype=grad.dtype, device=grad.device).view(ctx.inp_shape)
        wgrads: list[Any] = [None] * n
        if ctx.requires_wgrad:
            wgrads = [grouped_wgrad(weight, ctx.fuse, grad) for weight in ctx.weight_objects]
        del grads_q
        return (dgrad, None, None, None, None, *wgrads,
                *(grad_biases if ctx.use_bias else [None] * len(biases)))  # fmt: skip


class PadRowsFunction(torch.autograd.Function):
    """TE's `_Fp8Padding` / `_Fp8Unpadding` (module/fp8_padding.py 20-71, fp8_unpadding.py):
    a new [sum(rows_out), F] tensor forward, a new [sum(rows_in), F] gradient backward."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, rows_in: list[int], rows_out: list[int]) -> torch.Tensor:
        ctx.rows_in = rows_in
        features = inp.shape[-1]
        return torch.empty((sum(rows_out), features), dtype=inp.dtype, device=inp.device)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        shape = (sum(ctx.rows_in), grad_output.shape[-1])
        return torch.empty(shape, dtype=grad_output.dtype, device=grad_output.device), None, None


def _align(align_size: int | None) -> int:
    """TE quantization.py `get_align_size_for_quantization` (118-124): 32 for mxfp8, 64 for
    nvfp4, else 16."""
    if align_size is not None:
        return align_size
    from inspector.world.te.state import FP8GlobalStateManager

    recipe = FP8GlobalStateManager.get_fp8_recipe()
    return 32 if recipe.mxfp8() else 64 if recipe.nvfp4() else 16


class Fp8Padding(torch.nn.Module):
    """TE's Fp8Padding (module/fp8_padding.py 74-144): pad each GEMM's rows to the alignment."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, list[int]]:
        align = _align(self.align_size)
        padded = [(m + align - 1) // align * align for m in m_splits]
        if m_splits == padded:
            return inp, m_splits
        out: torch.Tensor = PadRowsFunction.apply(inp, list(m_splits), padded)
        return out, padded


class Fp8Unpadding(torch.nn.Module):
    """TE's Fp8Unpadding (module/fp8_unpadding.py): drop each GEMM's padding rows."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        align = _align(self.align_size)
        padded = [(m + align - 1) // align * align for m in m_splits]
        if m_splits == padded:
            return inp
        out: torch.Tensor = PadRowsFunction.apply(inp, padded, list(m_splits))
        return out
