"""Answer the few CUDA calls megatron-core makes while building TE-spec models, on meta.

Used only around builds, like `inspector.distopt.cuda_current_device_on_meta`. The calls, all in
megatron-core 0.13-0.16 construction paths:
- `torch.cuda.current_device()`: RotaryEmbedding / YarnRotaryEmbedding when the config does not
  ask for CPU initialisation (MLA builds its rotary embedding without passing
  use_cpu_initialization: transformer/multi_latent_attention.py, models/common/embeddings/
  rotary_pos_embedding.py ~78, yarn_rotary_pos_embedding.py ~76), and `_get_extra_te_kwargs`
  (extensions/transformer_engine.py ~296-306) when neither CPU nor meta initialisation is set.
- `torch.cuda.Stream()`: TEDotProductAttention's shared `cp_stream` with context parallelism
  (extensions/transformer_engine.py ~1227), SharedExpertMLP's overlap stream
  (transformer/moe/shared_experts.py ~123), the all-to-all dispatcher's `cuda_dtoh_stream`
  (transformer/moe/token_dispatcher.py ~445).
- `torch.tensor(..., device="cpu", pin_memory=True).cuda(non_blocking=True)`: the index of a
  context-parallel rank's two sequence chunks, in `get_pos_emb_on_this_cp_rank`
  (models/common/embeddings/rope_utils.py ~60), which MLA's YarnRotaryEmbedding calls while it is
  built (yarn_rotary_pos_embedding.py ~186, `_set_cos_sin_cache`) under cp > 1. Pinning only
  speeds the copy, so it is dropped (a CPU build has no pinned allocator), and `.cuda()` moves a
  tensor to the device `current_device()` answers: meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class SimulatedStream:
    """A CUDA stream that orders nothing: one stream runs everything here.

    The all-to-all dispatcher waits on its `cuda_dtoh_stream` before its host copies
    (token_dispatcher.py `_maybe_dtoh_and_synchronize`), so the stream answers the calls it makes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = "meta"

    def wait_stream(self, *args: Any) -> None:
        """Order nothing: one stream runs everything here."""

    def record_event(self, *args: Any) -> SimulatedStream:
        """Return an event that is already complete."""
        return self

    def synchronize(self) -> None:
        """Wait for nothing."""

    def __repr__(self) -> str:
        return "SimulatedStream()"


@contextlib.contextmanager
def simulated_cuda() -> Iterator[None]:
    """Answer current_device() with "meta", Stream() with a stand-in, pinned copies to CUDA on meta."""
    import torch

    current_device, stream = torch.cuda.current_device, torch.cuda.Stream
    tensor, to_cuda = torch.tensor, torch.Tensor.cuda

    def unpinned_tensor(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return tensor(*args, **kwargs)

    torch.cuda.current_device = lambda: "meta"  # type: ignore[assignment,return-value]
    torch.cuda.Stream = SimulatedStream  # type: ignore[assignment,misc]
    torch.tensor = unpinned_tensor
    torch.Tensor.cuda = lambda self, *args, **kwargs: self.to("meta")  # type: ignore[method-assign]
    try:
        with _cuda_factories_on_meta():
            yield
    finally:
        torch.cuda.current_device = current_device
        torch.cuda.Stream = stream  # type: ignore[misc]
        torch.tensor = tensor
        torch.Tensor.cuda = to_cuda  # type: ignore[method-assign]


def _cuda_factories_on_meta() -> Any:
    """Return a mode sending `device="cuda"` to meta: megatron-core 0.19's HybridEP dispatcher
    makes `torch.zeros(1, device='cuda')` when it is built (token_dispatcher.py `over_budget`)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if isinstance(device, torch.device | str) and str(device).startswith("cuda"):
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    return Mode()

