"""The index of a workload folder (`index.csv`): one row per stage file, and the files' names."""

from __future__ import annotations

import csv
import io

from inspector.report.workload import stage_records
from inspector.report.workload_inputs import ComputeRate, Context, StageInput

INDEX_COLUMNS = (
    "stage",
    "layers",
    "mtp_layers",
    "embedding",
    "output",
    "parameters",
    "records",
    "compute",
    "file",
)


def _ranges(layers: tuple[int, ...]) -> str:
    """Return layers as compact ranges: (0, 1, 2, 5) -> '0-2 5'."""
    parts: list[str] = []
    for layer in layers:
        if parts and parts[-1].split("-")[-1] == str(layer - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{layer}"
        else:
            parts.append(str(layer))
    return " ".join(parts)


def file_name(stage: int) -> str:
    """Return the workload file name of pipeline `stage`."""
    return f"stage{stage:03d}.txt"


def render_index(job: Context, stages: list[StageInput]) -> str:
    """Return the index (CSV) of a workload directory: one row per stage file.

    `layers` lists each chunk's global layers as ranges, chunks separated by `|`; `compute`
    says where times come from: `estimate` (FLOPs at --gpu-tflops x --mfu) or `profile`.
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(INDEX_COLUMNS)
    source = "estimate" if isinstance(job.compute, ComputeRate) else "profile"
    for stage in stages:
        writer.writerow(
            (
                stage.stage,
                " | ".join(_ranges(chunk) for chunk in stage.chunks),
                stage.mtp_layers,
                int(stage.has_embedding),
                int(stage.has_output),
                stage.parameters,
                len(stage_records(job, stage)),
                source,
                file_name(stage.stage),
            )
        )
    return out.getvalue()
