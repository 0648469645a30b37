"""Render the rank map: the ProcessCoord line and the per-rank table."""

from __future__ import annotations

from tabulate import tabulate

from inspector.job.layout import Layout, RankCoord
from inspector.report.table import topology_line


def _ranks(group: tuple[int, ...] | None) -> str:
    return ",".join(map(str, group)) if group else "-"


def render_topology_table(coords: list[RankCoord], layout: Layout) -> str:
    """Return one row per rank: its coordinates and the ranks of each of its groups."""
    headers = ["rank", "pipe", "data"] + (["context"] if layout.uses_cp_axis else []) + ["model"]
    headers += ["tensor group", "pipeline group", "data group", "embedding group"]
    if layout.ep > 1:
        headers.append("expert group")
    rows = []
    for c in coords:
        row: list[object] = [c.rank, c.pipe, c.data]
        row += [c.context] if layout.uses_cp_axis else []
        row += [c.model, _ranks(c.tensor_group), _ranks(c.pipeline_group), _ranks(c.data_group)]
        row.append(_ranks(c.embedding_group))
        if layout.ep > 1:
            row.append(_ranks(c.expert_group))
        rows.append(row)
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True) + "\n"


def render_topology_line(positions: list[tuple[int, int, int, int]], layout: Layout) -> str:
    """Return the ProcessCoord line of every rank's (pipe, data, context, model), in rank order."""
    return topology_line(positions, layout) + "\n"
