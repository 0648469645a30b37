"""A rank's iteration: its micro-batch traces replayed in megatron's pipeline schedule.

Every micro-batch of a chunk allocates the same (its shapes do not change), so one trace per
chunk (microbatch.py) stands for all of them. `schedule_passes` (job/dims.py) gives the order of
forwards and backwards megatron-core's schedule runs on the stage; while a pass runs, the
activations of the micro-batches still in flight are held beneath it. The rank's peak is the
highest point of any pass on top of its static memory, and the moment is named. The optimizer
step (optimizer.py) runs after the last backward, with no micro-batch in flight: its temporaries
are one more phase.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inspector.job.dims import schedule_passes
from inspector.memory.engine.allocator import Event
from inspector.memory.engine.microbatch import Trace


@dataclass(frozen=True)
class Peak:
    """The highest memory of a rank's iteration above its static memory, and when it happens."""

    bytes: int  # above static memory (weights, grads, optimizer state, persistent buffers)
    held: int  # of which: activations of other micro-batches in flight at that moment
    micro_batches: int  # micro-batches in flight then (the running one included)
    moment: str  # e.g. "backward of micro-batch 0 (chunk 0): backward MmBackward0 (...)"


REPLAYED = 10_000  # micro-batches replayed one by one; more are replayed as 4 groups


def iteration_peak(
    traces: tuple[Trace, ...],
    stage: int,
    pp: int,
    num_microbatches: int,
    group_size: int | None = None,
    step: tuple[Event, ...] = (),
    extra: int = 0,
) -> Peak:
    """Return the peak over one iteration of `stage`, whose chunks ran `traces` and whose
    optimizer step (after the last backward, nothing in flight) ran `step`.

    Every micro-batch of a chunk allocates alike, so past the warm-up (at most two groups of
    micro-batches) the schedule repeats itself group by group: beyond `REPLAYED` micro-batches
    the replay stops at 4 groups, which hold every state of the whole iteration (a micro-batch
    number in the moment then names its equal in those groups).
    """
    chunks = len(traces)
    group = group_size or pp
    if num_microbatches > max(REPLAYED, 4 * group):
        num_microbatches = 4 * group
    best = Peak(0, 0, 0, "")
    tops = [(_top(trace.backward), _top(trace.forward)) for trace in traces]  # once per chunk
    for ran in replay_passes(traces, stage, pp, num_microbatches, group_size, extra):
        top = tops[ran.chunk][ran.forward]
        if ran.held + top.allocated > best.bytes:
            label = pass_label(ran.forward, ran.mb, ran.chunk, chunks)
            best = Peak(ran.held + top.allocated, ran.held, ran.in_flight, f"{label}: {top.where}")
    top = _top(step)
    return Peak(top.allocated, 0, 0, top.where) if top.allocated > best.bytes else best


class Pass(NamedTuple):
    """One pass of the replay: a micro-batch's forward or backward on one chunk."""

    forward: bool
    chunk: int
    mb: int  # the micro-batch, numbered per chunk
    held: int  # activations the other micro-batches in flight hold beneath it
    in_flight: int  # micro-batches in flight while it runs, itself included


def replay_passes(
    traces: Sequence[Trace],
    stage: int,
    pp: int,
    num_microbatches: int,
    group_size: int | None = None,
    extra: int = 0,
) -> Iterator[Pass]:
    """Yield the passes of one iteration of `stage` in megatron's order (`schedule_passes`),
    each over what the micro-batches then in flight hold (their chunk's `Trace.held`) and what
    the output layer keeps of finished ones for its deferred weight gradient (`Trace.deferred`)."""
    chunks = len(traces)
    counts = [0] * chunks  # micro-batches started, per chunk
    flight: list[list[int]] = [[] for _ in range(chunks)]
    held = 0
    for forward, chunk in schedule_passes(stage, pp, num_microbatches, chunks, group_size, extra):
        if forward:
            mb = counts[chunk]
            counts[chunk] += 1
            yield Pass(True, chunk, mb, held, _in_flight(flight) + 1)
            flight[chunk].append(mb)
            held += traces[chunk].held
        else:
            mb = flight[chunk].pop(0)
            held -= traces[chunk].held
            yield Pass(False, chunk, mb, held, _in_flight(flight) + 1)
            kept, limit = traces[chunk].deferred  # until the drain, after the last backward
            held += kept if limit == 0 or mb < limit else 0


def pass_label(forward: bool, mb: int, chunk: int, chunks: int) -> str:
    """Return e.g. "backward of micro-batch 3 (chunk 1)" (no chunk without interleaving)."""
    where = f" (chunk {chunk})" if chunks > 1 else ""
    return f"{'forward' if forward else 'backward'} of micro-batch {mb}{where}"


def _top(events: tuple[Event, ...]) -> Event:
    """Return the first event at the highest total (an empty pass peaks at 0)."""
    if not events:
        return Event(0, 0, "")
    return max(events, key=lambda e: e.allocated)


def _in_flight(flight: list[list[int]]) -> int:
    return sum(len(f) for f in flight)
