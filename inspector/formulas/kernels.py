"""One kernel's seconds on a GPU, from throughput measured on an H200 and on an H100.

Two tables beside this module, measured at the same shapes, each read as it was written:
  - kernels-h200.json: shared/gpu/kernels-h200.json unchanged, one NVIDIA H200 (132 SMs, torch
    2.11, CUDA 13.0), bf16;
  - kernels-h100.json: bench/gpu_kernels.py re-measuring every row of the H200 table on one
    NVIDIA H100 80GB HBM3 (132 SMs, torch 2.11, CUDA 13.0; bench/RESULTS.md), in bf16, and every
    GEMM again in fp8 (`gemm_fp8` / `expert_gemm_fp8` rows: cuBLASLt's fp8 GEMM through
    torch._scaled_mm with per-tensor scales, as Transformer Engine runs delayed and tensorwise
    scaling on Hopper; E4M3 forward, E5M2 x E4M3 gradients).
A GPU with its own table (`--gpu h100`, `--gpu h200`) reads it; a Blackwell GPU (b200, gb200,
b300, gb300) reads the H100 table, each kind of kernel sped up by a published kernel-level
measurement or the range the sources imply (formulas/published_kernels.py); any other GPU (A100)
reads the H200 table scaled (below). How each kind of op is priced from a table:
  - GEMM (m, n, k), in the table's orientation convention (forward: m tokens, k in, n out;
    data gradient: m tokens, k out, n in; weight gradient: m in, k tokens, n out): the fraction
    of peak reached, as a function of log2(m n k) per orientation: the measured rows (Llama 3
    8B/70B/405B layers under tp 1-8 and 2k-16k tokens) averaged in bins one octave wide, linear
    between bin centres, clamped at the ends. An expert's GEMM (64-4096 tokens) reads its own
    curve built the same way from the table's expert rows. Roofline: never faster than moving
    its operands and result (m k + k n + m n elements) at the measured copy bandwidth.
  - fp8 GEMMs (Transformer Engine's linears under --fp8-format): the fraction of the GPU's dense
    fp8 peak that the H100's fp8 rows reach, by the same curves (the H100 is the only fp8
    measurement; on another GPU the same fraction of its own fp8 peak is assumed).
  - fp32 GEMMs (DeepSeek sparse attention's scores: torch matmuls of .float() tensors, which
    PyTorch runs without TF32 by default): no table measures them; the 16-bit curve's fraction
    of the GPU's fp32 CUDA-core peak (job/hardware.py `tflops_fp32`, NVIDIA's datasheets: 67
    TFLOP/s on H100 SXM and H200), operands and result 4 bytes: an estimate.
  - Flash attention, forward and backward (causal, head dim 128): TFLOP/s bilinear in
    (log2 sequence, log2 heads x micro-batch) over the measured grid (2k-16k, 4-32 heads; the
    two grouped-query settings measured averaged), clamped to the grid. FLOPs as the table
    counts them: forward 2 x 2 b a s^2 d / 2 (Q K^T and P V, causal half), backward 2.5 times it.
  - Memory-bound ops (copy, add, rms_norm, swiglu): bytes per second of the op's class, linear in
    log2(bytes moved) between the measured sizes, clamped. Bytes as the table counts them: copy
    and rms_norm 2 tensors, add and swiglu 3.
Other GPUs (and a --gpu-tflops override): compute-bound time scales by the table GPU's dense
16-bit peak over the GPU's, memory-bound time by the table GPU's HBM bandwidth over the GPU's
(`table_of`, `compute_scale`, `memory_scale` of a job/hardware.py record); both measured GPUs'
figures are their records there: 989 TFLOP/s dense BF16 and 1,979 dense FP8 each, HBM3e 4.8 TB/s
(H200), HBM3 3.35 TB/s (H100), from NVIDIA's datasheets.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Literal

from inspector.formulas.published_kernels import PUBLISHED, Kind, speedup, unmeasured
from inspector.job.hardware import GPUS, Gpu, KernelTable
from inspector.job.kernel_table import (
    BUILT_IN,
    fp8_rows_complete,
    reference_gpu,
    table_gpu,
    table_rows,
)

TABLES = BUILT_IN
TABLE = TABLES["h200"]  # the table GPUs without their own are scaled from
FP8_TABLE = "h100"  # the one table with fp8 GEMM rows
ELEMENT = 2  # bytes of a bf16 element, as the table measured
ATTENTION_BACKWARD = 2.5  # flash backward FLOPs over forward, as the table counts them
H100_FP8 = 1979.0  # the fp8 table's GPU's dense fp8 peak (job/hardware.py's h100 record)

Orient = Literal["fwd", "dgrad", "wgrad", "expert"]
MemoryClass = Literal["copy", "add", "rms_norm", "swiglu"]
Curve = tuple[tuple[float, ...], tuple[float, ...]]  # (x ascending, y)


def published(gpu: Gpu) -> bool:
    """Return whether a GPU's kernels are priced from published measurements (a Blackwell type
    without the user's --kernels table)."""
    return gpu.kernels is None and gpu.name in PUBLISHED


def scaled_from(gpu: Gpu) -> str:
    """Return the measured table a GPU's kernels are scaled from by its dense peaks and HBM
    bandwidth alone (no table of its own, no published figures: the A100's the H200's; a
    --kernels table measured on another type: `--kernels FILE (h200)`), "" otherwise."""
    if gpu.kernels is not None:
        measured = table_gpu(gpu.kernels)
        return "" if measured == gpu.name else f"{gpu.kernels.source} ({measured})"
    if gpu.name in TABLES or published(gpu):
        return ""
    return str(table_of(gpu))


def not_measured(gpu: Gpu) -> str:
    """Return the sentence naming what no measurement fixes of `gpu`'s kernels ("" where every
    kind is measured): a --kernels table measured on another type, scaled to this one; no table
    of its own (the A100: the H200's, scaled); a Blackwell type's kinds of kernel no published
    figure fixes (priced at the slow end of the range they leave)."""
    scaled = scaled_from(gpu)
    if scaled:
        return (f"Not measured on {gpu.name} (every kernel: the {scaled} table scaled by the dense "
                "peaks and HBM bandwidth; how far that strays: docs/how-time-is-computed.md).")  # fmt: skip
    kinds = unmeasured(gpu.name) if published(gpu) else ()
    if not kinds:
        return ""
    return (f"Not measured on {gpu.name} ({', '.join(kinds)}; docs/how-time-is-computed.md): the "
            "time is the slow end of the range the published figures imply.")  # fmt: skip


def table_of(gpu: Gpu) -> str | KernelTable:
    """Return the measured table a GPU's kernels are read from: the user's --kernels table, else
    its own where there is one, the H100's for a Blackwell type, the H200's otherwise."""
    if gpu.kernels is not None:
        return gpu.kernels
    if gpu.name in TABLES:
        return gpu.name
    return FP8_TABLE if gpu.name in PUBLISHED else "h200"


def _faster(gpu: Gpu, kind: Kind) -> float:
    """Return a Blackwell GPU's published speed-up over the H100 table for `kind`, at the end of
    its range the record asks for."""
    return speedup(gpu.name, kind, gpu.published_end)


def compute_scale(gpu: Gpu, kind: Kind = "gemm") -> float:
    """Return how much longer a compute-bound kernel takes than on the table's GPU: by the
    published speed-up of its kind (a --gpu-tflops override scaling it by the record's 16-bit
    peak over the given one), or by the dense 16-bit peaks."""
    if published(gpu):
        return GPUS[gpu.name].tflops_16bit / gpu.tflops_16bit / _faster(gpu, kind)
    return reference_gpu(table_of(gpu)).tflops_16bit / gpu.tflops_16bit


def memory_scale(gpu: Gpu) -> float:
    """Return how much longer a memory-bound kernel takes than on the table's GPU."""
    if published(gpu):
        return 1 / _faster(gpu, "memory")
    return reference_gpu(table_of(gpu)).hbm / gpu.hbm


@dataclass(frozen=True)
class Gemm:
    """A matrix product of `batch` (m x k) by (k x n) products, in the table's orientation."""

    name: str
    m: int
    n: int
    k: int
    orient: Orient
    batch: int = 1
    fp8: bool = False  # fp8 operands (Transformer Engine under --fp8-format)
    fp32: bool = False  # fp32 operands on CUDA cores (torch's matmul of .float() tensors)

    @property
    def flops(self) -> int:
        """Return 2 m n k per product."""
        return 2 * self.batch * self.m * self.n * self.k


@dataclass(frozen=True)
class Attention:
    """A flash attention kernel: `flops` at sequence `seq` over `heads` (x micro-batch) heads."""

    name: str
    seq: int
    heads: int
    flops: float
    backward: bool


@dataclass(frozen=True)
class Memory:
    """A memory-bound op: `elements` elements, `bytes_per_element` bytes moved for each."""

    name: str
    cls: MemoryClass
    elements: int
    bytes_per_element: float

    @property
    def bytes(self) -> float:
        """Return the bytes the op reads and writes."""
        return self.elements * self.bytes_per_element


Op = Gemm | Attention | Memory


def _binned(points: Iterable[tuple[float, float]]) -> Curve:
    """Return (mean x, mean y) per one-wide bin of x, ascending."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        bins.setdefault(math.floor(x), []).append((x, y))
    xs, ys = [], []
    for key in sorted(bins):
        group = bins[key]
        xs.append(sum(p[0] for p in group) / len(group))
        ys.append(sum(p[1] for p in group) / len(group))
    return tuple(xs), tuple(ys)


def _interpolate(curve: Curve, x: float) -> float:
    """Return the curve at x, linear between points, clamped at the ends."""
    xs, ys = curve
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@cache
def gemm_curve(orient: Orient, table: str | KernelTable = "h200", fp8: bool = False) -> Curve:
    """Return the fraction of peak by log2(m n k) for one orientation (or the expert rows):
    of the table GPU's dense 16-bit peak, or with `fp8` of its dense fp8 peak (fp8 rows)."""
    peak = reference_gpu(table).tflops_fp8 if fp8 else reference_gpu(table).tflops_16bit
    assert peak is not None
    suffix = "_fp8" if fp8 else ""
    if orient == "expert":
        # one expert's up projection (n = 2 x expert ffn, gated) over `tokens` tokens
        points = [(math.log2(r["tokens"] * r["hidden"] * 2 * r["expert_ffn"]), r["tflops"] / peak)
                  for r in table_rows(table) if r["kind"] == "expert_gemm" + suffix]  # fmt: skip
    else:
        points = [(math.log2(r["m"] * r["n"] * r["k"]), r["tflops"] / peak)
                  for r in table_rows(table) if r["kind"] == "gemm" + suffix and r["orient"] == orient]
    return _binned(points)


@cache
def memory_curve(cls: MemoryClass, table: str | KernelTable = "h200") -> Curve:
    """Return bytes per second by log2(bytes moved) for one class of memory-bound op; a class
    whose rows claim more than the GPU's HBM bandwidth reads the copy rows (`credible`)."""
    if not credible(cls, table):
        cls = "copy"
    return _binned(
        (math.log2(r["gbytes_per_s"] * 1e9 * r["seconds"]), r["gbytes_per_s"] * 1e9)
        for r in table_rows(table) if r["kind"] == "memory_bound" and r["op"] == cls
    )


def credible(cls: MemoryClass, table: str | KernelTable) -> bool:
    """Return whether every row of a memory-bound class moves its counted bytes within the table
    GPU's HBM bandwidth (job/hardware.py, NVIDIA's datasheet). The H200's `add` rows do not: two
    claim 5.5 and 6.0 TB/s counting two reads and a write, against 4.8, and all three took their
    size's `copy` time; the H100's, re-measured by bench/gpu_kernels.py at the same shapes, move
    0.98-1.09 times the copy rows' bytes per second. Such a class is priced at the copy rate."""
    rows = [r for r in table_rows(table) if r["kind"] == "memory_bound" and r["op"] == cls]
    return all(r["gbytes_per_s"] * 1e9 <= reference_gpu(table).hbm for r in rows)


@cache
def attention_grid(backward: bool, table: str | KernelTable = "h200",
                   ) -> tuple[tuple[int, ...], tuple[int, ...], dict[tuple[int, int], float]]:  # fmt: skip
    """Return (sequences, heads, TFLOP/s by (sequence, heads)), grouped-query settings averaged."""
    key = "bwd_tflops" if backward else "fwd_tflops"
    cells: dict[tuple[int, int], list[float]] = {}
    for r in table_rows(table):
        if r["kind"] == "flash_attention":
            cells.setdefault((r["seq"], r["heads_per_rank"]), []).append(r[key])
    grid = {cell: sum(v) / len(v) for cell, v in cells.items()}
    seqs = tuple(sorted({c[0] for c in grid}))
    heads = tuple(sorted({c[1] for c in grid}))
    return seqs, heads, grid


def _bracket(values: Sequence[int], x: float) -> tuple[int, int, float]:
    """Return the neighbours of log2 x among `values` and the weight of the upper one."""
    lx = min(max(math.log2(x), math.log2(values[0])), math.log2(values[-1]))
    i = min(max(bisect_right([math.log2(v) for v in values], lx), 1), len(values) - 1)
    lo, hi = values[i - 1], values[i]
    return lo, hi, (lx - math.log2(lo)) / (math.log2(hi) - math.log2(lo))


@cache
def attention_tflops(seq: int, heads: int, backward: bool, table: str | KernelTable = "h200") -> float:
    """Return a table's measured flash attention TFLOP/s, bilinear in log space, clamped."""
    seqs, counts, grid = attention_grid(backward, table)
    s0, s1, ws = _bracket(seqs, seq)
    h0, h1, wh = _bracket(counts, heads)
    low = grid[s0, h0] * (1 - wh) + grid[s0, h1] * wh
    high = grid[s1, h0] * (1 - wh) + grid[s1, h1] * wh
    return low * (1 - ws) + high * ws


def op_seconds(op: Op, gpu: Gpu) -> float:
    """Return one op's seconds on `gpu` (a job/hardware.py record, with the user's overrides)."""
    table = table_of(gpu)
    if isinstance(op, Memory):
        if op.elements == 0:
            return 0.0
        rate = _interpolate(memory_curve(op.cls, table), math.log2(op.bytes))
        return op.bytes / rate * memory_scale(gpu)
    if isinstance(op, Attention):
        rate = attention_tflops(op.seq, op.heads, op.backward, table) * 1e12
        return op.flops / rate * compute_scale(gpu, "attention")
    if op.flops == 0:
        return 0.0
    log_volume = math.log2(op.batch * op.m * op.n * op.k)
    if op.fp8 and gpu.tflops_fp8:
        fp8_table = table if fp8_rows_complete(table) else FP8_TABLE
        efficiency = _interpolate(gemm_curve(op.orient, fp8_table, True), log_volume)
        if published(gpu):  # the H100's fp8 GEMM sped up as published
            compute = op.flops / (H100_FP8 * 1e12 * efficiency * _faster(gpu, "gemm_fp8"))
        else:
            compute = op.flops / (gpu.tflops_fp8 * 1e12 * efficiency)
    elif op.fp32:  # no measured fp32 rows: the 16-bit curve's fraction of the fp32 peak
        efficiency = _interpolate(gemm_curve(op.orient, table), log_volume)
        compute = op.flops / (gpu.tflops_fp32 * 1e12 * efficiency)
    else:
        efficiency = _interpolate(gemm_curve(op.orient, table), log_volume)
        compute = op.flops / (reference_gpu(table).tflops_16bit * 1e12 * efficiency) * compute_scale(gpu)
    operand = 1 if op.fp8 else 2 * ELEMENT if op.fp32 else ELEMENT  # fp8 operands: 16-bit output
    moved = op.batch * ((op.m * op.k + op.k * op.n) * operand + op.m * op.n * max(operand, ELEMENT))
    copy = _interpolate(memory_curve("copy", table), math.log2(moved))
    return max(compute, moved / copy * memory_scale(gpu))


def ops_seconds(ops: Iterable[Op], gpu: Gpu) -> float:
    """Return the seconds of ops run one after another (an op met again, each local expert's
    GEMM, is priced once)."""
    seen: dict[Op, float] = {}
    return sum(seen[op] if op in seen else seen.setdefault(op, op_seconds(op, gpu)) for op in ops)
