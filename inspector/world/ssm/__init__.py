"""Stand-ins for the CUDA packages megatron-core's Mamba and gated delta net layers import:
mamba_ssm, causal_conv1d and flash-linear-attention (fla).

None of them installs without CUDA, and megatron-core's `MambaMixer` (ssm/mamba_mixer.py)
refuses to build without them (`HAVE_MAMBA_SSM`, decided when the module is imported); its
GatedDeltaNet (ssm/gated_delta_net.py) likewise without fla (`HAVE_FLA`). `install()`
puts small modules into `sys.modules` under the names megatron imports, before megatron-core is
imported, so megatron's own MambaMixer, MambaLayer and MambaStack build for real on top of them.
Only what megatron imports is offered; `modules.py` says, per name, which upstream file it
mirrors. Importing this package imports nothing but the standard library.
"""

from __future__ import annotations

import sys

# The releases mirrored: megatron-core 0.16.1's `dev` extra pins mamba-ssm~=2.2 and
# causal-conv1d~=1.5 (Megatron-LM pyproject.toml at core_v0.16.1).
MAMBA_SSM_VERSION = "2.2.4"
CAUSAL_CONV1D_VERSION = "1.5.0.post8"
# Megatron-LM core_v0.16.1 and core_v0.19.0 pyproject.toml: flash-linear-attention~=0.4.0
FLA_VERSION = "0.4.2"

__all__ = ["install", "installed"]


def installed() -> bool:
    """Return True if the stand-in is what `import mamba_ssm` gives."""
    module = sys.modules.get("mamba_ssm")
    return module is not None and getattr(module, "__stand_in__", False)


def install() -> None:
    """Put the stand-ins into sys.modules as `mamba_ssm`, `causal_conv1d` and `fla`; idempotent.

    Raises RuntimeError if a real one is already imported: it cannot be replaced under
    megatron-core's feet.
    """
    if installed():
        return
    if {"mamba_ssm", "causal_conv1d", "fla"} & set(sys.modules):
        raise RuntimeError(
            "a real mamba_ssm, causal_conv1d or fla is already imported; the simulated ones must be "
            "installed before megatron-core is imported"
        )
    from inspector.world.ssm import modules

    sys.modules.update(modules.build(MAMBA_SSM_VERSION, CAUSAL_CONV1D_VERSION))
    sys.modules.update(modules.build_fla(FLA_VERSION))
