"""A chunk's micro-batch trace composed from a traced chunk with one layer of each kind.

Tracing every layer of a 126-layer model costs as much as it is long, yet megatron runs every
layer of a kind the same way: the same ops on the same shapes, allocating and freeing the same
bytes in the same order. A trace is cut where megatron's modules say (allocator.py labels every
event with the module running, or in backward with the module that made the autograd node):

- head: what runs before the first transformer layer (inputs, embedding, the received tensor);
- one segment per layer (`decoder.layers.{i}`, and whatever runs between it and the next);
- tail: the final norm, output layer, loss, MTP block, the send.

The backward runs the same pieces in reverse. A chunk of N layers is then the head, N copies of
the segment of its layer's kind, and the tail, each event's running total recomputed
(tests/test_engine.py checks this equals the trace of every layer, event for event).

Where full recomputation checkpoints groups of layers (`--recompute-method uniform` with
`--recompute-num-layers` N > 1: megatron-core TransformerBlock._checkpointed_forward), the
backward of a group recomputes its N layers' forwards before running their backwards, so the
group, not the layer, is the piece: one segment per group of N consecutive layers.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from inspector.memory.engine.allocator import Event
from inspector.memory.engine.microbatch import Trace

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=[.:]|$)")

Step = tuple[int, str, str]  # bytes (negative: a free), where, a free's allocation (allocator.Event)


@dataclass(frozen=True)
class PhaseCut:
    """One phase (forward or backward) of a trace, cut into head, layers and tail."""

    head: tuple[Step, ...]
    layers: tuple[tuple[Step, ...], ...]  # by local layer index (or group of `group` layers)
    tail: tuple[Step, ...]


@functools.lru_cache(maxsize=1 << 16)
def layer_of(where: str) -> int | None:
    """Return the local index of the transformer layer an event's label names, else None
    (once per label: a composition reads each of a chunk's labels once per layer it makes)."""
    match = _LAYER.match(where)
    return int(match.group(1)) if match else None


def cut(events: Sequence[Event], layers: int, group: int = 1) -> PhaseCut:
    """Cut one phase's events into head, each layer's (or group of `group` layers') segment and
    tail.

    An unlabelled event between two layers belongs to the layer before it in running order.
    """
    head: list[Step] = []
    segments: list[list[Step]] = [[] for _ in range(layers // group)]
    tail: list[Step] = []
    seen = [i for i, e in enumerate(events) if layer_of(e.where) is not None]
    last = seen[-1] if seen else -1
    current: int | None = None
    for index, event in enumerate(events):
        layer = layer_of(event.where)
        current = layer if layer is not None else current
        step = (event.bytes, event.where, event.origin)
        if current is None:
            head.append(step)
        elif index > last:
            tail.append(step)
        else:
            segments[current // group].append(step)
    return PhaseCut(tuple(head), tuple(tuple(s) for s in segments), tuple(tail))


def compose(
    trace: Trace, layers: int, picks: Sequence[int], numbers: Sequence[int], group: int = 1
) -> Trace:
    """Return the trace of a chunk whose layer (or group of `group` layers) i runs as `trace`'s
    layer (group) picks[i].

    `layers`: how many layers `trace`'s chunk had; `numbers`: each composed layer's 0-based
    global number, for the labels ("layer 17 mlp.linear_fc1").
    """
    forward, backward = cut(trace.forward, layers, group), cut(trace.backward, layers, group)
    order = [(pick, numbers[k * group : (k + 1) * group]) for k, pick in enumerate(picks)]
    steps_f = [
        *_edge(forward.head, layers, numbers),
        *(s for pick, ns in order for s in _named(forward.layers[pick], pick * group, ns)),
        *_edge(forward.tail, layers, numbers),
    ]
    steps_b = [
        *_edge(backward.head, layers, numbers),
        *(s for pick, ns in reversed(order) for s in _named(backward.layers[pick], pick * group, ns)),
        *_edge(backward.tail, layers, numbers),
    ]
    events_f = _events(steps_f, 0)
    backward_b = _events(steps_b, events_f[-1].allocated if events_f else 0)
    persistent = _persistent(trace.persistent, layers, group, order)
    host = _persistent(trace.host, layers, group, order)  # each layer's host buffers, as its own
    stash = _persistent(trace.stash, layers, group, order)  # each layer's stash counts, as its own
    retained = _persistent(trace.retained, layers, group, order)  # each layer's, as its own
    return Trace(events_f, backward_b, persistent, trace.deferred, host, stash, retained)


def _persistent(
    kept: Sequence[tuple[str, int]],
    layers: int,
    group: int,
    order: Sequence[tuple[int, Sequence[int]]],
) -> tuple[tuple[str, int], ...]:
    """Return the chunk's persistent buffers: those outside the layers once, then each layer's
    (an MoE layer's token dispatcher keeps its last routing metadata: token_dispatcher.py)."""
    by_group: list[list[tuple[str, int]]] = [[] for _ in range(layers // group)]
    outside: list[tuple[str, int]] = []
    for where, size in kept:
        layer = layer_of(where)
        (outside if layer is None else by_group[layer // group]).append((where, size))
    own = [
        (_renamed(where, pick * group, numbers), size)
        for pick, numbers in order
        for where, size in by_group[pick]
    ]
    return (*outside, *own)


def _edge(steps: Sequence[Step], layers: int, numbers: Sequence[int]) -> list[Step]:
    """Return head or tail steps with a free's origin in a layer named as composed: the small
    chunk's first layers are the chunk's first, its last the chunk's last."""
    out = []
    for size, where, origin in steps:
        match = _LAYER.match(origin)
        if match:
            j = int(match.group(1))
            k = j if j < layers - 1 or layers == 1 else len(numbers) - (layers - j)
            origin = _renamed(origin, j, [numbers[k]])
        out.append((size, where, origin))
    return out


def _named(steps: Sequence[Step], first: int, numbers: Sequence[int]) -> list[Step]:
    return [(size, _renamed(where, first, numbers), _renamed(origin, first, numbers))
            for size, where, origin in steps]  # fmt: skip


def _renamed(where: str, first: int, numbers: Sequence[int]) -> str:
    """Return `where` with its layer (`decoder.layers.{first + j}`) named by numbers[j]; a free's
    origin in another piece's layer (j out of range) by its distance from this piece, as a
    chunk's layers are consecutive."""
    parts = _parts(where)
    if parts is None:
        return where
    j = parts[0] - first
    number = numbers[j] if 0 <= j < len(numbers) else numbers[0] + j
    return f"layer {number}{parts[1]}"


@functools.lru_cache(maxsize=1 << 16)
def _parts(where: str) -> tuple[int, str] | None:
    """Return a label's layer index and what `_renamed` writes after the layer's new name."""
    match = _LAYER.match(where)
    if not match:
        return None
    rest = where[match.end() :]
    return int(match.group(1)), rest if rest.startswith(":") else " " + rest[1:] if rest else ""


def _events(steps: Sequence[Step], total: int) -> tuple[Event, ...]:
    out = []
    for size, where, origin in steps:
        total += size
        out.append(Event(size, total, where, origin))
    return tuple(out)
