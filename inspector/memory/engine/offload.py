"""Megatron's fine-grained activation offloading, run on meta tensors: GPU bytes and host bytes.

megatron-core 0.16's `--fine-grained-activation-offloading` (pipeline_parallel/
fine_grained_activation_offload.py, `PipelineOffloadManager`, `ChunkOffloadHandler`) is run as it
is: its saved-tensor hooks take each tensor a marked module (`--offload-modules`) saves for
backward, its group commit copies the group to the host and drops the GPU tensor, and the group
start of the backward copies it back into a new GPU tensor, one group ahead (`bulk_reload`, and
`pre_reload_last_layer` for the next chunk's last group). The allocator model (allocator.py)
sees the GPU side as a GPU would: the frees after the copy out, the allocations of the reload.

What only a GPU runs is answered here, each piece the smallest that lets megatron's code run:
- streams and events order nothing (one stream runs everything here, world/te/cuda.py), so a
  copy is done when it is issued; `torch.cuda.stream(...)` switches nothing; `record_stream`
  and the NVTX ranges do nothing;
- a pinned host buffer (`torch.empty(..., device="cpu", pin_memory=True)`, made by the manager's
  `GPUTensorPool` or, for `expert_fc1` and `moe_act`, by `ChunkOffloadHandler.offload`) is a meta
  tensor the GPU allocator never sees, counted in `HostBytes`: the bytes asked for, and the
  bytes pinned, rounded up to a power of two as torch's pinned-memory allocator does
  (aten/src/ATen/core/CachingHostAllocator.h `allocate`: `c10::llvm::PowerOf2Ceil(size)`);
  megatron's pool keeps its buffers for the next group of that shape, so they stay pinned;
- megatron-core 0.19 manages only tensors on a CUDA device (`ChunkOffloadHandler.
  _can_manage_tensor_for_offload`, fine_grained_activation_offload.py ~950 at 0.19.2): here the
  GPU's tensors are meta, so that test takes meta for CUDA and is otherwise megatron's;
- Transformer Engine's `cpu_offload.CPUOffloadEnabled`, the flag the manager sets around its
  hooks (megatron's extensions/transformer_engine.py imports TE's `cpu_offload` module), is a
  namespace holding that flag when the stand-in Transformer Engine has no such module.

megatron-core 0.13 has no such module: `supported()` says so by version.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from inspector.world.te.cuda import SimulatedStream

MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"


def supported() -> bool:
    """Return True if the installed megatron-core has fine-grained activation offloading."""
    return importlib.util.find_spec(MODULE) is not None


def pinned(nbytes: int) -> int:
    """Return the bytes torch's pinned-memory allocator reserves for a request (power of two)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass
class HostBytes:
    """The pinned host buffers megatron's offloading holds: live and at their peak."""

    live: int = 0  # bytes asked for, alive now
    peak: int = 0
    pinned_live: int = 0  # as the pinned allocator reserves them
    pinned_peak: int = 0
    sizes: list[int] = field(default_factory=list)  # each host buffer made, in bytes
    made: list[tuple[str, int]] = field(default_factory=list)  # (where megatron made it, bytes)
    where: Callable[[], str] = lambda: ""  # names the module running (the engine's tracker)
    group: str = ""  # the offload group being copied out (megatron's `OffloadTensorGroup._name`)

    def add(self, tensor: torch.Tensor) -> None:
        """Count a new host buffer until its storage dies."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        self.sizes.append(nbytes)
        made = f"offload {self.group}" if self.group else "cpu offload"  # megatron's, or TE's
        self.made.append((f"{self.where()}: {made}", nbytes))
        self.live += nbytes
        self.pinned_live += pinned(nbytes)
        self.peak = max(self.peak, self.live)
        self.pinned_peak = max(self.pinned_peak, self.pinned_live)
        weakref.finalize(storage, self._free, nbytes)

    @property
    def buffers(self) -> int:
        """Return how many host buffers were made."""
        return len(self.sizes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes
        self.pinned_live -= pinned(nbytes)


class _Stream(SimulatedStream):
    """A stream that orders nothing, with the event calls the offload manager makes."""

    def wait_event(self, *args: Any) -> None:
        """Wait for nothing: the copy is done when it is issued."""


class _Event:
    """A CUDA event that is always complete (the manager records and waits on them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        """Record nothing."""

    def wait(self, *args: Any) -> None:
        """Wait for nothing."""

    def synchronize(self) -> None:
        """Wait for nothing."""

    def query(self) -> bool:
        """Say the work before it is done."""
        return True


_CURRENT = _Stream()


@contextlib.contextmanager
def offloading_on_meta(host: HostBytes) -> Iterator[None]:
    """Let megatron's offload manager run on meta; count its pinned host buffers in `host`."""
    empty, empty_like = torch.empty, torch.empty_like

    def pinned_on_meta(make: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Make a pinned host buffer a meta tensor the GPU allocator model never sees."""
        device = kwargs.get("device")
        if not (kwargs.get("pin_memory") and torch.device(device or "cpu").type == "cpu"):
            return make(*args, **kwargs)
        kwargs.update(device="meta", pin_memory=False)
        with _disable_current_modes():
            tensor = make(*args, **kwargs)
        host.add(tensor)
        return tensor

    def host_or_device_empty(*args: Any, **kwargs: Any) -> Any:
        return pinned_on_meta(empty, args, kwargs)

    def host_or_device_empty_like(*args: Any, **kwargs: Any) -> Any:  # TE's cpu_offload.py
        return pinned_on_meta(empty_like, args, kwargs)

    saved = {
        (torch.cuda, "Stream"): _Stream,
        (torch.cuda, "Event"): _Event,
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "current_stream"): lambda device=None: _CURRENT,
        (torch.cuda.nvtx, "range_push"): lambda *args, **kwargs: None,
        (torch.cuda.nvtx, "range_pop"): lambda *args, **kwargs: None,
        (torch.Tensor, "record_stream"): lambda self, stream: None,
        (torch, "empty"): host_or_device_empty,
        (torch, "empty_like"): host_or_device_empty_like,
    }
    if supported():  # megatron-core 0.16+: its fine-grained manager
        _name_groups(host, saved)
    flag = _te_cpu_offload_flag()
    with contextlib.ExitStack() as stack:
        for (owner, name), value in saved.items():
            stack.enter_context(_replaced(owner, name, value))
        stack.enter_context(flag)
        yield


def _name_groups(host: HostBytes, saved: dict[tuple[Any, str], Any]) -> None:
    """Name each host buffer by megatron's offload group that made it; let 0.19 manage meta."""
    handler = _chunk_handler()
    if hasattr(handler, "_can_manage_tensor_for_offload"):  # megatron-core 0.19
        saved[(handler, "_can_manage_tensor_for_offload")] = staticmethod(_manageable)
    copy_out = handler.bulk_offload_group

    def named_copy_out(self: Any, *args: Any, **kwargs: Any) -> Any:
        """megatron's bulk_offload_group, its host buffers named by their group (0.19 passes
        the group, 0.16 takes the last one queued)."""
        host.group = (args[0] if args else self._groups_to_offload[-1])._name
        try:
            return copy_out(self, *args, **kwargs)
        finally:
            host.group = ""

    saved[(handler, "bulk_offload_group")] = named_copy_out


@contextlib.contextmanager
def offloaded(config: Any, where: Callable[[], str]) -> Iterator[HostBytes]:
    """Run a micro-batch as megatron offloads it when `config` (its TransformerConfig) says so:
    a fresh manager (a first iteration's, which offloads every group; schedule.py replays the
    later iterations' state across micro-batches), its host buffers counted and named by
    `where`. Without offloading nothing is replaced."""
    host = HostBytes(where=where)
    if getattr(config, "cpu_offloading", False):  # Transformer Engine's (world/te/cpu_offload.py)
        with offloading_on_meta(host):
            yield host
        return
    if not getattr(config, "fine_grained_activation_offloading", False):
        yield host
        return
    manager = importlib.import_module(MODULE).PipelineOffloadManager
    with offloading_on_meta(host):
        manager.reset_instance()
        try:
            yield host
        finally:
            manager.OFFLOAD_MGR = None  # its pool goes with it


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set `owner.name` to `value` for the block, then put back exactly what was there."""
    own = vars(owner)
    had, before = name in own, own.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, before)
        else:
            delattr(owner, name)


def _chunk_handler() -> Any:
    return importlib.import_module(MODULE).ChunkOffloadHandler


def _manageable(tensor: torch.Tensor) -> bool:
    """megatron-core 0.19.2's `_can_manage_tensor_for_offload`, meta standing for CUDA."""
    stray = (torch._subclasses.fake_tensor.FakeTensor,
             torch._subclasses.functional_tensor.FunctionalTensor)  # fmt: skip
    return (
        not isinstance(tensor, torch.nn.Parameter)
        and not isinstance(tensor, stray)
        and tensor.device.type in ("cuda", "meta")
    )


@contextlib.contextmanager
def _te_cpu_offload_flag() -> Iterator[None]:
    """Give megatron a TE `cpu_offload` module holding `CPUOffloadEnabled` if it has none."""
    import megatron.core.extensions.transformer_engine as te_ext

    if getattr(te_ext, "cpu_offload", None) is not None:
        yield
        return
    te_ext.cpu_offload = types.SimpleNamespace(CPUOffloadEnabled=False)
    try:
        yield
    finally:
        te_ext.cpu_offload = None
