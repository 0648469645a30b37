"""mamba_ssm's kernels as the engine runs them: on meta tensors, allocating what the kernels do.

megatron-core's MambaMixer trains through two of them (ssm/mamba_mixer.py `_ssm_training`):
`mamba_split_conv1d_scan_combined` (the causal convolution, Mamba-2's chunked scan and the z
gate in one autograd Function) and its gated RMSNorm (`RMSNorm.forward` -> `rmsnorm_fn`). Each
stand-in allocates the outputs and temporaries its source allocates, in order, and saves for
backward what the source saves. Sources: state-spaces/mamba e9594ce, mamba_ssm/ops/triton/
ssd_combined.py (`MambaSplitConv1dScanCombinedFn` 820-981, `_mamba_chunk_scan_combined_fwd`
343-394, `_mamba_chunk_scan_combined_bwd` 397-517), ssd_chunk_state.py, ssd_state_passing.py,
ssd_bmm.py, ssd_chunk_scan.py, layernorm_gated.py (`LayerNormFn` 338-376, `_layer_norm_fwd`
108-147, `_layer_norm_bwd` 271-330); Dao-AILab/causal-conv1d 0d2252d cpp_functions.py
(`causal_conv1d_fwd_function` 94-114, `causal_conv1d_bwd_function` 117-150).

Left out, as too small to move a peak and sized by Triton's autotuned block sizes: the backward's
per-tile workspaces for dD, ddt and ddA (b x heads x chunks x a few tiles, fp32). The split
sums of dB, dC and dCB, and the gated RMSNorm's weight-gradient rows, are sized by the GPU's SM
count (`torch.cuda.get_device_properties(...).multi_processor_count`: the job's GPU's, te/cuda.py
`multi_processor_count`, job/hardware.py `Gpu.sms`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from inspector.world.te.cuda import multi_processor_count


def _empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _splits(batch: int, nchunks: int, nheads: int, ngroups: int) -> int:
    """ssd_chunk_state.py `_chunk_state_bwd_db` (and dC, dCB alike): heads split over programs."""
    ratio = nheads // ngroups
    sms = multi_processor_count()
    per_program = max(min(math.ceil(batch * nchunks * nheads / sms), ratio), 1)
    return -(-ratio // per_program)


def _chunk_scan_fwd(x: torch.Tensor, ngroups: int, dstate: int, chunk_size: int,
                    gated: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`_mamba_chunk_scan_combined_fwd`'s allocations; returns (out, out_x)."""
    b, s, h, p = x.shape
    nc = -(-s // chunk_size)
    f32 = torch.float32
    dt_out = _empty(x, b, h, nc, chunk_size, dtype=f32)  # ssd_chunk_state.py 724
    dA_cumsum = _empty(x, b, h, nc, chunk_size, dtype=f32)  # 725
    chunk_states = _empty(x, b, nc, h, p, dstate, dtype=f32)  # ssd_chunk_state.py 826
    states = _empty(x, b, nc, h, p * dstate)  # ssd_state_passing.py 207 (out_dtype: C's)
    final_states = _empty(x, b, h, p * dstate, dtype=f32)  # 208
    del chunk_states
    cb = _empty(x, b, nc, ngroups, chunk_size, chunk_size, dtype=f32)  # ssd_bmm.py 192
    out = _empty(x, b, s, h, p)  # ssd_chunk_scan.py 1276
    out_x = _empty(x, b, s, h, p) if gated else None  # 1278
    del dt_out, dA_cumsum, states, final_states, cb  # the Function keeps none of them
    return out, out_x


class MambaSplitConv1dScanCombinedFn(torch.autograd.Function):
    """ssd_combined.py 820-981 with rmsnorm_weight and outproj_weight None, as megatron calls it."""

    @staticmethod
    def forward(ctx: Any, zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor,
                conv1d_bias: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
                D: torch.Tensor, chunk_size: int, headdim: int, ngroups: int) -> torch.Tensor:  # fmt: skip
        nheads = D.shape[0]
        dim = nheads * headdim
        batch, seqlen, _ = zxbcdt.shape
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        # causal_conv1d_fwd_function: `out = torch.empty_like(x)` over xBC as (b, d, s)
        xbc_conv = _empty(zxbcdt, batch, conv1d_weight.shape[0], seqlen)
        x = xbc_conv[:, :dim].transpose(1, 2).reshape(batch, seqlen, nheads, headdim)
        out, out_x = _chunk_scan_fwd(x, ngroups, dstate, chunk_size, gated=True)
        del xbc_conv, x
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias)  # 888
        ctx.shape = (headdim, ngroups, dstate, chunk_size)
        return out.view(batch, seqlen, dim)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias = ctx.saved_tensors
        headdim, ngroups, dstate, chunk_size = ctx.shape
        b, s, h, p = out_x.shape
        nc, channels = -(-s // chunk_size), conv1d_weight.shape[0]
        f32 = torch.float32
        xbc_conv = _empty(zxbcdt, b, channels, s)  # 919-923: x, B, C recomputed
        dzxbcdt = torch.empty_like(zxbcdt)  # 929
        dxbc = _empty(zxbcdt, b, s, channels)  # 931: torch.empty_like(xBC)
        # _mamba_chunk_scan_combined_bwd 397-517, z given, dx/ddt/dB/dC/dz into the buffers above
        dt_in = _empty(zxbcdt, b, s, h)  # dt.clone()
        dt_out, dA_cumsum = (_empty(zxbcdt, b, h, nc, chunk_size, dtype=f32) for _ in range(2))
        cb = _empty(zxbcdt, b, nc, ngroups, chunk_size, chunk_size, dtype=f32)
        chunk_states = _empty(zxbcdt, b, nc, h, p, dstate, dtype=f32)
        states = _empty(zxbcdt, b, nc, h, p * dstate, dtype=f32)  # out_dtype None: states'
        final_states = _empty(zxbcdt, b, h, p * dstate, dtype=f32)
        del chunk_states, final_states
        dout_x = torch.empty_like(out_x)  # ssd_chunk_scan.py 1386 (_chunk_scan_bwd_dz)
        dstates = _empty(zxbcdt, b, nc, h, p, dstate, dtype=f32)  # 1433
        # _state_passing_bwd (ssd_state_passing.py 241, 243): dstates and the states converted
        # to x's dtype replace the fp32 ones
        dstates = _empty(zxbcdt, b, nc, h, p * dstate)
        states = _empty(zxbcdt, b, nc, h, p * dstate)
        splits = _splits(b, nc, h, ngroups)
        db = _empty(zxbcdt, b, s, splits, ngroups, dstate, dtype=f32).sum(2)  # chunk_state 940
        states_x = _empty(zxbcdt, b, nc, h, p, dstate)  # states.to(x.dtype)
        dc = _empty(zxbcdt, b, s, splits, ngroups, dstate, dtype=f32).sum(2)  # chunk_scan 1488
        ddA_prev = _empty(zxbcdt, b, h, nc, chunk_size, dtype=f32)  # 1744
        del states_x
        dcb = _empty(zxbcdt, b, nc, splits, ngroups, chunk_size, chunk_size, dtype=f32).sum(2)
        del db, dc, dcb, dout_x, dstates, states, cb  # dB/dC land in dxBC (_bmm_chunk_bwd out=)
        ddA_prev = ddA_prev.flip([-1]).cumsum(dim=-1).flip([-1])
        ddA = torch.empty_like(ddA_prev)  # _chunk_scan_bwd_ddAcs_stable
        ddA += ddA_prev
        del ddA, ddA_prev, dt_out, dA_cumsum, dt_in
        dA, ddt_bias = torch.empty_like(A, dtype=f32), torch.empty_like(dt_bias, dtype=f32)
        # causal_conv1d_bwd_function: dx given (dxBC), fp32 weight and bias gradients
        dweight = torch.zeros_like(conv1d_weight, dtype=f32)
        dbias = torch.zeros_like(conv1d_bias, dtype=f32)
        dD = torch.empty_like(D, dtype=f32)
        del xbc_conv, dxbc, dout
        return dzxbcdt, dweight, dbias, ddt_bias, dA, dD, None, None, None


def mamba_split_conv1d_scan_combined(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor,
                                     conv1d_bias: torch.Tensor, dt_bias: torch.Tensor,
                                     A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                                     **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """ssd_combined.py 983: the training path megatron takes (no norm or projection fused)."""
    unsupported = {k: v for k, v in kwargs.items() if v is not None and k in (
        "initial_states", "seq_idx", "rmsnorm_weight", "outproj_weight", "outproj_bias")}
    if unsupported or kwargs.get("return_final_states") or D.dim() != 1:
        raise NotImplementedError(f"mamba_split_conv1d_scan_combined with {sorted(unsupported)} "
                                  "or a per-channel D is not simulated")  # fmt: skip
    result: torch.Tensor = MambaSplitConv1dScanCombinedFn.apply(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, kwargs["headdim"],
        kwargs.get("ngroups", 1),
    )
    return result


class LayerNormFn(torch.autograd.Function):
    """layernorm_gated.py 338-376, RMS (no mean), as the gated RMSNorm runs without z."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,
                group_size: int | None) -> torch.Tensor:  # fmt: skip
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        groups = shape[-1] // (group_size or shape[-1])
        y = torch.empty_like(x)  # _layer_norm_fwd 127
        rstd = _empty(x, groups * x.shape[0], dtype=torch.float32)  # 130
        ctx.save_for_backward(x, weight, rstd)  # 360: x, weight, bias, mean, rstd, z
        ctx.shape, ctx.groups = shape, groups
        return y.reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight, rstd = ctx.saved_tensors
        dy = dy.reshape(-1, dy.shape[-1])
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty_like(x)  # _layer_norm_bwd 290
        block = 1 << (x.shape[-1] // ctx.groups - 1).bit_length()  # triton.next_power_of_2(N)
        warps = min(max(block // 256, 1), 8)  # _layer_norm_bwd's num_warps
        rows = math.ceil(multi_processor_count() * math.ceil(4 / warps) / ctx.groups)  # 312
        dw = _empty(weight, rows, weight.shape[0], dtype=torch.float32).sum(0).to(weight.dtype)
        return dx.reshape(ctx.shape), dw, None
