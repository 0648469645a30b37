"""The attention walkthrough (memory --walkthrough): records in, text, table or json out."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tabulate import tabulate

from inspector.formulas.walkthrough_steps import Walk, WalkthroughStep, running_allocation
from inspector.job.job import Job
from inspector.render.memory import MODE_TITLES, flops
from inspector.report.formats import MemoryFormat


def _where(step: WalkthroughStep) -> str:
    if step.materialized == "naive":
        return "without flash attention"
    if step.materialized == "flash":
        return "flash attention only"
    return ""


def _step_rows(steps: list[WalkthroughStep]) -> list[list[str]]:
    return [
        [
            s.name,
            s.kind,
            s.layout,
            "x".join(map(str, s.shape)),
            f"{s.elements:,}",
            f"{s.bytes:,}",
            flops(s.flops_global) if s.flops_global else "0",
            flops(s.flops_rank) if s.flops_rank else "0",
            f"{a.current:,}",
            f"{a.peak:,}",
            "; ".join(n for n in (_where(s), s.note) if n),
        ]
        for s, a in zip(steps, running_allocation(steps))
    ]


def _held(steps: Sequence[WalkthroughStep], flash: bool) -> int:
    """Return the activation bytes one rank's steps hold, with or without flash attention."""
    skip = "naive" if flash else "flash"
    return sum(s.bytes for s in steps if s.kind == "activation" and s.materialized != skip)


def render_walkthrough(
    walks: Sequence[tuple[str, int, list[WalkthroughStep]]], title: str, mlp_title: str = ""
) -> str:
    """Return one table per (mode, degree, steps), each with what the rank holds.

    `allocated` and `peak` are the running totals of walkthrough.running_allocation.
    """
    headers = [
        "step", "kind", "layout", "shape", "elements", "bytes", "FLOPs (layer)", "FLOPs (rank)",
        "allocated", "peak", "note",
    ]  # fmt: skip
    parts = []
    for mode, degree, steps in walks:
        if mode == "mlp":
            parts.append(f"# MLP walkthrough: 2-D model parallel (data x tensor); {mlp_title}")
        else:
            parts.append(f"# attention walkthrough: {MODE_TITLES[mode]}, P = {degree}; {title}")
        parts.append(tabulate(_step_rows(steps), headers=headers, disable_numparse=True))
        peak = running_allocation(steps)[-1].peak
        if mode == "mlp":
            parts.append(f"Peak allocation of one rank: {peak:,} bytes.")
        else:
            parts.append(
                f"Activations held by one rank: {_held(steps, False):,} bytes without flash "
                f"attention, {_held(steps, True):,} bytes with it; peak allocation without flash "
                f"attention, every tensor kept: {peak:,} bytes."
            )
        parts.append("")
    return "\n".join(parts)


def walkthrough_json(walks: Sequence[tuple[str, int, list[WalkthroughStep]]]) -> str:
    """Return the walkthrough tables as json."""
    out = [
        {
            "mode": mode,
            "degree": degree,
            "steps": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "layout": s.layout,
                    "shape": list(s.shape),
                    "elements": s.elements,
                    "bytes": s.bytes,
                    "flops_global": s.flops_global,
                    "flops_rank": s.flops_rank,
                    "materialized": s.materialized,
                    "in_place": s.in_place,
                    "freed": s.freed,
                    "allocated": a.current,
                    "peak_allocated": a.peak,
                    "note": s.note,
                }
                for s, a in zip(steps, running_allocation(steps))
            ],
        }
        for mode, degree, steps in walks
    ]
    return json.dumps({"walkthrough": out}, indent=1, allow_nan=False) + "\n"


def render_walkthroughs(job: Job, walks: Sequence[Walk], fmt: MemoryFormat) -> str:
    """Return the attention walkthroughs: json, or one table per mode titled with N, b, dtype."""
    if fmt is MemoryFormat.json:
        return walkthrough_json(walks)
    dims, micro = job.dims(), job.schedule().micro_batch_size
    title = f"N = {dims.seq_length}, b = {micro}, {8 * dims.activation_bytes}-bit activations"
    dp, tp, s = job.layout.dp, job.layout.tp, dims.seq_length
    layers = next((steps[1].shape[0] for mode, _, steps in walks if mode == "mlp"), 0)
    mlp_title = (
        f"DP = {dp}, TP = {tp}, N = b x s x DP = {micro} x {s} x {dp} = {micro * s * dp} tokens, "
        f"L = {layers} layers per stage, {8 * dims.activation_bytes}-bit activations"
    )
    return render_walkthrough(walks, title, mlp_title)
