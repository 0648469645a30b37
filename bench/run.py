"""Benchmark: each case against the floor `python -c "import torch"`, measured in one run.

Run it with `make bench` (or `.venv/bin/python bench/run.py`). Prints a table and writes
bench/RESULTS.md: per case the median wall time of 5 cold runs, its ratio to the floor, the median of
the paired ratios (each round runs the floor and then every case, so a ratio compares runs made
moments apart), the median CPU time (user + system, which a loaded machine disturbs less than wall
time) and its ratio to the floor's, peak RSS, and the warm (result-cache hit) time.
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
    Case("(c) params --model gpt3-175b --tp 8 --pp 16", TOOL + "params --model gpt3-175b --tp 8 --pp 16".split(), "< 1.5x floor"),
    Case("(d1) params --model llama3.1-405b --tp 8 --pp 16 --dp 1", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1 --bf16".split() + SPLIT, "-"),
    Case("(d) params --model llama3.1-405b --tp 8 --pp 16 --dp 1024", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16".split() + SPLIT, "< 1.5x floor, < 1.1x (d1), < 400 MB"),
    Case("(e) (d) + vpp 2 + --partitioning distopt", TOOL + "params --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16 --partitioning distopt".split() + SPLIT + VPP, "-"),
    Case("(f) params --model llama3-70b --tp 8 --pp 4 --dp 8 --use-distributed-optimizer", TOOL + LLAMA70.split(), "-"),
    Case("(g) memory, the same model and layout (issue #9)", TOOL + ["memory"] + LLAMA70.split()[1:] + MEMORY, "< 2x (f)"),
    Case("(h) workload -o DIR, the job of (d) (issue #18)", TOOL + "workload --model llama3.1-405b --tp 8 --pp 16 --dp 1024 --bf16 --micro-batch-size 1 --gpu-tflops 989".split() + SPLIT + ["-o", os.path.join(tempfile.gettempdir(), "inspect-model-bench-workload")], "< 1.1x (d) cold, < 0.3 s warm"),
    Case("(i) (f) with --transformer-impl local (issue #20)", TOOL + LLAMA70.split() + ["--transformer-impl", "local"], "TE (f) <= local (i)"),
    Case("(j) plan --model llama3.1-405b, 16,384 H100, full search (issue #15)", TOOL + "plan --model llama3.1-405b --gpus 16384 --seq-length 8192 --global-batch-size 2048 --bf16".split(), "< 10 s cold"),
    Case("(k) plan --model deepseek-v3, 1,024 H100, full search (MoE)", TOOL + "plan --model deepseek-v3 --gpus 1024 --seq-length 4096 --global-batch-size 4096 --bf16".split(), "-"),
    Case("(l) plan --model qwen3-30b-a3b, 64 H100 (MoE, issue #45)", TOOL + "plan --model qwen3-30b-a3b --gpus 64 --bf16 --global-batch-size 1024".split(), "< 25 s CPU cold"),
]  # fmt: skip


COLD = {**os.environ, "INSPECT_MODEL_NO_CACHE": "1"}
WARM = {k: v for k, v in os.environ.items() if k != "INSPECT_MODEL_NO_CACHE"}


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_seconds: float  # user + system
    rss: int  # peak, bytes
    code: int


def run_once(argv: list[str], env: dict[str, str]) -> Run:
    """Run a command; return its wall and CPU seconds, peak RSS and exit code."""
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE.parent, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    cpu = usage.ru_utime + usage.ru_stime
    return Run(elapsed, cpu, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))


@dataclass(frozen=True)
class Summary:
    seconds: float  # median wall
    paired: float  # median of (case / floor) over rounds; 1.0 for the floor
    cpu_seconds: float  # median CPU
    rss: int  # peak over runs
    code: int  # worst exit code


def measure_cold(env: dict[str, str]) -> list[Summary]:
    """Run RUNS rounds of every case, the floor first in each round; summarise per case."""
    rounds = [[run_once(case.argv, env) for case in CASES] for _ in range(RUNS)]
    summaries = []
    for index in range(len(CASES)):
        runs = [r[index] for r in rounds]
        summaries.append(
            Summary(
                seconds=statistics.median(r.seconds for r in runs),
                paired=statistics.median(r[index].seconds / r[0].seconds for r in rounds),
                cpu_seconds=statistics.median(r.cpu_seconds for r in runs),
                rss=max(r.rss for r in runs),
                code=max(r.code for r in runs),
            )
        )
    return summaries


def measure(case: Case, env: dict[str, str]) -> tuple[float, int]:
    runs = [run_once(case.argv, env) for _ in range(RUNS)]
    return statistics.median(r.seconds for r in runs), max(r.rss for r in runs)


def machine() -> str:
    cpus = os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{platform.machine()}, {cpus} cores, {memory:.0f} GiB, Python {platform.python_version()}"
    )


def main() -> None:
    load_before = os.getloadavg()
    cold = measure_cold(COLD)
    load_after = os.getloadavg()
    with tempfile.TemporaryDirectory() as cache:
        warm_env = {**WARM, "XDG_CACHE_HOME": cache}
        for case in CASES[1:]:
            run_once(case.argv, warm_env)  # prime the result cache
        warm = {case.label: measure(case, warm_env) for case in CASES[1:]}
    floor = cold[0]
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}. {RUNS} rounds, each running the floor and then every case cold, all in",
        "one run of `bench/run.py`; medians. Cold: result cache off (`INSPECT_MODEL_NO_CACHE=1`), every run",
        "builds the model. Paired x floor: the median over rounds of (case / floor in the same round).",
        "CPU: user + system seconds. Warm: the same command again with a primed result cache (a hit",
        f"imports no torch). Load average (1, 5, 15 min) before: {_load(load_before)}, after: {_load(load_after)}.",
        "",
        "| case | cold s | cold x floor | paired x floor | cold CPU s | CPU x floor | cold peak RSS MB "
        "| warm s | warm peak RSS MB | exit | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, summary in zip(CASES, cold):
        hit = warm.get(case.label)
        warm_cells = f"{hit[0]:.2f} | {hit[1] / 2**20:.0f}" if hit else "- | -"
        lines.append(
            f"| {case.label} | {summary.seconds:.2f} | {summary.seconds / floor.seconds:.2f} | "
            f"{summary.paired:.2f} | {summary.cpu_seconds:.2f} | "
            f"{summary.cpu_seconds / floor.cpu_seconds:.2f} | {summary.rss / 2**20:.0f} | "
            f"{warm_cells} | {summary.code} | {case.target} |"
        )
    lines += _plan_rates(cold)
    text = "\n".join(lines) + "\n" + _gpu_memory() + _ci_goldens()
    sys.stdout.write(text)
    # The notes under the table (from the first "## " heading on) are written by hand: keep them.
    path = HERE / "RESULTS.md"
    old = path.read_text() if path.exists() else ""
    notes = old[old.find("\n## ") :] if "\n## " in old else ""
    path.write_text(text + notes)


def _gpu_memory() -> str:
    """Return the engine's memory against the GPU runs (bench/gpu_memory.py)."""
    from gpu_memory import table

    return "\n" + table()


def _ci_goldens() -> str:
    """Return Megatron-LM's functional tests against their H100 golden values (bench/ci_goldens.py),
    where a checkout is at hand (BENCH_MEGATRON_LM, default /work/mlm)."""
    from ci_goldens import report

    root = Path(os.environ.get("BENCH_MEGATRON_LM", "/work/mlm"))
    if not (root / "tests" / "functional_tests").is_dir():
        return f"\nMegatron-LM's functional tests: no checkout at {root} (BENCH_MEGATRON_LM).\n"
    return "\n" + report(root)


def _plan_rates(cold: list[Summary]) -> list[str]:
    """Return a line per `plan` case: candidates priced (from its JSON) per cold second."""
    import json

    out = []
    for case, summary in zip(CASES, cold):
        if "plan" not in case.argv:
            continue
        done = subprocess.run(case.argv + ["--format", "json"], env=COLD, capture_output=True, text=True)
        found = json.loads(done.stdout) if done.returncode == 0 else {}
        evaluated, passed = found.get("evaluated", 0), found.get("passed_over", 0)
        out.append(f"\n{case.label.split()[0]}: {evaluated:,} candidates priced ({passed:,} layouts "
                   f"passed over by their floor), {evaluated / summary.seconds:.0f} per second of "
                   "its cold median.")
    return out


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{value:.2f}" for value in load)


if __name__ == "__main__":
    main()
