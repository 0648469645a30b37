"""Benchmark: each case against the floor `python -c "import torch"`, measured in one run.

Run it with `make bench` (or `.venv/bin/python bench/run.py`). Prints a table and writes
bench/RESULTS.md: median wall time of 5 runs, the ratio to the floor, and peak RSS per case.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = int(os.environ.get("BENCH_RUNS", "5"))
TOOL = [sys.executable, "-m", "inspector"]
VPP = ["--num-virtual-stages-per-pipeline-rank", "2"]
# 126 layers do not split over 16 stages: count the embedding and the loss as layers (128 / 16), as
# Megatron-LM users do for Llama-3.1 405B.
SPLIT = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
LLAMA70 = "params --model llama3-70b --tp 8 --pp 4 --dp 8 --use-distributed-optimizer --seq-length 8192"
MEMORY = ["--micro-batch-size", "1"]


@dataclass(frozen=True)
class Case:
    label: str
    argv: list[str]
    target: str  # what the issue asks for, as text


CASES = [
    Case("floor: python -c 'import torch'", [sys.executable, "-c", "import torch"], "-"),
    Case("(a) inspect-model --help", TOOL + ["--help"], "< 0.3 s"),
    Case("(a') inspect-model models", TOOL + ["models"], "< 0.3 s"),
    Case("(b) tree (default model)", TOOL + ["tree"], "-"),
    Case("(c) params --model gpt3-175b --tp 8 --pp 16", TOOL + "params --model gpt3-175b --tp 8 --pp 16".split(), "< 1.6x floor"),
    Case("(d1) params --model llama3.1-405b --tp 8 --pp 16 --dp 1", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1 --bf16".split() + SPLIT, "-"),
    Case("(d) params --model llama3.1-405b --tp 8 --pp 16 --dp 1024", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16".split() + SPLIT, "< 1.6x floor, < 1.1x (d1), < 450 MB"),
    Case("(e) (d) + vpp 2 + --partitioning distopt", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16 --partitioning distopt".split() + SPLIT + VPP, "-"),
    Case("(f) params --model llama3-70b --tp 8 --pp 4 --dp 8 --use-distributed-optimizer", TOOL + LLAMA70.split(), "-"),
    Case("(g) memory, the same model and layout (issue #9)", TOOL + ["memory"] + LLAMA70.split()[1:] + MEMORY, "< 2x (f)"),
    Case("(h) workload -o DIR, the job of (d) (issue #18)", TOOL + "workload --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16 --micro-batch-size 1 --gpu-tflops 989".split() + SPLIT + ["-o", os.path.join(tempfile.gettempdir(), "inspect-model-bench-workload")], "< 1.1x (d) cold, < 0.3 s warm"),
    Case("(i) (f) with --transformer-impl local (issue #20)", TOOL + LLAMA70.split() + ["--transformer-impl", "local"], "TE (f) <= local (i)"),
]  # fmt: skip


COLD = {**os.environ, "INSPECT_MODEL_NO_CACHE": "1"}
WARM = {k: v for k, v in os.environ.items() if k != "INSPECT_MODEL_NO_CACHE"}


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    """Run a command; return (seconds, peak RSS in bytes, exit code)."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE.parent, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    return elapsed, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def measure(case: Case, env: dict[str, str]) -> tuple[float, int, int]:
    runs = [run_once(case.argv, env) for _ in range(RUNS)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs), max(r[2] for r in runs)


def machine() -> str:
    cpus = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.machine()}, {cpus} cores, {memory:.0f} GiB, Python {platform.python_version()}"
    )


def main() -> None:
    cold = [(case, *measure(case, COLD)) for case in CASES]
    with tempfile.TemporaryDirectory() as cache:
        warm_env = {**WARM, "XDG_CACHE_HOME": cache}
        for case in CASES[1:]:
            run_once(case.argv, warm_env)  # prime the result cache
        warm = {case.label: measure(case, warm_env) for case in CASES[1:]}
    floor = cold[0][1]
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}. Median of {RUNS} runs per case, all cases in one run of `bench/run.py`.",
        "Cold: result cache off (`INSPECT_MODEL_NO_CACHE=1`), every run builds the model. Warm: the",
        "same command again with a primed result cache (a hit imports no torch).",
        "",
        "| case | cold s | cold x floor | cold peak RSS MB | warm s | warm peak RSS MB | exit | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, seconds, rss, code in cold:
        hit = warm.get(case.label)
        warm_cells = f"{hit[0]:.2f} | {hit[1] / 2**20:.0f}" if hit else "- | -"
        lines.append(
            f"| {case.label} | {seconds:.2f} | {seconds / floor:.2f} | {rss / 2**20:.0f} | "
            f"{warm_cells} | {code} | {case.target} |"
        )
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    # The notes under the table (from the first "## " heading on) are written by hand: keep them.
    path = HERE / "RESULTS.md"
    old = path.read_text() if path.exists() else ""
    notes = old[old.find("\n## ") :] if "\n## " in old else ""
    path.write_text(text + notes)


if __name__ == "__main__":
    main()
