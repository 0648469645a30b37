"""`calibrate`: the kernel micro-benchmarks (inspector/measure/kernels.py) and the table they
write, read back by `--kernels FILE` (job/kernel_table.py) into the step-time model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from inspector.errors import InputError
from inspector.formulas.kernels import Attention, Gemm, Memory, op_seconds, table_of
from inspector.job.hardware import GPUS
from inspector.job.kernel_table import BUILT_IN, gpu_type_of, parse_table, table_gpu

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernels"
SAMPLE = FIXTURES / "h200-sample.json"  # 13 shapes of the H200 table: every curve has rows
OPS = (
    Gemm("qkv", 4096, 6144, 4096, "fwd"),
    Gemm("proj", 4096, 4096, 4096, "dgrad"),
    Gemm("fc1", 8192, 4096, 28672, "wgrad"),
    Gemm("expert", 512, 4096, 7168, "expert"),
    Gemm("fp8", 4096, 6144, 4096, "fwd", fp8=True),
    Attention("core", 4096, 8, 2 * 2 * 8 * 4096 * 4096 * 128 / 2, False),
    Attention("core", 4096, 8, 2.5 * 2 * 2 * 8 * 4096 * 4096 * 128 / 2, True),
    Memory("norm", "rms_norm", 4096 * 4096, 4),
    Memory("add", "add", 4096 * 4096, 6),
)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample's shapes measured here on the CPU (the same code as on a GPU), 16x smaller."""
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("calibrate") / "cpu.json"
    result = run_cli("calibrate", "--device", "cpu", "--gpu", "h100", "--like", str(SAMPLE),
                     "--shrink", "16", "--warmup", "0", "--iters", "1", "-o", str(out))  # fmt: skip
    assert result.code == 0, result.err
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: calibrate measures it")
def test_calibrate_needs_a_cuda_gpu_unless_told_cpu(cli) -> None:
    # this machine has no CUDA GPU: the default --device cuda refuses, naming the way out
    result = cli("calibrate", "--like", str(SAMPLE))
    assert result.code == 2
    assert result.err == (
        "Error: calibrate measures this machine's CUDA GPU and torch sees none "
        "(torch.cuda.is_available() is False); --device cpu runs the same measurements on the "
        "CPU, for testing\n"
    )


def test_calibrate_writes_every_shape_measured_with_its_fp8_twin(measured: Path) -> None:
    rows = json.loads(measured.read_text())
    template = json.loads(SAMPLE.read_text())
    device = rows[0]
    assert device["kind"] == "device" and device["gpu"] == "h100" and device["device"] == "cpu"
    assert device["shrink"] == 16 and device["measured_by"] == "inspect-model calibrate"
    kinds = [r["kind"] for r in rows[1:]]
    # 4 GEMM shapes (3 orientations and the expert's), each with an fp8 twin; 4 attention cells
    # and 4 memory-bound classes once each
    assert len(rows) == 1 + 4 * 2 + 4 + 4
    assert kinds.count("gemm_fp8") + kinds.count("expert_gemm_fp8") == 4
    # the shapes measured are the template's divided by --shrink, and the rates recomputed
    fwd = next(r for r in rows if r["kind"] == "gemm" and r["orient"] == "fwd")
    source = next(r for r in template if r["kind"] == "gemm" and r["orient"] == "fwd")
    assert (fwd["m"], fwd["n"], fwd["k"]) == (source["m"] // 16, source["n"] // 16, source["k"] // 16)
    assert fwd["tflops"] == pytest.approx(2 * fwd["m"] * fwd["n"] * fwd["k"] / fwd["seconds"] / 1e12)
    copy = next(r for r in rows if r["kind"] == "memory_bound" and r["op"] == "copy")
    moved = 2 * copy["tokens"] * copy["hidden"] * 2
    assert copy["gbytes_per_s"] == pytest.approx(moved / copy["seconds"] / 1e9)
    assert copy["tokens"] == 4096 // 16


def test_a_calibrated_table_reaches_the_step_time_model(measured: Path) -> None:
    table = parse_table(measured.read_text(), str(measured))
    assert table_gpu(table) == "h100"
    builtin = GPUS["h100"]
    mine = replace(GPUS["h100"], kernels=table)
    assert table_of(mine) is table and table_of(builtin) == "h100"
    for op in OPS:
        # a CPU is slower than an H100 by orders of magnitude: every op is priced from the file
        assert op_seconds(op, mine) > 10 * op_seconds(op, builtin), op.name


def test_the_h100_table_given_as_kernels_prices_as_gpu_h100() -> None:
    # the built-in H100 table read through --kernels takes the same path to the same numbers
    text = BUILT_IN["h100"].read_text()
    table = parse_table(text, "kernels-h100.json")
    assert table_gpu(table) == "h100"  # from its device row's name: NVIDIA H100 80GB HBM3
    for op in OPS:
        ours = op_seconds(op, replace(GPUS["h100"], kernels=table))
        assert ours == op_seconds(op, GPUS["h100"]), op.name


def test_gpu_type_of_reads_cuda_device_names() -> None:
    assert gpu_type_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_type_of("NVIDIA H200") == "h200"
    assert gpu_type_of("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gpu_type_of("NVIDIA GB200") == "gb200"
    assert gpu_type_of("NVIDIA L40S") is None


def _table(tmp_path: Path, rows: object) -> str:
    path = tmp_path / "k.json"
    path.write_text(json.dumps(rows))
    return str(path)


def _sample() -> list[dict]:
    return json.loads(SAMPLE.read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # not a list of rows
        (lambda rows: {"rows": rows}, " is not a kernel table: a JSON list of rows (objects)"),
        # the device row must come first: it names the GPU the rates are relative to
        (lambda rows: rows[1:] + rows[:1],
         ": row 0 is not the device row; write the file with inspect-model calibrate"),
        # a GPU type the tool has no datasheet for
        (lambda rows: [{**rows[0], "gpu": "l40s"}] + rows[1:],
         ": the device row names no known --gpu type (\"gpu\": 'l40s'; one of: h100, h200, "
         "a100-80gb, b200, gb200, b300, gb300)"),
        # a rate that is no rate
        (lambda rows: rows[:1] + [{**rows[1], "tflops": -3}] + rows[2:],
         ": row 1 (gemm) needs tflops > 0, got -3"),
        # a curve with no rows: the model could not price the weight-gradient GEMMs
        (lambda rows: [r for r in rows if r.get("orient") != "wgrad"], " has no rows for: gemm wgrad"),
        # attention is bilinear over a grid: a missing cell cannot be interpolated
        (lambda rows: [r for r in rows if not (r["kind"] == "flash_attention" and r["seq"] == 4096
                                               and r["heads_per_rank"] == 8)],
         ": the flash_attention rows must cover a grid of at least 2 sequences x 2 head counts; "
         "they hold 3 cells over 2 x 2"),
    ],
)
def test_a_bad_kernel_table_is_refused_naming_the_file(tmp_path: Path, change, message) -> None:
    path = _table(tmp_path, change(_sample()))
    with pytest.raises(InputError) as caught:
        parse_table(Path(path).read_text(), path)
    assert str(caught.value) == f"--kernels {path}{message}"


def test_plan_refuses_a_kernels_file_that_is_not_json(cli, tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    path.write_text("[\n")
    result = cli("plan", "--gpus", "2", "--global-batch-size", "8", "--kernels", str(path))
    assert result.code == 2 and result.out == ""
    assert result.err == f"Error: --kernels {path} line 2: not valid JSON (Expecting value)\n"


def test_memory_refuses_a_missing_kernels_file(cli, tmp_path: Path, monkeypatch) -> None:
    # named from its folder: a message shortens a path over 80 characters, which the temporary
    # folder's alone may be (a parallel run's worker folder, a long user name)
    monkeypatch.chdir(tmp_path)
    result = cli("memory", "--micro-batch-size", "1", "--kernels", "none.json")
    assert result.code == 2
    assert result.err == "Error: --kernels none.json does not exist\n"


def test_kernels_and_efficiency_are_one_or_the_other(cli) -> None:
    result = cli("plan", "--gpus", "2", "--global-batch-size", "8", "--efficiency", "0.5",
                 "--kernels", str(SAMPLE))  # fmt: skip
    assert result.code == 2
    assert result.err == ("Error: --efficiency prices every FLOP at one fraction of the peak; "
                          "--kernels prices each kernel from a measured table: pass one\n")  # fmt: skip


@pytest.mark.parametrize(("flag", "value", "least"), [("--shrink", "0", 1), ("--iters", "0", 1),
                                                       ("--warmup", "-1", 0)])  # fmt: skip
def test_calibrate_counts_must_be_positive(cli, flag: str, value: str, least: int) -> None:
    result = cli("calibrate", "--device", "cpu", "--gpu", "h100", flag, value)
    assert result.code == 2
    assert result.err == f"Error: {flag} must be at least {least}, got {value}\n"


def test_calibrate_checks_its_output_before_measuring(cli, tmp_path: Path) -> None:
    # a folder in the way: refused at once, nothing measured
    result = cli("calibrate", "--device", "cpu", "--gpu", "h100", "--like", str(SAMPLE), "-o",
                 str(tmp_path))  # fmt: skip
    assert result.code == 2 and result.err.startswith("Error: ") and str(tmp_path) in result.err


SMALL_JOB = ("--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "512", "--micro-batch-size", "1", "--bf16", "--transformer-impl", "local")  # fmt: skip


def test_workload_takes_its_compute_times_from_the_kernels(cli) -> None:
    from inspector.job.job import make_job
    from inspector.report.workload_inputs import kernel_rate

    table = parse_table(SAMPLE.read_text(), str(SAMPLE))
    job = make_job({"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 512,
                    "micro_batch_size": 1, "bf16": True})  # fmt: skip
    rate = kernel_rate(job, replace(GPUS["h200"], kernels=table))
    builtin = kernel_rate(job, GPUS["h200"])
    # a fraction of the peak, and the sample's rows are not the whole table's curves
    assert 0 < rate.mfu < 1 and rate.mfu != builtin.mfu and rate.gpu_tflops == 989.0
    ours = cli("workload", *SMALL_JOB, "--stage", "0", "--kernels", str(SAMPLE))
    assert ours.code == 0, ours.err
    same = cli("workload", *SMALL_JOB, "--stage", "0", "--gpu-tflops", "989", "--mfu", repr(rate.mfu))
    assert ours.out == same.out


def test_workload_kernels_exclude_the_other_compute_sources(cli) -> None:
    result = cli("workload", *SMALL_JOB, "--stage", "0", "--kernels", str(SAMPLE), "--mfu", "0.4")
    assert result.code == 2
    assert result.err == ("Error: --kernels gives the compute times; --gpu-tflops, --mfu and "
                          "--compute-profile give them another way: pass one\n")  # fmt: skip


def test_plan_never_prints_one_layout_twice(cli) -> None:
    # expert tensor parallel 1 and 2 (= tp, megatron's default) are two layouts of one tp2 ep2
    # job; the table named both `tp2 pp1 dp4 ep2 mbs4` before the expert tp was shown
    moe = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
           "32", "--vocab-size", "1000", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
           "--disable-bias-linear")  # fmt: skip
    result = cli("plan", *moe, "--gpus", "8", "--global-batch-size", "16", "--bf16", "--tp", "2",
                 "--ep", "2", "--pp", "1", "--micro-batch-size", "4", "--use-distributed-optimizer",
                 "--format", "text")  # fmt: skip
    assert result.code == 0, result.err
    rows = [line for line in result.out.splitlines() if line[:1].isdigit()]
    labels = [row.split("  ")[2].strip() for row in rows]  # `#`, spaces, the layout column
    assert {"tp2 pp1 dp4 ep2 etp1 mbs4", "tp2 pp1 dp4 ep2 mbs4"} <= set(labels), rows
    assert len(set(labels)) == len(labels), rows
    assert len(set(rows)) == len(rows)
