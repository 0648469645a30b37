"""torch's Python helpers, answered without sympy where their arguments are plain Python values.

After megatron-core is imported (fastimport.import_megatron), three of torch's Python helpers that
its meta kernels, Python references and decompositions call on every elementwise op, matmul shape
check or dropout (the engine's trace) answer plain Python values without sympy (~0.25 s to import):
type promotion (`torch._prims_common.elementwise_dtypes`, `_promotion`), `torch.sym_not`
(`_sym_not`), and torch.fx.experimental.symbolic_shapes, whose functions those kernels import by
name (`_SymbolicShapes`, in sys.modules until something needs the real module, then torch's). Each
answer is torch's for those values (tests/test_fastimport.py compares them); anything symbolic
goes to torch's own function.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# torch's shape-reasoning module: its functions answer plain Python values as written below, but
# importing it imports sympy (~0.25 s). See `_SymbolicShapes`.
SYMBOLIC_SHAPES = "torch.fx.experimental.symbolic_shapes"


def _plain(value: Any) -> bool:
    """A Python int/bool, or a tuple/list/torch.Size of them: nothing symbolic."""
    if isinstance(value, (tuple, list)):
        return all(_plain(item) for item in value)
    return type(value) in (int, bool)


# Functions torch's references import by name beside the ones answered here (`from ... import a,
# b`), often without calling them: handed out as calls into the real module, imported on the
# first call (tests/test_fastimport.py: each is a function there).
_IMPORTED_UNCALLED = frozenset(
    {
        "_advise_is_bounded",
        "_advise_is_size",
        "_constrain_range_for_size",
        "constrain_range",
        "free_unbacked_symbols",
        "guard_int",
    }
)


class _SymbolicShapes(ModuleType):
    """Stand in for torch.fx.experimental.symbolic_shapes until something symbolic needs it.

    torch's meta kernels and Python references (torch._check, torch._refs, torch._prims_common,
    the decompositions) import a few of its functions on every call to test a condition or a
    shape; given plain Python ints and bools (a meta trace never makes SymInts) each returns its
    argument or a plain comparison, per torch/fx/experimental/symbolic_shapes.py: `expect_true`,
    `guard_or_false`/`guard_or_true` (`_guard_or`), `guard_size_oblivious` and
    `statically_known_true` return a bool as it is, `guarding_hint_or_throw` an int or bool as it
    is, `has_guarding_hint` is True for a number, `is_nested_int` is
    False for an int, `sym_and`/`sym_or` apply & and |, `sym_eq` compares element by element.
    Those answers are given here for plain values; any other value or name imports the real module
    and is answered by it (tests/test_fastimport.py: each answer equals the real function's).
    """

    def __init__(self) -> None:
        super().__init__(SYMBOLIC_SHAPES)
        self._real_module: ModuleType | None = None

    def _real(self) -> ModuleType:
        if self._real_module is None:
            if sys.modules.get(SYMBOLIC_SHAPES) is self:
                del sys.modules[SYMBOLIC_SHAPES]
            module = importlib.import_module(SYMBOLIC_SHAPES)
            self._real_module = module._real() if isinstance(module, _SymbolicShapes) else module
        return self._real_module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _IMPORTED_UNCALLED and self._real_module is None:
            return functools.partial(self._call_real, name)
        return getattr(self._real(), name)

    def _call_real(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._real(), name)(*args, **kwargs)

    def expect_true(self, a: Any, skip: int = 0) -> Any:
        return a if type(a) is bool else self._real().expect_true(a, skip + 1)

    def guard_or_false(self, a: Any) -> Any:
        return a if type(a) is bool else self._real().guard_or_false(a)

    def guard_or_true(self, a: Any) -> Any:
        return a if type(a) is bool else self._real().guard_or_true(a)

    def guard_size_oblivious(self, expr: Any) -> Any:
        return expr if type(expr) is bool else self._real().guard_size_oblivious(expr)

    def statically_known_true(self, x: Any) -> Any:
        return x if type(x) is bool else self._real().statically_known_true(x)

    def guarding_hint_or_throw(self, a: Any) -> Any:
        return a if type(a) in (int, bool) else self._real().guarding_hint_or_throw(a)

    def has_guarding_hint(self, a: Any) -> Any:
        return True if type(a) in (int, bool, float) else self._real().has_guarding_hint(a)

    def is_nested_int(self, s: Any) -> Any:
        return False if type(s) in (int, bool, float) else self._real().is_nested_int(s)

    def sym_and(self, x: Any, *others: Any) -> Any:
        if not _plain((x, *others)):
            return self._real().sym_and(x, *others)
        for y in others:
            x = x & y
        return x

    def sym_or(self, x: Any, *others: Any) -> Any:
        if not _plain((x, *others)):
            return self._real().sym_or(x, *others)
        for y in others:
            x = x | y
        return x

    def sym_eq(self, x: Any, y: Any) -> Any:
        if not (_plain(x) and _plain(y)):
            return self._real().sym_eq(x, y)
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            if len(x) != len(y):
                return False
            result: Any = True
            for a, b in zip(x, y):
                result = result & self.sym_eq(a, b)
            return result
        if isinstance(x, (tuple, list)) or isinstance(y, (tuple, list)):
            return self._real().sym_eq(x, y)  # torch's error
        return x == y


def defer_symbolic_shapes() -> None:
    """Put `_SymbolicShapes` in place of torch's module, unless it is imported already."""
    if SYMBOLIC_SHAPES in sys.modules:
        return
    import torch.fx.experimental as package

    sys.modules[SYMBOLIC_SHAPES] = stand_in = _SymbolicShapes()
    package.symbolic_shapes = stand_in


def _promotion(real: Callable[..., Any]) -> Callable[..., Any]:
    """torch._prims_common.elementwise_dtypes, answered without sympy for numbers and tensors.

    torch's type promotion for its Python references (torch/_prims_common/__init__.py
    `elementwise_dtypes`) imports sympy on every call (~0.22 s the first time) only to accept
    sympy expressions among its arguments. For arguments that are Python numbers (bool, int,
    float, complex) and tensors, this follows its steps: the highest Python type among them picks
    the category, the highest dtype among tensors of that category (tensors with dimensions before
    0-dim ones) or the default, then the promotion kind. Anything else goes to torch's function
    (tests/test_fastimport.py: equal to it over every dtype, rank and kind).
    """
    import torch
    from torch import _prims_common as utils

    kinds = utils.ELEMENTWISE_TYPE_PROMOTION_KIND
    order = {bool: 0, int: 1, float: 2, complex: 3}

    def highest(args: Sequence[Any], keep: Callable[[Any], bool], as_complex: bool = False) -> Any:
        zero_dim = more_dims = None
        for x in args:
            if isinstance(x, torch.Tensor) and keep(x.dtype):
                dtype = x.dtype
                if as_complex and utils.is_float_dtype(dtype):
                    dtype = utils.corresponding_complex_dtype(dtype)
                if x.ndim == 0:
                    zero_dim = utils.get_higher_dtype(zero_dim, dtype)
                else:
                    more_dims = utils.get_higher_dtype(more_dims, dtype)
        return more_dims if more_dims is not None else zero_dim

    @functools.wraps(real)
    def elementwise_dtypes(*_args: Any, type_promotion_kind: Any) -> Any:
        args = tuple(x for x in _args if x is not None)
        if not all(type(x) in order or isinstance(x, torch.Tensor) for x in args):
            return real(*_args, type_promotion_kind=type_promotion_kind)
        top = max(
            (
                order[type(x)] if type(x) in order else order[utils.dtype_to_type(x.dtype)]
                for x in args
            ),
            default=0,
        )
        if top == 2:
            result = highest(args, utils.is_float_dtype) or torch.get_default_dtype()
        elif top == 3:
            keep = lambda d: utils.is_float_dtype(d) or utils.is_complex_dtype(d)  # noqa: E731
            result = highest(args, keep, as_complex=True)
            if result is None:
                result = utils.corresponding_complex_dtype(torch.get_default_dtype())
        elif top == 1:
            result = highest(args, utils.is_integer_dtype) or torch.long
        else:
            result = torch.bool
        compute = utils.get_computation_dtype
        if type_promotion_kind is kinds.DEFAULT:
            return compute(result), result
        if type_promotion_kind is kinds.NO_OPMATH:
            return result, result
        if type_promotion_kind is kinds.INT_TO_FLOAT:
            if utils.is_integer_dtype(result) or utils.is_boolean_dtype(result):
                result = torch.get_default_dtype()
            return compute(result), result
        if type_promotion_kind is kinds.COMPLEX_TO_FLOAT:
            computation = compute(result)
            if utils.is_complex_dtype(result):
                result = utils.corresponding_real_dtype(result)
            return computation, result
        if type_promotion_kind is kinds.BOOL_TO_LONG:
            if utils.is_boolean_dtype(result):
                return torch.long, torch.long
            return compute(result), result
        if type_promotion_kind is kinds.ALWAYS_BOOL:
            return compute(result), torch.bool
        return real(*_args, type_promotion_kind=type_promotion_kind)  # torch's error

    elementwise_dtypes.real = real  # type: ignore[attr-defined]
    return elementwise_dtypes


def promote_without_sympy() -> None:
    """Put `_promotion` in torch's two places that call elementwise_dtypes during a meta trace,
    and `_sym_not` in place of torch.sym_not."""
    import torch
    from torch import _meta_registrations, _prims_common

    real = _prims_common.elementwise_dtypes
    if hasattr(real, "real"):
        return
    fast = _promotion(real)
    _prims_common.elementwise_dtypes = fast
    if _meta_registrations.elementwise_dtypes is real:
        _meta_registrations.elementwise_dtypes = fast
    torch.sym_not = _sym_not(torch.sym_not)


def _sym_not(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch.sym_not, which imports sympy on every call (for sympy expressions): a Python bool
    has no torch function, no `__sym_not__` and is no sympy expression, so torch returns `not a`."""

    @functools.wraps(real)
    def sym_not(a: Any) -> Any:
        return (not a) if type(a) is bool else real(a)

    sym_not.real = real  # type: ignore[attr-defined]
    return sym_not
