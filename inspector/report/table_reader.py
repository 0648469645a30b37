"""Read a params table back (`diff`, `--check`): semicolon text or JSON, checked cell by cell."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

from inspector.errors import InputError
from inspector.report.table import COLUMNS, ELEMENT_BYTES, HEADER, Cells

MAX_DIGITS = 4300  # Python's int() limit (sys.get_int_max_str_digits)
MAX_TABLE_DIGITS = 30  # stage numbers, parameters and bytes of any model fit in 20
_COMMENT = re.compile(
    r"^# stage ([0-9]+)(?: chunk ([0-9]+))?: .*?, ([0-9]+) params, ([0-9]+) bytes"
    r"(?: per GPU; all [0-9]+ expert-parallel ranks: [0-9]+ params, [0-9]+ bytes)?$"
)


@dataclass(frozen=True)
class TableRow(Cells):
    """One parameter row as a table states it, and where it stands."""

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
        except ValueError:  # Python's int() limit: "Exceeds the limit (4300 digits)"
            raise InputError(
                f"{origin}: a JSON number longer than Python reads ({MAX_DIGITS} digits); a "
                "params table's numbers are far shorter (docs/limits.md)"
            ) from None
        if not isinstance(data, dict) or not isinstance(data.get("parameters"), list):
            raise InputError(
                f"{origin} is JSON but not an inspect-model params table"
                ' (no "parameters" list at the top level)'
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
    where: tuple[int | None, int | None, int | None] = (None, None, None)
    seen_names: dict[str, int] = {}
    for number, line in enumerate(lines[start + 1 :], start=start + 2):
        if line.startswith("#"):
            where = _comment(line, origin, number)
            continue
        row = _row(line, origin, number, where)
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
    longest = max(len(group) for group in match.groups() if group is not None)
    if longest > MAX_TABLE_DIGITS:
        raise InputError(
            f"{origin} line {number}: a {longest}-digit number; a params table's numbers have at "
            f"most {MAX_TABLE_DIGITS} digits (docs/limits.md)"
        )
    per_element = int(size) // int(params) if int(params) else None
    return int(stage), int(chunk) if chunk is not None else None, per_element


def _row(
    line: str, origin: str, number: int, where: tuple[int | None, int | None, int | None]
) -> TableRow:
    fields = line.split(";")
    if len(fields) != len(COLUMNS):
        raise InputError(
            f"{origin} line {number}: expected {len(COLUMNS)} ';'-separated fields, "
            f"got {len(fields)}"
        )
    try:
        values = {column.attr: column.read(cell) for column, cell in zip(COLUMNS, fields)}
    except ValueError:
        raise InputError(
            f"{origin} line {number}: expected name;module;(shape);ranks;precs, got {line[:80]!r}"
        ) from None
    stage, chunk, element_bytes = where
    return TableRow(**values, stage=stage, chunk=chunk, line=number, element_bytes=element_bytes)


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
        raise InputError(f"{where} must be an object, got {_json_kind(item)}")
    for key in [column.name for column in COLUMNS] + ["stage", "chunk", "dtype"]:
        if key not in item:
            raise InputError(f"{where} has no {key!r} field")
    values = {}
    for column in COLUMNS:
        try:
            values[column.attr] = column.from_json(item[column.name])
        except (TypeError, ValueError):
            _wrong(where, column.name, item[column.name])
    if not values["name"]:
        _wrong(where, "name", item["name"])
    stage, chunk, dtype = item["stage"], item["chunk"], item["dtype"]
    if type(stage) is not int or stage < 0:
        _wrong(where, "stage", stage)
    if chunk is not None and (type(chunk) is not int or chunk < 0):
        _wrong(where, "chunk", chunk)
    if not isinstance(dtype, str) or dtype not in ELEMENT_BYTES:
        _wrong(where, "dtype", dtype)
    return TableRow(
        **values,
        stage=stage,
        chunk=chunk if chunked else None,
        line=line,
        element_bytes=ELEMENT_BYTES[dtype],
    )


_WANTED = {
    "name": "a non-empty string",
    "module": "a string",
    "shape": "a list of non-negative integers",
    "partitioning_ranks": "a list of non-negative integers (empty for a frozen parameter)",
    "precs": "a list of [d, d] pairs or null",
    "stage": "a non-negative integer",
    "chunk": "a non-negative integer or null",
    "dtype": "one of " + ", ".join(ELEMENT_BYTES),
}


def _wrong(where: str, key: str, value: Any) -> NoReturn:
    """Raise the InputError for a JSON field of the wrong type or value, shown as JSON."""
    shown = _short(json.dumps(value, default=str))
    raise InputError(f"{where}.{key} must be {_WANTED[key]}, got {shown}")


def _json_kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), "a number")


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
