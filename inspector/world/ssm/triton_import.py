"""Let megatron-core import ssm/mamba_mixer.py on a machine without Triton.

megatron-core 0.16.1 ssm/mamba_mixer.py imports, without a fallback, three copy helpers from
inference/contexts/attention_context/triton/tensor_ops.py, which `import triton` and decorate
Triton kernels (`@triton.jit`, `tl.constexpr` annotations) at import. Only inference calls them
(MambaMixer's `in_inference_mode` paths); training never does. While that one import runs, a
`triton` stand-in answers the decorator and the annotations; it is removed from sys.modules again
at once, so every other `try: import triton` in megatron (which picks a path by it) still finds no
Triton, as before. A helper called anyway raises, naming itself.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

MIXER = "megatron.core.ssm.mamba_mixer"


class _Kernel:
    """A `@triton.jit` kernel that refuses to launch: nothing here runs Triton."""

    def __init__(self, function: Any) -> None:
        self.__name__ = getattr(function, "__name__", "kernel")

    def __getitem__(self, grid: Any) -> Any:
        raise NotImplementedError(f"Triton kernel {self.__name__} is not simulated")


def _jit(function: Any = None, **kwargs: Any) -> Any:
    return _Kernel(function) if function is not None else _Kernel


class _Language(types.ModuleType):
    """`triton.language`: every name (tl.constexpr, tl.int64, ...) is a placeholder."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


@contextlib.contextmanager
def _triton_for_one_import() -> Iterator[None]:
    if "triton" in sys.modules:  # a real Triton (or a test's): nothing to stand in for
        yield
        return
    triton = types.ModuleType("triton")
    language = _Language("triton.language")
    vars(triton).update(jit=_jit, language=language, next_power_of_2=None)
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        yield
    finally:
        for name in ("triton", "triton.language"):
            sys.modules.pop(name, None)


def import_mamba_mixer() -> None:
    """Import megatron's mamba_mixer module, with Triton stood in for while it imports."""
    if MIXER in sys.modules:
        return
    with _triton_for_one_import():
        __import__(MIXER)
