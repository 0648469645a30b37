"""The gated delta net's kernels as the engine runs them: on meta tensors, allocating what they do.

megatron-core's GatedDeltaNet (ssm/gated_delta_net.py) trains through three of
flash-linear-attention's autograd Functions and, on megatron-core 0.16, causal-conv1d's:
- `l2norm` (fla/modules/l2norm.py `L2NormFunction` 237-257, `l2norm_fwd` 132-181, `l2norm_bwd`
  184-234): the queries' and keys' L2 norm;
- `chunk_gated_delta_rule` (fla/ops/gated_delta_rule/chunk.py `ChunkGatedDeltaRuleFunction`
  219-296, `chunk_gated_delta_rule_fwd` 24-102, `chunk_gated_delta_rule_bwd` 105-216; the
  allocations of fla/ops/utils/cumsum.py, common/chunk_scaled_dot_kkt.py, utils/solve_tril.py,
  gated_delta_rule/wy_fast.py, common/chunk_delta_h.py and common/chunk_o.py it calls);
- `causal_conv1d` (fla/modules/conv/triton/ops.py `CausalConv1dFunction` 339-397,
  `causal_conv1d_fwd` 20-78, `causal_conv1d_bwd` 125-219), which megatron-core 0.18+ calls;
- `causal_conv1d_fn` (Dao-AILab/causal-conv1d 0d2252d causal_conv1d_interface.py `CausalConv1dFn`
  9-96, cpp_functions.py `causal_conv1d_fwd_function` 94-114, `causal_conv1d_bwd_function`
  117-150), which megatron-core 0.16-0.17 call.
flash-linear-attention at v0.4.2 (ca910f8; Megatron-LM core_v0.16.1 and core_v0.19.0 pin
flash-linear-attention~=0.4.0). Each stand-in allocates the outputs and temporaries its source
allocates, in order (Python's lifetimes: a name rebound frees its old tensor), and saves for
backward what the source saves. The chunk size is fla's fixed 64; `chunk_bwd_dqkwg`'s key
blocks are sized for an H100 (`check_shared_mem('hopper')`: tiles of 128).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 64  # chunk.py: chunk_local_cumsum(g, chunk_size=64), the kernels' BT
HOPPER_TILE = 128  # chunk_o.py chunk_bwd_dqkwg: CONST_TILING on an H100


def _chunks(t: int) -> int:
    return -(-t // CHUNK)


class L2NormFunction(torch.autograd.Function):
    """fla/modules/l2norm.py `L2NormFunction`: y and its fp32 rstd per row, saved for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()  # @input_guard
        y = torch.empty_like(x)  # l2norm_fwd: y = torch.empty_like(x) over x.view(-1, D)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # (T,), viewed back
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        y, _ = ctx.saved_tensors
        return torch.empty_like(y)  # l2norm_bwd: dx = torch.empty_like(y)


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> Any:
    """fla/modules/l2norm.py `l2norm` (eps and output dtype at megatron's defaults)."""
    if output_dtype is not None:
        raise NotImplementedError("l2norm with an output dtype is not simulated")
    return L2NormFunction.apply(x)


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """fla's chunked gated delta rule, without initial state, final state or packed sequences."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:  # fmt: skip
        b, t, h, dk = k.shape
        nt = _chunks(t)
        g = torch.empty_like(g, dtype=torch.float32)  # chunk_local_cumsum: output_dtype float
        A = torch.empty(b, t, h, CHUNK, dtype=torch.float32, device=k.device)  # kkt, fp32
        A = torch.zeros_like(A, dtype=k.dtype)  # solve_tril(output_dtype=k.dtype)
        w, u = torch.empty_like(k), torch.empty_like(v)  # recompute_w_u_fwd
        hs = k.new_empty(b, nt, h, dk, v.shape[-1])  # chunk_gated_delta_rule_fwd_h: h
        v_new = torch.empty_like(u)  # save_new_value
        o = torch.empty_like(v)  # chunk_fwd_o
        del w, u, hs, v_new
        # forward: save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, initial_state, ...)
        ctx.save_for_backward(q, k, v, g, beta, A)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> Any:
        q, k, v, g, beta, A = ctx.saved_tensors
        b, t, h, dk = k.shape
        nt = _chunks(t)
        w, u = torch.empty_like(k), torch.empty_like(v)  # recompute_w_u_fwd
        hs = k.new_empty(b, nt, h, dk, v.shape[-1])  # chunk_gated_delta_rule_fwd_h
        v_new = torch.empty_like(u)
        dv = torch.empty_like(do)  # chunk_bwd_dv_local
        dh = q.new_empty(b, nt, h, dk, v.shape[-1])  # chunk_gated_delta_rule_bwd_dhu
        dv = torch.empty_like(dv)  # its dv2, rebound to dv
        dq, dkey = torch.empty_like(q), torch.empty_like(k)  # chunk_bwd_dqkwg
        blocks = -(-dk // min(max(1 << (dk - 1).bit_length(), 16), HOPPER_TILE))  # NK
        dg = torch.empty(blocks, *g.shape, dtype=torch.float32, device=g.device).sum(0)
        dw = torch.empty_like(w)
        dk2, dv = torch.empty_like(k), torch.empty_like(v)  # prepare_wy_repr_bwd
        dg2, db = torch.empty_like(g), torch.empty_like(beta)
        dkey.add_(dk2)
        dg.add_(dg2)
        dg = torch.empty_like(dg)  # chunk_local_cumsum(dg, reverse=True), fp32
        del w, u, hs, v_new, dh, dw, dk2, dg2
        return dq, dkey, dv, dg, db


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """fla/ops/gated_delta_rule/chunk.py `chunk_gated_delta_rule`, as megatron calls it."""
    given = [name for name, value in (
        ("initial_state", initial_state), ("output_final_state", output_final_state),
        ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), ("cu_seqlens", cu_seqlens),
        ("cp_context", kwargs.get("cp_context"))) if value]  # fmt: skip
    if given:
        raise NotImplementedError(f"chunk_gated_delta_rule with {', '.join(given)} is not simulated")
    return ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta), None


class CausalConv1dFunction(torch.autograd.Function):
    """fla's Triton causal convolution over x (b, s, d), SiLU fused; x kept as given."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, weight, bias)  # (x, weight, bias, residual, initial_state)
        return torch.empty_like(x, memory_format=torch.contiguous_format)  # causal_conv1d_fwd

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight, bias = ctx.saved_tensors
        b, t, _ = x.shape
        y = torch.empty_like(x, memory_format=torch.contiguous_format)  # recomputed pre-SiLU
        dx = torch.empty_like(x)
        rows = b * _chunks(t)  # B*NT partial sums of dw and db, fp32
        dw = weight.new_empty(rows, *weight.shape, dtype=torch.float32).sum(0).to(weight)
        db = None
        if bias is not None:
            db = bias.new_empty(rows, *bias.shape, dtype=torch.float32).sum(0).to(bias)
        del y
        return dx, dw, db


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, activation: str | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> Any:  # fmt: skip
    """fla/modules/conv/causal_conv1d.py `causal_conv1d` (the Triton backend, its default)."""
    given = (initial_state, kwargs.get("residual"), cu_seqlens)
    if any(t is not None for t in given) or output_final_state or weight is None or \
            activation not in ("silu", "swish"):  # fmt: skip
        raise NotImplementedError("fla's causal_conv1d is simulated for megatron's call only")
    return CausalConv1dFunction.apply(x, weight, bias), None


class CausalConv1dFn(torch.autograd.Function):
    """causal-conv1d's `CausalConv1dFn` over x (b, d, s), SiLU fused, no states."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty_like(x)  # causal_conv1d_fwd_function
        ctx.save_for_backward(x, weight, bias)  # (x, weight, bias, seq_idx, initial_states)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        x, weight, bias = ctx.saved_tensors
        if dout.stride(2) != 1 and dout.stride(1) != 1:
            dout = dout.contiguous()
        dx = torch.empty_like(x)  # causal_conv1d_bwd_function
        dweight = torch.zeros_like(weight, dtype=torch.float32)
        dbias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None else None
        return dx, dweight, dbias


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     seq_idx: torch.Tensor | None = None, initial_states: torch.Tensor | None = None,
                     return_final_states: bool = False, final_states_out: torch.Tensor | None = None,
                     activation: str | None = None) -> Any:  # fmt: skip
    """causal_conv1d_interface.py `causal_conv1d_fn`, as megatron's GatedDeltaNet calls it."""
    if seq_idx is not None or initial_states is not None or return_final_states or \
            activation not in ("silu", "swish"):  # fmt: skip
        raise NotImplementedError("causal_conv1d_fn is simulated for megatron's call only")
    return CausalConv1dFn.apply(x, weight, bias)
