"""Shared fixtures: run the CLI in-process, and compare against golden files."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from inspector.world import te
from tests import invariants

# megatron-core decides HAVE_TE when it is first imported, and some tests import it directly
# (tests/test_versions.py, at module level): the simulated Transformer Engine goes in first, as
# the simulated world puts it in before it imports megatron-core (notes/te.md).
te.install()

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"

# The result cache is off in tests (every test exercises the engine); tests/test_cache.py turns
# it on against a temporary cache folder.
os.environ["INSPECT_MODEL_NO_CACHE"] = "1"


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
        assert text == expected, f"output differs from {path} (pytest --update-golden to refresh)"
        invariants.check(name, text)

    return check
