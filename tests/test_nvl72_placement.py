"""NVL72 racks: the plan's job line says where megatron's ranks run, and --gpus-per-node changes it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # plan searches

# Qwen3-30B-A3B's 128 experts over ep 64 on 128 GB200s: a 72-GPU domain holds one expert-parallel
# group and 8 ranks of the next, so every group reaches across racks; 64-GPU domains hold one each
MOE = ("plan", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--gpus", "128", "--global-batch-size",
       "128", "--seq-length", "1024", "--bf16", "--tp", "1", "--pp", "1", "--ep", "64",
       "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall", "--top", "1")


def test_the_job_line_names_megatrons_rank_order_and_the_domain_it_fills() -> None:
    rack = run_cli(*MOE, "--gpu", "gb200")
    assert rack.code == 0, rack.err
    assert ("(--gpu gb200, 186 GiB each; ranks in megatron's order tp-cp-ep-dp-pp, 72 consecutive "
            "ranks per NVLink domain (--gpus-per-node))") in rack.out.splitlines()[0]
    sixteen_trays = run_cli(*MOE, "--gpu", "gb200", "--gpus-per-node", "64")
    assert "64 consecutive ranks per NVLink domain" in sixteen_trays.out.splitlines()[0]
    board = run_cli(*MOE, "--gpu", "h100")
    assert "consecutive ranks" not in board.out  # an 8-GPU board: the line as it always was


def test_filling_64_gpus_of_each_rack_keeps_each_expert_group_on_nvlink() -> None:
    plans = {n: json.loads(run_cli(*MOE, "--gpu", "gb200", "--gpus-per-node", n, "--format", "json").out)
             for n in ("72", "64")}  # fmt: skip
    expert = {n: p["plans"][0]["time_shares"]["expert"] for n, p in plans.items()}
    assert expert["64"] < expert["72"] / 2
