"""Render the params table for people: a tabulate table per stage block, with totals.

The semicolon text and JSON forms are the table's own (table.py), so they can be read back.
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import tabulate

from inspector.report.formats import ParamsFormat
from inspector.report.params import ParamsResult
from inspector.report.table import (
    Block,
    block_comment,
    format_shape,
    row_bytes,
    write_csv,
    write_json,
)


def render_human(blocks: Sequence[Block]) -> str:
    """Return a tabulate table per block, each followed by its totals (under expert
    parallelism: one GPU's, then the rows', which hold every expert-parallel rank's experts)."""
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
        ranks = len(block.expert_ranks)
        if ranks > 1:  # the rows list every expert-parallel rank's experts
            rows.append(["per GPU", "", "", "", f"{block.gpu_numel:,}", f"{block.gpu_bytes:,}"])
            rows.append([f"total, all {ranks} expert-parallel ranks", "", "", "",
                         f"{block.numel:,}", f"{block.bytes:,}"])
        else:
            rows.append(["total", "", "", "", f"{block.numel:,}", f"{block.bytes:,}"])
        title = block_comment(block).removeprefix("# ")
        parts.append(title + "\n" + tabulate(rows, headers=headers, disable_numparse=True))
    return "\n\n".join(parts) + "\n"


def rank_summary(rank: int, result: ParamsResult) -> str:
    """Return what global rank R holds, block by block ("Rank 5 holds stage 1: layers 4-7, ...")."""
    held = "; ".join(block_comment(block).removeprefix("# ") for block in result.blocks)
    return f"Rank {rank} holds {held}."


def render_params(result: ParamsResult, fmt: ParamsFormat) -> str:
    """Return the params table in the asked format."""
    if fmt is ParamsFormat.json:
        return write_json(result.header, result.blocks)
    if fmt is ParamsFormat.table:
        return render_human(result.blocks)
    return write_csv(result.topology, result.blocks, comments=result.comments)
