"""`inspect-model workload`: files from megatron's real stages, checked against the params table."""

from __future__ import annotations

import json
import re

import pytest

from inspector.report.simai import parse_workload

SMALL = "--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000".split()
JOB = [*SMALL, "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--gpu-tflops", "100"]  # fmt: skip
UNEVEN = ["--decoder-first-pipeline-num-layers", "2"]


def read_folder(path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"], UNEVEN])
def test_each_stage_file_holds_what_megatron_placed(cli, tmp_path, extra):
    """Layer records per stage equal the params table's layers; DP bytes equal its parameters."""
    out = tmp_path / "wl"
    result = cli("workload", *JOB, *extra, "-o", str(out))
    assert result.code == 0, result.err
    files = read_folder(out)
    assert sorted(files) == ["index.csv", "stage000.txt", "stage001.txt"]
    params = cli("params", *[a for a in JOB if a not in ("--micro-batch-size", "1", "--global-batch-size", "8", "--gpu-tflops", "100")],
                 *[a for a in extra if a != "--use-distributed-optimizer"], "--format", "json")  # fmt: skip
    rows = json.loads(params.out)["parameters"]
    distopt = "--use-distributed-optimizer" in extra
    for stage in (0, 1):
        header, records = parse_workload(files[f"stage{stage:03d}.txt"])
        assert (header.tp, header.pp, header.ga, header.all_gpus) == (2, 2, 4, 8)
        mine = [r for r in rows if r["stage"] == stage]
        layers = sorted({int(m.group(1)) for r in mine if (m := re.match(r"decoder\.layers\.(\d+)\.", r["name"]))})
        # one attention_column per layer per micro-batch (sequence parallelism is off: attention_layer)
        per_block = [r.name for r in records if r.name in ("attention_layer", "attention_column")]
        assert len(per_block) == len(layers) * header.ga
        numel = sum(r["numel"] for r in mine)
        reduce = next(r for r in records if r.name == "grad_param_comm")
        if distopt:
            # padded buffer: at least the parameters, at most one lcm(dp, 128) bucket pad more
            assert numel * 4 <= reduce.wg_bytes < (numel + 128 * 2 + 64 * len(mine)) * 4
        else:
            assert reduce.wg_bytes == numel * 4  # fp32 grads of bf16 parameters, no padding
    index = files["index.csv"].splitlines()
    assert index[0].startswith("stage,layers") and len(index) == 3


def test_stage_view_is_the_folders_file(cli, tmp_path):
    out = tmp_path / "wl"
    assert cli("workload", *JOB, "-o", str(out)).code == 0
    single = cli("workload", *JOB, "--stage", "1")
    assert single.code == 0 and single.out == (out / "stage001.txt").read_text()


def test_rewriting_a_previous_export_replaces_it_and_leaves_no_temporary(cli, tmp_path):
    out = tmp_path / "wl"
    assert cli("workload", *JOB, "-o", str(out)).code == 0
    assert cli("workload", *JOB, "--tp", "1", "-o", str(out)).code == 0
    assert parse_workload((out / "stage000.txt").read_text())[0].tp == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wl"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([*JOB], "Error: workload writes every stage into -o DIR, or one stage with --stage S; pass one\n"),
        ([*JOB[:-2], "--stage", "0"], "Error: workload needs compute times: --gpu or --gpu-tflops (FLOPs at that peak, estimates) or --compute-profile FILE (measured), one of them\n"),
        ([*JOB, "--stage", "5"], "Error: --stage 5 is out of range for --pp 2 (stages 0-1)\n"),
    ],
)
def test_bad_input(cli, args, message):
    result = cli("workload", *args)
    assert (result.code, result.out, result.err) == (2, "", message)


def test_a_folder_with_other_files_is_written_into_and_they_stay(cli, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = cli("workload", *JOB, "-o", str(tmp_path))
    assert (result.code, result.err) == (0, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.csv", "notes.txt", "stage000.txt", "stage001.txt"
    ]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_mtp_layers_are_on_the_stage_megatron_put_them(cli, tmp_path):
    out = tmp_path / "wl"
    args = [*SMALL[:-2], "--vocab-size", "1000", "--position-embedding-type", "rope", "--mtp-num-layers", "1",
            "--transformer-impl", "transformer_engine", "--untie-embeddings-and-output-weights",
            "--micro-batch-size", "1", "--gpu-tflops", "100", "--pp", "2", "-o", str(out)]  # fmt: skip
    result = cli("workload", *args)
    assert result.code == 0, result.err
    rows = [line.split(",") for line in (out / "index.csv").read_text().splitlines()[1:]]
    assert [(row[0], row[2]) for row in rows] == [("0", "0"), ("1", "1")]
