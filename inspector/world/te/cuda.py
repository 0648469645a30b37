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



# The GPU the simulated world runs on, as TE and the kernels ask torch.cuda about it:
# (compute capability, multi_processor_count). An H100 SXM unless a job's GPU is entered
# (`on_gpu`, around every build and engine run: world/build.py, memory/engine/run.py).
_GPU: list[tuple[tuple[int, int], int]] = [((9, 0), 132)]


@contextlib.contextmanager
def on_gpu(capability: tuple[int, int], sms: int) -> Iterator[None]:
    """Run the block on a GPU of this compute capability and SM count (restored after)."""
    _GPU.append((tuple(capability), int(sms)))  # type: ignore[arg-type]
    try:
        yield
    finally:
        _GPU.pop()


def device_capability() -> tuple[int, int]:
    """Return `torch.cuda.get_device_capability()` of the simulated GPU."""
    return _GPU[-1][0]


def multi_processor_count() -> int:
    """Return `torch.cuda.get_device_properties().multi_processor_count` of the simulated GPU."""
    return _GPU[-1][1]


def is_non_tn_fp8_gemm_supported() -> bool:
    """TE pytorch/utils.py `is_non_tn_fp8_gemm_supported` (v2.11 491-496, v2.14 523, v2.17 657),
    common/transformer_engine.cpp `nvte_is_non_tn_fp8_gemm_supported` (v2.11 947-960): fp8 GEMMs
    of any layout on compute capability 10.x-11.x and 13.0+, so Float8 quantizers keep no
    transpose there (`(10, 0) <= device_capability < (12, 0) or device_capability >= (13, 0)`)."""
    capability = device_capability()
    return (10, 0) <= capability < (12, 0) or capability >= (13, 0)
