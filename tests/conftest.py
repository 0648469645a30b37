"""Shared fixtures: run the CLI in-process, and compare against golden files."""

from __future__ import annotations

import contextlib
import io
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inspector.world.setup import megatron
from tests import invariants

# megatron-core decides HAVE_TE, and the torch.compile of its fused functions (megatron/core/
# jit.py), when it is first imported, and some tests import it directly (tests/test_versions.py,
# at module level): it is imported first as the simulated world imports it (world/fastimport.py:
# the simulated Transformer Engine in, torch.compile passing through; notes/te.md). The engine's
# allocator model runs those functions on meta tensors and never compiles them, as the CLI does.
megatron()

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"

# The result cache is off in tests (every test exercises the engine); tests/test_cache.py turns
# it on against a temporary cache folder.
os.environ["INSPECT_MODEL_NO_CACHE"] = "1"


def default_signals() -> None:
    """Give a child process the default action for the signals a test sends it (Popen's
    preexec_fn): a child inherits what its parent ignores, and a shell's background job (`&`)
    ignores SIGINT, nohup SIGHUP, so Python would neither raise KeyboardInterrupt nor die of them."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="Rewrite fixtures/golden/ from the current output (review the diff like code).",
    )


@dataclass
class Result:
    code: int
    out: str
    err: str


def run_cli(*args: str, stdin: str = "") -> Result:
    """Run `inspect-model ARGS` in this process and capture its exit code and streams."""
    from inspector.cli import main

    out, err = io.StringIO(), io.StringIO()
    old = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO(stdin)
    try:
        code = main(list(args))
    finally:
        sys.stdout, sys.stderr, sys.stdin = old
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli() -> Callable[..., Result]:
    return run_cli


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """Compare text with fixtures/golden/NAME byte for byte (or rewrite it with --update-golden)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN / name
        if update:
            invariants.check(name, text)  # a regeneration that breaks an invariant is refused
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="\n")
            return
        assert path.exists(), f"missing golden file {path}; run pytest --update-golden"
        expected = path.read_text(encoding="utf-8")
        from tests.test_versions import as_built_by_installed, as_printed_by_0_16

        # golden files hold megatron-core 0.16's modules and reprs (tests/test_versions.py)
        text, expected = as_printed_by_0_16(text), as_built_by_installed(expected)
        assert text == expected, f"output differs from {path} (pytest --update-golden to refresh)"
        invariants.check(name, text)

    return check


@contextlib.contextmanager
def formulas_only() -> Iterator[None]:
    """Replace the engine's one entry (`engine.memory.run_job`) by one that runs nothing, so that
    `memory` answers by the closed forms (its answer where the engine cannot run a job)."""
    from unittest import mock

    from inspector.memory.engine import run as engine

    def nothing(job: Any, stages: Any, *shared: Any) -> Any:  # shared: the search's caches
        return engine.JobRuns({}, "not run in this test")

    with mock.patch.object(engine, "run_job", nothing):
        yield


def formula_activations(*args: str) -> list[dict[str, Any]]:
    """Return the closed-form activations (formulas/activations.py) of each stage of `ARGS` (a
    `memory` command line), on the stages megatron builds for it, without running the engine.

    `memory` reports the engine's numbers wherever it runs; the formulas stay as a cross-check,
    checked here directly: the engine's one entry (`engine.memory.run_job`) is replaced by one
    that keeps the built stages and runs nothing.
    """
    from unittest import mock

    from inspector.memory.engine import run as engine
    from inspector.memory.measure import formula_activations as formulas

    seen: list[tuple[Any, tuple[Any, ...]]] = []

    def keep(job: Any, stages: Any) -> Any:
        seen.append((job, tuple(stages)))
        return engine.JobRuns({}, "not run in this test")

    with mock.patch.object(engine, "run_job", keep):
        result = run_cli(*args)
    assert result.code == 0, result.err
    (job, stages), = seen
    out = []
    for stage in stages:
        a = formulas(job, stage)
        out.append({
            "layers": a.layers, "embedding": a.embedding, "output": a.output,
            "recompute_buffer": a.recompute_buffer, "loss_logits": a.loss_logits,
            "total": math.ceil(a.total),
            "in_flight": list(a.in_flight),
        })  # fmt: skip
    return out
