"""Fine-grained activation offloading from the second iteration on: what stays and comes back early.

A micro-batch's trace (microbatch.py) runs a fresh `PipelineOffloadManager`, as megatron's
first iteration does: every group is copied out, each reloaded when its backward needs it. From
the second iteration the manager holds state across the iteration's chunks (megatron-core 0.16.1
pipeline_parallel/fine_grained_activation_offload.py), replayed here pass by pass:

- host: the first iteration's demand (every group offloaded: the most its micro-batches in
  flight hold at once) stays pinned in megatron's pool, which keeps its buffers (`host_demand`);
- kept: `post_warmup_callback` marks the last group of each module name in the first backward
  chunk not offloadable, and `should_bulk_offload` keeps the last group of each name of a chunk
  that is itself the next backward chunk (`front_backward_chunk(name)`: the first chunk, in the
  iteration's backward order, whose backward has not started). Such a chunk holds those groups
  on the GPU from its forward to its backward, and not on the host;
- reloaded early: each group's backward start (`on_group_start_backward` -> `bulk_reload`) pops
  one group off the chunk's reload stack, or, once the stack is empty, reloads the top group of
  the next backward chunk whose forward is done (`pre_reload_last_layer`). A chunk whose backward
  began with n groups not on its stack (kept, or reloaded early) thus reloads n groups of the
  next chunk at its end, which that chunk holds until its own backward.

The groups are read off the trace's host buffers (`Trace.host`, named "...: offload NAME" in
commit order); a chunk's own backward pass is its trace's (it reloads each group when the
gradient reaches it), so what is early counts beneath the other passes.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from inspector.memory.engine.allocator import rounded
from inspector.memory.engine.microbatch import Trace
from inspector.memory.engine.offload import pinned

# a group: a layer's buffers of one module name (a decoder layer, as composed, or an MTP layer's)
_GROUP = re.compile(r"^((?:layer |decoder\.layers\.|mtp\.layers\.)\d+)\b.*: offload (\w+)$")


@dataclass(frozen=True)
class OffloadGroup:
    """One offload group of a chunk's micro-batch: its module name and bytes."""

    name: str
    gpu: int  # as the caching allocator holds the tensors (allocator.py)
    host: int  # the pinned host buffers asked for
    pinned: int  # as torch's pinned-memory allocator reserves them (offload.py `pinned`)


def offload_groups(trace: Trace) -> tuple[OffloadGroup, ...]:
    """Return the trace's offload groups in commit order (a group: a layer's buffers of a name)."""
    groups: list[tuple[tuple[str, str], OffloadGroup]] = []
    for where, size in trace.host:
        match = _GROUP.match(where)
        if match is None:  # Transformer Engine's layer offload: no state across micro-batches
            continue
        key = (match.group(1), match.group(2))
        add = OffloadGroup(key[1], rounded(size), size, pinned(size))
        if groups and groups[-1][0] == key:
            _, old = groups.pop()
            add = OffloadGroup(old.name, old.gpu + add.gpu, old.host + add.host, old.pinned + add.pinned)
        groups.append((key, add))
    return tuple(group for _, group in groups)


def _kept(groups: Sequence[OffloadGroup]) -> set[int]:
    """Return the indices of the last group of each name (megatron's `find_next_group` is None)."""
    return {max(i for i, g in enumerate(groups) if g.name == name) for name in {g.name for g in groups}}


@dataclass
class SteadyOffload:
    """The manager's state over one iteration of a rank, driven by the replay's passes."""

    traces: Sequence[Trace]
    backward_order: Sequence[tuple[int, int]]  # (chunk, micro-batch) as the backwards run
    groups: list[tuple[OffloadGroup, ...]] = field(init=False)
    position: dict[tuple[int, int], int] = field(init=False)  # in the backward order
    offloading: list[int] = field(init=False)  # positions of the chunks with groups
    started: int = 0  # backwards started: they start in the backward order
    done: set[tuple[int, int]] = field(default_factory=set)  # forwards run
    stacks: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # groups still offloaded
    early: dict[tuple[int, int], int] = field(default_factory=dict)  # GPU bytes held early
    ahead: dict[tuple[int, int], int] = field(default_factory=dict)  # groups not on its stack

    def __post_init__(self) -> None:
        self.groups = [offload_groups(trace) for trace in self.traces]
        self.position = {key: k for k, key in enumerate(self.backward_order)}
        self.offloading = [k for k, (chunk, _) in enumerate(self.backward_order) if self.groups[chunk]]

    def _neighbour(self, position: int, after: bool) -> int | None:
        """Return the position of the chunk with groups just before (or after) `position`."""
        k = bisect.bisect_right(self.offloading, position) if after else \
            bisect.bisect_left(self.offloading, position) - 1  # fmt: skip
        return self.offloading[k] if 0 <= k < len(self.offloading) else None

    def forward(self, chunk: int, mb: int) -> int:
        """Run a forward: return the GPU bytes it keeps beyond its trace's (kept groups)."""
        key, groups = (chunk, mb), self.groups[chunk]
        self.done.add(key)
        if not groups:
            return 0
        before = self._neighbour(self.position[key], after=False)
        front = before is None or before < self.started
        kept = _kept(groups) if front else set()
        self.stacks[key] = [i for i in range(len(groups)) if i not in kept]
        self.ahead[key] = len(kept)
        self.early[key] = sum(groups[i].gpu for i in kept)
        return self.early[key]

    def backward(self, chunk: int, mb: int) -> int:
        """Start a backward: return the GPU bytes held early that its pass now holds itself."""
        key = (chunk, mb)
        self.started = self.position[key] + 1
        return self.early.pop(key, 0)

    def backward_done(self, chunk: int, mb: int) -> int:
        """End a backward: reload the top groups of the next chunk to run its backward early;
        return the GPU bytes so reloaded."""
        key, groups = (chunk, mb), self.groups[chunk]
        if not groups:
            return 0
        self.stacks.pop(key, None)
        calls = self.ahead.pop(key, 0)
        following = self._neighbour(self.position[key], after=True)
        if not calls or following is None or self.backward_order[following] not in self.done:
            return 0
        nxt = self.backward_order[following]
        stack = self.stacks[nxt]
        popped = stack[max(0, len(stack) - calls) :]
        del stack[len(stack) - len(popped) :]
        self.ahead[nxt] = self.ahead.get(nxt, 0) + len(popped)
        reloaded = sum(self.groups[nxt[0]][i].gpu for i in popped)
        self.early[nxt] = self.early.get(nxt, 0) + reloaded
        return reloaded


def backward_order(order: Sequence[tuple[bool, int]]) -> list[tuple[int, int]]:
    """Return the (chunk, micro-batch) of each backward of `schedule_passes`' order, in order."""
    counts: dict[int, int] = {}
    out = []
    for forward, chunk in order:
        if not forward:
            out.append((chunk, counts.get(chunk, 0)))
            counts[chunk] = counts.get(chunk, 0) + 1
    return out


def steady_offload(traces: Sequence[Trace], order: Sequence[tuple[bool, int]]) -> SteadyOffload:
    """Return the offload manager's state for a replay of `order` (nothing without offloading)."""
    return SteadyOffload(traces, backward_order(order))


def host_demand(traces: Sequence[Trace], stage: int, pp: int, num_microbatches: int,
                group_size: int | None = None, extra: int = 0) -> tuple[int, int]:  # fmt: skip
    """Return the pinned host memory (bytes asked, bytes pinned) a rank's offloading holds: the
    most its micro-batches in flight offload at once over the iteration. megatron's pool keeps
    its buffers for the iterations after (`GPUTensorPool.reset` marks them free), as torch's
    pinned allocator caches Transformer Engine's (`CachingHostAllocator`)."""
    if not any(trace.host for trace in traces):
        return 0, 0
    sizes = [(sum(size for _, size in t.host), sum(pinned(size) for _, size in t.host)) for t in traces]
    top = most_in_flight(sizes, stage, pp, num_microbatches, group_size, extra)
    return top[0], top[1]


def most_in_flight(sizes: Sequence[Sequence[int]], stage: int, pp: int, num_microbatches: int,
                   group_size: int | None = None, extra: int = 0) -> list[int]:  # fmt: skip
    """Return, for each of the numbers a chunk's micro-batch holds from its forward to the end
    of its backward (`sizes[chunk]`), the most the rank's micro-batches in flight hold at once
    over the iteration's passes (job/dims.py `schedule_passes`)."""
    from inspector.job.dims import schedule_passes

    width = len(sizes[0]) if sizes else 0
    live, top = [0] * width, [0] * width
    for forward, chunk in schedule_passes(stage, pp, num_microbatches, len(sizes), group_size, extra):
        for k in range(width):  # made in its forward, given back after its backward
            live[k] += sizes[chunk][k] if forward else -sizes[chunk][k]
            top[k] = max(top[k], live[k])
    return top
