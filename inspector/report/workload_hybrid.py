"""A hybrid (Mamba) model's Mamba layers as SimAI workload records.

megatron-core 0.16.1's MambaLayer runs MambaMixer (ssm/mamba_mixer.py): `in_proj`, a
TELayerNormColumnParallelLinear of h -> 2 d_inner + 2 G N + H (z, x, B, C, dt), the causal
convolution and Mamba-2's chunked scan on this rank's d_inner / t channels, then `out_proj`, a
TERowParallelLinear of d_inner -> h. So the layer is one tensor-parallel region, as an MLP is:
with sequence parallelism `in_proj` gathers its input and `out_proj` reduce-scatters its output,
without it `out_proj` all-reduces (and `in_proj` the input gradient).

With context parallelism (ssm/mamba_context_parallel.py `MambaContextParallel`) the mixer trades
sequence for channels before the convolution and back after the scan: `pre_conv_ssm` all-to-alls
z, x, B, C and dt (B and C repeated `group_repeat_count` times where a rank's groups are fewer
than cp ranks) and `post_conv_ssm` all-to-alls the scan's output; backward runs the same
all-to-alls the other way. SimAI has no context-parallel group: they go to `context_group`, as
attention's K/V exchange does.

Compute, from FLOPs (workload's --gpu-tflops x --mfu): the two projections as GEMMs of the real
widths; the scan as Megatron-LM counts it (training.py `mamba_layer_flops`: 7 B s d_in N forward,
backward twice that, no weight gradient). A measured --compute-profile has no Mamba section, so it
cannot time these layers.

MambaStack's forward (ssm/mamba_block.py `MambaStack.forward`) calls each layer directly, without
the transformer block's full-recompute checkpointing, so `--recompute-granularity full` re-runs
nothing in a hybrid stack; selective recomputation happens inside TransformerLayer and stays.
"""

from __future__ import annotations

from dataclasses import replace

from inspector.errors import ConfigError
from inspector.formulas.flops import GEMM_FACTOR
from inspector.job.hybrid_model import MambaShape
from inspector.report.simai import Record
from inspector.report.simai_groups import context_group
from inspector.report.workload_inputs import ComputeRate, Context
from inspector.report.workload_tp import Phases, gemm, tp_pair

SCAN_FLOPS = 7  # training.py mamba_layer_flops: 7 * batch * seq * d_in * state, forward


def hybrid_context(job: Context) -> Context:
    """Return `job` as a hybrid stack runs it: full recomputation re-runs nothing."""
    if job.training.recompute != "full":
        return job
    return replace(job, training=replace(job.training, recompute="none"))


def mamba_records(job: Context, shape: MambaShape, prefix: str = "") -> list[Record]:
    """Return one Mamba layer's records for one micro-batch on one rank."""
    if not isinstance(job.compute, ComputeRate):
        raise ConfigError(
            "workload cannot time a Mamba layer from a --compute-profile (AICB profiles have "
            "attention and MLP sections only); pass --gpu or --gpu-tflops"
        )
    par, h, tp = job.par, job.dims.hidden_size, job.par.tp
    in_proj = gemm(job, GEMM_FACTOR * job.tokens * h * shape.in_width / tp)
    out_proj = gemm(job, GEMM_FACTOR * job.tokens * shape.d_inner * h / tp)
    scan_fwd = job.compute.ns(SCAN_FLOPS * job.tokens * shape.d_inner * shape.state / tp)
    first = Phases(in_proj.fwd + scan_fwd, in_proj.ig + 2 * scan_fwd, in_proj.wg)
    records = tp_pair(job, prefix + "mamba", 1, first, out_proj)
    if par.cp > 1:
        group = context_group(par)
        repeat = max(1, par.cp * tp // shape.groups)  # group_repeat_count
        into = shape.in_width + 2 * shape.groups * shape.state * (repeat - 1)
        size = job.dims.activation_bytes * job.tokens
        comm = "ALLTOALL" + group
        records.insert(1, Record(prefix + "mamba_cp", 0, comm, size * into // tp, 0, comm,
                                 size * into // tp))  # fmt: skip
        records.insert(2, Record(prefix + "mamba_cp", 0, comm, size * shape.d_inner // tp, 0,
                                 comm, size * shape.d_inner // tp))  # fmt: skip
    return records
