"""--moe-layer-freq: Megatron-LM's MoE layer pattern, an integer or a Python list expression."""

from __future__ import annotations

import ast
from typing import Any

from inspector.errors import ConfigError

_FREQ_HELP = "an integer or a list expression such as ([0]*3+[1]*58)"


def parse_moe_layer_freq(value: Any, flag: str = "--moe-layer-freq") -> int | tuple[int, ...]:
    """Return --moe-layer-freq (or `flag`, another argument Megatron-LM reads with the same
    `moe_freq_type`, such as --window-attn-skip-freq) as Megatron-LM reads it, without eval.

    Megatron-LM (`arguments.py` `moe_freq_type`) takes an int N or a string; a string holding
    `[` is a Python list expression it evaluates. Here the expression is parsed, and only list
    literals of integers, integers, `+`, `*` and parentheses are evaluated.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{flag} needs {_FREQ_HELP}, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{flag} needs {_FREQ_HELP}, got {text!r}") from None
    try:
        result = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, _BadPattern):
        raise ConfigError(f"{flag} needs {_FREQ_HELP}, got {text!r}") from None
    if not isinstance(result, list):
        raise ConfigError(f"{flag} needs {_FREQ_HELP}, got {text!r}")
    return tuple(result)


class _BadPattern(Exception):
    """An expression outside the list-pattern subset."""


_MAX_PATTERN = 1_000_000  # elements: larger than any model, small enough to build


def _eval_pattern(node: ast.expr) -> int | list[int]:
    """Evaluate list literals of ints, ints, + and * (the subset Megatron-LM's recipes use)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_eval_pattern(item) for item in node.elts]
        if not all(isinstance(item, int) for item in items):
            raise _BadPattern
        return items  # type: ignore[return-value]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            return left + right  # type: ignore[operator]
        if isinstance(node.op, ast.Mult):
            size = len(left) if isinstance(left, list) else len(right) if isinstance(right, list) else 1
            count = right if isinstance(left, list) else left
            if isinstance(count, int) and size * max(count, 0) <= _MAX_PATTERN:
                return left * right  # type: ignore[operator]
    raise _BadPattern
