"""The planner's caches, owned in one place: `clear()` empties every one of them.

A search prices thousands of candidates that share stages, layers and builds, so the plan modules
remember what they computed: dictionaries made by `table()` and functions wrapped by `memo()`.
Each registers here; nothing else may hold planner state between calls (tests/test_plan_unit.py
checks every module-level cache in plan/ is registered, and that a search priced again after
`clear()` gives byte-identical output).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_TABLES: list[dict[Any, Any]] = []
_FUNCTIONS: list[Any] = []


def table() -> dict[Any, Any]:
    """Return a new, registered cache dictionary."""
    made: dict[Any, Any] = {}
    _TABLES.append(made)
    return made


def memo(maxsize: int | None = 65536) -> Callable[[F], F]:
    """Return functools.lru_cache(maxsize), registered so that `clear()` empties it."""

    def wrap(function: F) -> F:
        cached = lru_cache(maxsize=maxsize)(function)
        _FUNCTIONS.append(cached)
        return cached  # type: ignore[return-value]

    return wrap


def clear() -> None:
    """Empty every planner cache: the next search prices everything from scratch."""
    for made in _TABLES:
        made.clear()
    for function in _FUNCTIONS:
        function.cache_clear()


def registered() -> tuple[list[dict[Any, Any]], list[Any]]:
    """Return the registered tables and memoised functions (for the tests)."""
    return list(_TABLES), list(_FUNCTIONS)
