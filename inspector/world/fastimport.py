"""Import megatron-core with only what building a model on the meta device needs.

`import_megatron` (called once, by setup.megatron()) prepares the process:

- torch.compile passes functions through unchanged, for the rest of the process (megatron imports
  modules lazily while it builds too). megatron-core decorates its fused kernels with `jit_fuser` =
  torch.compile (megatron/core/jit.py); building the decorator imports dynamo and inductor (~2.5 s).
  Nothing here runs a forward pass, so undecorated functions are equivalent.
- While megatron-core is imported, DTensor (`torch.distributed.tensor`, and
  `torch.distributed._tensor` which re-exports it) is not importable. megatron-core imports it
  inside `try: ... except ImportError` (HAVE_DTENSOR) and uses it only on tensors that are DTensors,
  which a meta build never makes; it costs ~0.6 s (it pulls in torch.distributed.checkpoint, FSDP
  and sympy). megatron.core.safe_globals (0.14+), which imports it without a fallback, gets a stand-in
  (world/import_later.py). Should a megatron-core still need DTensor, the import is retried with it.
- torch's meta kernels written in Python (torch._refs) and torch.optim's optimizers (the engine's
  optimizer step) are wrapped in `torch._disable_dynamo`, which imports torch._dynamo (~0.5 s, and
  inductor with it) on the first call only to learn how to switch dynamo off. With torch.compile
  passing through dynamo never runs, so each wrapper is pre-seeded with the answer it would cache:
  the plain function.
- megatron.core.transformer.fsdp_dtensor_checkpoint (0.15+), imported by megatron's optimizer
  package for two checkpoint helpers, imports torch.distributed.checkpoint and DTensor without a
  fallback (~0.3 s); a stand-in (world/import_later.py) imports it when one of them is first called.
  The same for megatron.core.dist_checkpointing.serialization (0.19 imports DCP at its top, and
  megatron.core.utils imports its package at load): its save/load functions import it when called.
  0.19's megatron_fsdp package (its __init__ imports DTensor) is imported without running its
  __init__ until a name is asked of it.
- The garbage collector's full collections skip what exists before and after the import (torch's
  and megatron's modules, classes, functions: `gc.freeze()`): ~2 full collections would otherwise
  rescan them, ~0.1-0.2 s each. Nothing frozen is garbage; collection itself stays on.
- The Transformer Engine stand-in (inspector.world.te), mamba_ssm's and causal_conv1d's
  (inspector.world.ssm) and Emerging-Optimizers' (inspector.world.emerging) are installed before
  megatron-core is imported.
- After the import, three of torch's Python helpers answer plain Python values without sympy
  (world/sympy_free.py).

While a stage is built (`meta_cat()`, entered by setup.simulated_rank), two kinds of call on meta
tensors are answered directly, because torch's meta kernels for them are Python references whose
type promotion imports sympy (~0.35 s):
- `torch.cat`: megatron's CPU weight initialisation (`_initialize_affine_weight_cpu`) splits a
  master weight, concatenates this rank's pieces and copies the result into the weight it already
  made and marked, a no-op on meta. The answer is torch's: the shape with `dim` summed, contiguous.
- `normal_` / `uniform_` fills (torch.nn.Embedding's own reset_parameters, e.g. for learned position
  embeddings): no values on meta, so the tensor is returned as it is.
The weights' shapes and attributes still come from megatron alone.

Nothing in torch's or megatron's files is changed; the golden files prove shapes are unchanged, and
tests/test_fastimport.py that a build imports none of these modules.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import FunctionType, ModuleType
from typing import Any

from inspector.world.import_later import FOR_THE_PROCESS, SAFE_GLOBALS
from inspector.world.sympy_free import defer_symbolic_shapes, promote_without_sympy

# Modules not importable while megatron-core is imported (see the module notes).
DEFERRED = ("torch.distributed.tensor", "torch.distributed._tensor")


class _Deferred(importlib.abc.MetaPathFinder):
    """Refuse the DEFERRED modules, as if torch had been built without them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == name or fullname.startswith(name + ".") for name in DEFERRED):
            raise ModuleNotFoundError(
                f"{fullname} is not imported by inspect-model (no DTensor on the meta device)",
                name=fullname,
            )
        return None


_DEFERRED = _Deferred()


def _compile_passes_through() -> None:
    """Make torch.compile return its function unchanged, for the rest of the process."""
    import torch

    def passthrough(model: Any = None, **kwargs: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = passthrough


# The modules whose `_disable_dynamo` wrappers are pre-seeded (`_seed_dynamo_disable`).
SEEDED = ("torch._refs", "torch._prims", "torch._decomp", "torch.optim")


def _seed_dynamo_disable() -> int:
    """Pre-seed torch._refs' `_disable_dynamo` wrappers so calling them does not import dynamo.

    `torch._disable_dynamo(fn)` returns `inner`, which on first call imports torch._dynamo to build
    `torch._dynamo.disable(fn)` and caches it as `fn.__dynamo_disable`. Outside a compiled region
    that function just calls `fn`; with torch.compile passing through there is no compiled region.
    The wrappers are found from the modules' functions and their classes' methods, through
    `__wrapped__` and through the functions their closures hold: an elementwise reference
    (`torch._refs.reciprocal`, reached by `1.0 / tensor` in megatron's rotary embeddings) keeps its
    wrapper only in a closure. torch.optim's are the optimizer step's (the engine): `Optimizer`'s
    `add_param_group` and `zero_grad`, and the functional optimizers' fallbacks
    (`_disable_dynamo_if_unsupported`). Returns the number of wrappers seeded.
    """
    import torch

    inner_code = torch._disable_dynamo(lambda: None).__code__
    seeded = 0
    seen: set[int] = set()
    modules = [
        module
        for name, module in list(sys.modules.items())
        if module is not None and name.startswith(SEEDED)
    ]
    pending = [value for module in modules for value in list(vars(module).values())]
    pending += [
        method
        for module in modules
        for value in list(vars(module).values())
        if isinstance(value, type) and value.__module__ == module.__name__
        for method in list(vars(value).values())
    ]
    while pending:
        function = pending.pop()
        if not callable(function) or id(function) in seen:
            continue
        seen.add(id(function))
        if getattr(function, "__code__", None) is inner_code:
            cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
            wrapped = cells["fn"].cell_contents
            if getattr(wrapped, "__dynamo_disable", None) is None:
                wrapped.__dynamo_disable = wrapped
                seeded += 1
        pending.append(getattr(function, "__wrapped__", None))
        pending.extend(_closure_functions(function))
    return seeded


def _closure_functions(function: Any) -> list[Any]:
    """Return the plain functions a function's closure holds."""
    out = []
    for cell in getattr(function, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        if isinstance(contents, FunctionType):
            out.append(contents)
    return out


def _meta_cat_result(torch: Any, tensors: Any, dim: int) -> Any:
    """Return torch.cat's result for meta tensors of one dtype and at most 3 dimensions, else None.

    The result is what torch's own meta `cat` returns there: the inputs' shape with `dim` summed, in
    the contiguous layout (channels-last layouts need 4 or more dimensions).
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        return None
    first = tensors[0]
    if not all(
        isinstance(t, torch.Tensor) and t.is_meta and t.dtype == first.dtype and 1 <= t.dim() <= 3
        for t in tensors
    ):
        return None
    if any(t.dim() != first.dim() or t.requires_grad for t in tensors):
        return None
    axis = dim + first.dim() if dim < 0 else dim
    if not 0 <= axis < first.dim():
        return None
    shape = list(first.shape)
    if any(list(t.shape[:axis]) + list(t.shape[axis + 1 :]) != shape[:axis] + shape[axis + 1 :]
           for t in tensors):  # fmt: skip
        return None
    shape[axis] = sum(t.shape[axis] for t in tensors)
    return torch.empty(shape, dtype=first.dtype, device="meta")


def _fills_meta(torch: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this normal_/uniform_ call fills a floating meta tensor, with bounds torch accepts.

    Such a call changes nothing on meta (there are no values) and returns its tensor; torch's meta
    kernel for it is a Python reference that imports sympy.
    """
    tensor = args[0] if args else kwargs.get("tensor")
    if not (isinstance(tensor, torch.Tensor) and tensor.is_meta and tensor.is_floating_point()):
        return False
    normal = func in (torch.nn.init.normal_, torch.Tensor.normal_)
    if normal:
        names = ("mean", "std")
    else:
        names = ("a", "b") if func is torch.nn.init.uniform_ else ("from", "to")
    if (
        set(kwargs) - {"tensor", "generator", *names}
        or len(args) > 3
        or kwargs.get("generator") is not None
    ):
        return False
    low = args[1] if len(args) > 1 else kwargs.get(names[0], 0.0)
    high = args[2] if len(args) > 2 else kwargs.get(names[1], 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        return False
    return bool(high >= 0) if normal else bool(low <= high)


@contextlib.contextmanager
def meta_cat() -> Iterator[None]:
    """Answer `torch.cat` of meta tensors without torch's Python meta kernel (see the module notes).

    Anything else, including a cat this does not know the answer to, goes to torch as usual.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    fills = {
        torch.nn.init.normal_,
        torch.nn.init.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
    }

    class MetaCat(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func in fills and _fills_meta(torch, func, args, kwargs):
                return args[0] if args else kwargs["tensor"]
            if func is torch.cat and len(args) + len(kwargs) <= 2:
                tensors = args[0] if args else kwargs.get("tensors")
                dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
                if isinstance(dim, int):
                    result = _meta_cat_result(torch, tensors, dim)
                    if result is not None:
                        return result
            return func(*args, **kwargs)

    with MetaCat():
        yield


def _install_transformer_engine_standin() -> None:
    """Put the Transformer Engine stand-in (inspector.world.te) into sys.modules before megatron.

    megatron-core decides whether Transformer Engine is there when it is first imported: the
    stand-in goes in first, so a real TE on this machine (working or broken) is never loaded.
    """
    from inspector.world import emerging, hadamard, hybrid_ep, ssm, te

    te.install()
    hadamard.install()  # fast_hadamard_transform: DSA's dsa.py imports it at its import
    hybrid_ep.install()  # DeepEP's stand-in and HybridEP's: fused_a2a.py imports them at its import
    ssm.install()  # mamba_ssm and causal_conv1d: ssm/mamba_mixer.py decides HAVE_MAMBA_SSM at import
    # Emerging-Optimizers: 0.18+'s optimizer/emerging_optimizers.py subclasses its classes at import
    emerging.install()


def _import(names: Callable[[], Any]) -> Any:
    """Run `names` (the megatron imports) with DTensor deferred; retry with it if they need it.

    The deferral ends with the import: a module imported later that wants DTensor gets it (slower,
    still correct); tests/test_fastimport.py checks that building and `memory` import none.
    """
    finders = (_DEFERRED, SAFE_GLOBALS)
    sys.meta_path[:0] = finders
    try:
        return names()
    except ImportError as exc:
        if not (exc.name or "").startswith(DEFERRED):
            raise
    finally:
        for finder in finders:
            sys.meta_path.remove(finder)
    # This megatron-core needs DTensor at import: forget the half-imported megatron and import it
    # again with DTensor available (correct, only slower).
    for name in [name for name in sys.modules if name.split(".")[0] == "megatron"]:
        del sys.modules[name]
    return names()


def import_megatron(names: Callable[[], Any]) -> Any:
    """Prepare the process for megatron (see the module notes), then return `names()`.

    `names` does the megatron imports and returns what the caller keeps of them.
    """
    gc.freeze()  # torch's own objects: never garbage, no need to scan them again
    # megatron-core logs at import and while building (0.15 warns, at import, that experimental
    # functions it decorates reached end of life); none of it is for this tool's user.
    logging.getLogger("megatron").setLevel(logging.ERROR)
    # PyPI's torch (a CUDA build: the Python 3.12 venvs of megatron-core 0.17+) warns when megatron
    # imports torch.utils.cpp_extension that no CUDA runtime is found; true, and not for the user.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    _compile_passes_through()
    _install_transformer_engine_standin()
    for later in FOR_THE_PROCESS:
        if later not in sys.meta_path:
            sys.meta_path.insert(0, later)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _import(names)
    _seed_dynamo_disable()
    defer_symbolic_shapes()
    promote_without_sympy()
    gc.freeze()  # megatron's modules, classes and functions likewise
    return result
