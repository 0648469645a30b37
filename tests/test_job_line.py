"""Every report starts with the job as understood, and notes the defaults that surprise."""

from __future__ import annotations

import json

import pytest

from tests import invariants

SMALL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "256", "--vocab-size", "1000"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["--micro-batch-size", "1"],
        ["--micro-batch-size", "2", "--bf16", "--pp", "2", "--dp", "2", "--global-batch-size", "16"],
        ["--micro-batch-size", "1", "--fp16", "--tp", "2", "--pp", "2", "--dp", "2"],
    ],
)
def test_memory_job_line_agrees_with_the_job(cli, extra):
    text = cli("memory", *SMALL, *extra).out
    report = json.loads(cli("memory", *SMALL, *extra, "--format", "json").out)
    job = invariants.job_line(text)
    config, training = report["config"], report["training"]
    assert (job["layers"], job["seq"]) == (config["num_layers"], config["seq_length"])
    assert job["precision"] == ("bf16" if config["bf16"] else "fp16" if config["fp16"] else "fp32")
    assert job["gbs"] == training["global_batch_size"]
    assert job["tp"] * job["pp"] * job["dp"] == report["world_size"]
    # the batch note names the flag exactly when it is absent
    assert ("Note: no --global-batch-size" in text) == ("--global-batch-size" not in extra)
    assert cli("memory", *SMALL, *extra, "--format", "table").out.splitlines()[0] == (
        text.splitlines()[0]
    )


def test_one_micro_batch_note_gives_the_steady_state(cli):
    text = cli("memory", *SMALL, "--micro-batch-size", "2", "--pp", "2", "--dp", "2").out
    assert "with --pp 2, --global-batch-size 8 or more shows the steady state." in text
    steady = cli("memory", *SMALL, "--micro-batch-size", "2", "--pp", "2", "--dp", "2",
                 "--global-batch-size", "8").out  # fmt: skip
    assert "Note:" not in steady.replace("Note: neither --bf16", "")


def test_params_table_job_line_and_rank_summary(cli):
    args = ["params", *SMALL, "--pp", "2", "--dp", "2", "--bf16", "--format", "table"]
    text = cli(*args).out
    job = invariants.job_line(text)
    assert (job["pp"], job["dp"], job["precision"]) == (2, 2, "bf16")
    invariants.params_human(text)
    ranked = cli(*args, "--rank", "3").out.splitlines()
    stage1 = next(line for line in text.splitlines() if line.startswith("stage 1:"))
    assert ranked[0] == text.splitlines()[0]
    assert ranked[1] == f"Rank 3 holds {stage1}."


def test_machine_formats_keep_their_first_lines(cli):
    # the committed csv keeps the topology line first; json carries the job in its fields
    csv = cli("params", *SMALL).out
    assert csv.startswith("{ProcessCoord(") and "Job:" not in csv
    assert json.loads(cli("memory", *SMALL, "--micro-batch-size", "1", "--format", "json").out)


def test_the_model_is_named_as_given(cli):
    assert cli("params", "--model", "llama3-8b", "--num-layers", "2", "--format", "table").out.startswith(
        "Job: llama3-8b (2 layers, hidden 4096), fp32, sequence 8192; tp 1 x pp 1 x dp 1 = 1 GPU."
    )
    script = "fixtures/scripts/llama3_8b.sh"
    text = cli("params", "--from-script", script, "--num-layers", "2", "--format", "table").out
    assert text.startswith(f"Job: {script} (2 layers, hidden 4096), bf16, sequence 8192; tp 2 x pp 2")


def test_plan_says_what_it_searched(cli):
    text = cli("plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--tp", "2", "--top", "1").out
    first, note = text.splitlines()[:2]
    assert first == (
        "Job: gpt2-small (4 layers, hidden 128), fp32, sequence 256; layout searched on 8 GPUs "
        "(--gpu h100, 80 GiB each) (fixed: tp 2); global batch 8."
    )
    assert note.startswith("Note: neither --bf16 nor --fp16 is given")
