"""A Hugging Face config.json value read with its JSON type checked (hf.py, hf_hybrid.py): a value
of the wrong type is an error naming the key, never converted into some other model."""

from __future__ import annotations

import json
import math
from typing import Any

from inspector.errors import InputError

_TYPE_WORDS = {int: "a whole number of at least 0", float: "a finite number",
               bool: "true or false", str: "a string", dict: "a mapping", list: "a list"}  # fmt: skip


def value_of(data: dict[str, Any], key: str, kind: type, path: str, default: Any = None,
             least: int = 0, most: float | None = None) -> Any:  # fmt: skip
    """Return data[key] when it has the JSON type kind (default where absent or null), or raise
    InputError naming the key: a string, a bool or a fraction where a count belongs, a NaN where
    a number belongs, a count below `least` (a size of 0 builds no model), a rate above `most`,
    is refused, never converted into some other model."""
    value = data.get(key)
    if value is None:
        return default
    if kind is float:
        good = isinstance(value, (int, float)) and not isinstance(value, bool)
        good = good and math.isfinite(value) and (most is None or 0 <= value <= most)
    else:
        good = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        good = good and not (kind is int and value < least)
    if not good:
        shown = json.dumps(value, default=str)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        words = _TYPE_WORDS[kind]
        if kind is int:
            words = words.replace("at least 0", f"at least {least}")
        elif kind is float and most is not None:
            words = f"a finite number from 0 to {most:g}"
        raise InputError(f'{path}: "{key}" must be {words}, got {shown}')
    return float(value) if kind is float else value
