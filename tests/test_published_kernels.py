"""Blackwell kernels from published kernel-level measurements (formulas/published_kernels.py), not
from the datasheet peaks alone; a range where no measurement exists, both ends shown by `plan`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from inspector.formulas import kernels
from inspector.formulas.kernels import Attention, Gemm, Memory, op_seconds
from inspector.formulas.published_kernels import PUBLISHED, speedup, unmeasured
from inspector.job.hardware import GPUS
from inspector.job.kernel_table import gpu_type_of
from tests.conftest import run_cli

BIG = Gemm("fc1", 16384, 16384, 8192, "fwd")
H100, B200 = GPUS["h100"], GPUS["b200"]
PLAN = ("plan", "--model", "llama3-8b", "--num-layers", "4", "--gpus", "8", "--global-batch-size", "8",
        "--bf16", "--top", "2")


def test_a_b200_gemm_is_priced_from_the_measured_fp8_gain_not_the_peak_ratio() -> None:
    # cuBLAS 12.9 (NVIDIA): Blackwell FP4 up to 2.3x its FP8, 4.6x Hopper's FP8: FP8 2.0x Hopper;
    # the BF16 GEMM's range runs from that measured gain to the peaks' 2250 / 989
    slow = op_seconds(BIG, B200)
    fast = op_seconds(BIG, replace(B200, published_end="fast"))
    assert slow == pytest.approx(op_seconds(BIG, H100) / 2.0)
    assert fast == pytest.approx(op_seconds(BIG, H100) * 989 / 2250)
    # before: the H200 table scaled by the peaks, faster than either end's measured basis
    assert slow > op_seconds(BIG, replace(GPUS["h200"], tflops_16bit=2250.0)) * 1.05


def test_measured_kinds_have_one_figure_the_rest_a_range() -> None:
    b200 = PUBLISHED["b200"]
    assert b200["gemm_fp8"].measured and b200["gemm_fp8"].low == pytest.approx(2.0)
    # FlashAttention-4: 1,613 TFLOP/s on B200, 1.3x cuDNN 9.13; the H100 table's best: 625
    assert (b200["attention"].low, b200["attention"].high) == pytest.approx((1613 / 1.3 / 625, 1613 / 625))
    assert unmeasured("b200") == ("BF16 GEMMs", "attention", "memory-bound kernels")
    assert unmeasured("h100") == ()
    # Blackwell Ultra: the B200's FP8 measurement stands in at equal FP8 peaks; it was reported
    # as measured on B300 (a range of one value), so its "Not measured" line left FP8 GEMMs out
    assert unmeasured("b300") == ("BF16 GEMMs", "FP8 GEMMs", "attention", "memory-bound kernels")
    assert PUBLISHED["b300"]["gemm_fp8"].borrowed and not PUBLISHED["b300"]["gemm_fp8"].measured
    # GB200 and GB300: no kernel measured; their slow end is the B200's measured speed
    for name in ("gb200", "b300", "gb300"):
        for kind in ("gemm", "gemm_fp8", "attention", "memory"):
            assert speedup(name, kind, "slow") == speedup("b200", kind, "slow")  # type: ignore[arg-type]
            assert speedup(name, kind, "fast") >= speedup(name, kind, "slow")  # type: ignore[arg-type]
    assert speedup("gb300", "attention", "fast") == pytest.approx(2500 / 625)  # BF16 peak bound


def test_every_kind_of_kernel_reads_its_own_figure() -> None:
    attention = Attention("a", 8192, 16, 1e12, False)
    copy = Memory("c", "copy", 16384 * 16384, 4)
    for op, kind in ((attention, "attention"), (copy, "memory")):
        for end in ("slow", "fast"):
            gpu = replace(B200, published_end=end)
            got = op_seconds(op, H100) / op_seconds(op, gpu)
            assert got == pytest.approx(speedup("b200", kind, end)), (kind, end)
    # --gpu-tflops still sets the 16-bit peak: half the peak, twice the compute-bound time
    assert op_seconds(BIG, replace(B200, tflops_16bit=1125.0)) == pytest.approx(2 * op_seconds(BIG, B200))
    assert kernels.table_of(GPUS["gb300"]) == "h100"


@pytest.mark.slow
def test_plan_on_a_blackwell_gpu_shows_the_range_it_ranks_by_the_slow_end() -> None:
    text = run_cli(*PLAN, "--gpu", "b200")
    assert text.code == 0, text.err
    line = next(x for x in text.out.splitlines() if x.startswith("Not measured on b200"))
    assert "(BF16 GEMMs, attention, memory-bound kernels;" in line
    data = json.loads(run_cli(*PLAN, "--gpu", "b200", "--format", "json").out)
    assert data["unmeasured_kernels"] == ["BF16 GEMMs", "attention", "memory-bound kernels"]
    fast, slow = data["step_seconds_fast_end"], [p["step_seconds"] for p in data["plans"]]
    assert line.endswith(f"at the fast end: {fast[0]:.2f}, {fast[1]:.2f} s.")
    assert len(fast) == len(slow) == 2 and all(0.8 * s < f < s for f, s in zip(fast, slow, strict=True))
    assert "Not measured" not in run_cli(*PLAN, "--gpu", "h100").out
    assert "unmeasured_kernels" not in run_cli(*PLAN, "--gpu", "h100", "--format", "json").out


def test_device_names_of_blackwell_ultra() -> None:
    assert [gpu_type_of(f"NVIDIA {n}") for n in ("GB300", "B300 SXM6 AC", "B200")] == ["gb300", "b300", "b200"]


@pytest.mark.slow
def test_plan_on_an_a100_says_its_kernels_are_another_table_scaled() -> None:
    # the A100 has no table and no published figures: the H200's table scaled by the peaks and
    # HBM bandwidth; only the Blackwell types said what was not measured
    text = run_cli(*PLAN, "--gpu", "a100-80gb")
    assert text.code == 0, text.err
    assert ("Not measured on a100-80gb (every kernel: the h200 table scaled by the dense peaks and "
            "HBM bandwidth; how far that strays: docs/how-time-is-computed.md).") in text.out.splitlines()
    data = json.loads(run_cli(*PLAN, "--gpu", "a100-80gb", "--format", "json").out)
    assert data["kernels_scaled_from"] == "h200" and "unmeasured_kernels" not in data
    assert "kernels_scaled_from" not in run_cli(*PLAN, "--gpu", "h100", "--format", "json").out
    assert "Not measured" not in run_cli(*PLAN, "--gpu", "a100-80gb", "--efficiency", "0.5").out
