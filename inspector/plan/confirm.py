"""Confirm the plans a search prints with `memory`'s own computation, where it differs.

The search prices activations by the closed forms (formulas/activations.py). `memory` uses the
same closed forms except where megatron's engine runs the job (inspector/engine: every job
`engine.memory.not_runnable` lets through, Transformer Engine's context parallelism included),
and the engine's peak lies above them (temporaries, kept buffers). There each printed plan is
measured as `memory` measures it (world/build.build, report/memory.measure): its stages take
the engine's peak above the state, and a plan that does not fit is dropped for the next one,
so that `memory` confirms every plan `plan` prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from inspector.plan.price import Plan


def engine_runs(plan: Plan) -> bool:
    """Return whether `memory` runs megatron's engine for the plan's job (else: closed forms)."""
    from inspector.engine.memory import not_runnable

    return not_runnable(plan.job) is None


def measured(plan: Plan) -> Plan:
    """Return the plan with each stage's activations as `memory` measures them (the peak above
    the state, megatron's kept buffers included: report/memory.StageMemory.total)."""
    from inspector.report.memory import Hardware, measure
    from inspector.world.build import build, select_view

    job = plan.job
    report = measure(build(job, select_view(job), expert_ranks=(0,)), Hardware())
    stages = tuple(
        replace(printed, activations=built.total - printed.state)
        for printed, built in zip(plan.stages, report.stages, strict=True)
    )
    return replace(plan, stages=stages)


def confirmed(ranked: Iterable[Plan], budget: int, top: int) -> list[Plan]:
    """Return the first `top` ranked plans that fit `budget` bytes as `memory` measures them
    (every one when `top` is 0), in the ranking's order."""
    out: list[Plan] = []
    for plan in ranked:
        if top and len(out) == top:
            break
        if engine_runs(plan):
            plan = measured(plan)
            if plan.peak > budget:
                continue
        out.append(plan)
    return out
