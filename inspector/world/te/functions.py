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

import math
from dataclasses import dataclass
from typing import Any

import torch

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


def gather_along_first_dim(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """TE distributed.py `gather_along_first_dim`: a new tensor tp times as long (dim 0)."""
    shape = (tensor.shape[0] * tp_size, *tensor.shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, tp_size: int) -> torch.Tensor:
    """TE distributed.py `reduce_scatter_along_first_dim`: a new tensor 1/tp as long (dim 0)."""
    shape = (tensor.shape[0] // tp_size, *tensor.shape[1:])
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)


def clear_tensor_data(*tensors: torch.Tensor | None) -> None:
    """TE utils.py `clear_tensor_data`: free a tensor's storage early (`tensor.data = empty`)."""
    for tensor in tensors:
        if tensor is not None:
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
        ctx.save_for_backward(saved, weight, weight, bias)
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
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
        wgrad, grad_bias = _weight_grads(ctx, weight, bias, grad)
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
    ) -> torch.Tensor:
        inputmat = inp.view(-1, inp.shape[-1])
        ln_out = torch.empty_like(inputmat)
        rows = (inputmat.shape[0],)
        mu = None
        if setup.normalization == "LayerNorm":
            mu = torch.empty(rows, dtype=torch.float32, device=inp.device)
        rsigma = torch.empty(rows, dtype=torch.float32, device=inp.device)
        out = _forward_gemm(ln_out, weight, setup)
        saved_ln_out = ln_out if weight.requires_grad else None
        ctx.save_for_backward(inputmat, weight, weight, bias, ln_weight, saved_ln_out, mu, rsigma)
        ctx.setup, ctx.inp_shape, ctx.use_bias = setup, inp.shape, bias.numel() > 0
        ctx.requires_dgrad, ctx.requires_wgrad = inp.requires_grad, weight.requires_grad
        ctx.has_ln_bias = ln_bias is not None
        return out.view(-1, *inp.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        inputmat, _, weight, bias, ln_weight, ln_out, mu, rsigma = ctx.saved_tensors
        setup: GemmSetup = ctx.setup
        grad = _grad_output(ctx, grad_output)
        gathered = ctx.requires_wgrad and setup.gathers_input  # ln_out_needs_gather
        total = gather_along_first_dim(ln_out, setup.tp_size) if gathered else ln_out
        gemm_out, dgrad = _dgrad(ctx, grad, weight)
        wgrad, grad_bias = _weight_grads(ctx, weight, bias, grad)
        clear_tensor_data(ln_out)
        if gathered:
            clear_tensor_data(total)
        # tex.layernorm_bwd / rmsnorm_bwd (layernorm_linear.py 968-992): dx, dgamma (, dbeta)
        dx = torch.empty_like(inputmat)
        dgamma = torch.empty_like(ln_weight)
        dbeta = torch.empty_like(ln_weight) if ctx.has_ln_bias else None
        clear_tensor_data(mu, rsigma)
        del gemm_out, dgrad
        return dx.view(ctx.inp_shape), dgamma, dbeta, wgrad, grad_bias, None


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
        x = inp.reshape(-1, weight.numel())
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
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str = "sbhd"
    ) -> torch.Tensor:
        s, b, heads = q.shape[0], q.shape[1], q.shape[2]
        if qkv_format == "bshd":
            s, b = b, s
        out = torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)
        stats = torch.empty((b, heads, s, 1), dtype=torch.float32, device=q.device)
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, None, None, None, None, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> Any:
        q, k, v, *_ = ctx.saved_tensors
        d_out = d_out.contiguous()
        # fused_attn_bwd (pytorch/csrc/extensions/attention.cpp): dQ, dK, dV like Q, K, V for the
        # separate sbhd_sbhd_sbhd layout megatron's q, k, v take
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


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
            wgrads = [_grouped_wgrad(weight, ctx.fuse, grad) for weight in weights]
        dgrad = None if dgrad is None else dgrad.view(ctx.inp_shape)
        return (dgrad, None, None, *wgrads, *(grad_biases if ctx.use_bias else [None] * len(biases)))


def _grouped_wgrad(weight: torch.Tensor, fuse: bool, like: torch.Tensor) -> Any:
    """One GEMM's weight gradient (grouped_linear.py 418-426, 480-505 handle_custom_ddp_from_mcore)."""
    if not fuse:
        return torch.empty(weight.shape, dtype=like.dtype, device=like.device)
    main_grad: torch.Tensor = getattr(weight, "main_grad")  # noqa: B009 (TE's main_grad_func)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(main_grad.shape), weight.dtype)
    return None
