"""The module objects `install()` puts into sys.modules, under the names megatron-core imports.

megatron-core 0.16.1 ssm/mamba_mixer.py imports, each in its own `try`:
- `mamba_ssm.ops.triton.layernorm_gated.RMSNorm` (as `RMSNormGated`, which `ExtendedRMSNorm`
  subclasses) and `mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`,
  `mamba_split_conv1d_scan_combined` (`HAVE_MAMBA_SSM`: without them MambaMixer refuses to build);
- `mamba_ssm.ops.triton.selective_state_update.selective_state_update` (inference only);
- `causal_conv1d.causal_conv1d_fn` (which ssm/gated_delta_net.py imports too), `causal_conv1d_update` and
  `causal_conv1d.causal_conv1d_varlen.causal_conv1d_varlen_states`.
Upstream sources: state-spaces/mamba (mamba_ssm/ops/triton/layernorm_gated.py, ssd_combined.py)
and Dao-AILab/causal-conv1d (causal_conv1d/causal_conv1d_interface.py).

`build_fla` gives flash-linear-attention's (fla-org/flash-linear-attention) for the gated
delta net. The training path's kernels run on meta tensors (kernels.py, fla_kernels.py); the
others (inference, the non-memory-efficient path) raise, naming themselves, so that no run can
silently skip one.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any


def _rms_norm_gated() -> type:
    """Return mamba_ssm's gated RMSNorm module, registering its parameters as upstream does.

    mamba_ssm/ops/triton/layernorm_gated.py `class RMSNorm` (lines 415-431 at state-spaces/mamba
    e9594ce): `weight` = Parameter(empty(hidden_size)) filled with ones, `bias` registered as None,
    `eps`, `group_size` and `norm_before_gate` kept as attributes.
    """
    import torch

    from inspector.world.ssm import kernels

    class RMSNorm(torch.nn.Module):
        def __init__(
            self,
            hidden_size: int,
            eps: float = 1e-5,
            group_size: int | None = None,
            norm_before_gate: bool = True,
            device: Any = None,
            dtype: Any = None,
        ) -> None:
            super().__init__()
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)
            self.group_size = group_size
            self.norm_before_gate = norm_before_gate
            self.reset_parameters()

        def reset_parameters(self) -> None:
            torch.nn.init.ones_(self.weight)

        def forward(self, x: Any, z: Any = None) -> Any:
            """`rmsnorm_fn` (layernorm_gated.py 433-437); megatron's mixer passes no z."""
            if z is not None:
                raise NotImplementedError("the gated RMSNorm with z is not simulated")
            return kernels.LayerNormFn.apply(x, self.weight, self.group_size)

    RMSNorm.__module__ = "mamba_ssm.ops.triton.layernorm_gated"
    return RMSNorm


def _fla_kernel(name: str) -> Any:
    from inspector.world.ssm import fla_kernels

    return getattr(fla_kernels, name)


def _split_conv1d_scan() -> Any:
    from inspector.world.ssm.kernels import mamba_split_conv1d_scan_combined

    return mamba_split_conv1d_scan_combined


def _not_simulated(name: str) -> Any:
    """Return a kernel entry point that refuses to run: nothing here simulates it yet."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{name} is not simulated by inspect-model")

    kernel.__name__ = name.rsplit(".", 1)[-1]
    return kernel


def _module(name: str, package: bool, attributes: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__stand_in__ = True  # type: ignore[attr-defined]
    vars(module).update(attributes)
    return module


def build(mamba_version: str, conv1d_version: str) -> dict[str, types.ModuleType]:
    """Return the stand-in modules by name, each submodule attached to its parent."""
    ssd = "mamba_ssm.ops.triton.ssd_combined"
    modules = {
        "mamba_ssm": _module("mamba_ssm", True, {"__version__": mamba_version}),
        "mamba_ssm.ops": _module("mamba_ssm.ops", True, {}),
        "mamba_ssm.ops.triton": _module("mamba_ssm.ops.triton", True, {}),
        "mamba_ssm.ops.triton.layernorm_gated": _module(
            "mamba_ssm.ops.triton.layernorm_gated", False, {"RMSNorm": _rms_norm_gated()}
        ),
        ssd: _module(ssd, False, {
            "mamba_chunk_scan_combined": _not_simulated(f"{ssd}.mamba_chunk_scan_combined"),
            "mamba_split_conv1d_scan_combined": _split_conv1d_scan(),
        }),
        "mamba_ssm.ops.triton.selective_state_update": _module(
            "mamba_ssm.ops.triton.selective_state_update", False,
            {"selective_state_update": _not_simulated("selective_state_update")},
        ),
        "causal_conv1d": _module("causal_conv1d", True, {
            "__version__": conv1d_version,
            "causal_conv1d_fn": _fla_kernel("causal_conv1d_fn"),
            "causal_conv1d_update": _not_simulated("causal_conv1d.causal_conv1d_update"),
        }),
        "causal_conv1d.causal_conv1d_varlen": _module("causal_conv1d.causal_conv1d_varlen", False, {
            "causal_conv1d_varlen_states": _not_simulated("causal_conv1d_varlen_states"),
        }),
    }
    return _attached(modules)


def build_fla(fla_version: str) -> dict[str, types.ModuleType]:
    """Return flash-linear-attention's stand-in modules: what megatron's GatedDeltaNet imports
    (`fla.modules.l2norm.l2norm`, `fla.ops.gated_delta_rule.chunk_gated_delta_rule`, and from
    megatron-core 0.18 `fla.modules.convolution.causal_conv1d`)."""
    return _attached({
        "fla": _module("fla", True, {"__version__": fla_version}),
        "fla.modules": _module("fla.modules", True, {}),
        "fla.modules.l2norm": _module("fla.modules.l2norm", False, {"l2norm": _fla_kernel("l2norm")}),
        "fla.modules.convolution": _module("fla.modules.convolution", False, {
            "causal_conv1d": _fla_kernel("causal_conv1d")}),
        "fla.ops": _module("fla.ops", True, {}),
        "fla.ops.gated_delta_rule": _module("fla.ops.gated_delta_rule", True, {
            "chunk_gated_delta_rule": _fla_kernel("chunk_gated_delta_rule")}),
    })  # fmt: skip


def _attached(modules: dict[str, types.ModuleType]) -> dict[str, types.ModuleType]:
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
