"""The GPU types (job/hardware.py): one table read by `memory`, `workload` and `plan`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.job.hardware import GPUS, get_gpu, with_overrides
from tests.conftest import run_cli

DOCS = Path(__file__).resolve().parent.parent / "docs" / "hardware.md"
PLAN = ("plan", "--num-layers", "2", "--gpus", "8", "--global-batch-size", "8")
MEMORY = ("memory", "--num-layers", "2", "--micro-batch-size", "1", "--bf16")


def test_the_docs_table_is_the_records() -> None:
    from inspector.render.hardware import render_gpus

    assert render_gpus() in DOCS.read_text()
    assert len(render_gpus().splitlines()) == 2 + len(GPUS)


def test_every_command_lists_the_gpu_types_of_the_table() -> None:
    for command in ("plan", "memory", "workload"):
        result = run_cli(command, "--help")
        assert result.code == 0
        assert f"({', '.join(GPUS)})" in " ".join(result.out.split()), command


def test_each_figure_matches_its_datasheet() -> None:
    # the datasheet figures cited beside GPUS (dense, no sparsity; each way for NVLink)
    h100, a100 = get_gpu("h100"), get_gpu("a100-80gb")
    assert (h100.tflops_16bit, h100.tflops_fp8, h100.tflops_fp32) == (989.0, 1979.0, 67.0)
    assert (a100.tflops_16bit, a100.tflops_fp8, a100.tflops_fp32) == (312.0, None, 19.5)
    assert h100.intra * 2 == 900e9 and a100.intra * 2 == 600e9
    assert h100.inter * 8 == 400e9 and a100.inter * 8 == 200e9  # 400 / 200 Gb/s per GPU
    assert h100.peak_tflops("bfloat16") == h100.peak_tflops("float16") == 989.0
    assert h100.peak_tflops("float32") == 67.0
    # the kernel model's figures (docs/how-time-is-computed.md): dense 16-bit peak and HBM
    h200, b200 = get_gpu("h200"), get_gpu("b200")
    assert (h200.tflops_16bit, h200.hbm, h100.hbm, a100.hbm) == (989.0, 4.8e12, 3.35e12, 2.039e12)
    assert (b200.tflops_16bit, b200.tflops_fp8, b200.tflops_fp32) == (2250.0, 4500.0, 75.0)
    assert (b200.memory_gib, b200.hbm, b200.intra * 2, b200.inter * 8) == (180, 8e12, 1800e9, 400e9)
    # GB200 NVL72's page, per rack of 72 GPUs and per superchip of 2: NVFP4 dense 720 PFLOP/s;
    # FP8 720 and BF16 360 sparse (dense is half); FP32 5,760 TFLOP/s; 372 GB per superchip; 576
    # TB/s; 3.6 TB/s NVLink per superchip; one NVLink domain of 72 GPUs
    gb200 = get_gpu("gb200")
    assert (gb200.tflops_fp4, gb200.tflops_fp8) == (720e3 / 72, 720e3 / 72 / 2)
    assert (gb200.tflops_16bit, gb200.tflops_fp32) == (360e3 / 72 / 2, 5760 / 72)
    assert (gb200.memory_gib, gb200.hbm) == (372 / 2, 576e12 / 72)
    assert (gb200.intra * 2 * 2, gb200.inter * 8, gb200.gpus_per_node) == (3.6e12, 400e9, 72)
    assert b200.tflops_fp4 == 144e3 / 8 / 2
    # HGX B300, per 8 GPUs: BF16 36 and FP8 72 PFLOP/s sparse, FP4 108 dense, FP32 600 TFLOP/s,
    # 1.6 TB/s of networking (800 Gb/s per GPU); Verda's per-GPU table: 270 GB at 7.7 TB/s
    b300, gb300 = get_gpu("b300"), get_gpu("gb300")
    assert (b300.tflops_16bit, b300.tflops_fp8, b300.tflops_fp4) == (36e3 / 8 / 2, 72e3 / 8 / 2, 108e3 / 8)
    assert (b300.tflops_fp32, b300.memory_gib, b300.hbm) == (600 / 8, 270, 7.7e12)
    assert (b300.intra * 2, b300.inter * 8, b300.gpus_per_node, b300.sms) == (1.8e12, 800e9, 8, 160)
    # GB300 NVL72, per rack of 72: FP4 1,080 dense, FP8 720 and BF16 360 sparse, 576 TB/s, 72
    # ConnectX-8 at 800 Gb/s; one NVLink domain
    assert (gb300.tflops_fp4, gb300.tflops_fp8, gb300.tflops_16bit) == (1080e3 / 72, 720e3 / 72 / 2, 360e3 / 72 / 2)
    assert (gb300.hbm, gb300.inter * 8, gb300.gpus_per_node, gb300.sms) == (576e12 / 72, 800e9, 72, 160)
    assert [g.tflops_fp4 for g in (h100, h200, a100)] == [None, None, None]


@pytest.mark.slow
def test_gb200_is_a_b200_at_its_figures_on_a_72_gpu_nvlink_domain() -> None:
    # the same Blackwell GPU: at the slow end of the published ranges (what ranks the plans) its
    # kernels run as the B200's measured ones, whatever the peak; plan reads memory, links and
    # GPUs per node from the record
    job = ("plan", "--num-layers", "2", "--gpus", "144", "--global-batch-size", "144", "--format", "json")
    named = run_cli(*job, "--gpu", "gb200")
    by_hand = run_cli(*job, "--gpu", "b200", "--gpu-memory", "186", "--gpus-per-node", "72")
    assert named.code == by_hand.code == 0
    gb200, b200 = json.loads(named.out), json.loads(by_hand.out)
    for key in ("layout", "step_seconds", "peak_bytes"):
        assert [p[key] for p in gb200["plans"]] == [p[key] for p in b200["plans"]], key
    assert gb200["step_seconds_fast_end"] != b200["step_seconds_fast_end"]  # gb200's higher peak
    assert named.out != run_cli(*job, "--gpu", "b200").out  # the figures change the plan


def test_overrides_change_one_figure_each() -> None:
    h100 = get_gpu("h100")
    got = with_overrides(h100, 500.0, 40.0, 100.0, 10.0)
    assert (got.tflops_16bit, got.memory_gib, got.intra, got.inter) == (500.0, 40.0, 100e9, 10e9)
    assert (got.hbm, got.tflops_fp32, got.gpus_per_node) == (h100.hbm, 67.0, 8)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        # each names the flag as typed, with the value as typed (GB/s, not bytes/s)
        ("--intra-node-bandwidth", "-1", "--intra-node-bandwidth must be a finite number of GB/s "
         "greater than 0, got -1.0"),
        ("--inter-node-bandwidth", "0", "--inter-node-bandwidth must be a finite number of GB/s "
         "greater than 0, got 0.0"),
        ("--gpu-tflops", "-5", "--gpu-tflops must be a finite number of TFLOP/s greater than 0, "
         "got -5.0"),
        ("--gpu-memory", "-1", "--gpu-memory must be a finite number of GiB greater than 0, got -1.0"),
        ("--gpus-per-node", "0", "--gpus-per-node must be at least 1, got 0"),
        ("--top", "0", "--top must be at least 1, got 0"),
        ("--efficiency", "0", "--efficiency must lie in (0, 1], got 0.0"),
        ("--gpu", "tpu", "unknown --gpu 'tpu'; choose one of: h100, h200, a100-80gb, b200, gb200, b300, gb300"),
    ],
)
def test_plan_hardware_errors_name_the_flag_typed(flag: str, value: str, message: str) -> None:
    result = run_cli(*PLAN, flag, value)
    assert result.code == 2
    assert result.err == f"Error: {message}\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--gpu", "tpu"), "unknown --gpu 'tpu'; choose one of: h100, h200, a100-80gb, b200, gb200, b300, gb300"),
        (("--gpu", "h100", "--gpu-memory", "0"),
         "--gpu-memory must be a finite number of GiB greater than 0, got 0.0"),
        (("--gpu", "h100", "--attention-walkthrough"),
         "--gpu has no effect with --attention-walkthrough, which prints one attention layer and "
         "no report; pass one of them"),
    ],
)
def test_memory_gpu_errors(args: tuple[str, ...], message: str) -> None:
    result = run_cli(*MEMORY, *args)
    assert result.code == 2
    assert result.err == f"Error: {message}\n"


def test_memory_with_a_gpu_type_equals_its_figures_given_by_hand() -> None:
    # --gpu h100 on a bf16 model: 80 GiB and the 16-bit peak, 989 TFLOP/s
    named = run_cli(*MEMORY, "--gpu", "h100", "--mfu", "0.5")
    by_hand = run_cli(*MEMORY, "--gpu-memory", "80", "--gpu-tflops", "989", "--mfu", "0.5")
    assert named.code == by_hand.code == 0
    assert named.out == by_hand.out
    assert "at 989 TFLOP/s" in named.out
    # a given figure wins over the type's; float32 takes the FP32 peak
    mine = run_cli(*MEMORY, "--gpu", "a100-80gb", "--gpu-memory", "40")
    assert "--gpu-memory 40.00 GiB" in mine.out and "at 312 TFLOP/s" in mine.out
    fp32 = run_cli(*MEMORY[:-1], "--gpu", "a100-80gb")
    assert "at 19.5 TFLOP/s" in fp32.out


def test_workload_with_a_gpu_type_equals_its_peak_given_by_hand() -> None:
    job = ("workload", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
           "--bf16", "--stage", "0")
    named, by_hand = run_cli(*job, "--gpu", "h200"), run_cli(*job, "--gpu-tflops", "989")
    assert named.code == by_hand.code == 0 and named.out == by_hand.out
    other = run_cli(*job, "--gpu", "a100-80gb")
    assert other.code == 0 and other.out != named.out
    both = run_cli(*job, "--gpu", "h100", "--compute-profile", str(DOCS))
    assert both.code == 2 and "one of them" in both.err
