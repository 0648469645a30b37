"""Confirm the plans a search prints with `memory`'s own computation, where it differs.

The search prices activations by the closed forms (memory/closed/activations.py). `memory` uses the
same closed forms except where megatron's engine runs the job (inspector/memory/engine: every job
`memory.engine.run.not_runnable` lets through, Transformer Engine's context parallelism included),
and the engine's peak lies above them (temporaries, kept buffers). There each printed plan is
measured as `memory` measures it: its stages take the engine's peak above the state, and a plan
that does not fit is dropped for the next one, so that `memory` confirms every plan `plan`
prints. The engine runs on the chunk shapes of the plan's split without building the stages
(`engine_shapes`; tests/test_plan_confirm.py compares it with `memory`'s whole computation);
Megatron-FSDP's state and buffers in flight come from one built stage of each kind (`_fsdp_held`).
A flex job runs as `memory` runs it, the buffers DeepEP or HybridEP hold outside PyTorch's
allocator among each stage's activations and kept by name (`StagePlan.outside`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import inspector.caches as caches
from inspector.plan.price import Plan

if TYPE_CHECKING:
    from inspector.job.job import Job
    from inspector.memory.engine.run import JobRuns, Steps
    from inspector.memory.engine.stage import Cache, ChunkShape


# megatron's engine runs an FSDP job as the same job without FSDP (inspector/memory/engine reads no
# strategy: its buffers are `_fsdp_held`'s), and a search tries each layout under every strategy:
# the engine's runs by job less its strategy, and chunk shapes
_ENGINE: dict[tuple[Any, ...], JobRuns] = caches.table()
# what one engine run shares with another of the plans a search measures (a layout tried again
# with more recomputation, another micro-batch size): the small chunks' traces, whose own key
# holds the layers a small chunk recomputes (memory/engine/stage.py `_composed`), by the job less
# its --recompute-num-layers; the optimizer steps, which see the parameters only, by the job less
# its recomputation and micro-batch size
_TRACES: dict[Any, Cache] = caches.table()
_STEPS: dict[Any, Steps] = caches.table()


def engine_runs(plan: Plan) -> bool:
    """Return whether `memory` runs megatron's engine for the plan's job (else: closed forms)."""
    from inspector.memory.engine.run import not_runnable

    return not_runnable(plan.job) is None


def measured(plan: Plan) -> Plan:
    """Return the plan with each stage's activations as `memory` measures them (the peak above
    the state, megatron's kept buffers included: memory/measure.StageMemory.total)."""
    shapes = engine_shapes(plan)
    if shapes is None:
        return _measured_as_memory(plan)
    from inspector.memory.engine.run import StageShapes, run_job

    job = plan.job
    fsdp = job.training.megatron_fsdp or job.training.torch_fsdp2
    # the strategy changes the run only where its gradient buckets are in the backward
    from inspector.world.fsdp import buckets_each_backward

    strategy = job.training.sharding_strategy
    strategy = strategy if job.training.megatron_fsdp and buckets_each_backward(strategy) else ""
    key = (replace(job, training=replace(job.training, sharding_strategy=strategy)), tuple(shapes))
    engine = _ENGINE.get(key) if fsdp else None
    if engine is None:
        stage_shapes = [StageShapes(s.stage, c) for s, c in zip(plan.stages, shapes, strict=True)]
        engine = run_job(job, stage_shapes, *_shared(job))
        if fsdp:
            _ENGINE[key] = engine
    if engine.not_run is not None:  # `memory` answers by the closed forms then
        return _measured_as_memory(plan)
    held = _fsdp_held(job, shapes) if fsdp else None
    stages = []
    for printed in plan.stages:
        run = engine.runs[printed.stage]
        above = run.static + run.peak.bytes
        if held is not None:  # `memory`'s FSDP state and buffers in flight, not the plan's
            above += held[printed.stage] - printed.state.total - printed.fsdp_in_flight
        stages.append(replace(printed, activations=above, outside=run.outside))
    return replace(plan, stages=tuple(stages))


def _shared(job: Job) -> tuple[Cache, Steps]:
    """Return the small chunks' traces and the optimizer steps `job`'s engine run shares with
    the other runs of the search (`_TRACES`, `_STEPS`)."""
    training = job.training
    traces = replace(job, training=replace(training, recompute_num_layers=1))
    steps = replace(job, training=replace(training, recompute="none", recompute_method="uniform",
                                          recompute_num_layers=1, micro_batch_size=None))  # fmt: skip
    return _TRACES.setdefault(traces, {}), _STEPS.setdefault(steps, {})


def engine_shapes(plan: Plan) -> list[tuple[ChunkShape, ...]] | None:
    """Return what megatron puts on each chunk of each stage of the plan, from its printed split,
    or None where `memory`'s whole computation is needed.

    `memory` builds every stage (world/build.build) for two things: the state, which the plan's
    stages already hold exactly (tests/test_plan.py: the composed state equals `memory`'s,
    stage by stage), and the chunks' shapes, which are the plan's split: the embedding on the
    first chunk of stage 0, the output layer, loss and MTP block on the last chunk of the last
    stage (megatron asserts a layout string's embedding and loss there too). FSDP's state (the
    plan's leaves out megatron's bucket padding) and buffers in flight come from one built stage
    of each kind (`_fsdp_held`). Left to `memory`: an MTP block in a layout string (which may
    place it elsewhere).
    """
    job = plan.job
    from inspector.memory.engine.stage import ChunkShape

    mtp = job.model.mtp_num_layers or 0
    if mtp and job.layout.pipeline_model_parallel_layout is not None:
        return None
    last = job.layout.pp - 1
    out = []
    for printed in plan.stages:
        chunks = []
        for k, layers in enumerate(printed.layers):
            output = printed.stage == last and k == len(printed.layers) - 1
            chunks.append(ChunkShape(tuple(layers), printed.stage == 0 and k == 0, output,
                                     mtp if output else 0))  # fmt: skip
        out.append(tuple(chunks))
    return out


def _fsdp_held(job: Job, shapes: Sequence[tuple[ChunkShape, ...]]) -> list[int]:
    """Return each stage's FSDP bytes as `memory` counts them: its most loaded rank's state and
    the gathered buffers in flight (memory/measure.py `_stage_memory`).

    Both come from the chunks' bucket layouts, which depend only on what each chunk holds (its
    layers' kinds, embedding, output layer, MTP block) and its place in the stage: stages alike
    share them, so one stage of each kind is built (the middle stages of a pipeline are one).
    Every stage's ranks hold the same (data, expert data) shard pairs (ranks.stage_shard_pairs).
    """
    from inspector.memory.fsdp_buffers import fsdp_in_flight, fsdp_state
    from inspector.world.build import View, build
    from inspector.world.ranks import stage_shard_pairs

    moe = job.model.is_moe_layer
    kinds = [
        tuple((tuple(map(moe, c.layers)), c.embedding, c.output, c.mtp) for c in chunks)
        for chunks in shapes
    ]
    first = {kind: stage for stage, kind in reversed(list(enumerate(kinds)))}
    built = build(job, View(tuple(sorted(first.values()))), expert_ranks=(0,))
    pairs = stage_shard_pairs(job.layout)
    held = {}
    for stage in built.stages:
        layouts = [chunk.fsdp() for chunk in stage.chunks]
        state = max(sum(fsdp_state(layouts, data, expert)) for data, expert in pairs)
        # Megatron-FSDP's gradient buckets are in the engine's backward (engine/fsdp_grads.py)
        held[kinds[stage.stage]] = state + fsdp_in_flight(layouts, not job.training.megatron_fsdp)
    return [held[kind] for kind in kinds]


def _measured_as_memory(plan: Plan) -> Plan:
    """Return `measured`'s answer as `memory` computes it: every stage built, then measured."""
    from inspector.memory.measure import Hardware, measure
    from inspector.world.build import build, select_view

    job = plan.job
    report = measure(build(job, select_view(job), expert_ranks=(0,)), Hardware())
    stages = tuple(  # FSDP's buffers in flight are `memory`'s own there, not the plan's `gathered`
        replace(printed, activations=built.total - printed.state.total - printed.fsdp_in_flight,
                outside=built.run.outside if built.run is not None else ())
        for printed, built in zip(plan.stages, report.stages, strict=True)
    )
    return replace(plan, stages=stages)


def confirmed(
    ranked: Iterable[Plan], budget: int, top: int,
    retry: Callable[[Plan], Plan | None] = lambda plan: None, limit: float = math.inf,
) -> tuple[list[Plan], Plan | None] | None:
    """Return the first `top` ranked plans that fit `budget` bytes as `memory` measures them
    (every one when `top` is 0), fastest first; and of the plans measured over the budget, the
    one `memory` finds the least memory for (None when none was). None where that needs a plan
    slower than `limit` seconds, or more plans than `ranked` holds while `limit` is set (the
    search passed slower settings over unpriced).

    A plan measured over the budget gives way to `retry(plan)` (its layout with more
    recomputation, candidates.more_recompute), ranked by its own step time among the rest.
    """
    out: list[Plan] = []
    least: Plan | None = None
    queue = [(p.time.seconds, p.peak, i, p) for i, p in enumerate(ranked)]
    heapq.heapify(queue)
    count = len(queue)
    while queue and not (top and len(out) == top):
        seconds, _, _, plan = heapq.heappop(queue)
        if seconds > limit:
            return None
        if engine_runs(plan):
            plan = measured(plan)
            if plan.peak > budget:
                if least is None or plan.peak < least.peak:
                    least = plan
                more = retry(plan)
                if more is not None:
                    heapq.heappush(queue, (more.time.seconds, more.peak, count, more))
                    count += 1
                continue
        out.append(plan)
    if limit < math.inf and (not top or len(out) < top):
        return None
    return out, least
