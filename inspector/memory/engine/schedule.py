"""A rank's iteration: its micro-batch traces replayed in megatron's pipeline schedule.

Every micro-batch of a chunk allocates the same (its shapes do not change), so one trace per
chunk (microbatch.py) stands for all of them. `schedule_passes` (job/dims.py) gives the order of
forwards and backwards megatron-core's schedule runs on the stage; while a pass runs, the
activations of the micro-batches still in flight are held beneath it. The rank's peak is the
highest point of any pass on top of its static memory, and the moment is named. The optimizer
step (optimizer.py) runs after the last backward, with no micro-batch in flight: its temporaries
are one more phase. Under the MoE all-to-all overlap each 1F1B step runs a forward and a
backward together, layer by layer (`combined`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from inspector.job.dims import schedule_passes
from inspector.memory.engine.allocator import Event
from inspector.memory.engine.microbatch import Trace
from inspector.memory.engine.offload_steady import steady_offload


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
    tops = [(top_event(trace.backward), top_event(trace.forward), top_event(freeing(trace, False)),
             top_event(freeing(trace))) for trace in traces]  # once per chunk  # fmt: skip
    pairs: dict[tuple[int, int], Event] = {}
    for ran in replay_passes(traces, stage, pp, num_microbatches, group_size, extra):
        if ran.paired is None:
            top = tops[ran.chunk][ran.forward + 2 * bool(ran.frees)]
        else:
            key = (ran.chunk, ran.paired[0])
            if key not in pairs:
                pairs[key] = top_event(combined(traces[ran.chunk], traces[ran.paired[0]]))
            top = pairs[key]
        if ran.held + top.allocated > best.bytes:
            label = pass_label(ran.forward, ran.mb, ran.chunk, chunks, ran.paired)
            best = Peak(ran.held + top.allocated, ran.held, ran.in_flight, f"{label}: {top.where}")
    top = top_event(step)
    return Peak(top.allocated, 0, 0, top.where) if top.allocated > best.bytes else best


class Pass(NamedTuple):
    """One pass of the replay: a micro-batch's forward or backward on one chunk (under the MoE
    all-to-all overlap, a forward run together with a backward: `paired`)."""

    forward: bool
    chunk: int
    mb: int  # the micro-batch, numbered per chunk
    held: int  # activations the other micro-batches in flight hold beneath it
    in_flight: int  # micro-batches in flight while it runs, itself included
    paired: tuple[int, int] | None = None  # (chunk, micro-batch) of the backward run with it
    frees: int = 0  # what the chunk's last backward left its layers, freed here (`Trace.retained`)


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
    the output layer keeps of finished ones for its deferred weight gradient (`Trace.deferred`).

    What a chunk's backward leaves its layers (`Trace.retained`) is part of the static memory
    (the iteration before left it, as the last backward leaves it for the optimizer step); the
    chunk's next pass frees it (`freeing`), its next backward makes it again."""
    chunks = len(traces)
    counts = [0] * chunks  # micro-batches started, per chunk
    flight: list[list[int]] = [[] for _ in range(chunks)]
    held = 0
    retained = [trace.left for trace in traces]
    holding = [bool(size) for size in retained]  # left by the iteration before
    order = schedule_passes(stage, pp, num_microbatches, chunks, group_size, extra)
    steady = steady_offload(traces, order)
    index = 0
    while index < len(order):
        forward, chunk = order[index]
        index += 1
        if forward:
            mb = counts[chunk]
            counts[chunk] += 1
            paired = None
            back = order[index][1] if index < len(order) and not order[index][0] else None
            if extra and back is not None and flight[back]:  # a 1F1B step of older micro-batches
                index += 1
                paired = (back, flight[back].pop(0))
                held -= traces[back].held + steady.backward(*paired)
            frees = retained[chunk] if holding[chunk] else 0
            holding[chunk] = False
            yield Pass(True, chunk, mb, held, _in_flight(flight) + 1 + (paired is not None),
                       paired, frees)  # fmt: skip
            flight[chunk].append(mb)
            held += traces[chunk].held + steady.forward(chunk, mb) - frees
            if paired is not None:  # (its events are the plain passes': `combined`)
                held += _deferred(traces[paired[0]], paired[1]) + steady.backward_done(*paired)
                held += 0 if holding[paired[0]] else retained[paired[0]]
                holding[paired[0]] = True
        else:
            mb = flight[chunk].pop(0)
            held -= traces[chunk].held + steady.backward(chunk, mb)
            frees = retained[chunk] if holding[chunk] else 0  # the recomputed forward replaces it
            yield Pass(False, chunk, mb, held, _in_flight(flight) + 1, frees=frees)
            held += _deferred(traces[chunk], mb) + steady.backward_done(chunk, mb) + retained[chunk] - frees
            holding[chunk] = True


def freeing(trace: Trace, forward: bool = True) -> tuple[Event, ...]:
    """Return the chunk's forward (or backward) where its layers still hold what their last
    backward left (`Trace.retained`): each layer's is freed as that layer's pass begins, where
    megatron replaces the attribute that held it (an MoE layer's dispatcher sets its
    probabilities after attention: freeing it at the layer's first event is at most that
    attention early; a backward's recomputed forward sets it again)."""
    events = trace.forward if forward else trace.backward
    frees = retained_by_layer(trace)
    if not frees:
        return events
    out, freed = [], frees.pop("", 0)  # a layer the labels do not name: at the start
    for event in events:
        match = _LAYER.match(event.where)
        if match and match.group(1) in frees:
            size = frees.pop(match.group(1))
            freed += size
            out.append(Event(-size, event.allocated - event.bytes - freed, event.where,
                             "what the layer's last backward left"))  # fmt: skip
        out.append(Event(event.bytes, event.allocated - freed, event.where, event.origin))
    return tuple(out)


def retained_by_layer(trace: Trace) -> dict[str, int]:
    """Return what the chunk's last backward left (`Trace.retained`) by the layer that holds it
    (its number; "" where the labels name none), as `freeing` frees it: one free a layer."""
    held: dict[str, int] = {}
    for where, size in trace.retained:
        key = layer_key(where)
        held[key] = held.get(key, 0) + size
    return held


def layer_key(where: str) -> str:
    """Return the number of the layer an event's label names ("" where it names none)."""
    match = _LAYER.match(where)
    return match.group(1) if match else ""


def _deferred(trace: Trace, mb: int) -> int:
    """Return what the output layer keeps of micro-batch `mb` after its backward, until the
    drain after the last backward (`Trace.deferred`: the first `limit` micro-batches, 0 all)."""
    kept, limit = trace.deferred
    return kept if limit == 0 or mb < limit else 0


def combined(forward: Trace, backward: Trace) -> tuple[Event, ...]:
    """Return one 1F1B step of the MoE all-to-all overlap: a micro-batch's forward and an older
    one's backward, run layer by layer together, as allocator events over what the backward's
    micro-batch holds (`Trace.held`).

    megatron-core's `TransformerModelChunkSchedulePlan.run` (models/common/
    model_chunk_schedule_plan.py): the forward's pre-process (embedding) and the backward's
    post-process (loss, output layer), then forward layer i with backward layer L-1-i for each
    i, then the forward's post-process and the backward's pre-process. Within a layer pair
    (`TransformerLayerSchedulePlan.run`) the forward's attention, dispatch, MLP and combine
    interleave with the backward's; here the forward layer's events come first, so a pair
    peaks at most one layer's activations above megatron's order.
    """
    f_head, f_layers, f_tail = _by_layer(forward.forward)
    b_head, b_layers, b_tail = _by_layer(backward.backward)
    pairs = [e for k in range(max(len(f_layers), len(b_layers)))
             for part in (f_layers, b_layers) if k < len(part) for e in part[k]]  # fmt: skip
    total, out = backward.held, []
    for event in (*f_head, *b_head, *pairs, *f_tail, *b_tail):
        total += event.bytes
        out.append(Event(event.bytes, total, event.where, event.origin))
    return tuple(out)


_LAYER = re.compile(r"^(?:layer |decoder\.layers\.)(\d+)")


def _by_layer(events: Sequence[Event]) -> tuple[list[Event], list[list[Event]], list[Event]]:
    """Cut a pass's events into what runs before the first transformer layer, each layer's
    events in running order (an unlabelled event goes with the layer before it), and what runs
    after the last (compose.py cuts traces the same way)."""
    labelled = [i for i, e in enumerate(events) if _LAYER.match(e.where)]
    if not labelled:
        return list(events), [], []
    first, last = labelled[0], labelled[-1]
    layers: list[list[Event]] = []
    current = None
    for event in events[first : last + 1]:
        match = _LAYER.match(event.where)
        if match and match.group(1) != current:
            current = match.group(1)
            layers.append([])
        layers[-1].append(event)
    return list(events[:first]), layers, list(events[last + 1 :])


def pass_label(
    forward: bool, mb: int, chunk: int, chunks: int, paired: tuple[int, int] | None = None
) -> str:
    """Return e.g. "backward of micro-batch 3 (chunk 1)" (no chunk without interleaving), or
    "forward of micro-batch 2 with the backward of micro-batch 1" for a combined step."""
    where = f" (chunk {chunk})" if chunks > 1 else ""
    label = f"{'forward' if forward else 'backward'} of micro-batch {mb}{where}"
    if paired is not None:
        label += f" with the {pass_label(False, paired[1], paired[0], chunks)}"
    return label


def top_event(events: tuple[Event, ...]) -> Event:
    """Return the first event at the highest total (an empty pass peaks at 0)."""
    if not events:
        return Event(0, 0, "")
    return max(events, key=lambda e: e.allocated)


def _in_flight(flight: list[list[int]]) -> int:
    return sum(len(f) for f in flight)
