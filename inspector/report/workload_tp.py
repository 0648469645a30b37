"""The compute phases of one workload record and a tensor-parallel region's column/row records
(shared by the transformer layers, workload_layers.py, and the Mamba layers, workload_hybrid.py)."""

from __future__ import annotations

from dataclasses import dataclass

from inspector.report.simai import NONE, Record
from inspector.report.workload_inputs import ComputeRate, Context


@dataclass(frozen=True)
class Phases:
    """Per-rank compute (ns) of one record's forward, input-grad and weight-grad phases."""

    fwd: int = 0
    ig: int = 0
    wg: int = 0


def gemm(job: Context, flops: float, te: bool = True) -> Phases:
    """Split a GEMM's 6-factor FLOPs (flops.py) evenly: forward, data grad, weight grad.

    `te`: a Transformer Engine linear of the layer, at the fp8 peak in an fp8 job (megatron's
    output layer and MTP projection are not: `te` False).
    """
    if not isinstance(job.compute, ComputeRate):
        return Phases()
    t = job.compute.ns(flops / 3, te and job.dims.fp8 is not None)
    return Phases(t, t, t)


def recompute(
    job: Context, phases: Phases, core: int = 0, modules: tuple[str, ...] = ()
) -> Phases:
    """Add recomputation to the input-grad phase: the whole forward (full), or under selective
    the core attention's (`core`, core_attn) and the record's forward once for each of its
    `modules` among --recompute-modules (formulas/ops.py RECOMPUTED: mlp, moe, shared_experts;
    layernorm and moe_act re-run no GEMM). Shared experts under both moe and shared_experts run
    twice more: the MoE layer's recomputed forward checkpoints them again."""
    mode = job.training.recompute
    extra = phases.fwd if mode == "full" else 0
    if mode == "selective":
        asked = job.training.recompute_modules
        extra = core if "core_attn" in asked else 0
        extra += phases.fwd * sum(m in asked for m in modules)
    return Phases(phases.fwd, phases.ig + extra, phases.wg)


def tp_pair(
    job: Context, name: str, width: int, first: Phases, second: Phases, column: int = 0
) -> list[Record]:
    """Return the column/row records of one tensor-parallel region of `width` x activation.

    With sequence parallelism the column gathers its input (backward: reduce-scatter) and the
    row reduce-scatters its output (backward: all-gather); without it the row all-reduces its
    output and the column all-reduces its input gradient, in one `NAME_layer` record as AICB.
    `column`, when given, is the bytes the column gathers (MLA gathers latents, not h).
    """
    tp = job.par.tp > 1
    n = job.activation * width if tp else 0
    c = (column or n) if tp else 0
    if not job.par.sequence_parallel:
        comm = "ALLREDUCE" if tp else NONE
        fwd, ig, wg = (first.fwd + second.fwd, first.ig + second.ig, first.wg + second.wg)
        return [Record(f"{name}_layer", fwd, comm, n, ig, comm, c, wg)]
    gather, scatter = ("ALLGATHER", "REDUCESCATTER") if tp else (NONE, NONE)
    return [
        Record(f"{name}_column", first.fwd, gather, c, first.ig, scatter, c, first.wg),
        Record(f"{name}_row", second.fwd, scatter, n, second.ig, gather, n, second.wg),
    ]
