"""Stand-ins for TE's LayerNorm and RMSNorm, as megatron's TENorm constructs them.

Mirrors transformer_engine 2.11.0 `pytorch/module/layernorm.py` / `rmsnorm.py` (the public
classes, which take megatron's deprecated `hidden_size` / `params_dtype` arguments) and the
operations they subclass, `pytorch/ops/basic/layer_norm.py` / `rmsnorm.py` (parameter
registration); forward runs `functions.NormFunction`. No extra_repr and no children, so they
print `LayerNorm()` / `RMSNorm()` as TE's do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from inspector.world.te._base import empty, mark_sequence_parallel
from inspector.world.te.kernels.functions import NormFunction


def _normalized_shape(normalized_shape: Any, hidden_size: int | None) -> tuple[int, ...]:
    """Resolve TE's deprecated `hidden_size` argument (module/rmsnorm.py 75-90)."""
    if normalized_shape is None:
        if hidden_size is None:
            raise RuntimeError(
                "Neither `normalized_shape` nor `hidden_size` (deprecated) args are provided"
            )
        normalized_shape = hidden_size
    elif hidden_size is not None:
        raise RuntimeError(
            "Both `normalized_shape` and `hidden_size` (deprecated) args are provided"
        )
    if isinstance(normalized_shape, Iterable):
        return tuple(normalized_shape)
    return (normalized_shape,)


def _dtype(params_dtype: torch.dtype | None, kwargs: dict[str, Any]) -> torch.dtype | None:
    """Resolve TE's deprecated `params_dtype` argument (module/rmsnorm.py 91-96)."""
    if params_dtype is not None:
        if "dtype" in kwargs:
            raise RuntimeError("Both `dtype` and `params_dtype` (deprecated) kwargs are provided")
        return params_dtype
    dtype: torch.dtype | None = kwargs.get("dtype")
    return dtype


def _deferred(device: Any) -> bool:
    """Return TE's `defer_param_init`: only an explicit meta device defers (ops rmsnorm.py 90-93)."""
    return device is not None and torch.device(device).type == "meta"


class _Norm(torch.nn.Module):
    """What both norms share: TE's public signature, deprecated arguments, `weight` (then `bias`
    where the norm has one), the sequence-parallel flag."""

    _has_bias = False

    def __init__(
        self,
        normalized_shape: Any = None,
        eps: float = 1e-5,
        sequence_parallel: bool | None = None,
        params_dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
        hidden_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        unknown = set(kwargs) - {"device", "dtype", "sm_margin"}
        if unknown:
            raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
        self.sequence_parallel = sequence_parallel
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self._shape = _normalized_shape(normalized_shape, hidden_size)
        self._dtype = _dtype(params_dtype, kwargs)
        self.weight = torch.nn.Parameter(empty(*self._shape, dtype=self._dtype))
        if self._has_bias:
            self.bias = torch.nn.Parameter(empty(*self._shape, dtype=self._dtype))
        self._finish(kwargs.get("device"))

    def _finish(self, device: Any) -> None:
        if not _deferred(device):
            self.reset_parameters()

    def reset_parameters(self, defer_init: bool | None = None) -> None:
        """Flag the parameters for sequence parallelism, as TE's reset does (module/rmsnorm.py 119-138)."""
        if defer_init:
            return
        if self.sequence_parallel is not None:
            for param in self.parameters():
                mark_sequence_parallel(param, self.sequence_parallel)

    def get_extra_state(self) -> torch.Tensor:
        """Return the ops' extra state without fp8: an empty byte tensor (ops/op.py 528-596)."""
        return torch.empty(0, dtype=torch.uint8, device="cpu")

    def set_extra_state(self, state: Any) -> None:
        """Accept the ops' extra state (ops/op.py 604)."""

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """Run TE's norm operation as memory sees it (functions.NormFunction)."""
        bias = self.bias if self._has_bias else None
        out: torch.Tensor = NormFunction.apply(inp, self.weight, bias)
        return out


class RMSNorm(_Norm):
    """TE's RMSNorm (module/rmsnorm.py 16-133 over ops/basic/rmsnorm.py 69-105): one `weight`.

    `weight` has the normalized shape and dtype; with sequence_parallel given and a non-meta
    device it carries `sequence_parallel` (set by reset_parameters, which meta defers).
    """


class LayerNorm(_Norm):
    """TE's LayerNorm (module/layernorm.py 16-130 over ops/basic/layer_norm.py 70-115).

    Registers `weight` then `bias`, both of the normalized shape and dtype.
    """

    _has_bias = True
