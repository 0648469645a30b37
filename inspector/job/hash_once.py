"""A frozen record's hash computed once per object, for the records a planner hashes most.

A frozen dataclass hashes the tuple of all its fields on every dict lookup; `plan` looks up the
same few model shapes (ModelDims, about 80 fields) and training settings hundreds of thousands of
times. The hash is kept beside the object, by its id, until the object is collected; equality is
the dataclass's own, field by field, so a lookup finds what it found before.
"""

from __future__ import annotations

import weakref
from typing import Any, TypeVar

T = TypeVar("T", bound=type)

_HASHES: dict[int, int] = {}  # id(object) -> its fields' hash, while the object lives


def hash_once(cls: T) -> T:
    """Give a frozen dataclass (applied above @dataclass) a hash computed once per object."""
    fields_hash = vars(cls)["__hash__"]  # the dataclass's, over every field

    def __hash__(self: Any) -> int:
        key = id(self)
        found = _HASHES.get(key)
        if found is None:
            found = _HASHES[key] = fields_hash(self)
            weakref.finalize(self, _HASHES.pop, key, None)
        return found

    cls.__hash__ = __hash__  # type: ignore[assignment]
    return cls
