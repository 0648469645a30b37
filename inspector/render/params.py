"""Render the params table: semicolon text (SPEC), JSON, and a human table with totals."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tabulate import tabulate

from inspector.walk import ParamRecord

HEADER = "name;module;shape;partitioning_ranks;precs"
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Row:
    """A table row: a parameter, its owners, and its preconditioner sizes (None: left empty)."""

    record: ParamRecord
    owners: tuple[int, ...]
    precs: list[int] | None


@dataclass(frozen=True)
class Block:
    """One `# stage S[ chunk C]` block: its global layer numbers (0-based) and its rows."""

    stage: int
    chunk: int | None
    layers: tuple[int, ...]
    rows: list[Row]


def format_shape(shape: Sequence[int]) -> str:
    """Return a shape as a Python tuple: `(1536, 1024)`, `(1536,)`."""
    return str(tuple(shape))


def format_precs(precs: list[int] | None) -> str:
    """Return preconditioner sizes as Python prints a list of torch.Size([d, d])."""
    if precs is None:
        return ""
    return "[" + ", ".join(f"torch.Size([{d}, {d}])" for d in precs) + "]"


def row_bytes(record: ParamRecord) -> int:
    """Return the bytes one rank holds for this parameter."""
    return record.numel * ELEMENT_BYTES[record.dtype]


def block_comment(block: Block) -> str:
    """Return the block's comment line: stage, chunk, layer range and totals."""
    heading = f"# stage {block.stage}" + (
        f" chunk {block.chunk}" if block.chunk is not None else ""
    )
    span = f"layers {block.layers[0]}-{block.layers[-1]}" if block.layers else "no layers"
    params = sum(row.record.numel for row in block.rows)
    size = sum(row_bytes(row.record) for row in block.rows)
    return f"{heading}: {span}, {params} params, {size} bytes"


def format_row(row: Row) -> str:
    """Return one `name;module;shape;partitioning_ranks;precs` line."""
    r = row.record
    owners = ",".join(map(str, row.owners))
    return f"{r.name};{r.module};{format_shape(r.shape)};{owners};{format_precs(row.precs)}"


def render_csv(topology: str | None, blocks: Sequence[Block], comments: bool = True) -> str:
    """Return the semicolon table: topology line (if any), header, blocks."""
    lines = [topology] if topology is not None else []
    lines.append(HEADER)
    for block in blocks:
        if comments:
            lines.append(block_comment(block))
        lines.extend(format_row(row) for row in block.rows)
    return "\n".join(lines) + "\n"


def _row_json(row: Row, chunk: int | None) -> dict[str, Any]:
    r = row.record
    return {
        "name": r.name,
        "module": r.module,
        "shape": list(r.shape),
        "partitioning_ranks": list(row.owners),
        "precs": None if row.precs is None else [[d, d] for d in row.precs],
        "stage": r.stage,
        "chunk": chunk if chunk is not None else 0,
        "local_name": r.local_name,
        "dtype": r.dtype,
        "numel": r.numel,
        "global_shape": list(r.global_shape),
        "tensor_parallel": r.tensor_parallel,
        "partition_dim": r.partition_dim,
        "tied": r.tied,
        "expert": r.expert,
        "expert_parallel_rank": r.expert_rank,
    }


def render_json(header: dict[str, Any], blocks: Sequence[Block]) -> str:
    """Return `{"header": {...}, "parameters": [...]}`, indented, keys in a fixed order."""
    parameters = [_row_json(row, block.chunk) for block in blocks for row in block.rows]
    return json.dumps({"header": header, "parameters": parameters}, indent=1) + "\n"


def render_human(blocks: Sequence[Block]) -> str:
    """Return a tabulate table per block, each followed by its totals."""
    parts = []
    headers = ["name", "shape", "owners", "precs", "params", "bytes"]
    for block in blocks:
        rows = [
            [
                row.record.name,
                format_shape(row.record.shape),
                ",".join(map(str, row.owners)),
                " ".join(f"{d}x{d}" for d in row.precs or []) or "-",
                f"{row.record.numel:,}",
                f"{row_bytes(row.record):,}",
            ]
            for row in block.rows
        ]
        params = sum(row.record.numel for row in block.rows)
        size = sum(row_bytes(row.record) for row in block.rows)
        rows.append(["total", "", "", "", f"{params:,}", f"{size:,}"])
        title = block_comment(block).removeprefix("# ")
        parts.append(title + "\n" + tabulate(rows, headers=headers, disable_numparse=True))
    return "\n\n".join(parts) + "\n"
