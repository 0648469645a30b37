"""Render a job's SimAI workloads: one file per pipeline stage and an index (notes/simai.md)."""

from __future__ import annotations

from collections.abc import Sequence

from inspector.report.workload import render_stage
from inspector.report.workload_index import file_name, render_index
from inspector.report.workload_inputs import Context, StageInput

INDEX = "index.csv"


def workload_files(context: Context, stages: Sequence[StageInput]) -> dict[str, str]:
    """Return file name -> text: each stage's workload and the index naming them."""
    files = {file_name(stage.stage): render_stage(context, stage) for stage in stages}
    files[INDEX] = render_index(context, list(stages))
    return files
