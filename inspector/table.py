"""The params table (SPEC: `inspect-model params`): its columns, written and read back.

One column spec serves the writer (semicolon text and JSON), the reader (`diff`, `--check`) and
the diff: each Column says how its value is written in a cell, read back from one, and put in or
taken out of JSON. This module imports neither torch nor megatron.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from inspector.errors import InputError
from inspector.records import ParamRecord
from inspector.topology import Layout

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
Precs = tuple[tuple[int, int], ...]  # Kronecker factor shapes; None where a rank view omits them


@dataclass(frozen=True)
class Cells:
    """The five values of a table row."""

    name: str
    module: str
    shape: tuple[int, ...]
    owners: tuple[int, ...]
    precs: Precs | None


def format_shape(shape: Sequence[int]) -> str:
    """Return a shape as a Python tuple: `(1536, 1024)`, `(1536,)`."""
    return str(tuple(shape))


def format_owners(owners: Sequence[int]) -> str:
    """Return data-parallel owners as `0` or `0,1`."""
    return ",".join(map(str, owners))


def format_precs(precs: Precs | None) -> str:
    """Return factor shapes as Python prints a list of torch.Size; "" when left empty."""
    if precs is None:
        return ""
    return "[" + ", ".join(f"torch.Size([{a}, {b}])" for a, b in precs) + "]"


_SHAPE = re.compile(r"^\(([0-9]+(?:, [0-9]+)*)?,?\)$")
_OWNERS = re.compile(r"^[0-9]+(?:,[0-9]+)*$")
_FACTOR = r"torch\.Size\(\[([0-9]+), ([0-9]+)\]\)"
_PRECS = re.compile(rf"^\[(?:{_FACTOR}(?:, {_FACTOR})*)?\]$")


def _parse_name(cell: str) -> str:
    if not cell:
        raise ValueError("empty name")
    return cell


def _parse_shape(cell: str) -> tuple[int, ...]:
    match = _SHAPE.match(cell)
    if not match:
        raise ValueError(f"shape {cell!r}")
    return tuple(int(d) for d in match.group(1).split(", ")) if match.group(1) else ()


def _parse_owners(cell: str) -> tuple[int, ...]:
    if not _OWNERS.match(cell):
        raise ValueError(f"ranks {cell!r}")
    return tuple(int(r) for r in cell.split(","))


def _parse_precs(cell: str) -> Precs | None:
    if cell == "":
        return None
    if not _PRECS.match(cell):
        raise ValueError(f"precs {cell!r}")
    numbers = [int(n) for n in re.findall(r"\d+", cell)]
    return tuple(zip(numbers[::2], numbers[1::2]))


def _json_text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _json_ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise TypeError(f"expected a list of non-negative integers, got {value!r}")
    return tuple(value)


def _json_precs(value: Any) -> Precs | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(type(d) is int for d in p) for p in value
    ):
        raise TypeError(f"expected null or a list of [d, d] pairs, got {value!r}")
    return tuple((a, b) for a, b in value)


@dataclass(frozen=True)
class Column:
    """One column: its header name, the Cells field it shows, and how it is written and read."""

    name: str
    attr: str
    label: str  # what `diff` calls a change in this column
    write: Callable[[Any], str]
    read: Callable[[str], Any]  # raises ValueError on a malformed cell
    to_json: Callable[[Any], Any]
    from_json: Callable[[Any], Any]  # raises TypeError on a value of the wrong type


COLUMNS: tuple[Column, ...] = (
    Column("name", "name", "name", str, _parse_name, str, _json_text),
    Column("module", "module", "module", str, str, str, _json_text),
    Column("shape", "shape", "shape", format_shape, _parse_shape, list, _json_ints),
    Column(
        "partitioning_ranks", "owners", "owners", format_owners, _parse_owners, list, _json_ints
    ),
    Column(
        "precs",
        "precs",
        "precs",
        format_precs,
        _parse_precs,
        lambda p: None if p is None else [list(f) for f in p],
        _json_precs,
    ),
)
HEADER = ";".join(column.name for column in COLUMNS)
# The columns `diff` compares, in the order it reports changes.
COMPARED = tuple(COLUMNS[i] for i in (2, 3, 4, 1))


@dataclass(frozen=True)
class Row:
    """A written row: a parameter, its owners, its preconditioner sizes (None: left empty)."""

    record: ParamRecord
    owners: tuple[int, ...]
    precs: list[int] | None

    @property
    def cells(self) -> Cells:
        """Return the row's five values."""
        precs = None if self.precs is None else tuple((d, d) for d in self.precs)
        r = self.record
        return Cells(r.name, r.module, r.shape, self.owners, precs)


@dataclass(frozen=True)
class Block:
    """One `# stage S[ chunk C]` block: its global layer numbers (0-based) and its rows."""

    stage: int
    chunk: int | None
    layers: tuple[int, ...]
    rows: list[Row]

    @property
    def numel(self) -> int:
        """Return the parameter elements of the block's rows (every expert-parallel rank's)."""
        return sum(row.record.numel for row in self.rows)

    @property
    def bytes(self) -> int:
        """Return the bytes of the block's rows (every expert-parallel rank's)."""
        return sum(row_bytes(row.record) for row in self.rows)

    @property
    def expert_ranks(self) -> tuple[int, ...]:
        """Return the expert-parallel ranks whose experts the rows hold, in order."""
        ranks = {row.record.expert_rank for row in self.rows}
        return tuple(sorted(rank for rank in ranks if rank is not None))

    def _one_gpu(self) -> list[Row]:
        """Return the rows one GPU holds: shared ones, and the experts of the first expert rank."""
        first = self.expert_ranks[0] if self.expert_ranks else None
        return [row for row in self.rows if row.record.expert_rank in (None, first)]

    @property
    def gpu_numel(self) -> int:
        """Return the parameter elements one GPU of the block holds."""
        return sum(row.record.numel for row in self._one_gpu())

    @property
    def gpu_bytes(self) -> int:
        """Return the bytes one GPU of the block holds."""
        return sum(row_bytes(row.record) for row in self._one_gpu())


def row_bytes(record: ParamRecord) -> int:
    """Return the bytes one rank holds for this parameter."""
    return record.numel * ELEMENT_BYTES[record.dtype]


def block_comment(block: Block) -> str:
    """Return the block's comment line: stage, chunk, layer range and what one GPU holds.

    Under expert parallelism the rows hold the experts of every expert-parallel rank; the line
    states one GPU's share first (shared parameters and one rank's experts, all ranks hold
    equally many), then the rows' total: `..., P params, B bytes per GPU; all E
    expert-parallel ranks: P' params, B' bytes`.
    """
    heading = f"# stage {block.stage}" + (
        f" chunk {block.chunk}" if block.chunk is not None else ""
    )
    span = f"layers {block.layers[0]}-{block.layers[-1]}" if block.layers else "no layers"
    ranks = len(block.expert_ranks)
    if ranks <= 1:
        return f"{heading}: {span}, {block.numel} params, {block.bytes} bytes"
    return (
        f"{heading}: {span}, {block.gpu_numel} params, {block.gpu_bytes} bytes per GPU; "
        f"all {ranks} expert-parallel ranks: {block.numel} params, {block.bytes} bytes"
    )


def format_row(cells: Cells) -> str:
    """Return one `name;module;shape;partitioning_ranks;precs` line."""
    return ";".join(column.write(getattr(cells, column.attr)) for column in COLUMNS)


def topology_line(positions: list[tuple[int, int, int, int]], layout: Layout) -> str:
    """Return the DeepSpeed-style `{ProcessCoord(pipe=.., data=.., model=..): rank, ...}` line.

    `positions` holds each rank's (pipe, data, context, model), in rank order.
    """
    if layout.uses_cp_axis:
        entry = "ProcessCoord(pipe={}, data={}, context={}, model={}): {}"
        parts = [entry.format(p, d, c, m, r) for r, (p, d, c, m) in enumerate(positions)]
    else:
        entry = "ProcessCoord(pipe={}, data={}, model={}): {}"
        parts = [entry.format(p, d, m, r) for r, (p, d, _, m) in enumerate(positions)]
    return "{" + ", ".join(parts) + "}"


def write_csv(topology: str | None, blocks: Sequence[Block], comments: bool = True) -> str:
    """Return the semicolon table: topology line (if any), header, blocks."""
    lines = [topology] if topology is not None else []
    lines.append(HEADER)
    for block in blocks:
        if comments:
            lines.append(block_comment(block))
        lines.extend(format_row(row.cells) for row in block.rows)
    return "\n".join(lines) + "\n"


def _row_json(row: Row, chunk: int | None) -> dict[str, Any]:
    cells, r = row.cells, row.record
    item = {column.name: column.to_json(getattr(cells, column.attr)) for column in COLUMNS}
    item.update(
        stage=r.stage,
        chunk=chunk if chunk is not None else 0,
        local_name=r.local_name,
        dtype=r.dtype,
        numel=r.numel,
        global_shape=list(r.global_shape),
        tensor_parallel=r.tensor_parallel,
        partition_dim=r.partition_dim,
        tied=r.tied,
        expert=r.expert,
        expert_parallel_rank=r.expert_rank,
    )
    return item


def write_json(header: dict[str, Any], blocks: Sequence[Block]) -> str:
    """Return `{"header": {...}, "parameters": [...]}`, indented, keys in a fixed order."""
    parameters = [_row_json(row, block.chunk) for block in blocks for row in block.rows]
    return json.dumps({"header": header, "parameters": parameters}, indent=1, allow_nan=False) + "\n"


# Reading a table back.

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
    if not values["owners"]:
        _wrong(where, "partitioning_ranks", item["partitioning_ranks"])
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
    "partitioning_ranks": "a non-empty list of non-negative integers",
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
