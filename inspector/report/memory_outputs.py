"""The memory command's checks of flags it cannot honour, and the passes --timeline and
--snapshot draw from a memory report (memory/measure.py), within the caps one file holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from inspector.errors import ConfigError
from inspector.job.job import Job
from inspector.memory.measure import MemoryReport
from inspector.records import MemoryPass


def check_walkthrough_flags(**hardware: object) -> None:
    """Raise ConfigError for a hardware flag that --attention-walkthrough would ignore."""
    for name, value in hardware.items():
        if value is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} has no effect with --attention-walkthrough, which prints one attention "
                f"layer and no report; pass one of them"
            )


# --timeline and --snapshot: the passes one file may hold, and the snapshot's trace entries (about
# 85 bytes each pickled: 2,000,000 is some 170 MB). plan's --svg draws up to 100,000 passes too.
MAX_PASSES = 100_000
MAX_SNAPSHOT_ENTRIES = 2_000_000


def check_engine_outputs(job: Job, flags: Sequence[str], not_run: str | None = None) -> None:
    """Raise ConfigError when --timeline or --snapshot asks for a run the engine does not make."""
    from inspector.memory.engine.run import not_runnable

    reason = not_run or not_runnable(job)
    if flags and reason is not None:
        verb = "needs" if len(flags) == 1 else "need"
        raise ConfigError(
            f"{' and '.join(flags)} {verb} megatron's run of the job, which the engine cannot make: "
            f"{reason}"
        )


def engine_passes(report: MemoryReport, flags: Sequence[str]) -> dict[int, tuple[MemoryPass, ...]]:
    """Return each stage's iteration pass by pass for --timeline and --snapshot, or raise
    ConfigError when the engine did not run or the iteration is past what a file holds."""
    check_engine_outputs(report.job, flags, report.not_run)
    passes: dict[int, tuple[MemoryPass, ...]] = {}
    for stage in report.stages:
        replay = stage.run.replay if stage.run is not None else None
        if replay is None:
            check_engine_outputs(report.job, flags, f"stage {stage.stage} was not run")
            continue
        if replay.count > MAX_PASSES:
            raise ConfigError(
                f"{' and '.join(flags)}: stage {stage.stage} runs {replay.count:,} passes in an "
                f"iteration (a forward and a backward per micro-batch and chunk, the optimizer step), "
                f"past the {MAX_PASSES:,} one file draws"
            )
        passes[stage.stage] = replay.passes()
    if "--snapshot" in flags:
        for number, one in passes.items():
            entries = sum(len(p.steps) for p in one) * 3 // 2  # a free is two entries
            if entries > MAX_SNAPSHOT_ENTRIES:
                raise ConfigError(
                    f"--snapshot: stage {number}'s iteration makes about {entries:,} trace entries "
                    f"(allocations and frees), past the {MAX_SNAPSHOT_ENTRIES:,} one file holds"
                )
    return passes


def check_ulysses(ulysses_degree: int | None) -> None:
    """Raise ConfigError for --ulysses-degree outside the attention walkthrough."""
    if ulysses_degree is not None:
        raise ConfigError(
            "--ulysses-degree only shapes --attention-walkthrough: megatron-core trains with "
            "tensor and context parallelism, not Ulysses"
        )
