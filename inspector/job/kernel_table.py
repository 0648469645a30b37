"""Kernel tables: the built-in measured ones beside this module, and a user's own (`--kernels FILE`,
written by `inspect-model calibrate` on their GPU), read and checked row by row.

A table is a JSON list of rows (the format of kernels-h200.json): a `device` row first (what
measured it; a calibrated table also names the `--gpu` type whose datasheet peaks its throughput
is a fraction of), then `gemm` rows (m, n, k, orient fwd/dgrad/wgrad, tflops), `expert_gemm` rows
(tokens, hidden, expert_ffn, tflops), `flash_attention` rows on a full grid of sequence x heads
(seq, heads_per_rank, gqa, fwd_tflops, bwd_tflops), `memory_bound` rows of the four classes (op,
tokens, hidden, seconds, gbytes_per_s), and optionally `gemm_fp8` / `expert_gemm_fp8` rows (a row
with an `error` instead of `tflops`: the GPU could not run it). formulas/kernels.py prices each op
from these rows.
"""

from __future__ import annotations

import hashlib
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

from inspector.errors import InputError
from inspector.inputs.safe_parse import parse_json
from inspector.job.hardware import GPUS, Gpu, KernelTable

_FORMULAS = Path(__file__).resolve().parent.parent / "formulas"  # where the measured tables live
BUILT_IN = {name: _FORMULAS / f"kernels-{name}.json" for name in ("h200", "h100")}
MEASURED_BY = "inspect-model calibrate"
HEAD_DIM = 128  # the flash attention rows' head dimension
MEMORY_TENSORS = {"copy": 2, "rms_norm": 2, "add": 3, "swiglu": 3}  # tensors each class moves
ORIENTS = ("fwd", "dgrad", "wgrad")
MAX_TABLE_BYTES = 16 * 2**20  # a calibrated table is about 250 kB
# a CUDA device name's words -> the --gpu type (job/hardware.py) whose datasheet describes it
NAMED = (("GB300", "gb300"), ("B300", "b300"), ("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"),
         ("H100", "h100"), ("A100", "a100-80gb"))

Row = dict[str, Any]
_NUMBERS = {
    "gemm": ("m", "n", "k", "tflops"),
    "expert_gemm": ("tokens", "hidden", "expert_ffn", "tflops"),
    "gemm_fp8": ("m", "n", "k"),
    "expert_gemm_fp8": ("tokens", "hidden", "expert_ffn"),
    "flash_attention": ("seq", "heads_per_rank", "gqa", "fwd_tflops", "bwd_tflops"),
    "memory_bound": ("tokens", "hidden", "seconds", "gbytes_per_s"),
}


def gpu_type_of(device_name: str) -> str | None:
    """Return the --gpu type a CUDA device name is (`NVIDIA H100 80GB HBM3` -> h100), or None."""
    upper = device_name.upper()
    return next((gpu for word, gpu in NAMED if word in upper), None)


def reference_gpu(table: str | KernelTable) -> Gpu:
    """Return the GPU whose datasheet peaks a table's throughput is read against."""
    return GPUS[table_gpu(table) if isinstance(table, KernelTable) else table]


def table_gpu(table: KernelTable) -> str:
    """Return the --gpu type a --kernels table was measured on (its device row)."""
    return _table_gpu(table.rows[0], table.source)


def table_rows(table: str | KernelTable) -> tuple[Row, ...]:
    """Return a table's rows: a built-in one's (`h200`, `h100`) or a --kernels FILE's."""
    if isinstance(table, KernelTable):
        return table.rows
    return _built_in(table)


@cache
def _built_in(table: str) -> tuple[Row, ...]:
    with BUILT_IN[table].open() as f:
        return tuple(json.load(f))


def parse_table(text: str, path: str) -> KernelTable:
    """Return a --kernels FILE's table (its text read), or raise InputError naming the file and
    the row that is wrong."""
    shown = f"--kernels {path}"
    rows = parse_json(text, shown)
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise InputError(f"{shown} is not a kernel table: a JSON list of rows (objects)")
    if rows[0].get("kind") != "device":
        raise InputError(f"{shown}: row 0 is not the device row; write the file with inspect-model calibrate")
    _table_gpu(rows[0], shown)
    for index, row in enumerate(rows[1:], 1):
        _check_row(row, index, shown)
    _check_coverage(rows, shown)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return KernelTable(shown, digest, tuple(rows))


def _table_gpu(device: Row, shown: str) -> str:
    gpu = device.get("gpu") or gpu_type_of(str(device.get("name", "")))
    if gpu not in GPUS:
        raise InputError(f"{shown}: the device row names no known --gpu type (\"gpu\": {gpu!r}; "
                         f"one of: {', '.join(GPUS)})")  # fmt: skip
    return str(gpu)


def _check_row(row: Row, index: int, shown: str) -> None:
    kind = row.get("kind")
    if kind not in _NUMBERS:
        raise InputError(f"{shown}: row {index} has kind {kind!r}; known: {', '.join(_NUMBERS)}")
    needed = _NUMBERS[kind]
    if kind.endswith("_fp8") and "error" not in row:
        needed = (*needed, "tflops")
    for key in needed:
        value = row.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(float(value)) and float(value) > 0):  # type: ignore[arg-type]
            raise InputError(f"{shown}: row {index} ({kind}) needs {key} > 0, got {value!r}")
    if kind == "gemm" and row.get("orient") not in ORIENTS:
        raise InputError(f"{shown}: row {index} (gemm) has orient {row.get('orient')!r}; "
                         f"one of: {', '.join(ORIENTS)}")  # fmt: skip
    if kind == "memory_bound" and row.get("op") not in MEMORY_TENSORS:
        raise InputError(f"{shown}: row {index} (memory_bound) has op {row.get('op')!r}; "
                         f"one of: {', '.join(MEMORY_TENSORS)}")  # fmt: skip


def _check_coverage(rows: list[Row], shown: str) -> None:
    """Raise unless every curve the kernel model reads has rows (and attention a full grid)."""
    kinds = {(r["kind"], r.get("orient") or r.get("op")) for r in rows[1:]}
    wanted = [("gemm", o) for o in ORIENTS] + [("memory_bound", op) for op in MEMORY_TENSORS]
    missing = [f"{k} {what}" for k, what in wanted if (k, what) not in kinds]
    missing += [k for k in ("expert_gemm", "flash_attention") if k not in {r["kind"] for r in rows}]
    if missing:
        raise InputError(f"{shown} has no rows for: {', '.join(missing)}")
    cells = {(r["seq"], r["heads_per_rank"]) for r in rows if r["kind"] == "flash_attention"}
    seqs, heads = {c[0] for c in cells}, {c[1] for c in cells}
    if len(seqs) < 2 or len(heads) < 2 or len(cells) != len(seqs) * len(heads):
        raise InputError(
            f"{shown}: the flash_attention rows must cover a grid of at least 2 sequences x 2 head "
            f"counts; they hold {len(cells)} cells over {len(seqs)} x {len(heads)}"
        )


@cache
def fp8_rows_complete(table: str | KernelTable) -> bool:
    """Return whether a table measured every fp8 GEMM (each orientation and the expert's)."""
    fp8 = [r for r in table_rows(table) if r["kind"] in ("gemm_fp8", "expert_gemm_fp8")]
    covered = {r.get("orient", "expert") for r in fp8}
    return bool(fp8) and all("tflops" in r for r in fp8) and covered >= {*ORIENTS, "expert"}
