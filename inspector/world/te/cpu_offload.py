"""Transformer Engine's layer offload (`transformer_engine.pytorch.cpu_offload`), its memory only.

megatron-core's TransformerBlock asks TE for `get_cpu_offload_context(cpu_offloading,
cpu_offloading_num_layers, num_layers, ...)` when it is built, enters the context around each
layer's forward and passes each layer's output through the returned synchronization function
(transformer_block.py 303-323, 764-786; extensions/transformer_engine.py `get_cpu_offload_context`).
This mirrors TE 2.11's default path (pytorch/cpu_offload.py, NVTE_CPU_OFFLOAD_V1 unset):

- `OffloadableLayerState` (223-441): a layer's saved tensors that are offloadable (not a
  Parameter, not marked `_TE_do_not_offload`, on the device, contiguous or marked
  `offload_base_tensor`) are kept in a list and replaced by their index; `start_offload` makes a
  pinned host copy of each (a view marked `offload_base_tensor` as its base, each tensor once:
  `TensorGroupProcessor`), `release_activation_forward_gpu_memory` drops the device tensors,
  `start_reload` allocates new device tensors, `release_all_memory` drops everything;
- `DefaultOffloadSynchronizer` (522-593): layers 0..N-1 are offloaded; layer i's copy starts at
  the forward of layer i+1, its device memory is released at the forward of layer L-N+i, its
  reload starts at the backward of layer L-1-N+i; the forward of layer 0 resets every layer;
- `get_cpu_offload_context` (632-871): the saved-tensor hooks around each layer, and the
  synchronization function's pre-hook on the layer output's grad_fn (the backward step, and the
  release of the last layer backwarded at the end of the backward).

What only a GPU does is answered as in engine/offload.py: the offload stream orders nothing and
events complete when recorded; the copies themselves allocate nothing beyond their buffers
(`copy_`), so they are not run. A meta tensor stands for a device tensor. Host buffers are asked
for as TE asks (`torch.empty_like(..., device="cpu", pin_memory=True)`): the engine counts them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

OFFLOAD_SYNCHRONIZER: Any = None


def is_cpu_offload_enabled() -> bool:
    """Return True inside an offloaded layer's forward (cpu_offload.py 32-36)."""
    return OFFLOAD_SYNCHRONIZER is not None


def mark_not_offload(*tensors: torch.Tensor | None) -> None:
    """Mark tensors TE keeps on the device (cpu_offload.py 45-56: `_TE_do_not_offload`)."""
    for tensor in tensors:
        if tensor is not None:
            tensor._TE_do_not_offload = True  # type: ignore[attr-defined]


def start_offload(*tensors: torch.Tensor | None, offload_base_tensor: bool = False) -> None:
    """Mark views whose base is offloaded in their place (cpu_offload.py 59-85; the event that
    lets the copy start early orders nothing here)."""
    for tensor in tensors:
        if tensor is not None and offload_base_tensor and tensor._base is not None:
            tensor.offload_base_tensor = True  # type: ignore[attr-defined]


def _offloadable(tensor: torch.Tensor) -> bool:
    """`OffloadableLayerState._check_if_offload` (405-423), meta standing for CUDA."""
    return (
        not isinstance(tensor, torch.nn.Parameter)
        and not getattr(tensor, "_TE_do_not_offload", False)
        and not isinstance(tensor, torch._subclasses.FakeTensor)
        and tensor.device.type in ("cuda", "meta")
        and (tensor.is_contiguous() or getattr(tensor, "offload_base_tensor", False))
    )


class _LayerState:
    """TE's `OffloadableLayerState`: one layer's saved tensors, on the device, host, device again."""

    def __init__(self) -> None:
        self.forward: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.backward: list[torch.Tensor] = []
        self.views: list[tuple[int, Any]] = []  # per pushed tensor: its copy, and its view
        self.state = "not_offloaded"

    def push_tensor(self, tensor: torch.Tensor) -> int | torch.Tensor:
        if not _offloadable(tensor):
            return tensor
        self.forward.append(tensor)
        return len(self.forward) - 1

    def start_offload(self) -> None:
        """Copy each saved tensor (a view's base, each once) to a pinned host buffer."""
        self.state, copies, self.views = "offload_started", {}, []
        for tensor in self.forward:
            view, base = None, tensor
            if getattr(tensor, "offload_base_tensor", False) and tensor._base is not None:
                view, base = (tensor.shape, tensor.stride(), tensor.storage_offset()), tensor._base
            tensor = base
            if id(tensor) not in copies:  # _deduplicate_tensors
                copies[id(tensor)] = len(self.host)
                self.host.append(torch.empty_like(tensor, device="cpu", pin_memory=True))
            self.views.append((copies[id(tensor)], view))

    def release_activation_forward_gpu_memory(self) -> None:
        self.state, self.forward = "offload_finished", []

    def start_reload(self) -> None:
        """Allocate each host buffer's device copy (on the current stream, as TE does)."""
        self.state = "reload_started"
        reloaded = [torch.empty_like(host, device=_device()) for host in self.host]
        self.backward = [reloaded[k] if view is None else reloaded[k].as_strided(*view)
                         for k, view in self.views]  # fmt: skip

    def pop_tensor(self, tensor_or_id: torch.Tensor | int) -> torch.Tensor:
        if isinstance(tensor_or_id, torch.Tensor):
            return tensor_or_id
        return (self.forward if self.state == "not_offloaded" else self.backward)[tensor_or_id]

    def release_all_memory(self) -> None:
        self.forward, self.host, self.backward, self.views = [], [], [], []
        self.state = "not_offloaded"


def _device() -> torch.device:
    """The device megatron's tensors live on here (meta; cuda on a GPU)."""
    return torch.device("meta")


class DefaultOffloadSynchronizer:
    """TE's `DefaultOffloadSynchronizer` with its base `OffloadSynchronizer` (443-593)."""

    def __init__(self, num_layers: int, num_offloaded_layers: int) -> None:
        self.num_layers = num_layers
        self.layer_states = {i: _LayerState() for i in range(num_layers)}
        self.offloaded = {i: i < num_offloaded_layers for i in range(num_layers)}
        self.finish_offload: dict[int, list[int]] = {}
        self.start_reload: dict[int, list[int]] = {}
        for i in range(num_offloaded_layers):
            self.finish_offload.setdefault(num_layers - num_offloaded_layers + i, []).append(i)
            self.start_reload.setdefault(num_layers - 1 - num_offloaded_layers + i, []).append(i)
        self.num_of_fwds: int | None = None
        self.previous_bwd_layer_id: int | None = None
        self.current_layer_id: int | None = None

    def fwd_step(self) -> int:
        if self.num_of_fwds in (None, self.num_layers - 1):
            for state in self.layer_states.values():
                state.release_all_memory()
            self.num_of_fwds = 0
        else:
            self.num_of_fwds = (self.num_of_fwds or 0) + 1
        layer = self.current_layer_id = self.num_of_fwds
        if self.offloaded.get(layer - 1, False):
            self.layer_states[layer - 1].start_offload()
        for done in self.finish_offload.get(layer, []):
            self.layer_states[done].release_activation_forward_gpu_memory()
        return layer

    def bwd_step(self, layer: int) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].release_all_memory()
        self.previous_bwd_layer_id = self.current_layer_id = layer
        for reloaded in self.start_reload.get(layer, []):
            self.layer_states[reloaded].start_reload()

    def push_tensor(self, tensor: torch.Tensor) -> int | torch.Tensor:
        return self.layer_states[self.num_of_fwds or 0].push_tensor(tensor)

    def pop_tensor(self, tensor_or_id: torch.Tensor | int) -> torch.Tensor:
        return self.layer_states[self.current_layer_id or 0].pop_tensor(tensor_or_id)

    def finish_part_of_bwd(self) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].release_all_memory()
        self.previous_bwd_layer_id = None


class _CpuOffloadContext(contextlib.ContextDecorator):
    """The context `get_cpu_offload_context` returns (cpu_offload.py 808-858)."""

    def __init__(self, synchronizer: DefaultOffloadSynchronizer) -> None:
        self.synchronizer = synchronizer
        self.current_layer: int | None = None
        self.previous: Any = None
        self.inside_context = False  # megatron's tensor_parallel/layers.py reads it

    def __enter__(self) -> _CpuOffloadContext:
        global OFFLOAD_SYNCHRONIZER
        self.inside_context = True
        self._hooks = saved_tensors_hooks(self.synchronizer.push_tensor, self.synchronizer.pop_tensor)
        self._hooks.__enter__()
        self.previous, OFFLOAD_SYNCHRONIZER = OFFLOAD_SYNCHRONIZER, self.synchronizer
        self.current_layer = self.synchronizer.fwd_step()
        return self

    def __exit__(self, *args: Any) -> None:
        global OFFLOAD_SYNCHRONIZER
        self._hooks.__exit__(*args)
        OFFLOAD_SYNCHRONIZER = self.previous
        self.inside_context = False

    def synchronization_function(self, tensor: torch.Tensor) -> torch.Tensor:
        """Run the backward step of this layer when the gradient reaches its output."""
        layer, synchronizer = self.current_layer, self.synchronizer

        def hook(_: Any) -> None:
            engine = torch.autograd.variable.Variable._execution_engine  # type: ignore[attr-defined]
            engine.queue_callback(synchronizer.finish_part_of_bwd)
            synchronizer.bwd_step(layer)  # type: ignore[arg-type]

        tensor.grad_fn.register_prehook(hook)  # type: ignore[union-attr]
        return tensor


def get_cpu_offload_context(
    enabled: bool = False, num_layers: int | None = 1, model_layers: int = 1,
    offload_activations: bool = True, offload_weights: bool = False, double_buffering: bool = False,
    retain_pinned_cpu_buffers: bool = False,
) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:  # fmt: skip
    """TE 2.11's `get_cpu_offload_context` without manual synchronization (cpu_offload.py
    632-871): the layers' context and synchronization function, or nothing when disabled.
    `retain_pinned_cpu_buffers` (megatron-core 0.19 passes it) keeps the host buffers for the
    next iteration: the same pinned bytes, which the engine counts once either way."""
    if not enabled or not offload_activations:  # offload_weights alone: "does not have any effect"
        return contextlib.nullcontext(), lambda x: x
    layers = num_layers or 0
    # "Cannot offload all layers without manual synchronization - last layer is not offloaded."
    assert layers <= model_layers - 1
    context = _CpuOffloadContext(DefaultOffloadSynchronizer(model_layers, layers))
    return context, context.synchronization_function
