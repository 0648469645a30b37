"""A gated delta net layer's kernels, as `plan` prices them (plan/hybrid.py calls it).

megatron-core's GatedDeltaNet (ssm/gated_delta_net.py) runs: in_proj (Transformer Engine's
LayerNormColumnParallelLinear: q, k, v, the gate z, beta and alpha), the causal convolution over
q, k and v, the L2 norm of q and k, flash-linear-attention's `chunk_gated_delta_rule`, the gated
RMSNorm and out_proj. The delta rule has no measured kernel in the tables: its matrix products
per chunk of 64 tokens (flash-linear-attention v0.4.2 fla/ops/gated_delta_rule/chunk.py
`chunk_gated_delta_rule_fwd`: common/chunk_scaled_dot_kkt.py beta K K^T, wy_fast.py
`recompute_w_u_fwd` W = A (beta K) and U = A (beta V), common/chunk_delta_h.py V_new = U - W S
and S += K^T V_new, common/chunk_o.py O = Q S + (Q K^T o M) V_new) are priced as batched GEMMs
of those shapes from the GEMM table, its backward as two products each, and utils/solve_tril.py's
triangular solve, the state passing, the convolution and the norms as memory passes: an
estimate (`GDN_NOTE`), not a measurement.
"""

from __future__ import annotations

from dataclasses import replace

from inspector.formulas.kernels import Gemm, Memory, Op
from inspector.formulas.ops import LayerOps, Shard, linear
from inspector.job.dims import ModelDims

GDN_NOTE = (
    "gated delta net layers: flash-linear-attention's chunked delta rule has no measured kernel "
    "here; its matrix products per 64-token chunk are priced as batched GEMMs from the measured "
    "GEMM table, an estimate (docs/hybrid-models.md)"
)
CHUNK = 64  # fla's chunk_gated_delta_rule chunk (world/ssm/fla_kernels.py)


def gdn_ops(dims: ModelDims, z: Shard, residual: tuple[list[Op], list[Op], list[Op], list[Op]]) -> LayerOps:
    """Return a GDN layer's kernels on one rank for one micro-batch; `residual`: the input
    norm's and the residual add's forward and backward kernels (a GPT layer's)."""
    norm_f, add_f, norm_b, add_b = residual
    g, act, h = dims.gdn_shape(), dims.activation_bytes, dims.hidden_size
    tokens = dims.seq_length * z.micro_batch // z.cp
    heads, dk, dv = g.value_heads // z.tp, g.key_dim, g.value_dim
    qk, v = g.key_heads * dk // z.tp, heads * dv
    chunks, fp8 = -(-tokens // CHUNK), dims.fp8 is not None
    in_proj = linear("in_proj", tokens, h, g.in_width // z.tp, fp8=fp8)
    out_proj = linear("out_proj", tokens, v, h, fp8=fp8)
    conv = tokens * g.conv_width // z.tp
    batch = chunks * heads
    products = [Gemm("delta rule beta K K^T", CHUNK, CHUNK, dk, "fwd", batch),
                Gemm("delta rule W = A K", CHUNK, dk, CHUNK, "fwd", batch),
                Gemm("delta rule U = A V", CHUNK, dv, CHUNK, "fwd", batch),
                Gemm("delta rule V_new", CHUNK, dv, dk, "fwd", batch),
                Gemm("delta rule state update", dk, dv, CHUNK, "fwd", batch),
                Gemm("delta rule Q S", CHUNK, dv, dk, "fwd", batch),
                Gemm("delta rule Q K^T", CHUNK, CHUNK, dk, "fwd", batch),
                Gemm("delta rule intra-chunk O", CHUNK, dv, CHUNK, "fwd", batch)]  # fmt: skip
    states = batch * dk * dv  # each chunk's state S, written once (chunk_delta_h.py h)
    solve = tokens * heads * CHUNK  # A, [T, H, 64]: solve_tril reads and writes it
    forward: list[Op] = [
        *norm_f, in_proj[0],
        Memory("conv1d", "copy", conv, 2 * act + act * g.conv_kernel / tokens),
        Memory("q k l2norm", "rms_norm", tokens * 2 * qk, 2 * act),
        Memory("delta rule solve_tril", "copy", solve, 2 * 4),
        *products, Memory("delta rule state passing", "copy", states, 2 * act),
        Memory("gated norm", "rms_norm", tokens * v, 3 * act), out_proj[0], *add_f,
    ]
    backward: list[Op] = [
        *add_b, *out_proj[1:], Memory("gated norm backward", "rms_norm", tokens * v, 5 * act),
        Memory("delta rule state passing backward", "copy", states, 4 * act),
        *(replace(p, name=p.name + " " + o, orient=o) for p in products for o in ("dgrad", "wgrad")),
        Memory("delta rule solve_tril backward", "copy", solve, 3 * 4),
        Memory("q k l2norm backward", "rms_norm", tokens * 2 * qk, 3 * act),
        Memory("conv1d backward", "copy", conv, 3 * act), *in_proj[1:], *norm_b,
    ]
    return LayerOps(tuple(forward), tuple(backward), ())
