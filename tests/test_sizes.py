"""Sizes that ran for minutes or ended in a traceback (issue #30, unbounded work and int() limits).

Each case of unbounded work runs the real command line in a process of its own, bounded by a
subprocess timeout that fails the test: one `Error:` line naming the flag or file and exit 2, or
the right answer. Long numbers in a table (int()'s limit: an answer or a traceback, at once) run
through the CLI's entry point in this process (tests/conftest.run_cli).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli

TINY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--vocab-size", "100", "--seq-length", "16"]  # fmt: skip
BIG = "9" * 5000  # past Python's int() limit of 4,300 digits


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inspector", *argv, *(["--no-cache"] if argv[0] != "diff" else [])],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


CAPS = {
    # 1,048,576 rows each naming its 1,048,576-rank data group: 223 s and 7.4 GB before the cap.
    "topology-table-dp-1048576": (["topology", "--dp", "1048576", "--format", "table"],
        "Error: --format table lists each rank's groups: --tp 1 x --pp 1 x --dp 1048576 x "
        "--context-parallel-size 1 = 1048576 rows of 1048580 rank numbers = 1,099,515,822,080, "
        "more than the 4,000,000 it prints (docs/limits.md); --format line maps every rank"),
    "num-experts-100000": (["params", "--num-experts", "100000"],
        "Error: --num-experts 100000 experts x 12 MoE layers = 1,200,000 sequential experts "
        "(SequentialMLP, about 2 ms each) to build, more than the 8,192 this tool builds "
        "(docs/limits.md)"),
    "num-experts-100000-te-grouped": (["memory", "--num-experts", "100000", "--ep", "4", "--dp",
        "4", "--moe-grouped-gemm", "--disable-bias-linear", "--transformer-impl",
        "transformer_engine", "--micro-batch-size", "1"],
        # memory builds one expert-parallel rank of each stage: 100000 / 4 of the experts
        "Error: --num-experts 100000 / --expert-model-parallel-size 4 x 1 rank(s) = 25000 experts "
        "x 12 MoE layers = 300,000 TEGroupedMLP experts (a weight each, about 0.5 ms) to build, "
        "more than the 32,768 this tool builds (docs/limits.md)"),
    # a hybrid model's MoE layers are its pattern's 23 E layers, not all 52 (its Mamba and
    # attention layers hold no experts)
    "num-experts-2048-hybrid": (["params", "--model", "nemotron-3-nano-30b-a3b", "--num-experts",
        "2048"],
        "Error: --num-experts 2048 experts x 23 MoE layers = 47,104 TEGroupedMLP experts (a "
        "weight each, about 0.5 ms) to build, more than the 32,768 this tool builds "
        "(docs/limits.md)"),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", CAPS)
def test_capped_in_seconds_naming_the_flags(name):
    from inspector.job.versions import hybrid_moe_layers

    if name.endswith("-hybrid") and not hybrid_moe_layers():
        pytest.skip("a hybrid pattern's E layers are megatron-core 0.16+ (job/versions.py)")
    argv, message = CAPS[name]
    result = _run(*argv)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n")


@pytest.mark.slow
def test_topology_line_maps_a_million_ranks():
    result = _run("topology", "--dp", "1048576")
    assert result.returncode == 0 and result.stdout.count("ProcessCoord(") == 1048576


@pytest.mark.slow
def test_topology_table_within_the_cap_is_printed():
    result = _run("topology", "--dp", "64", "--tp", "2", "--format", "table")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 2 + 128


@pytest.mark.slow
def test_experts_within_the_cap_build():
    # 64 experts x 2 MoE layers = 128 sequential experts: builds
    # no biases: megatron-core 0.13 refuses biases in MoE layers
    result = _run("params", *TINY[2:], "--num-layers", "2", "--num-experts", "64",
                  "--disable-bias-linear")  # fmt: skip
    assert result.returncode == 0 and "decoder.layers.1.mlp.experts.local_experts.63" in result.stdout


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[Path, str]:
    text = run_cli("params", *TINY, "--no-cache").out
    assert text.startswith("{ProcessCoord(")
    return tmp_path_factory.mktemp("tables"), text


def _variants(text: str) -> dict[str, tuple[str, str]]:
    layer = re.sub(r"^decoder\.layers\.0\.", f"decoder.layers.{BIG}.", text, count=1, flags=re.M)
    return {
        # a stage comment's count, read with int(): a traceback before
        "comment.csv": (re.sub(r" ([0-9]+) params", f" {BIG} params", text, count=1),
                        " line 3: a 5000-digit number; a params table's numbers have at most 30 "
                        "digits (docs/limits.md)"),
        # json.loads itself refuses the number (ValueError, not JSONDecodeError)
        "table.json": ('{"parameters": [{"name": "a", "shape": [' + BIG + "]}]}",
                       ": a JSON number longer than Python reads (4300 digits); a params "
                       "table's numbers are far shorter (docs/limits.md)"),
        # a layer number and a topology coordinate past int(): read as text, not numbers
        "layer.csv": (layer, ""),
        "topology.csv": (text.replace("model=0): 0}", f"model={BIG}): 0}}", 1), ""),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["comment.csv", "table.json", "layer.csv", "topology.csv"])
def test_long_numbers_in_a_params_table(table, name):
    folder, text = table
    content, message = _variants(text)[name]
    path = folder / name
    path.write_text(content)
    (folder / "same.csv").write_text(text)
    for argv in (["diff", str(folder / "same.csv"), str(path)],
                 ["params", *TINY, "--no-cache", "--check", str(path)]):
        result = run_cli(*argv)
        if message:
            assert (result.code, result.err) == (2, f"Error: {path}{message}\n")
        else:
            assert result.code == 1 and "Traceback" not in result.err, result.err
