"""Read a params table back (semicolon text or JSON, detected) for `diff` and `--check`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import InputError
from inspector.render.params import ELEMENT_BYTES, HEADER

_COMMENT = re.compile(
    r"^# stage ([0-9]+)(?: chunk ([0-9]+))?: .*?, ([0-9]+) params, ([0-9]+) bytes$"
)
_SHAPE = re.compile(r"^\(([0-9]+(?:, [0-9]+)*)?,?\)$")
_OWNERS = re.compile(r"^[0-9]+(?:,[0-9]+)*$")


@dataclass(frozen=True)
class TableRow:
    """One parameter row as a table states it."""

    name: str
    module: str
    shape: tuple[int, ...]
    owners: tuple[int, ...]
    precs: str  # as written; "" where a --rank view leaves it empty
    stage: int | None  # None in --rank tables (no stage comment lines)
    chunk: int | None
    line: int
    element_bytes: int | None  # None when the text does not say (rank views)

    @property
    def numel(self) -> int:
        """Return the number of elements of the local shape."""
        return math.prod(self.shape)


@dataclass
class ParamsTable:
    """A parsed params table."""

    origin: str
    topology: str | None
    rows: list[TableRow] = field(default_factory=list)


def read_table(text: str, origin: str) -> ParamsTable:
    """Parse a params table; raise InputError naming the origin and line when it is not one.

    JSON is recognised by a leading `{` that is not the topology line's `{ProcessCoord(`. Line
    endings (LF, CRLF, CR) and a leading UTF-8 byte-order mark are ignored.
    """
    text = text[1:] if text.startswith("\ufeff") else text
    stripped = text.lstrip()
    if stripped.startswith("{") and not stripped.startswith("{ProcessCoord("):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(
                f"{origin} line {exc.lineno} column {exc.colno}: not valid JSON ({exc.msg})"
            ) from None
        except RecursionError:
            raise InputError(f"{origin}: JSON nested too deeply to be a params table") from None
        if not isinstance(data, dict) or not isinstance(data.get("parameters"), list):
            raise InputError(
                f"{origin} is JSON but not an inspect-model params table"
                " (no \"parameters\" list at the top level)"
            )
        return _from_json(data, origin)
    return _from_text(text, origin)


def _from_text(text: str, origin: str) -> ParamsTable:
    lines = text.splitlines()
    topology = None
    start = 0
    if lines and lines[0].startswith("{ProcessCoord("):
        topology, start = lines[0], 1
    if len(lines) <= start or lines[start] != HEADER:
        seen = lines[start][:60] if len(lines) > start else "(end of file)"
        raise InputError(
            f"{origin} is not an inspect-model params table (line {start + 1}: expected the header "
            f"{HEADER!r}, got {seen!r})"
        )
    table = ParamsTable(origin, topology)
    stage = chunk = element_bytes = None
    seen_names: dict[str, int] = {}
    for number, line in enumerate(lines[start + 1 :], start=start + 2):
        if line.startswith("#"):
            stage, chunk, element_bytes = _comment(line, origin, number)
            continue
        row = _row(line, origin, number, stage, chunk, element_bytes)
        if row.name in seen_names:
            raise InputError(
                f"{origin} line {number}: {row.name} already appears on line {seen_names[row.name]}"
            )
        seen_names[row.name] = number
        table.rows.append(row)
    return table


def _comment(line: str, origin: str, number: int) -> tuple[int, int | None, int | None]:
    match = _COMMENT.match(line)
    if not match:
        raise InputError(
            f"{origin} line {number}: expected a '# stage S: ...' comment, got {line[:60]!r}"
        )
    stage, chunk, params, size = match.groups()
    per_element = int(size) // int(params) if int(params) else None
    return int(stage), int(chunk) if chunk is not None else None, per_element


def _row(
    line: str, origin: str, number: int, stage: Any, chunk: Any, element_bytes: Any
) -> TableRow:
    fields = line.split(";")
    if len(fields) != 5:
        raise InputError(
            f"{origin} line {number}: expected 5 ';'-separated fields, got {len(fields)}"
        )
    name, module, shape, owners, precs = fields
    shape_match = _SHAPE.match(shape)
    if not name or not shape_match or not _OWNERS.match(owners):
        raise InputError(
            f"{origin} line {number}: expected name;module;(shape);ranks;precs, got {line[:80]!r}"
        )
    dims = tuple(int(d) for d in shape_match.group(1).split(", ")) if shape_match.group(1) else ()
    ranks = tuple(int(r) for r in owners.split(","))
    return TableRow(name, module, dims, ranks, precs, stage, chunk, number, element_bytes)


def _from_json(data: dict[str, Any], origin: str) -> ParamsTable:
    header = data.get("header")
    topology = None
    if isinstance(header, dict) and isinstance(header.get("topology"), dict):
        topology = header["topology"].get("line")
    if topology is not None and not isinstance(topology, str):
        raise InputError(f"{origin}: header.topology.line must be a string or null")
    table = ParamsTable(origin, topology)
    items = data["parameters"]
    # JSON rows say chunk 0 without a virtual pipeline; text tables then name no chunk at all
    chunked = any(isinstance(item, dict) and item.get("chunk") for item in items)
    seen: dict[str, int] = {}
    for index, item in enumerate(items):
        row = _json_row(item, f"{origin}: parameters[{index}]", index + 1, chunked)
        if row.name in seen:
            raise InputError(
                f"{origin}: parameters[{index}].name {row.name!r} already appears in"
                f" parameters[{seen[row.name]}]"
            )
        seen[row.name] = index
        table.rows.append(row)
    return table


def _json_row(item: Any, where: str, line: int, chunked: bool) -> TableRow:
    """Return one JSON parameter as a row, or raise InputError naming the index and field."""
    if not isinstance(item, dict):
        raise InputError(f"{where} must be an object, got {_kind(item)}")

    def field(name: str, check: Any, wanted: str) -> Any:
        if name not in item:
            raise InputError(f"{where} has no {name!r} field")
        value = item[name]
        if not check(value):
            raise InputError(f"{where}.{name} must be {wanted}, got {_shown_value(value)}")
        return value

    name = field("name", lambda v: isinstance(v, str) and v != "", "a non-empty string")
    module = field("module", lambda v: isinstance(v, str), "a string")
    shape = field("shape", lambda v: _ints(v, 0), "a list of non-negative integers")
    owners = field(
        "partitioning_ranks", lambda v: _ints(v, 1), "a non-empty list of non-negative integers"
    )
    precs = field("precs", lambda v: v is None or _pairs(v), "a list of [d, d] pairs or null")
    stage = field("stage", lambda v: _int(v), "a non-negative integer")
    chunk = field("chunk", lambda v: v is None or _int(v), "a non-negative integer or null")
    dtype = field("dtype", lambda v: v in ELEMENT_BYTES, f"one of {', '.join(ELEMENT_BYTES)}")
    written = (
        "" if precs is None else "[" + ", ".join(f"torch.Size([{a}, {b}])" for a, b in precs) + "]"
    )
    return TableRow(
        name=name,
        module=module,
        shape=tuple(shape),
        owners=tuple(owners),
        precs=written,
        stage=stage,
        chunk=chunk if chunked else None,
        line=line,
        element_bytes=ELEMENT_BYTES[dtype],
    )


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _ints(value: Any, at_least: int) -> bool:
    return isinstance(value, list) and len(value) >= at_least and all(_int(v) for v in value)


def _pairs(value: Any) -> bool:
    return isinstance(value, list) and all(_ints(pair, 2) and len(pair) == 2 for pair in value)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _shown_value(value: Any) -> str:
    text = json.dumps(value, allow_nan=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."
