"""Blackwell kernels from published kernel-level measurements: each kind of kernel's speed-up over
the measured H100 table (kernels-h100.json), with its source, or the range the sources imply.

No Blackwell GPU has a table of its own (none was lent to measure one; `inspect-model calibrate`
writes one on your GPU). Its kernels read the H100's measured curves, every kind scaled by how much
faster a Blackwell GPU ran that kind of kernel in a published measurement, never by the datasheet
peaks alone. Where no measurement of a kind exists, its speed-up is a range (`low`, `high`) and
`plan` prices both ends: the step time at the slow end ranks the layouts, the fast end is shown.

Figures (dense peaks from job/hardware.py's records; the H100 table's own best rows):
  - H100 table: flash attention forward at most 625 TFLOP/s (seq 16k, 16 heads); copy at most
    2.73 TB/s (16384 x 16384 bf16 elements read and written).
  - Attention, B200: FlashAttention-4 (Zadouri, Shah, Dao et al., 2026, "FlashAttention-4:
    Algorithm and Kernel Pipelining Co-Design for Asymmetric Hardware Scaling"): forward in BF16
    up to 1,613 TFLOP/s on B200, up to 1.3x cuDNN 9.13, so cuDNN's kernel (what Transformer Engine
    runs there) reached about 1,613 / 1.3 = 1,241 TFLOP/s at that shape: 1.99-2.58x the H100
    table's 625. The forward is bound by the exponential units, not the tensor cores (same paper).
  - FP8 GEMM, B200: NVIDIA, "Boosting Matrix Multiplication Speed and Flexibility with NVIDIA
    cuBLAS 12.9" (technical blog, 2025): block-scaled FP4 GEMMs up to 2.3x the FP8 GEMMs on
    Blackwell and up to 4.6x the FP8 GEMMs on Hopper, so Blackwell's FP8 GEMM ran 4.6 / 2.3 = 2.0x
    Hopper's (the same largest shapes). MXFP8 runs on the same FP8 tensor-core rate; it is not
    measured apart and reads the same figure.
  - BF16 GEMM, B200: no published kernel-level measurement found. Range: 2.0x (the FP8 GEMMs'
    measured gain: BF16 and FP8 tensor-core peaks grew by the same 2.27x from H100 to B200) to
    2250 / 989 = 2.27x (the datasheet peaks' ratio, the most any measurement has shown).
  - Memory-bound kernels, B200: CUDA's bandwidthTest device-to-device copy "over 6,000 GB/s"
    (NewMind AI, "Inside NVIDIA's Blackwell B200 Architecture", benchmarks on 8 x B200) and an
    MXFP8 quantization kernel "6+ TB/s on B200" (both lower bounds): 6.0 / 2.73 = 2.20x, up to the
    HBM ratio 8 / 3.35 = 2.39x.
  - GB200 (the same Blackwell GPU at a higher power limit, 2,500 dense BF16 against the B200's
    2,250): no kernel measured. Its kernels run at least at the B200's measured speed-up and at
    most that times 2500 / 2250 (compute) or the same HBM (memory).
  - B300 / GB300 (Blackwell Ultra): the same BF16 and FP8 peaks as B200 / GB200 (job/hardware.py),
    so their GEMMs read the B200's / GB200's ranges (B300's FP8 GEMMs the B200's measured 2.0x,
    reported as not measured on B300), and memory-bound kernels the B200's measured
    copy up to their own HBM ratio (7.7 TB/s for B300). Their exponential units are doubled
    (10.7 against 5 tera-exponentials/s, Verda, "NVIDIA GB300 NVL72: GPU Architecture &
    Performance"), which lifts the attention forward's bound: no attention kernel is measured on
    them, so attention ranges from the B200's measured speed-up to the BF16 peak over the H100
    table's attention (2250 / 625 = 3.6x, every
    FLOP at the tensor-core peak).
  - NVFP4 GEMMs (up to 2.3x the FP8 GEMMs, the blog above): for the record; `--fp4-format` jobs
    are priced at the BF16 rate (render/job.py's note says so).
  - Collectives: NVLink and InfiniBand at their datasheet bandwidths, as on every GPU type: no
    published bus-bandwidth measurement is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gemm", "gemm_fp8", "attention", "memory"]
KINDS: tuple[Kind, ...] = ("gemm", "gemm_fp8", "attention", "memory")
KIND_NAMES = {"gemm": "BF16 GEMMs", "gemm_fp8": "FP8 GEMMs", "attention": "attention",
              "memory": "memory-bound kernels"}  # fmt: skip

H100_ATTENTION = 625.0  # TFLOP/s: the H100 table's fastest flash attention forward
H100_COPY = 2.726e12  # bytes/s: the H100 table's fastest copy
_CUDNN, _FA4 = 1613.0 / 1.3, 1613.0  # B200 attention forward, TFLOP/s (FlashAttention-4 paper)
_FP8 = 4.6 / 2.3  # Blackwell FP8 GEMM over Hopper's (cuBLAS 12.9 blog)
_PEAKS = 2250.0 / 989.0  # B200 over H100, dense BF16 and FP8 alike (job/hardware.py)
_GB = 2500.0 / 2250.0  # GB200 / GB300 over B200 / B300, dense peaks
_COPY = 6.0e12  # bytes/s: B200 copy measured "over 6 TB/s"


@dataclass(frozen=True)
class Speedup:
    """A kind of kernel's speed over the H100 table's: measured where low == high."""

    low: float
    high: float
    borrowed: bool = False  # another GPU type's measurement, taken at equal peaks

    @property
    def measured(self) -> bool:
        """Return whether a published measurement on this GPU type fixes the figure (no range)."""
        return self.low == self.high and not self.borrowed


def _b200(hbm: float = 8e12) -> dict[Kind, Speedup]:
    """Return the B200's figures; memory-bound kernels up to the HBM ratio of `hbm` (bytes/s)."""
    return {
        "gemm": Speedup(_FP8, _PEAKS),
        "gemm_fp8": Speedup(_FP8, _FP8),
        "attention": Speedup(_CUDNN / H100_ATTENTION, _FA4 / H100_ATTENTION),
        "memory": Speedup(_COPY / H100_COPY, hbm / 3.35e12),
    }


def _faster(table: dict[Kind, Speedup], compute: float) -> dict[Kind, Speedup]:
    """Return `table` with the compute kinds' fast end times `compute` (memory as it is)."""
    return {kind: s if kind == "memory" else Speedup(s.low, s.high * compute)
            for kind, s in table.items()}  # fmt: skip


def _ultra(table: dict[Kind, Speedup], peak: float) -> dict[Kind, Speedup]:
    """Return `table` with attention ranging up to every FLOP at the BF16 `peak`, and the FP8
    GEMMs' figure marked as the B200's (no FP8 GEMM is measured on Blackwell Ultra; its FP8 peak
    is the B200's, so the B200's measured gain stands in, a range of one value)."""
    fp8 = table["gemm_fp8"]
    return {**table, "attention": Speedup(table["attention"].low, peak / H100_ATTENTION),
            "gemm_fp8": Speedup(fp8.low, fp8.high, borrowed=True)}  # fmt: skip


PUBLISHED: dict[str, dict[Kind, Speedup]] = {
    "b200": _b200(),
    "gb200": _faster(_b200(), _GB),
    "b300": _ultra(_b200(7.7e12), 2250.0),
    "gb300": _ultra(_faster(_b200(), _GB), 2500.0),
}


def speedup(gpu_name: str, kind: Kind, end: str) -> float:
    """Return a GPU type's speed-up for one kind of kernel at the `end` of its range ("slow" or
    "fast"; a measured figure is both)."""
    figure = PUBLISHED[gpu_name][kind]
    return figure.low if end == "slow" else figure.high


def unmeasured(gpu_name: str) -> tuple[str, ...]:
    """Return the kinds of kernel no published measurement fixes on a GPU type, by name."""
    table = PUBLISHED.get(gpu_name, {})
    return tuple(KIND_NAMES[kind] for kind in KINDS if kind in table and not table[kind].measured)
