"""A rank's iteration as the schedule replay sees it, pass by pass, for drawing and snapshots.

The same replay as schedule.py's `iteration_peak` (megatron-core's order of forwards and
backwards from `schedule_passes`, job/dims.py), kept pass by pass instead of reduced to the
peak: each pass's allocator events (allocator.py), on top of the activations the other
micro-batches in flight hold. Phases after the last backward (the optimizer step) come last,
with nothing in flight. tests/test_timeline.py checks the highest point equals `iteration_peak`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inspector.job.dims import warmup_steps
from inspector.memory.engine.allocator import Event
from inspector.memory.engine.microbatch import Trace
from inspector.memory.engine.schedule import combined, freeing, pass_label, replay_passes
from inspector.records import MemoryPass

Steps = tuple[tuple[int, int, str], ...]
Phase = tuple[str, tuple[Event, ...]]  # (label, events) of a phase after the last backward


@dataclass(frozen=True)
class Replay:
    """What the replay of a rank's iteration needs, kept so the passes are made only when asked."""

    traces: tuple[Trace, ...]  # one micro-batch of each chunk
    stage: int
    pp: int
    num_microbatches: int
    phases: tuple[Phase, ...] = ()  # after the last backward, nothing in flight (optimizer step)
    extra: int = 0  # warm-up forwards the MoE all-to-all overlap adds (job/ep_overlap.py)
    group_size: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage

    @property
    def count(self) -> int:
        """Return how many passes the iteration has (without making them): under the MoE
        all-to-all overlap each 1F1B step's forward and backward are one pass."""
        chunks = len(self.traces)
        forwards = self.num_microbatches * chunks
        steady = 0
        if self.extra:
            group = self.group_size or self.pp
            steady = forwards - warmup_steps(self.stage, self.pp, self.num_microbatches, chunks,
                                             group, self.extra)  # fmt: skip
        return 2 * forwards - steady + len(self.phases)

    def passes(self) -> tuple[MemoryPass, ...]:
        """Return the iteration's passes in order (`iteration_timeline`)."""
        return iteration_timeline(
            self.traces, self.stage, self.pp, self.num_microbatches, self.group_size,
            phases=self.phases, extra=self.extra,
        )


def iteration_timeline(
    traces: Sequence[Trace],
    stage: int,
    pp: int,
    num_microbatches: int,
    group_size: int | None = None,
    phases: Sequence[Phase] = (),
    extra: int = 0,
) -> tuple[MemoryPass, ...]:
    """Return every pass of one iteration of `stage`, whose chunks ran `traces`, in order.

    `phases`: (label, events) run after the last backward with no micro-batch in flight, e.g.
    ("optimizer step", its events) — the hook for the optimizer step's phase.
    """
    chunks = len(traces)
    # shared by all passes: each chunk's backward and forward, then both freeing what it retained
    steps = [(_steps(t.backward), _steps(t.forward), *((_steps(freeing(t, False)), _steps(freeing(t)))
                                                        if t.retained else ())) for t in traces]  # fmt: skip
    passes: list[MemoryPass] = []
    held = 0
    for ran in replay_passes(traces, stage, pp, num_microbatches, group_size, extra):
        label = pass_label(ran.forward, ran.mb, ran.chunk, chunks, ran.paired)
        if ran.paired is None:
            own = steps[ran.chunk][ran.forward + 2 * bool(ran.frees)]
        else:  # the MoE all-to-all overlap's forward and backward together
            own = _steps(combined(traces[ran.chunk], traces[ran.paired[0]]))
        passes.append(MemoryPass(label, (ran.chunk, ran.mb), ran.held, own))
        trace = traces[ran.chunk]
        held = ran.held + (trace.held if ran.forward else trace.left) - ran.frees
    for index, (label, events) in enumerate(phases):
        passes.append(MemoryPass(label, (-1, index), held, _steps(events)))
    return tuple(passes)


def _steps(events: Sequence[Event]) -> Steps:
    return tuple((e.bytes, e.allocated, e.where) for e in events)
