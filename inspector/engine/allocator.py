"""The CUDA caching allocator's view of a run: every allocation and free, in order, in its units.

A TorchDispatchMode sees every aten op megatron's code runs (forward, the autograd engine's
backward, DDP's hooks). An output whose storage no input shares is a new allocation; a weakref
on that storage frees it when the last tensor using it dies, as the allocator frees the block.
This is how torch's own `torch.distributed._tools.mem_tracker.MemTracker` follows storages
(`_WeakRefInfo`), kept to what the GPU's counters report:

- sizes are rounded up to 512 bytes and a 0-byte tensor allocates nothing, as
  c10/cuda/CUDACachingAllocator.cpp does (`kMinBlockSize = 512`, `round_size`; `malloc` returns
  no block for size 0), so `memory_allocated` and `max_memory_allocated` are the GPU's numbers;
- storages that existed before the recording (parameters, grad buffers) are never counted.

Each event carries where megatron was (`Tracker.where`, set by the caller) so a peak can be named.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

BLOCK = 512  # kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp


def rounded(nbytes: int) -> int:
    """Return the bytes the caching allocator counts for a request: 0, or a multiple of 512."""
    return -(-nbytes // BLOCK) * BLOCK


@dataclass(frozen=True)
class Event:
    """One allocation (bytes > 0) or free (bytes < 0), with where megatron was and the total after."""

    bytes: int
    allocated: int  # memory_allocated after the event, relative to the start of the recording
    where: str


@dataclass
class Tracker(TorchDispatchMode):
    """Record allocations and frees of new storages while active (use as a context manager)."""

    where: str = ""
    allocated: int = 0
    peak: int = 0
    events: list[Event] = field(default_factory=list)
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # storage -> (bytes, event)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if _is_tensor(t)}
        for tensor in pytree.tree_leaves(out):
            if _is_tensor(tensor) and _storage_id(tensor) not in inputs:
                self._allocate(tensor.untyped_storage())
        return out

    def _allocate(self, storage: Any) -> None:
        key = storage._cdata
        if key in self.live:
            return
        size = rounded(storage.nbytes())
        if size:
            self.live[key] = (size, len(self.events))
            self._record(size)
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size, _ = self.live.pop(key, (0, 0))
        if size:
            self._record(-size)

    def _record(self, size: int) -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        node = torch._C._current_autograd_node()
        where = self.where if node is None else f"backward {node.name()} ({self.where})"
        self.events.append(Event(size, self.allocated, where))

    def mark(self) -> int:
        """Return the index of the next event (to slice the record into phases)."""
        return len(self.events)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)
