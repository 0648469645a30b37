"""What TE's linear and norm kernels allocate and save for backward, as autograd Functions.

Each Function mirrors a TE 2.11 (`v2.11` tag) autograd Function without the fp8, userbuffers,
cpu-offload, FSDP and delayed-wgrad branches (megatron's defaults take none): its forward
allocates what TE's forward allocates (GEMM output, `ln_out`, the sequence-parallel gather and
reduce-scatter buffers, the fp32 norm statistics), saves what TE's `ctx.save_for_backward` saves
(`SAVED` names them, in order), and its backward allocates the gradients TE's backward returns
and the temporaries it holds (the gathered input or gradient, the full dgrad before its
reduce-scatter). Tensor-parallel collectives allocate their output (`gather_along_first_dim`,
`reduce_scatter_along_first_dim`) or work in place (`allreduce`): the data never matters here.

With `fuse_wgrad_accumulation` (megatron's `gradient_accumulation_fusion`) the wgrad GEMM
accumulates into `weight.main_grad` (megatron DDP's grad buffer) and the weight's gradient is
TE's kept placeholder (`get_dummy_wgrad`) when megatron marks the weight with
`grad_added_to_main_grad`, so no gradient tensor is allocated per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inspector.world.te import cpu_offload
from inspector.world.te.state import get_dummy_wgrad


@dataclass(frozen=True)
class GemmSetup:
    """What a TE linear's forward takes besides tensors (the `ctx` flags its backward reads)."""

    parallel_mode: str | None  # "column", "row" or None
    tp_size: int
    sequence_parallel: bool
    fuse_wgrad_accumulation: bool
    normalization: str = "LayerNorm"  # LayerNormLinear only
    fp8: str | None = None  # the fp8 recipe inside fp8_autocast (fp8_functions.py), else None

    @property
    def gathers_input(self) -> bool:
        """Return whether the input is all-gathered over tp (column parallel under SP)."""
        return self.parallel_mode == "column" and self.sequence_parallel and self.tp_size > 1

    @property
    def scatters_output(self) -> bool:
        """Return whether the output is reduce-scattered over tp (row parallel under SP)."""
        return self.parallel_mode == "row" and self.sequence_parallel and self.tp_size > 1


# what LayerNormLinear returns beside its output (TE's return_layernorm_output and
# return_layernorm_output_gathered, layernorm_linear.py 1322-1351, 619-625 of TE 2.20.2)
RETURN_LOCAL, RETURN_GATHERED = 1, 2


def gather_along_first_dim(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """TE distributed.py `gather_along_first_dim`: a new tensor tp times as long (dim 0)."""
    shape = (tensor.shape[0] * tp_size, *tensor.shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """TE distributed.py `reduce_scatter_along_first_dim`: a new tensor 1/tp as long (dim 0)."""
    shape = (tensor.shape[0] // tp_size, *tensor.shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)


def clear_tensor_data(*tensors: torch.Tensor | None) -> None:
    """TE utils.py `clear_tensor_data` (v2.11 37-58, v2.14 49-70): free a tensor's storage early
    (`tensor.data = empty`), but never one marked `_do_not_clear` (TE's op fuser marks its inputs)."""
    for tensor in tensors:
        if tensor is not None and not hasattr(tensor, "_do_not_clear"):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def _gemm_out(rows: int, features: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((rows, features), dtype=like.dtype, device=like.device)


def _forward_gemm(ln_out: torch.Tensor, weight: torch.Tensor, setup: GemmSetup) -> torch.Tensor:
    """The forward GEMM and its tp communication (linear.py `_Linear.forward` 183-372)."""
    total = gather_along_first_dim(ln_out, setup.tp_size) if setup.gathers_input else ln_out
    out = _gemm_out(total.shape[0], weight.shape[0], ln_out)
    if setup.gathers_input:
        clear_tensor_data(total)  # "Deallocate GEMM input tensor if no longer needed"
    if setup.scatters_output:
        out = reduce_scatter_along_first_dim(out, setup.tp_size)
    return out


def _weight_grads(
    ctx: Any, weight: torch.Tensor, bias: torch.Tensor, total: torch.Tensor
) -> tuple[Any, Any]:
    """The wgrad GEMM (+ fused bgrad) and the gradient returned for the weight (linear.py
    `_Linear.backward` 783-966): into `main_grad` with fusion, else a new tensor."""
    setup: GemmSetup = ctx.setup
    grad_bias = torch.empty_like(bias) if ctx.use_bias else None
    if not ctx.requires_wgrad:
        return None, grad_bias
    if not setup.fuse_wgrad_accumulation:
        return torch.empty(weight.shape, dtype=total.dtype, device=total.device), grad_bias
    main_grad: torch.Tensor = getattr(weight, "main_grad")  # noqa: B009 (TE's main_grad_func)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(main_grad.shape), weight.dtype), grad_bias
    return None, grad_bias


def _dgrad(ctx: Any, grad: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any]:
    """The dgrad GEMM and its tp communication; return (full GEMM output, dgrad to return).

    TE keeps the GEMM output referenced (`gemm_out`) until backward returns, while the async
    reduce-scatter fills the local dgrad (linear.py 685-760).
    """
    if not ctx.requires_dgrad:
        return None, None
    setup: GemmSetup = ctx.setup
    gemm_out = _gemm_out(grad.shape[0], weight.shape[1], grad)
    if setup.parallel_mode == "column" and setup.tp_size > 1 and setup.sequence_parallel:
        return gemm_out, reduce_scatter_along_first_dim(gemm_out, setup.tp_size)
    return gemm_out, gemm_out


def _grad_output(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
    """TE base.py `grad_output_preprocess` (1099-1127, no fp8): 2-D, contiguous, gathered over
    tp for a row-parallel layer under sequence parallelism."""
    grad = grad_output.reshape((-1, grad_output.shape[-1])).contiguous()
    if ctx.setup.scatters_output:
        grad = gather_along_first_dim(grad, ctx.setup.tp_size)
    return grad


class LinearFunction(torch.autograd.Function):
    """TE `_Linear` (pytorch/module/linear.py, v2.11): `forward` 88-493, `backward` 495-990."""

    SAVED = ("inputmat", "weightmat", "weight", "bias")  # prepare_for_saving, linear.py 433-439

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, setup: GemmSetup
    ) -> torch.Tensor:
        inputmat = inp.reshape(-1, inp.shape[-1])
        out = _forward_gemm(inputmat, weight, setup)
        saved = inputmat if weight.requires_grad else None  # backward_needs_input
        if cpu_offload.is_cpu_offload_enabled():  # linear.py 420-431: mark_not_offload
            cpu_offload.mark_not_offload(weight, bias)
        ctx.save_for_backward(saved, weight, weight, bias)
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
        # under saved-tensor hooks (activation offloading) torch unpacks a Parameter as a plain
        # Tensor, so TE keeps the weight object for its main_grad (linear.py, `cpu_offloading`:
        # `ctx.weight_object = weight`, "Torch rips off the Parameter wrapper")
        ctx.weight_object = weight
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weight.requires_grad
        return out.view(-1, *inp.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        inputmat, _, weight, bias = ctx.saved_tensors
        setup: GemmSetup = ctx.setup
        grad = _grad_output(ctx, grad_output)
        gathered = ctx.requires_wgrad and setup.gathers_input  # backward_input_needs_gather
        total = gather_along_first_dim(inputmat, setup.tp_size) if gathered else inputmat
        gemm_out, dgrad = _dgrad(ctx, grad, weight)
        wgrad, grad_bias = _weight_grads(ctx, ctx.weight_object, bias, grad)
        if gathered:
            clear_tensor_data(total)
        if setup.scatters_output:
            clear_tensor_data(grad)
        del gemm_out
        dgrad = None if dgrad is None else dgrad.view(ctx.inp_shape)
        return dgrad, wgrad, grad_bias, None


class LayerNormLinearFunction(torch.autograd.Function):
    """TE `_LayerNormLinear` (pytorch/module/layernorm_linear.py, v2.11): `forward` 92-540,
    `backward` 542-1040; the norm is `apply_normalization` (module/_common.py: layernorm_fwd or
    rmsnorm_fwd: `ln_out` in the input's dtype, fp32 `mu` (LayerNorm only) and `rsigma` per row)."""

    SAVED = (
        "inputmat", "weightmat", "weight", "bias", "ln_weight", "ln_out", "mu", "rsigma",
    )  # prepare_for_saving, layernorm_linear.py 466-476  # fmt: skip

    @staticmethod
    def forward(
        ctx: Any,
        inp: torch.Tensor,
        ln_weight: torch.Tensor,
        ln_bias: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor,
        setup: GemmSetup,
        ret_ln: int = 0,
    ) -> Any:
        inputmat = inp.view(-1, inp.shape[-1])
        ln_out = torch.empty_like(inputmat)
        rows = (inputmat.shape[0],)
        mu = None
        if setup.normalization == "LayerNorm":
            mu = torch.empty(rows, dtype=torch.float32, device=inp.device)
        rsigma = torch.empty(rows, dtype=torch.float32, device=inp.device)
        ln_return, out = ln_out, None
        if ret_ln == RETURN_GATHERED and setup.gathers_input:
            # layernorm_linear.py 283-288 (TE 2.20.2): gathered in high precision, returned, and
            # the GEMM's input, so kept (427-435)
            ln_return = gather_along_first_dim(ln_out, setup.tp_size)
            out = _gemm_out(ln_return.shape[0], weight.shape[0], ln_out)
        else:
            out = _forward_gemm(ln_out, weight, setup)
        saved_ln_out = ln_out if weight.requires_grad else None
        ctx.save_for_backward(inputmat, weight, weight, bias, ln_weight, saved_ln_out, mu, rsigma)
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
        ctx.weight_object = weight  # layernorm_linear.py, as LinearFunction's
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weight.requires_grad
        ctx.has_ln_bias, ctx.ret_ln = ln_bias is not None, ret_ln
        out = out.view(-1, *inp.shape[1:-1], weight.shape[0])
        if not ret_ln:
            return out
        return out, ln_return.view(-1, *inp.shape[1:])  # 619-625

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, *grad_ln: Any) -> Any:
        inputmat, _, weight, bias, ln_weight, ln_out, mu, rsigma = ctx.saved_tensors
        setup: GemmSetup = ctx.setup
        grad = _grad_output(ctx, grad_output)
        gathered = ctx.requires_wgrad and setup.gathers_input  # ln_out_needs_gather
        total = gather_along_first_dim(ln_out, setup.tp_size) if gathered else ln_out
        gemm_out, dgrad = _dgrad(ctx, grad, weight)
        wgrad, grad_bias = _weight_grads(ctx, ctx.weight_object, bias, grad)
        clear_tensor_data(ln_out)
        if gathered:
            clear_tensor_data(total)
        # 1134-1135: the returned (local) norm output's gradient added to dgrad, a new tensor;
        # a gathered one's gradient is not read
        residual = None
        if ctx.ret_ln == RETURN_LOCAL and grad_ln and grad_ln[0] is not None:
            residual = torch.empty_like(inputmat)
        # tex.layernorm_bwd / rmsnorm_bwd (layernorm_linear.py 968-992): dx, dgamma (, dbeta)
        dx = torch.empty_like(inputmat)
        dgamma = torch.empty_like(ln_weight)
        dbeta = torch.empty_like(ln_weight) if ctx.has_ln_bias else None
        clear_tensor_data(mu, rsigma)
        del gemm_out, dgrad, residual
        return dx.view(ctx.inp_shape), dgamma, dbeta, wgrad, grad_bias, None, None


class NormFunction(torch.autograd.Function):
    """TE's LayerNorm / RMSNorm operations (pytorch/ops/basic/layer_norm.py `op_forward` 176-226,
    `op_backward` 228-266; rmsnorm.py 159-244, v2.11), run by ops/fuser.py's autograd Function:
    output in the input's dtype, fp32 means (LayerNorm) and rstdevs per row."""

    SAVED_LAYER_NORM = ("x", "means", "rstdevs")  # layer_norm.py 221
    SAVED_RMS_NORM = ("x", "rstdevs")  # rmsnorm.py 202

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x = inp.contiguous().view(-1, weight.numel())  # rmsnorm.py 182: a view is copied
        rows = (x.shape[0],)
        rstdevs = torch.empty(rows, dtype=torch.float32, device=inp.device)
        if bias is None:
            ctx.save_for_backward(x, rstdevs)
        else:
            means = torch.empty(rows, dtype=torch.float32, device=inp.device)
            ctx.save_for_backward(x, means, rstdevs)
        ctx.weight_shape, ctx.has_bias = weight.shape, bias is not None
        ctx.weight_dtype = weight.dtype
        return torch.empty_like(inp)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        x = ctx.saved_tensors[0]
        dx = torch.empty_like(x).view(grad_output.shape)
        dw = torch.empty(ctx.weight_shape, dtype=ctx.weight_dtype, device=x.device)
        db = torch.empty_like(dw) if ctx.has_bias else None
        return dx, dw, db


class GroupedLinearFunction(torch.autograd.Function):
    """TE `_GroupedLinear` (pytorch/module/grouped_linear.py, v2.11): `forward` 66-304 (the
    input split into views per GEMM, one output of sum(m_splits) rows), `backward` 306-528
    (one dgrad, a wgrad per GEMM into `main_grad` with fusion, bias gradients per GEMM)."""

    SAVED = ("*inputmats", "*weights_fp8", "*weights", "*biases")  # grouped_linear.py 250-256

    @staticmethod
    def forward(
        ctx: Any, inp: torch.Tensor, m_splits: list[int], fuse_wgrad: bool, *params: torch.Tensor
    ) -> torch.Tensor:
        n = len(m_splits)
        weights, biases = params[:n], params[n:]
        inputmats: list[Any] = list(torch.split(inp.reshape(-1, inp.shape[-1]), m_splits))
        out = torch.empty((sum(m_splits), weights[0].shape[0]), dtype=inp.dtype, device=inp.device)
        if not weights[0].requires_grad:
            inputmats = [None] * n
        ctx.save_for_backward(*inputmats, *weights, *weights, *biases)
        ctx.weight_objects = weights  # grouped_linear.py under cpu_offloading, as Linear's
        ctx.m_splits, ctx.inp_shape, ctx.fuse = m_splits, inp.shape, fuse_wgrad
        ctx.use_bias = biases[0].numel() > 0
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weights[0].requires_grad
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        n = len(ctx.m_splits)
        saved = ctx.saved_tensors
        weights, biases = saved[2 * n : 3 * n], saved[3 * n :]
        grad = grad_output.contiguous().view(-1, grad_output.shape[-1])
        grad_biases: list[Any] = [None] * n
        if ctx.use_bias:
            grad_biases = [g.sum(dim=0) for g in torch.split(grad, ctx.m_splits)]
        dgrad = None
        if ctx.requires_dgrad:
            dgrad = torch.empty((grad.shape[0], weights[0].shape[1]), dtype=grad.dtype, device=grad.device)
        wgrads: list[Any] = [None] * n
        if ctx.requires_wgrad:
            wgrads = [grouped_wgrad(weight, ctx.fuse, grad) for weight in ctx.weight_objects]
        dgrad = None if dgrad is None else dgrad.view(ctx.inp_shape)
        return (dgrad, None, None, *wgrads, *(grad_biases if ctx.use_bias else [None] * len(biases)))


def grouped_wgrad(weight: torch.Tensor, fuse: bool, like: torch.Tensor) -> Any:
    """One GEMM's weight gradient (grouped_linear.py 418-426, 480-505 handle_custom_ddp_from_mcore)."""
    if not fuse:
        return torch.empty(weight.shape, dtype=like.dtype, device=like.device)
    main_grad: torch.Tensor = getattr(weight, "main_grad")  # noqa: B009 (TE's main_grad_func)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(main_grad.shape), weight.dtype)
    return None


def delayed_wgrad_gemm(xs: Any, dys: Any, grad_weights: list[Any]) -> list[Any]:
    """The weight-gradient grouped GEMM a `WeightGradStore` keeps (TE 2.14 ops/basic/
    grouped_linear.py 917-928, ops/fused/backward_grouped_mlp.py 131-139): it writes into the
    buffers made in the backward (main_grad or new), so runs without allocating."""
    return grad_weights


def general_gemm(
    A: torch.Tensor, B: torch.Tensor, out_dtype: torch.dtype | None = None, *args: Any,
    layout: str = "TN", out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    grad: bool = False, **kwargs: Any,
) -> tuple[Any, ...]:
    """TE cpp_extensions/gemm.py `general_gemm` on 16-bit operands: D = op(B) op(A) in
    `out_dtype` (default A's), written into `out` when given; returns (D, bias gradient, gelu
    input, extra output). cuBLAS reads the operands as they are and writes only D, in a workspace
    that is TE's own (`get_cublas_workspace`, kept for the process: memory/engine/run.py counts
    it). With `grad` and a bias, the bias gradient (B's column sums) in the bias's dtype."""
    rows = B.shape[-1] if layout[1] == "T" else B.shape[0]
    cols = A.shape[-1] if layout[0] == "N" else A.shape[0]
    if out is None:
        out = torch.empty((rows, cols), dtype=out_dtype or A.dtype, device=B.device)
    bias_grad = None
    if grad and bias is not None:
        bias_grad = torch.empty(B.shape[-1], dtype=bias.dtype, device=B.device)
    return out, bias_grad, None, None
