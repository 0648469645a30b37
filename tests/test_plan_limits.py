"""`plan` on unbounded sizes (issue 30): an answer or one `Error:` line within seconds, through the
real CLI in a subprocess whose timeout fails the test (docs/limits.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TIMEOUT = 120  # seconds: generous on two shared cores; a hang is minutes or forever


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inspector", "plan", "--no-cache", *args],
        capture_output=True, text=True, timeout=TIMEOUT, check=False,
    )


def one_error(result: subprocess.CompletedProcess[str], *named: str) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("batch", ["512", "1000000000"])
def test_a_billion_gpus_is_refused_with_the_arithmetic(batch: str) -> None:
    one_error(run_plan("--gpus", "1000000000", "--global-batch-size", batch), "--gpus 1000000000")


def test_a_hundred_thousand_layers_is_refused_as_memory_would() -> None:
    one_error(run_plan("--gpus", "8", "--num-layers", "100000", "--global-batch-size", "512"),
              "--num-layers 100000", "1024")


def test_a_hundred_thousand_experts_is_refused_naming_the_flag() -> None:
    one_error(run_plan("--gpus", "64", "--num-experts", "100000", "--global-batch-size", "512"),
              "--num-experts 100000", "8,192")


def test_global_batch_in_scientific_notation_is_refused_as_argparse_would() -> None:
    one_error(run_plan("--gpus", "8", "--global-batch-size", "1e9"), "--global-batch-size", "1e9")


@pytest.mark.slow
def test_a_billion_sequences_per_step_is_planned_without_drawing_them() -> None:
    result = run_plan("--gpus", "8", "--global-batch-size", "1000000000", "--top", "1")
    assert result.returncode == 0, result.stderr
    assert "not drawn" in result.stdout and "--global-batch-size 1000000000" in result.stdout


def test_the_replayed_groups_give_the_whole_schedule_s_points() -> None:
    from inspector.errors import ConfigError
    from inspector.job import dims

    for pp in range(1, 7):
        for v in (1, 2, 3):
            for group in {pp, pp + 1}:
                for stage in range(pp):
                    for m in range(1, 14 * group):
                        try:
                            short = set(dims.live_microbatches(stage, pp, m, v, group))
                        except ConfigError:
                            continue
                        whole = _replay(dims, stage, pp, m, v, group)
                        assert short == whole, (pp, v, group, stage, m)


def _replay(dims, stage: int, pp: int, m: int, v: int, group: int) -> set:  # type: ignore[no-untyped-def]
    order = dims._schedule_table(m, v, group)
    warmup = dims.warmup_steps(stage, pp, m, v, group)
    live, points = [0] * v, set()
    for step in range(len(order)):
        live[order[step]] += 1
        points.add(tuple(live))
        if step >= warmup:
            live[v - 1 - order[step - warmup]] -= 1
    return points
