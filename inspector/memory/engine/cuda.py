"""Run megatron's CUDA code path on the meta device, with the kernels a GPU would pick.

torch's FakeTensorMode cannot stand in for CUDA on this CPU build of torch: any op that takes a
device guard (`Tensor.contiguous` in python_variable_methods.cpp, `copy_`, the autograd engine,
`rms_norm`) fails with "PyTorch is not linked with support for cuda devices". So the engine runs
on meta, whose kernels give every op's output shape, dtype and storage, and simulates only where
torch or megatron choose by device:

- `torch.cuda.current_device()` answers "meta" and `device="cuda"` becomes meta (megatron
  allocates its buffers, masks and workspaces there);
- dropout with 0 < p < 1 runs `native_dropout` (a bool mask), as ATen's `dropout` does on CUDA
  (aten/src/ATen/native/Dropout.cpp `is_fused_kernel_acceptable`); on other devices it would keep
  a mask in the input's dtype;
- `rms_norm` runs the fused CUDA kernel's contract (torch >= 2.8 aten/src/ATen/native/
  layer_norm.cpp sends CUDA inputs to `_fused_rms_norm`): output in the input's dtype, fp32 rstd
  per row, and input, weight and rstd saved for backward; the composite it replaces keeps fp32
  copies of the whole input;
- apex's FusedLayerNorm (megatron/core/fusions/fused_layer_norm.py) runs as torch's layer_norm,
  which saves the same tensors for backward (input, and fp32 mean and rstd per row; apex's
  FusedLayerNormAffineFunction and FastLayerNormFN: input, mean, invvar);
- a host tensor asked in page-locked memory (`pin_memory=True`: megatron's rope_utils
  `get_pos_emb_on_this_cp_rank` under context parallelism) is made in ordinary host memory: it
  takes no GPU memory either way, and this CPU build has no pinned allocator;
- megatron's CUDA RNG tracker forks nothing and RNG states are host tensors, as on a GPU
  (CUDA generator states are kept by the host, not in GPU memory);
- megatron-core 0.17's `process_mtp_loss` (transformer/multi_token_prediction.py; GPTModel and
  MambaModel call it) branches on
  the rolled loss mask's token count, `num_tokens > 0`, a value a GPU reads back; a training
  micro-batch has tokens (pretrain_gpt's loss mask is 0 only at EOD tokens), so inside that
  function a meta scalar's truth answers True; 0.18 made the branch a multiplication;
- megatron's fused cross entropy (fusions/fused_cross_entropy.py, `jit_fuser` = torch.compile)
  runs as inductor's code for it allocates: the backward's `calculate_gradients` updates the
  saved fp32 softmax through a view (`grad_2d[arange_1d, masked_target_1d] -= softmax_update`),
  then `mul_`s the whole; functionalised, the indexed update is an `index_put` whose result is
  not the one copied back into the input, so inductor's reinplacing refuses it (torch/_inductor/
  fx_passes/reinplace.py `can_inplace`: a view of a graph input is reinplaced only when a later
  `copy_` writes that op's result back) and lowering clones it (lowering.py `index_put`): one
  more fp32 tensor of the logits' size beside the softmax and the bf16 gradient, freed on return.
  The forward's functions are reinplaced whole (no new logits-sized buffer: their generated code
  writes the input in place), so they run as written;
- Transformer Engine's kernels run as the stand-in's autograd Functions (world/te/*functions.py),
  and its kept placeholder weight gradients (`get_dummy_wgrad`) start afresh in each run, as in
  a new process, so every trace holds the ones it makes (persistent buffers).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}
_RMS_NORMS = {torch.nn.functional.rms_norm, torch.rms_norm}


class _CudaKernels(TorchFunctionMode):
    """Send device="cuda" to meta, and dropout and rms_norm to their CUDA kernels' contracts."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "meta"
        if kwargs.get("pin_memory"):  # page-locked host memory: no GPU memory, and no CUDA here
            kwargs["pin_memory"] = False
        if func in _DROPOUTS:
            return _dropout(*args, **kwargs)
        if func in _RMS_NORMS:
            return _rms_norm(*args, **kwargs)
        return func(*args, **kwargs)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Any:
    """ATen's dropout on CUDA: the fused `native_dropout` for 0 < p < 1, else the input itself."""
    if not training or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input.mul_(0) if inplace else input * 0
    out = torch.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def _rms_norm(
    input: torch.Tensor,
    normalized_shape: Any,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    out: torch.Tensor = _FusedRMSNorm.apply(input, tuple(normalized_shape), weight)
    return out


class _FusedRMSNorm(torch.autograd.Function):
    """What `_fused_rms_norm` allocates and saves on CUDA (layer_norm_kernel.cu)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, shape: tuple[int, ...], weight: Any) -> Any:
        rows = input.shape[: input.dim() - len(shape)]
        rstd = torch.empty((*rows, *([1] * len(shape))), dtype=torch.float32, device=input.device)
        ctx.save_for_backward(input, weight, rstd)
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        input, weight, _ = ctx.saved_tensors
        grad_weight = None if weight is None else torch.empty_like(weight)
        return torch.empty_like(input), None, grad_weight


def _apex_layer_norm(self: Any, input: torch.Tensor) -> torch.Tensor:
    """apex's fused LayerNorm, as far as memory sees it: torch's layer_norm on the same inputs."""
    weight = self.weight + 1 if self.zero_centered_gamma else self.weight
    return torch.nn.functional.layer_norm(input, tuple(weight.shape), weight, self.bias, self.eps)


@contextlib.contextmanager
def _no_fork(self: Any, name: str = "") -> Iterator[None]:
    """megatron's CudaRNGStatesTracker.fork, as far as memory sees it: nothing is allocated."""
    yield


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A CUDA generator's state, which torch returns as a host tensor (no GPU memory)."""
    return torch.zeros(16, dtype=torch.uint8)


def _compiled_gradients(original: Any) -> Any:
    """megatron's `calculate_gradients` as inductor compiles it (module notes): the indexed
    update and the scaling on a clone of the softmax, written back into it on return."""
    original = getattr(original, "__wrapped__", original)  # a nested run wraps it once

    def calculate_gradients(softmax: Any, grad_output: Any, target_mask: Any, target: Any) -> Any:
        work = softmax.clone()
        grad_input = original(work, grad_output, target_mask, target)
        softmax.copy_(work)
        return grad_input

    calculate_gradients.__wrapped__ = original  # type: ignore[attr-defined]
    return calculate_gradients


@contextlib.contextmanager
def cuda_on_meta() -> Iterator[None]:
    """Run megatron's CUDA code on meta tensors (see the module docstring) inside the block."""
    from inspector.world.ddp import cuda_streams_on_meta
    from inspector.world.setup import fresh_te_process, megatron

    # megatron imported as the world prepares it (world/fastimport.py): its fused functions'
    # torch.compile passes them through, so nothing is compiled inside the allocator model
    megatron()
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.tensor_parallel import random

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: "meta"),
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        (random.CudaRNGStatesTracker, "fork", _no_fork),
        (FusedLayerNorm, "forward", _apex_layer_norm),
        (random, "_get_cuda_rng_state", _cpu_rng_state),
        (random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
        (fused_cross_entropy, "calculate_gradients",
         _compiled_gradients(fused_cross_entropy.calculate_gradients)),
    ]
    patches += _mtp_loss_counted()
    fresh_te_process()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with _CudaKernels(), cuda_streams_on_meta():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class _TokensCounted(TorchFunctionMode):
    """Answer `bool` of a meta scalar True: a count of a training micro-batch's tokens."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__bool__ and args[0].is_meta and args[0].dim() == 0:
            return True
        return func(*args, **(kwargs or {}))


# the model modules that call `process_mtp_loss` (0.17+): GPTModel's, and the hybrid model's,
# MambaModel's on 0.17 (models/mamba/mamba_model.py), HybridModel's from 0.18
_MTP_LOSS_CALLERS = ("megatron.core.models.gpt.gpt_model", "megatron.core.models.mamba.mamba_model",
                     "megatron.core.models.hybrid.hybrid_model")  # fmt: skip


def _mtp_loss_counted() -> list[tuple[Any, str, Any]]:
    """Run each model's `process_mtp_loss` (0.17+) with its token-count branch answered."""
    import sys

    patches = []
    for name in _MTP_LOSS_CALLERS:  # those imported: the model the run has built is among them
        module = sys.modules.get(name)
        original = getattr(module, "process_mtp_loss", None)
        if original is None:  # 0.13-0.16: the MTP loss is computed in the model itself
            continue
        patches.append((module, "process_mtp_loss", _counted(original)))
    return patches


def _counted(original: Any) -> Any:
    """Return `original` run with a meta scalar's truth answered (_TokensCounted)."""

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        with _TokensCounted():
            return original(*args, **kwargs)

    return counted
