"""`check LOG`: a Megatron-LM training log (inputs/training_log.py) beside the prediction for the
same job (plan/check.py), on the example log of docs/calibrate-and-check.md."""

from __future__ import annotations

import os
import statistics
import threading
from pathlib import Path

import pytest

from inspector.errors import InputError
from inspector.inputs.training_log import parse_training_log
from inspector.output import read_head

LOGS = Path(__file__).resolve().parent.parent / "fixtures" / "logs"
LOG = LOGS / "j7_gpt_dropout.log"
SCRIPT = LOGS / "j7_gpt_dropout.sh"
MIB = 1 << 20


def test_the_example_log_reads_as_megatron_printed_it() -> None:
    log = parse_training_log(LOG.read_text(), str(LOG))
    # report_memory: ranks 0 and 4 (data-parallel rank 0 of each stage), after iterations 1 and 2;
    # the last report of each rank is kept (max allocated only grows)
    assert [(m.rank, m.iteration) for m in log.memory] == [(0, 2), (4, 2)]
    assert log.memory[0].allocated == round(2883.54 * MIB)
    assert log.memory[0].max_allocated == round(7052.18 * MIB)
    assert log.memory[1].reserved == round(5906.00 * MIB)
    # training_log: iterations 1..20, one line each (--log-interval 1)
    assert [i for i, _ in log.iterations] == list(range(1, 21))
    assert log.iterations[0][1] == pytest.approx(2.8119)
    assert len(log.times_after(3)) == 17 and not log.cut


def test_other_forms_of_the_lines_read_too() -> None:
    text = (
        # a launcher's prefix; the running mean later releases print after the interval's time
        "0: [2026-01-01 00:00:00.000000] iteration       10/     100 | consumed samples: 80 | "
        "elapsed time per iteration (ms): 391.3/395.0 | learning rate: 1.0E-04 |\n"
        # a logger with no iteration count (`/infinity`)
        " iteration       20/infinity | consumed samples: 160 | elapsed time per iteration (ms): 388.7 |\n"
        "1: [Rank 3] (after 20 iterations) memory (MB) | allocated: 10.50 | max allocated: 20.25 | "
        "reserved: 30.00 | max reserved: 40.00\n"
    )
    log = parse_training_log(text, "x.log")
    assert [i for i, _ in log.iterations] == [10, 20]
    assert [t for _, t in log.iterations] == pytest.approx([0.3913, 0.3887])
    assert [(m.rank, m.allocated, m.max_reserved) for m in log.memory] == [(3, round(10.5 * MIB), 40 * MIB)]


def test_a_log_without_either_line_is_refused() -> None:
    with pytest.raises(InputError) as caught:
        parse_training_log("building GPT model ...\nNCCL INFO Bootstrap\n", "job.log")
    assert str(caught.value) == (
        "job.log has no Megatron-LM memory report (`[Rank R] (after N iterations) memory (MB) | "
        "allocated: ...`) and no `elapsed time per iteration (ms)` line"
    )


def test_read_head_stops_at_its_limit_on_a_pipe_that_never_ends(tmp_path: Path) -> None:
    fifo = tmp_path / "endless"
    os.mkfifo(fifo)
    stop = threading.Event()

    def write() -> None:
        with open(fifo, "wb") as stream:
            try:
                while not stop.is_set():
                    stream.write(b"x" * 4096)
            except BrokenPipeError:
                pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    text, cut = read_head(str(fifo), 100_000)
    stop.set()
    assert cut and len(text) == 100_000


def test_check_puts_the_log_beside_the_prediction(cli) -> None:
    result = cli("check", str(LOG), "--from-script", str(SCRIPT), "--gpu", "h200")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].startswith("Job: ") and "tp 2 x pp 2 x dp 2 = 8 GPUs" in lines[0]
    rows = [line.split() for line in lines if line[:1].isdigit()]
    # rank, stage, the measured MiB as megatron printed them; errors within 2% (bench/RESULTS.md:
    # memory's peak is 0.991-1.004 of these ranks' measured peaks)
    measured = {("0", "peak"): "7,052.18", ("0", "allocated"): "2,883.54",
                ("4", "peak"): "5,458.13", ("4", "allocated"): "2,842.60"}  # fmt: skip
    assert len(rows) == 4
    for row in rows:
        rank, stage, what = row[0], row[1], row[2]
        assert stage == {"0": "0", "4": "1"}[rank]
        assert row[-3] == measured[rank, what]
        assert abs(float(row[-1].rstrip("%"))) < 2.0
    times = [t for _, t in parse_training_log(LOG.read_text(), str(LOG)).iterations[3:]]
    median = statistics.median(times) * 1000
    assert f"Iteration time: measured {median:,.1f} ms (median of 17 logged after iteration 3)" in result.out


def test_check_json_carries_every_number(cli) -> None:
    import json

    result = cli("check", str(LOG), "--from-script", str(SCRIPT), "--gpu", "h200", "--format", "json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert doc["gpu"] == "h200" and doc["warmup"] == 3 and doc["iteration_times_used"] == 17
    peak = doc["memory"][0]
    assert peak["quantity"] == "peak allocated" and peak["measured"] == round(7052.18 * MIB)
    assert peak["error"] == pytest.approx((peak["predicted"] - peak["measured"]) / peak["measured"])
    time = doc["iteration_time"]
    assert time["measured"] == pytest.approx(0.0677)  # the 9th of the 17 times after iteration 3, sorted


def test_check_refuses_a_rank_the_job_does_not_have(cli, tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_text("[Rank 9] (after 2 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | "
                   "reserved: 3.00 | max reserved: 4.00\n")  # fmt: skip
    result = cli("check", str(log), "--from-script", str(SCRIPT))
    assert result.code == 2
    assert result.err.endswith(
        "Error: the log reports rank 9, but the job has 8 ranks (8: check the layout flags against "
        "the log's job)\n"
    )


def test_check_refuses_a_warmup_below_zero(cli) -> None:
    result = cli("check", str(LOG), "--skip-iterations", "-1")
    assert result.code == 2 and result.err == "Error: --skip-iterations must be at least 0, got -1\n"


def test_memory_with_kernels_prints_the_step_check_predicts(cli) -> None:
    # the same job, the same table: memory's step line and check's prediction are one number
    import json

    table = str(LOGS.parent / "kernels" / "h200-sample.json")
    memory = cli("memory", "--from-script", str(SCRIPT), "--kernels", table)
    assert memory.code == 0, memory.err
    last = memory.out.splitlines()[-1]
    assert last.startswith("Step time: ") and last.endswith(f"s per iteration on h200, as plan "
                                                            f"prices the job from --kernels {table}.")  # fmt: skip
    checked = cli("check", str(LOG), "--from-script", str(SCRIPT), "--kernels", table, "--format", "json")
    assert checked.code == 0, checked.err
    predicted = json.loads(checked.out)["iteration_time"]["predicted"]
    assert last == f"Step time: {predicted:,.3f} s per iteration on h200, as plan prices the job from --kernels {table}."
    # the sample has the H200 table's rows at its shapes only: not the built-in table's answer
    builtin = json.loads(cli("check", str(LOG), "--from-script", str(SCRIPT), "--gpu", "h200",
                             "--format", "json").out)["iteration_time"]["predicted"]  # fmt: skip
    assert builtin != predicted


def test_check_and_memory_say_what_no_measurement_fixes_on_the_gpu(cli) -> None:
    """As `plan` does: the A100's kernels are the H200 table scaled, a B300's the published
    ranges' slow end, a --kernels table priced for another GPU type scaled; h200 is measured."""
    import json

    def note(*flags: str) -> str:
        result = cli("check", str(LOG), "--from-script", str(SCRIPT), *flags, "--format", "json")
        assert result.code == 0, result.err
        return json.loads(result.out)["not_measured"]

    assert note("--gpu", "h200") is None
    assert note("--gpu", "a100-80gb") == (
        "Not measured on a100-80gb (every kernel: the h200 table scaled by the dense peaks and HBM "
        "bandwidth; how far that strays: docs/how-time-is-computed.md).")  # fmt: skip
    assert note("--gpu", "b300").startswith("Not measured on b300 (BF16 GEMMs, ")
    text = cli("check", str(LOG), "--from-script", str(SCRIPT), "--gpu", "b300").out.splitlines()
    assert text[-2].startswith("Iteration time: ") and text[-1].startswith("Not measured on b300 (")
    table = str(LOGS.parent / "kernels" / "h200-sample.json")
    memory = cli("memory", "--from-script", str(SCRIPT), "--kernels", table, "--gpu", "h100")
    assert memory.code == 0, memory.err
    assert memory.out.splitlines()[-1] == (
        f"Not measured on h100 (every kernel: the --kernels {table} (h200) table scaled by the dense "
        "peaks and HBM bandwidth; how far that strays: docs/how-time-is-computed.md).")  # fmt: skip
    planned = cli("plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch-size", "64", "--bf16",
                  "--kernels", table, "--gpu", "h100", "--format", "json")  # fmt: skip
    assert planned.code == 0, planned.err
    assert json.loads(planned.out)["kernels_scaled_from"] == f"--kernels {table} (h200)"
    assert cli("memory", "--from-script", str(SCRIPT), "--kernels", table).out.splitlines()[-1].startswith(
        "Step time: ")  # fmt: skip


@pytest.mark.slow
def test_check_compares_the_log_with_what_torch_cuda_counts(cli, tmp_path: Path, monkeypatch) -> None:
    """check's predictions are `memory`'s torch.cuda figures: the bytes megatron asks for plus the
    caching allocator's blocks beyond its set-up requests (tests/test_segments.py derives the
    hand-made job's last-stage tails), what Megatron-LM's `allocated` lines count."""
    import json

    from tests.test_segments import LAST_STAGE_TAILS, hand_made_job

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    config = str(hand_made_job(tmp_path))
    log = tmp_path / "job.log"  # rank 4: the first rank of the last stage (tp 2 x pp 2 x dp 2)
    log.write_text("[Rank 4] (after 2 iterations) memory (MB) | allocated: 517.00 | max allocated: "
                   "1381.00 | reserved: 1500.00 | max reserved: 1500.00\n")  # fmt: skip
    checked = cli("check", str(log), "--config", config, "--dp", "2", "--format", "json")
    assert checked.code == 0, checked.err
    memory = cli("memory", "--config", config, "--dp", "2", "--format", "json")
    assert memory.code == 0, memory.err
    last = json.loads(memory.out)["stages"][1]
    rows = {row["quantity"]: row["predicted"] for row in json.loads(checked.out)["memory"]}
    assert rows == {"peak allocated": last["total"] + LAST_STAGE_TAILS,
                    "allocated after the step": last["static"] + LAST_STAGE_TAILS}  # fmt: skip
