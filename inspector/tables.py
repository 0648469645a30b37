"""Read a params table back (semicolon text or JSON, detected) for `diff` and `--check`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import InputError
from inspector.render.params import ELEMENT_BYTES, HEADER

_COMMENT = re.compile(r"^# stage (\d+)(?: chunk (\d+))?: .*?, (\d+) params, (\d+) bytes$")
_SHAPE = re.compile(r"^\((\d+(?:, \d+)*)?,?\)$")
_OWNERS = re.compile(r"^\d+(?:,\d+)*$")


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
    """Parse a params table; raise InputError naming the origin and line when it is not one."""
    stripped = text.lstrip()
    if stripped.startswith("{") and '"parameters"' in stripped[:200000]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and "parameters" in data:
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
    topology = data.get("header", {}).get("topology", {}).get("line")
    table = ParamsTable(origin, topology)
    # JSON rows say chunk 0 without a virtual pipeline; text tables then name no chunk at all
    chunked = any(isinstance(item, dict) and item.get("chunk") for item in data["parameters"])
    for index, item in enumerate(data["parameters"], start=1):
        try:
            precs = item["precs"]
            written = (
                ""
                if precs is None
                else "[" + ", ".join(f"torch.Size([{a}, {b}])" for a, b in precs) + "]"
            )
            table.rows.append(
                TableRow(
                    name=item["name"],
                    module=item["module"],
                    shape=tuple(item["shape"]),
                    owners=tuple(item["partitioning_ranks"]),
                    precs=written,
                    stage=item["stage"],
                    chunk=item["chunk"] if chunked else None,
                    line=index,
                    element_bytes=ELEMENT_BYTES[item["dtype"]],
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{origin} parameter {index}: not a params row ({exc!r})") from None
    return table
