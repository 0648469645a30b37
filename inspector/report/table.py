"""The params table (docs/params-table.md): its columns, and the writer.

One column spec serves the writer (semicolon text and JSON), the reader (table_reader: `diff`,
`--check`) and the diff: each Column says how its value is written in a cell, read back from one,
and put in or taken out of JSON. This module and table_reader import neither torch nor megatron.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.job.layout import Layout
from inspector.records import ParamRecord

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
    if cell == "":  # a frozen parameter (LoRA): no optimizer work, no owner
        return ()
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
    """Return the bytes one rank holds for this parameter (a quantized weight's own tensors)."""
    if record.stored is not None:
        return record.stored
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
    """Return the semicolon table: topology line (if any), header, each block's comment and rows.

    A `--rank R` file has no comment lines (the params table format): `comments` False.
    """
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


MAX_TABLE_RANKS = 4_000_000  # rank numbers in one table: about 30 MB of text, a few seconds


def check_table_size(layout: Layout) -> None:
    """Raise ConfigError when the table would list more than MAX_TABLE_RANKS rank numbers.

    Each row names its tensor, pipeline, data, embedding (and expert) groups, so the table grows
    as ranks x group sizes: `--dp 1048576` would be 10^12 numbers.
    """
    per_row = layout.tp + layout.pp + layout.dp + min(layout.pp, 2) + 1
    per_row += layout.ep if layout.ep > 1 else 0
    total = layout.world_size * per_row
    if total > MAX_TABLE_RANKS:
        raise ConfigError(
            f"--format table lists each rank's groups: --tp {layout.tp} x --pp {layout.pp} x "
            f"--dp {layout.dp} x --context-parallel-size {layout.cp} = {layout.world_size} rows "
            f"of {per_row} rank numbers = {total:,}, more than the {MAX_TABLE_RANKS:,} it prints "
            "(docs/limits.md); --format line maps every rank"
        )
