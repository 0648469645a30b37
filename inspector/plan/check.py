"""`check LOG`: a Megatron-LM training log beside what `memory` and `plan` predict for the same job.

Measured, from the log (inputs/training_log.py): each reporting rank's `max allocated` (the
peak of PyTorch's caching allocator) and `allocated` after its last reported iteration, and the
median of the logged seconds per iteration after the warm-up. Predicted: what torch.cuda
counts on the rank's pipeline stage as `memory` reports it (memory/segments.py `torch_counts`:
megatron's own step on fake tensors, the peak the stage's total, what stays allocated after the
step its static bytes and what the step leaves until the next iteration's zero_grad, both less
what the GPU holds outside PyTorch's allocator and a captured CUDA graphs' pool, plus the
caching allocator's blocks beyond megatron's set-up requests), and the step time of the job as
`plan` prices it (timing.evaluate, at the layer split megatron makes of the job's flags).
Nothing here prints.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from inspector.errors import InputError
from inspector.formulas.kernels import not_measured
from inspector.inputs.training_log import TrainingLog
from inspector.job.job import Job
from inspector.memory.measure import MemoryReport
from inspector.plan.request import PlanFlags, make_request
from inspector.plan.split import pinned_split
from inspector.plan.timing import evaluate


@dataclass(frozen=True)
class Compared:
    """One measured quantity beside its prediction (bytes or seconds)."""

    what: str
    rank: int | None  # the reporting rank; None for the iteration time
    stage: int | None
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """Return the prediction's error, a fraction of the measurement (+: over)."""
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class CheckResult:
    """A log beside the prediction for its job."""

    memory: tuple[Compared, ...]
    time: Compared | None
    times_used: int  # logged iteration times the median is of
    warmup: int
    log: TrainingLog
    not_measured: str = ""  # what no measurement fixes of the GPU's kernels (kernels.not_measured)


def predicted_seconds(job: Job, args: dict[str, Any], flags: PlanFlags) -> tuple[float, str]:
    """Return the job's step seconds as `plan` prices it, on the GPU `flags` names, and the
    sentence naming what no measurement fixes of that GPU's kernels ("" where all are)."""
    req = make_request(args, flags)
    lay = job.layout
    split = pinned_split(req.fixed.get("pin", {}), job.model.num_layers, lay.pp, lay.chunks)
    if split is None:  # megatron-core refused this split already when the job was made
        raise InputError("the job's pipeline split cannot be priced")
    return evaluate(job, split, req).time.seconds, not_measured(req.gpu)


def compare_memory(log: TrainingLog, report: MemoryReport) -> tuple[Compared, ...]:
    """Return each reporting rank's peak and after-step bytes beside its stage's prediction."""
    from inspector.memory.segments import torch_counts
    from inspector.world.ranks import rank_shard_indices

    job = report.job
    stage_of = [pipe for pipe, _data, _expert in rank_shard_indices(job.layout)]
    stages = {s.stage: s for s in report.stages}
    rows: list[Compared] = []
    for line in log.memory:
        if line.rank >= len(stage_of):
            raise InputError(
                f"the log reports rank {line.rank}, but the job has {len(stage_of)} ranks "
                f"({job.layout.world_size}: check the layout flags against the log's job)"
            )
        stage = stages[stage_of[line.rank]]
        after, peak = torch_counts(stage)
        rows.append(Compared("peak allocated", line.rank, stage.stage, line.max_allocated, peak))
        rows.append(Compared("allocated after the step", line.rank, stage.stage, line.allocated,
                             after))  # fmt: skip
    return tuple(rows)


def compare_time(log: TrainingLog, predicted: float | None, warmup: int) -> tuple[Compared | None, int]:
    """Return the median logged iteration time after `warmup` iterations beside the prediction."""
    times = log.times_after(warmup)
    if predicted is None or not times:
        return None, len(times)
    return Compared("iteration time", None, None, statistics.median(times), predicted), len(times)
