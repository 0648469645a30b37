"""`memory --snapshot FILE.pickle`: the iteration as torch.cuda.memory._dump_snapshot writes it.

The dict is the one torch/cuda/memory.py `_snapshot` documents, in the shape torch's own
synthetic snapshot takes (torch/cuda/_memory_viz.py `_profile_to_snapshot`), so PyTorch's
memory viewer (pytorch.org/memory_viz, `_memory_viz.trace_plot`) opens it:

- one device per pipeline stage (device i is stage i, the rank the report shows for it);
- `segments`: one segment per device, as the caching allocator holds it at the iteration's end:
  the static memory (weights, gradients, optimizer state, each persistent buffer, the cuBLAS
  workspaces) as `active_allocated` blocks the trace never allocates, so the viewer draws them
  from the start, then the free space the iteration's allocations used;
- `device_traces`: every allocation (`alloc`) and free (`free_requested`, `free_completed`) of
  the iteration in the schedule's order (memory/engine/timeline.py), with two frames: where megatron
  was (the module, or the autograd node and the module that made it) and the pass. What the
  iteration before left an MoE layer (its dispatcher's last routing probabilities and the graph
  behind them, freed by the layer's next pass) is allocated first, under "the iteration before",
  and not among the static blocks; the last backward leaves it again.

Addresses are synthetic and deterministic: a first-fit allocator over the segment. The engine
records a free's size, not its storage, so a free releases the latest live block of its size
made by the same micro-batch (any pass of it). Pickled with protocol 4: byte-identical run to run,
and for equal content (the frames' names are interned: pickle stores a string once per object,
so equal names made apart would otherwise pickle apart).
"""

from __future__ import annotations

import bisect
import pickle
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

from inspector.memory.engine.schedule import layer_key, retained_by_layer
from inspector.memory.measure import MemoryReport, StageMemory
from inspector.records import MemoryPass

BASE = 0x7F0000000000  # where device 0's segment starts: a CUDA-like address, made up
DEVICE_STRIDE = 1 << 40
ALIGN = 2 << 20  # the allocations start on a 2 MiB boundary (kLargeBuffer) after the static blocks


def render_snapshot(report: MemoryReport, passes: dict[int, tuple[MemoryPass, ...]]) -> bytes:
    """Return the pickled snapshot of every stage (one device each), given each stage's passes
    (report.memory_outputs.engine_passes)."""
    return pickle.dumps(snapshot(report, passes), protocol=4)


def snapshot(report: MemoryReport, passes: dict[int, tuple[MemoryPass, ...]]) -> dict[str, Any]:
    """Return the snapshot dict: `segments` and `device_traces`, device i being stage i."""
    segments: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for device, stage in enumerate(report.stages):
        base = BASE + device * DEVICE_STRIDE
        left = _left_before(stage)
        blocks = _static_blocks(stage, base, [item for _, items in left for item in items])
        start = _aligned(blocks[-1]["address"] + blocks[-1]["size"] - base) if blocks else 0
        trace, high = _trace(passes.get(stage.stage, ()), base + start, left)
        segments.append(_segment(device, base, blocks, start + high))
        traces.append(trace)
    return {"segments": segments, "device_traces": traces}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _left_before(stage: StageMemory) -> list[tuple[dict[str, int], tuple[tuple[str, int], ...]]]:
    """Return, per chunk, what the iteration before left its layers (an MoE layer's dispatcher
    keeps its last routing probabilities with the graph behind them: schedule.py `freeing`), by
    layer as the passes free it, and as the persistent buffers list it."""
    replay = stage.run.replay if stage.run is not None else None
    if replay is None:
        return []
    return [(retained_by_layer(trace), trace.retained) for trace in replay.traces if trace.retained]


def _static_blocks(stage: StageMemory, base: int, left: Sequence[tuple[str, int]] = ()
                   ) -> list[dict[str, Any]]:  # fmt: skip
    """Return the blocks alive all through the iteration, one after another from `base`: the
    persistent buffers less what the iteration before `left` the layers, which the first passes
    free (`_trace` allocates it first)."""
    state, run = stage.state, stage.run
    named = [("weights", state.weights), ("gradients", state.gradients)]
    named.append(("optimizer state", state.optimizer))
    if run is not None:
        freed = Counter((layer_key(where), size) for where, size in left)  # by layer and size:
        for where, size in run.persistent:  # the buffers name the module, `left` the layer
            if freed[layer_key(where), size]:
                freed[layer_key(where), size] -= 1
            else:
                named.append((where, size))
        named.append(("cuBLAS workspaces", run.workspaces))
    blocks, address = [], base
    for where, size in named:
        if size:
            blocks.append(_block(address, size, "active_allocated", [_frame(where)]))
            address += size
    return blocks


def _block(address: int, size: int, state: str, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {"address": address, "size": size, "requested_size": size, "state": state, "frames": frames}


def _frame(name: str) -> dict[str, Any]:
    return {"filename": "megatron-core", "line": 0, "name": sys.intern(name)}


def _segment(device: int, base: int, blocks: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Return the device's one segment at the iteration's end: static blocks, then free space."""
    used = sum(b["size"] for b in blocks)
    if total > used:
        blocks = [*blocks, _block(base + used, total - used, "inactive", [])]
    return {
        "device": device,
        "address": base,
        "total_size": total,
        "allocated_size": used,
        "active_size": used,
        "requested_size": used,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }


def _trace(passes: Sequence[MemoryPass], start: int,
           left: Sequence[tuple[dict[str, int], Any]] = ()) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """Return the device trace of the passes from address `start`, and the bytes it spans; what
    the iteration before `left` each chunk's layers (`_left_before`) is allocated first."""
    heap = _FirstFit()
    live: dict[tuple[int, int], dict[int, list[int]]] = {}  # owner -> size -> addresses
    frames: dict[tuple[str, str], list[dict[str, Any]]] = {}  # shared: pickle stores each once
    out: list[dict[str, Any]] = []
    for chunk, (by_layer, _) in enumerate(left):
        blocks = live.setdefault((-2, chunk), {})
        for layer, size in by_layer.items():
            offset = heap.take(size)
            blocks.setdefault(size, []).append(offset)
            where = f"layer {layer}: what its last backward left" if layer else "what the last backward left"
            out.append(_entry("alloc", start + offset, size, [_frame(where), _frame("the iteration before")]))
    for one in passes:
        blocks = live.setdefault(one.owner, {})
        for size, _, where in one.steps:
            stack = frames.setdefault((where, one.label), [_frame(where), _frame(one.label)])
            if size > 0:
                offset = heap.take(size)
                blocks.setdefault(size, []).append(offset)
                out.append(_entry("alloc", start + offset, size, stack))
            else:
                offset = _release(live, one.owner, -size)
                heap.give(offset, -size)
                out.append(_entry("free_requested", start + offset, -size, stack))
                out.append(_entry("free_completed", start + offset, -size, stack))
    return out, heap.high


def _release(live: dict[tuple[int, int], dict[int, list[int]]], owner: tuple[int, int], size: int) -> int:
    """Return the offset of the block a free of `size` releases: the owner's latest of that size
    (another owner's when it has none, which the engine's traces do not make)."""
    for key in (owner, *live):
        addresses = live[key].get(size)
        if addresses:
            return addresses.pop()
    raise ValueError(f"a free of {size} bytes with no live block of that size")


def _entry(action: str, address: int, size: int, frames: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": action, "addr": address, "size": size, "stream": 0, "frames": frames}


class _FirstFit:
    """Addresses for allocations: the lowest free range that fits, ranges merged when freed."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted by offset
        self.high = 0  # the end of the highest range ever taken

    def take(self, size: int) -> int:
        """Return the offset of `size` bytes, taken from the lowest free range that fits."""
        for index, (offset, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[index]
                else:
                    self.free[index] = (offset + size, room - size)
                return offset
        if self.free and sum(self.free[-1]) == self.high:  # grow the last free range
            offset = self.free.pop()[0]
        else:
            offset = self.high
        self.high = offset + size
        return offset

    def give(self, offset: int, size: int) -> None:
        """Return `size` bytes at `offset` to the free ranges, merged with their neighbours."""
        index = bisect.bisect(self.free, (offset, size))
        if index < len(self.free) and offset + size == self.free[index][0]:
            size += self.free.pop(index)[1]
        if index and sum(self.free[index - 1]) == offset:
            offset, size = self.free[index - 1][0], self.free[index - 1][1] + size
            del self.free[index - 1]
        bisect.insort(self.free, (offset, size))
