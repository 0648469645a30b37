"""A stand-in for NVIDIA Transformer Engine, put in place only by the simulated world.

Transformer Engine (TE) cannot be installed without CUDA, yet megatron-core's TE layer spec, its
MoE, MLA and context-parallel code are written against it. `install()` puts a small stand-in into
`sys.modules` as `transformer_engine` (and the submodules megatron-core imports), so that
megatron-core's own TE wrappers (`TELayerNormColumnParallelLinear`, `TEDotProductAttention`,
`TENorm`, `TEGroupedMLP`, ...) run for real on top of it. The stand-in classes register their
parameters exactly as TE 2.11.0 does (each cites the TE source it mirrors); their forwards (on
meta tensors, in the engine) allocate and save what TE's kernels do (`kernels/`).

Nothing here is importable as `transformer_engine` until `install()` is called: the stand-in lives
under `inspector.world.te`, not on sys.path, and importing this package imports nothing but the standard
library. Call `install()` before megatron-core is imported: megatron decides `HAVE_TE` at import.
"""

from __future__ import annotations

import sys

# The TE release mirrored: the newest megatron-core 0.16.1 accepts (its `dev` extra pins
# transformer-engine>=2.9.0a0,<2.12.0), so every version gate in megatron-core 0.13-0.16 takes the
# path a current cluster takes (>=2.3 delayed wgrad, >=2.7 fused router, >=2.8 softmax_type,
# >=2.9 qk-clip, >=2.10 num_splits).
VERSION = "2.11.0"
NAME = "transformer_engine"

__all__ = ["NAME", "VERSION", "install", "installed"]


def installed() -> bool:
    """Return True if the stand-in is what `import transformer_engine` gives."""
    module = sys.modules.get(NAME)
    return module is not None and getattr(module, "__stand_in__", False)


def install() -> None:
    """Put the stand-in into sys.modules as `transformer_engine`; idempotent and cheap.

    Raises RuntimeError if a real Transformer Engine is already imported in this process: it
    cannot be replaced under megatron-core's feet.
    """
    if installed():
        return
    if NAME in sys.modules:
        raise RuntimeError(
            "a real transformer_engine is already imported; the simulated one must be installed "
            "before megatron-core is imported"
        )
    from inspector.world.te import _modules

    for name, module in _modules.build().items():
        sys.modules[name] = module
