"""A gated delta net (GDN) layer's mixer as SimAI workload records.

megatron-core's GatedDeltaNet (ssm/gated_delta_net.py at 0.16.1, ssm/gated_delta_net/gdn.py at
0.19.2) is one tensor-parallel region, as an MLP and a Mamba mixer are: `in_proj`, a
TELayerNormColumnParallelLinear of h -> 2 n_k d_k + 2 n_v d_v + 2 n_v (q, k, v, the gate z,
beta, alpha), then on this rank's heads the causal convolution, the L2 norms, the chunked gated
delta rule and the gated RMSNorm, then `out_proj`, a TERowParallelLinear of n_v d_v -> h. So
with sequence parallelism `in_proj` gathers its input and `out_proj` reduce-scatters its output;
without it `out_proj` all-reduces (and `in_proj` the input gradient). Context parallelism, GDN's
only other collective (its head all-to-alls), is refused (job/gdn.py).

Compute, from FLOPs (workload's --gpu-tflops x --mfu): the two projections as GEMMs of the real
widths; the convolution and the gated delta rule as Megatron-LM counts them (training.py
`linear_self_attn_term`, formulas/flops.py `gdn_token_flops`: w (2 n_k d_k + n_v d_v) and
4 n_v d_v^2 multiply-adds a token), backward twice the forward, no weight gradient. A measured
--compute-profile has no GDN section, so it cannot time these layers.
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.formulas.flops import GEMM_FACTOR
from inspector.report.simai import Record
from inspector.report.workload_inputs import ComputeRate, Context
from inspector.report.workload_tp import Phases, gemm, recompute, tp_pair


def gdn_records(job: Context, layer: int, prefix: str = "") -> list[Record]:
    """Return one GDN mixer's records for one micro-batch on one rank (`layer` unused: every
    GDN of a model has the same sizes)."""
    if not isinstance(job.compute, ComputeRate):
        raise ConfigError(
            "workload cannot time a gated delta net layer from a --compute-profile (AICB "
            "profiles have attention and MLP sections only); pass --gpu or --gpu-tflops"
        )
    dims, tp = job.dims, job.par.tp
    shape, h = dims.gdn_shape(), dims.hidden_size
    tokens = job.training.micro_batch_size * dims.seq_length
    in_proj = gemm(job, GEMM_FACTOR * tokens * h * shape.in_width / tp)
    out_proj = gemm(job, GEMM_FACTOR * tokens * shape.value_heads * shape.value_dim * h / tp)
    inner = shape.conv_kernel * shape.conv_width + 4 * shape.value_heads * shape.value_dim**2
    rule_fwd = job.compute.ns(2 * tokens * inner / tp)
    first = recompute(job, Phases(in_proj.fwd + rule_fwd, in_proj.ig + 2 * rule_fwd, in_proj.wg))
    return tp_pair(job, prefix + "gdn", 1, first, recompute(job, out_proj))
