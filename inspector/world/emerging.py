"""An Emerging-Optimizers stand-in: the `emerging_optimizers` megatron-core's Muon imports.

megatron/core/optimizer/muon.py (core_v0.16.1) imports, at its top, `OrthogonalizedOptimizer` and
`get_muon_scale_factor` from `emerging_optimizers.orthogonalized_optimizers` and `newton_schulz_tp`
from its `muon_utils`, and builds `TensorParallelMuon` on them; without the package it refuses
("Emerging Optimizers is not installed."). The package (github.com/NVIDIA-NeMo/Emerging-Optimizers,
Apache-2.0) is not installed here; this is its smallest part that lets megatron's own Muon run on
meta tensors, each step allocating what the package's allocates:

- `OrthogonalizedOptimizer.step` (orthogonalized_optimizers/orthogonalized_optimizer.py): per
  2-D parameter, the momentum buffer made on the first step (`zeros_like(grad)`: fp32, as the
  grad of megatron's fp32 master copy), decoupled weight decay in place, `exp_avg.lerp_(grad)`,
  Nesterov's `grad.lerp(exp_avg)` (a new tensor), `orthogonalize`, `p.add_(update)`;
- `newton_schulz` (orthogonalized_optimizers/muon_utils.py): normalise (a new tensor), in bf16
  when the fp32 matmul precision is "medium" (megatron's --muon-fp32-matmul-prec default), per
  step `A = X @ X.mT`, `B = addmm(A, A, A)`, `X = addmm(X, B, X)` on the smaller side
  (transposed when rows > columns), back to fp32; `newton_schulz_tp` with no partition (megatron's
  default --muon-tp-mode blockwise) is `newton_schulz`, "duplicated" all-gathers the shards first;
- `get_muon_scale_factor` (orthogonalized_optimizers/muon.py): the update's scale (a number).

megatron-core 0.18+ (optimizer/emerging_optimizers.py, core_v0.19.2) imports, at its import, also
`registry` (`get_optimizer_name_list`, `get_optimizer_cls`: the package's registered optimizers,
none here, so megatron's own `muon` and `adaptive_muon` entries are the registry), `AdaptiveMuon`,
`muon_utils.NSCoeffT`, `scalar_optimizers.Lion` and `soap.SOAP`, and calls
`OrthogonalizedOptimizer.__init__(params, lr, momentum, nesterov=..., weight_decay_method=...)` and
`newton_schulz_tp(..., tp_mode=...)` (the package's 0.2 spellings); AdaptiveMuon, Lion and SOAP are
names only (--optimizer adaptive_muon, lion and soap are refused before megatron runs).

Values are never computed (meta tensors have none). No package code is copied here.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any, Literal

import torch

NAME = "emerging_optimizers"

# muon_utils.py _COEFFICIENT_SETS: how many (a, b, c) steps each type cycles through
COEFFICIENT_STEPS = {"simple": 1, "quintic": 5, "polar_express": 8, "aol": 4}
# muon_utils.py: the coefficient types, as a Literal (megatron 0.18+ reads its members)
NSCoeffT = Literal["simple", "quintic", "polar_express", "aol"]


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """orthogonalized_optimizers/muon.py: the scale of the orthogonalised update."""
    if mode == "shape_scaling":
        return float(max(1, size_out / size_in) ** 0.5)
    if mode == "spectral":
        return float(max(size_out, size_in) ** 0.5)
    if mode == "unit_rms_norm":
        return float((size_out / size_in) ** 0.5)
    raise ValueError(f"Invalid mode for Muon update scale factor: {mode}")


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic",
                  transpose: bool | None = None, **_: Any) -> torch.Tensor:  # fmt: skip
    """muon_utils.py `newton_schulz`: the allocations of its iteration, on the smaller side."""
    if x.ndim < 2 or x.dtype != torch.float32:
        raise ValueError("newton_schulz takes a float32 matrix")
    if coefficient_type not in COEFFICIENT_STEPS:
        raise ValueError(f"Invalid coefficient type: {coefficient_type}")
    transpose = x.size(-2) > x.size(-1) if transpose is None else transpose
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=1e-7)  # type: ignore[arg-type]
    if torch.get_float32_matmul_precision() == "medium":
        X = X.to(torch.bfloat16)
    for _step in range(steps):
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=1.0, beta=1.0)
        X = torch.addmm(X, B, X, alpha=1.0, beta=1.0)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def newton_schulz_tp(x: torch.Tensor, steps: int, coefficient_type: str, tp_group: Any,
                     partition_dim: int | None = None, mode: str = "duplicated",
                     tp_mode: str | None = None) -> torch.Tensor:  # fmt: skip
    """muon_utils.py `newton_schulz_tp`: unsharded matrices as they are; "duplicated" gathers
    the tensor-parallel shards into the whole matrix, orthogonalises it and keeps this rank's
    (`mode` in the package's 0.1, `tp_mode` in its 0.2)."""
    mode = tp_mode or mode
    if partition_dim is None:
        return newton_schulz(x, steps, coefficient_type)
    if mode != "duplicated":
        raise NotImplementedError("--muon-tp-mode distributed is not simulated")
    shards = [torch.empty_like(x) for _ in range(tp_group.size())]
    whole = newton_schulz(torch.cat(shards, dim=partition_dim), steps, coefficient_type)
    return whole.chunk(tp_group.size(), dim=partition_dim)[tp_group.rank()]


@contextlib.contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """emerging_optimizers/utils: torch's fp32 matmul precision inside the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class OrthogonalizedOptimizer(torch.optim.Optimizer):
    """orthogonalized_optimizer.py: momentum SGD whose update is orthogonalised."""

    def __init__(self, params: Any, lr: float, momentum_beta: float, use_nesterov: bool = False,
                 weight_decay: float = 0.0, weight_decay_method: str = "decoupled",
                 fp32_matmul_prec: str = "medium", scaled_orthogonalize_fn: Any = None,
                 nesterov: bool | None = None, **kwargs: Any) -> None:  # fmt: skip
        use_nesterov = use_nesterov if nesterov is None else nesterov  # the package's 0.2 name
        self.fp32_matmul_prec = fp32_matmul_prec
        defaults = dict(lr=lr, momentum_beta=momentum_beta, use_nesterov=use_nesterov,
                        weight_decay=weight_decay, weight_decay_method=weight_decay_method,
                        **kwargs)  # fmt: skip
        super().__init__(params, defaults)
        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Update every 2-D parameter, allocating what the package's step allocates."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 1:
                    raise ValueError(f"{type(self).__name__} does not support 1D parameters")
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                exp_avg = state["momentum_buffer"]
                if group["weight_decay"] > 0.0 and group["weight_decay_method"] == "decoupled":
                    p.mul_(1 - group["weight_decay"] * group["lr"])
                elif group["weight_decay"] > 0.0:
                    grad = grad + group["weight_decay"] * p
                exp_avg.lerp_(grad, 1 - group["momentum_beta"])
                grad = grad.lerp(exp_avg, group["momentum_beta"]) if group["use_nesterov"] else exp_avg
                with fp32_matmul_precision(self.fp32_matmul_prec):
                    kwargs = {k: v for k, v in group.items() if k != "params"}
                    grad = self.orthogonalize(p, grad, **kwargs)
                p.add_(grad, alpha=-group["lr"])

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Return the scaled, orthogonalised update."""
        return self.scaled_orthogonalize_fn(grad)


class AdaptiveMuon(OrthogonalizedOptimizer):
    """orthogonalized_optimizers/adaptive_muon.py: a name megatron 0.18+ subclasses (its
    TensorParallelAdaptiveMuon); --optimizer adaptive_muon is refused, so it never steps here."""

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise NotImplementedError("adaptive_muon is not simulated")


class _NotSimulated(torch.optim.Optimizer):
    """Lion (scalar_optimizers) and SOAP (soap): names megatron 0.18+ imports; never built here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is not simulated")


class Lion(_NotSimulated):
    pass


class SOAP(_NotSimulated):
    pass


def get_optimizer_name_list() -> list[str]:
    """registry.py: the names the package registered (none in the stand-in)."""
    return []


def get_optimizer_cls(name: str) -> type:
    """registry.py: the class registered under `name`."""
    raise ValueError(f"Optimizer {name} not found in the registry.")


def install() -> None:
    """Put the stand-in into sys.modules as `emerging_optimizers` unless the package is there."""
    if NAME in sys.modules:
        return
    try:
        import emerging_optimizers  # noqa: F401  # the real package, where installed
        return
    except ImportError:
        pass
    utils = _module("orthogonalized_optimizers.muon_utils", newton_schulz=newton_schulz,
                    newton_schulz_tp=newton_schulz_tp, NSCoeffT=NSCoeffT)  # fmt: skip
    optimizers = _module("orthogonalized_optimizers", OrthogonalizedOptimizer=OrthogonalizedOptimizer,
                         AdaptiveMuon=AdaptiveMuon, get_muon_scale_factor=get_muon_scale_factor,
                         muon_utils=utils)  # fmt: skip
    registry = _module("registry", get_optimizer_name_list=get_optimizer_name_list,
                       get_optimizer_cls=get_optimizer_cls)  # fmt: skip
    scalar = _module("scalar_optimizers", Lion=Lion)
    soap = _module("soap", SOAP=SOAP)
    _module("", orthogonalized_optimizers=optimizers, registry=registry, scalar_optimizers=scalar,
            soap=soap)  # fmt: skip


def _module(name: str, **members: Any) -> types.ModuleType:
    """Put one module of the stand-in package (`name` under it; "" the package) in sys.modules."""
    full = f"{NAME}.{name}" if name else NAME
    module = types.ModuleType(full, __doc__ if not name else None)
    module.__dict__.update(members)
    sys.modules[full] = module
    return module
