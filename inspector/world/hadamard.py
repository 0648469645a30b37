"""Stand-in for fast_hadamard_transform, the CUDA package DSA's indexer imports.

megatron-core's DSA (transformer/experimental_attention_variant/dsa.py, 0.16+) imports
`from fast_hadamard_transform import hadamard_transform` in a `try` and its `rotate_activation`
asserts it is there; the package builds only with CUDA. `install()` puts a small module into
`sys.modules` under that name before megatron-core is imported, so megatron's own DSAIndexer
rotates its queries and keys through it. Mirrored: Dao-AILab/fast-hadamard-transform at
f134af6 (1.0.4.post1, the commit Megatron-LM core_v0.19.0's pyproject.toml pins),
fast_hadamard_transform/fast_hadamard_transform_interface.py `HadamardTransformFn` (lines 16-27:
the forward keeps only the scale, no tensor, for the backward, which runs the same transform on
the gradient) and csrc/fast_hadamard_transform.cpp `fast_hadamard_transform` (lines 73-112: fp32,
fp16 or bf16 input, rows of the last dimension zero-padded to a multiple of 8, at most 32768,
one `empty_like` output of the input's shape and dtype, the padding sliced off). The values are not
computed (the engine runs on meta tensors): the output is that allocation. Importing this module
imports nothing but the standard library.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

# the release mirrored: Megatron-LM core_v0.19.0 pyproject.toml pins the git commit f134af6
FAST_HADAMARD_TRANSFORM_VERSION = "1.0.4.post1"
_MAX_DIM = 32768  # csrc/fast_hadamard_transform.cpp line 95


def installed() -> bool:
    """Return True if the stand-in is what `import fast_hadamard_transform` gives."""
    module = sys.modules.get("fast_hadamard_transform")
    return module is not None and getattr(module, "__stand_in__", False)


def install() -> None:
    """Put the stand-in into sys.modules as `fast_hadamard_transform`; idempotent.

    Raises RuntimeError if a real fast_hadamard_transform is already imported.
    """
    if installed():
        return
    if "fast_hadamard_transform" in sys.modules:
        raise RuntimeError(
            "a real fast_hadamard_transform is already imported; the simulated one must be "
            "installed before megatron-core is imported"
        )
    module = types.ModuleType("fast_hadamard_transform")
    module.__spec__ = importlib.machinery.ModuleSpec("fast_hadamard_transform", None)
    module.__stand_in__ = True  # type: ignore[attr-defined]
    module.__version__ = FAST_HADAMARD_TRANSFORM_VERSION  # type: ignore[attr-defined]
    module.hadamard_transform = hadamard_transform  # type: ignore[attr-defined]
    sys.modules["fast_hadamard_transform"] = module


def _transform(x: Any, scale: float) -> Any:
    """`fast_hadamard_transform_cuda.fast_hadamard_transform` (cpp lines 73-112): the output's
    allocation, of x's shape and dtype (padded rows allocated, then sliced off, as upstream)."""
    import torch

    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fast_hadamard_transform takes fp32, fp16 or bf16, got {x.dtype}")
    shape = x.shape
    dim = shape[-1]
    rows = x.reshape(-1, dim)
    if dim % 8:
        rows = torch.nn.functional.pad(rows, (0, 8 - dim % 8))
    if rows.shape[-1] > _MAX_DIM:
        raise ValueError(f"fast_hadamard_transform takes a last dimension of at most {_MAX_DIM}")
    out = torch.empty_like(rows)
    if dim % 8:
        out = out[:, :dim]
    return out.reshape(shape)


def _function() -> Any:
    """Return `HadamardTransformFn` (interface.py lines 16-27), built when first asked for."""
    import torch

    class HadamardTransformFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, scale: float = 1.0) -> Any:
            ctx._hadamard_transform_scale = scale
            return _transform(x, scale)

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            return _transform(dout, ctx._hadamard_transform_scale), None

    return HadamardTransformFn


_FN: list[Any] = []


def hadamard_transform(x: Any, scale: float = 1.0) -> Any:
    """`hadamard_transform` (interface.py lines 30-42): x (..., dim) times the Hadamard matrix."""
    if not _FN:
        _FN.append(_function())
    return _FN[0].apply(x, scale)
