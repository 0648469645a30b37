"""`check LOG`: the training log beside the prediction, as text or JSON (records in, str out)."""

from __future__ import annotations

import json
from typing import Any

from tabulate import tabulate

from inspector.plan.check import CheckResult, Compared

MIB = 1 << 20
HEADERS = ["rank", "stage", "quantity", "measured MiB", "predicted MiB", "error"]


def _percent(row: Compared) -> str:
    return f"{row.error * 100:+.1f}%"


def _memory_table(rows: tuple[Compared, ...]) -> str:
    cells = [
        [row.rank, row.stage, row.what, f"{row.measured / MIB:,.2f}", f"{row.predicted / MIB:,.2f}",
         _percent(row)]
        for row in rows
    ]  # fmt: skip
    return tabulate(cells, headers=HEADERS, disable_numparse=True)


def _time_line(result: CheckResult, gpu: str) -> str:
    row = result.time
    if row is None:
        if not result.log.iterations:
            return "Iteration time: the log has no `elapsed time per iteration (ms)` line."
        return (f"Iteration time: every logged iteration is within the warm-up (--skip-iterations "
                f"{result.warmup}); pass a smaller --skip-iterations.")  # fmt: skip
    return (
        f"Iteration time: measured {row.measured * 1000:,.1f} ms (median of {result.times_used} "
        f"logged after iteration {result.warmup}), predicted {row.predicted * 1000:,.1f} ms on "
        f"{gpu}: {_percent(row)}."
    )


def render_check(result: CheckResult, gpu: str, log_name: str) -> str:
    """Return the comparison as text: a memory table per reporting rank, then the time line."""
    lines = []
    if result.log.cut:
        lines.append(f"Note: read the first part of {log_name} only; it is longer.")
    if result.memory:
        last = max(line.iteration for line in result.log.memory)
        lines += [f"Memory, after iteration {last} (Megatron-LM's report_memory, MiB = 2^20 bytes):",
                  "", _memory_table(result.memory), ""]  # fmt: skip
    else:
        lines += ["Memory: the log has no `[Rank R] (after N iterations) memory (MB)` line.", ""]
    lines.append(_time_line(result, gpu))
    if result.time is not None and result.not_measured:
        lines.append(result.not_measured)
    return "\n".join(lines) + "\n"


def _row(row: Compared) -> dict[str, object]:
    return {"quantity": row.what, "rank": row.rank, "stage": row.stage, "measured": row.measured,
            "predicted": row.predicted, "error": row.error}  # fmt: skip


def render_check_json(result: CheckResult, gpu: str) -> str:
    """Return the comparison as JSON: bytes and seconds, errors as fractions."""
    doc = {
        "gpu": gpu,
        "memory": [_row(r) for r in result.memory],
        "iteration_time": None if result.time is None else _row(result.time),
        "iteration_times_used": result.times_used,
        "not_measured": result.not_measured or None,
        "warmup": result.warmup,
        "log_cut": result.log.cut,
    }
    return json.dumps(doc, indent=1, allow_nan=False) + "\n"


def render_table(rows: list[dict[str, Any]]) -> str:
    """Return a kernel table as its file holds it: one JSON row per object, as the built-in
    tables are written (formulas/kernels-h100.json)."""
    return json.dumps(rows, indent=0, allow_nan=False) + "\n"


def with_step_time(text: str, as_json: bool, seconds: float, gpu: str, source: str,
                   not_measured: str = "") -> str:  # fmt: skip
    """Return `memory`'s output with the job's step time from a measured kernel table: a line
    at the end of the text (and the sentence naming what no measurement fixes on `gpu`, where
    something is not), `step_seconds_kernels` (and `not_measured`) fields in the JSON."""
    if as_json:
        doc = json.loads(text)
        doc["step_seconds_kernels"] = seconds
        if not_measured:
            doc["not_measured"] = not_measured
        return json.dumps(doc, indent=1, allow_nan=False) + "\n"
    return text + (f"Step time: {seconds:,.3f} s per iteration on {gpu}, as plan prices the job "
                   f"from {source}.\n") + (f"{not_measured}\n" if not_measured else "")  # fmt: skip
