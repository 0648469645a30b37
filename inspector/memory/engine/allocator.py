"""The CUDA caching allocator's view of a run: every allocation and free, in order, in its units.

A TorchDispatchMode sees every aten op megatron's code runs (forward, the autograd engine's
backward, DDP's hooks). An output whose storage no input shares is a new allocation; a weakref
on that storage frees it when the last tensor using it dies, as the allocator frees the block.
This is how torch's own `torch.distributed._tools.mem_tracker.MemTracker` follows storages
(`_WeakRefInfo`), kept to what the GPU's counters report:

- sizes are rounded up to 512 bytes and a 0-byte tensor allocates nothing, as
  c10/cuda/CUDACachingAllocator.cpp does (`kMinBlockSize = 512`, `round_size`; `malloc` returns
  no block for size 0), so `memory_allocated` and `max_memory_allocated` are the GPU's numbers;
- storages that existed before the recording (parameters, grad buffers) are never counted, nor
  host (CPU) storages: the RNG states megatron's checkpoints keep, Adam's step counters;
- `UntypedStorage.resize_`, which megatron's CheckpointWithoutOutput uses to drop an output's
  memory and give it back on recomputation (tensor_parallel/random.py), reaches no dispatch mode:
  it is followed as CUDA does it (aten/src/ATen/native/cuda/Resize.cpp `resize_bytes_cuda`: a
  block of the new size, the old one freed after the copy; size 0 takes no block).

The engine's dispatch modes tell torch not to wrap their `__torch_dispatch__` for dynamo
(`_should_skip_dynamo`): torch/utils/_python_dispatch.py wraps it in `torch._disable_dynamo` by
default, whose first call imports torch._dynamo (~0.5 s) to keep dynamo out of the mode's frames,
and nothing here compiles (world/fastimport.py: torch.compile passes through).

Each event carries where megatron was, so a peak can be named and a trace cut into layers: in
forward (and recomputation) the module running (`Tracker.enter`/`leave`, from module hooks) or the
step the caller named (`Tracker.at`); in backward the module whose forward created the autograd
node running, found by the node's sequence number (autograd numbers nodes in creation order,
c10/core `at::sequence_number`; `Tracker.at`/`enter` note the number each label starts at).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

BLOCK = 512  # kMinBlockSize in c10/cuda/CUDACachingAllocator.cpp
# AccumulateGrad nodes take UINT64_MAX as sequence number (torch/csrc/autograd/functions/
# accumulate_grad.cpp), so the engine runs them as soon as they are ready.
_ACCUMULATE_GRAD = 1 << 63


def rounded(nbytes: int) -> int:
    """Return the bytes the caching allocator counts for a request: 0, or a multiple of 512."""
    return -(-nbytes // BLOCK) * BLOCK


@dataclass(frozen=True)
class Event:
    """One allocation (bytes > 0) or free (bytes < 0), with where megatron was and the total after."""

    bytes: int
    allocated: int  # memory_allocated after the event, relative to the start of the recording
    where: str
    # a free's: where its block was allocated (the pool it returns to, engine/cuda_graphs.py);
    # not compared: a composed trace names it from its own pieces (compose.py)
    origin: str = field(default="", compare=False)


@dataclass
class Tracker(TorchDispatchMode):
    """Record allocations and frees of new storages while active (use as a context manager)."""

    where: str = ""
    phase: str = ""  # the step the caller named last
    allocated: int = 0
    peak: int = 0
    events: list[Event] = field(default_factory=list)
    live: dict[int, tuple[int, int]] = field(default_factory=dict)  # storage -> (bytes, event)
    stack: list[str] = field(default_factory=list)  # modules whose forward is running
    starts: list[int] = field(default_factory=list)  # autograd sequence number each label starts
    labels: list[str] = field(default_factory=list)
    watched: set[int] = field(default_factory=set)  # storages a finalizer will free
    made_by: dict[int, int] = field(default_factory=dict)  # a free's event -> its allocation's

    def __post_init__(self) -> None:
        super().__init__()

    def __enter__(self) -> Tracker:
        resize = self._resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: Any, nbytes: int) -> Any:
            out = resize(storage, nbytes)
            tracker._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Keep `__torch_dispatch__` as written: nothing here compiles (module notes)."""
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_id(t) for t in tensors_in((args, kwargs))}
        for tensor in tensors_in(out):
            if _storage_id(tensor) not in inputs:
                self._allocate(tensor.untyped_storage())
        return out

    def _allocate(self, storage: Any) -> None:
        key = storage._cdata
        if key in self.live or storage.device.type != "meta":
            return
        size = rounded(storage.nbytes())
        if size:
            self.live[key] = (size, len(self.events))
            self._record(size)
            self.watched.add(key)
            weakref.finalize(storage, self._free, key)

    def _resized(self, storage: Any) -> None:
        """Follow a storage resized in place: its new block, then the old one freed."""
        key = storage._cdata
        if storage.device.type != "meta":
            return
        old, made = self.live.pop(key, (0, 0))
        size = rounded(storage.nbytes())
        if size:
            self.live[key] = (size, len(self.events))
            self._record(size)
            if key not in self.watched:
                self.watched.add(key)
                weakref.finalize(storage, self._free, key)
        if old:
            self.made_by[len(self.events)] = made
            self._record(-old, self.events[made].where)

    def _free(self, key: int) -> None:
        self.watched.discard(key)
        size, made = self.live.pop(key, (0, 0))
        if size:
            self.made_by[len(self.events)] = made
            self._record(-size, self.events[made].where)

    def _record(self, size: int, origin: str = "") -> None:
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        self.events.append(Event(size, self.allocated, self._location(), origin))

    def _location(self) -> str:
        """Return where megatron is: the module running, else the creator of the backward node."""
        node = torch._C._current_autograd_node()
        if node is None or self.stack:
            return self.where
        seq = node._sequence_nr()
        if seq >= _ACCUMULATE_GRAD:  # AccumulateGrad runs right after the node making the grad
            return self.events[-1].where if self.events else self.where
        index = bisect.bisect_right(self.starts, seq) - 1
        # a custom Function's ctx may set its own `name` (megatron's offload group commit does)
        name = node.name() if callable(node.name) else type(node).__name__
        return f"{self.labels[index] if index >= 0 else self.where}: {name}"

    def at(self, label: str) -> None:
        """Name the step that runs next (outside any module)."""
        self.where = self.phase = label
        self._start(label)

    def enter(self, name: str) -> None:
        """Note that module `name`'s forward starts."""
        self.stack.append(name)
        self.where = name
        self._start(name)

    def leave(self) -> None:
        """Note that the innermost module's forward ended."""
        if self.stack:
            self.stack.pop()
        self.where = self.stack[-1] if self.stack else self.phase
        self._start(self.where)

    def _start(self, label: str) -> None:
        seq = torch._C._autograd._get_sequence_nr()
        if self.starts and self.starts[-1] == seq:
            self.labels[-1] = label
        else:
            self.starts.append(seq)
            self.labels.append(label)

    def mark(self) -> int:
        """Return the index of the next event (to slice the record into phases)."""
        return len(self.events)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Return the tensors among an ATen call's arguments or results, as torch's
    `pytree.tree_leaves` finds them: in tuples (named ones too), lists and dicts, nested; any
    other container torch's pytree knows is handed to it (tests/test_allocator.py)."""
    out: list[torch.Tensor] = []
    todo = [tree]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (tuple, list)):
            todo.extend(reversed(item))
        elif isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
        elif not isinstance(item, (int, float, bool, str, type(None), torch.dtype, torch.device,
                                   torch.layout, torch.memory_format)):  # fmt: skip
            out.extend(t for t in pytree.tree_leaves(item) if isinstance(t, torch.Tensor))
    return out


def _storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)

