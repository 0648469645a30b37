"""A stand-in for NVIDIA Transformer Engine, put in place only by the simulated world.

Transformer Engine (TE) cannot be installed without CUDA, yet megatron-core's TE layer spec, its
MoE, MLA and context-parallel code are written against it. `install()` puts a small stand-in into
`sys.modules` as `transformer_engine` (and the submodules megatron-core imports), so that
megatron-core's own TE wrappers (`TELayerNormColumnParallelLinear`, `TEDotProductAttention`,
`TENorm`, `TEGroupedMLP`, ...) run for real on top of it. The stand-in classes register their
parameters exactly as TE 2.11.0 does (each cites the TE source it mirrors; under megatron-core
0.17+ it adds what 2.14 added that megatron calls, and reports 2.14.0, 2.16.0 under 0.18 and
2.17.1 under 0.19: `VERSION` below); their
forwards (on meta tensors, in the engine) allocate and save what TE's kernels do (`kernels/`).

Nothing here is importable as `transformer_engine` until `install()` is called: the stand-in lives
under `inspector.world.te`, not on sys.path, and importing this package imports nothing but the standard
library. Call `install()` before megatron-core is imported: megatron decides `HAVE_TE` at import.
"""

from __future__ import annotations

import sys

# The TE release mirrored, per megatron-core release: the newest one each accepts, so every
# version gate megatron checks takes the path a current cluster takes. megatron-core 0.13-0.16:
# 2.11.0 (0.16.1's `dev` extra pins transformer-engine>=2.9.0a0,<2.12.0; >=2.3 delayed wgrad,
# >=2.7 fused router, >=2.8 softmax_type, >=2.9 qk-clip, >=2.10 num_splits). 0.17+ pin no TE
# release and call what TE 2.14 added: `quantize_master_weights` and `replace_raw_data` of an
# NVFP4Tensor (tensor/utils.py; 2.12 and 2.13 have neither) for --fp4-param-gather, and 0.18+
# gate features on 2.14 (GroupedLinear's single_grouped_weight, is_te_min_version("2.14.0")).
# 0.18 and 0.19 declare the release their own uv.lock installs (Megatron-LM core_v0.18.2:
# transformer-engine 2.16.0+b9d690e0; core_r0.19.0: 2.17.1+4329ff84; Megatron-Bridge 0.7.0 locks
# 2.18.0+e7c550c5): neither gates anything between 2.14 and 2.19 (is_te_min_version), so megatron
# takes 2.14's paths and the modules mirror 2.14, but attention runs MXFP8 in fp8 from 2.15
# (attention.py `fp8_attention_recipe`), which their MXFP8BlockScaling hands `fp8_dpa`.
TE_RELEASES = (((0, 0), "2.11.0"), ((0, 17), "2.14.0"), ((0, 18), "2.16.0"), ((0, 19), "2.17.1"))


def release_for(megatron: tuple[int, int]) -> str:
    """Return the TE release the stand-in mirrors under this megatron-core (major, minor)."""
    return [te for first, te in TE_RELEASES if megatron >= first][-1]


def _installed_megatron() -> tuple[int, int]:
    """Return the installed megatron-core's (major, minor) from its package metadata."""
    import importlib.metadata

    major, minor = importlib.metadata.version("megatron-core").split(".")[:2]
    return int(major), int(minor)


VERSION = release_for(_installed_megatron())
NAME = "transformer_engine"

__all__ = [
    "FUSE_UNSCALE_SINCE", "NAME", "VERSION", "fuses_bf16_moments", "install", "installed", "release",
    "release_for",
]


def release() -> tuple[int, int]:
    """Return the (major, minor) of the TE release the stand-in declares (`VERSION`, read at call
    time: the one home every TE version gate of the stand-in asks)."""
    major, minor = VERSION.split(".")[:2]
    return int(major), int(minor)


# FusedAdam's kernel takes bf16 moments as they are (fused_adam.py `fuse_unscale`, when both
# exp_avg and exp_avg_sq are bf16) from TE 2.13: PR #2632, "Fuse scaling and unscaling of bf16
# momentums into kernels", is in the v2.13 tag (commit 7deecabee, fused_adam.py v2.13 219) and
# v2.14 (459e7cf49, v2.14 219), not in v2.12
FUSE_UNSCALE_SINCE = (2, 13)


def fuses_bf16_moments() -> bool:
    """Return whether the declared release's FusedAdam updates bf16 moments in its kernel, without
    fp32 copies (with both moments bf16): the one test of the stand-in's FusedAdam
    (optimizers.py) and of the step's time (world/environment.py, for plan/ and formulas/)."""
    return release() >= FUSE_UNSCALE_SINCE


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
