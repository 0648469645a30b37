"""Python's own limits never reach the user as tracebacks (issue #30, family 4).

Each file goes through the real command line (`tree --config FILE`, `workload
--compute-profile FILE`): one `Error:` line naming the file, exit 2, no output, within a
subprocess timeout that fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)
LONG = "1" + "0" * 5000
FILES = {
    "deep.json": ("[" * 100_000, "Error: deep.json: nested more than 64 levels deep"),
    "deep-object.json": ('{"a":' * 100_000, "Error: deep-object.json: nested more than 64 levels deep"),
    "deep.yaml": ("a: " + "[" * 100_000, "Error: deep.yaml: nested more than 64 levels deep"),
    "deep-block.yaml": ("".join(" " * i + "a:\n" for i in range(1000)),  # under MAX_YAML_CHARS
                        "Error: deep-block.yaml: nested more than 64 levels deep"),
    "bomb.yaml": (BOMB + "num-layers: *i\n",
                  "Error: bomb.yaml: more than 1,000,000 values once its aliases are expanded"),
    "list-key.yaml": ("? [1, 2]\n: 3\n", "Error: list-key.yaml line 1: a key is a list, not a name"),
    "map-key.yaml": ("? {a: 1}\n: 3\n", "Error: map-key.yaml line 1: a key is a mapping, not a name"),
    "long.yaml": (f"num-layers: {LONG}\n",
                  "Error: long.yaml: not valid YAML here (a number has more than 4,300 digits)"),
    "long.json": (f'{{"num-layers": {LONG}}}',
                  "Error: long.json: not valid JSON here (a number has more than 4,300 digits)"),
}  # fmt: skip


def _run(tmp_path, *argv: str) -> subprocess.CompletedProcess[str]:
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's inspector, not the installed one
    return subprocess.run(
        [sys.executable, "-m", "inspector", *argv],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": root, "INSPECT_MODEL_NO_CACHE": "1"},
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
def test_config_files_beyond_pythons_limits(tmp_path, name):
    text, message = FILES[name]
    (tmp_path / name).write_text(text)
    result = _run(tmp_path, "tree", "--config", name)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n")


@pytest.mark.slow
def test_aliases_within_the_caps_still_read(tmp_path):
    (tmp_path / "ok.yaml").write_text("num-layers: &n 4\nnum-attention-heads: *n\nhidden-size: 64\n")
    result = _run(tmp_path, "params", "--config", "ok.yaml", "--vocab-size", "1000")
    assert result.returncode == 0, result.stderr
    assert "decoder.layers.3." in result.stdout and "decoder.layers.4." not in result.stdout


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e300"])
def test_compute_profile_with_non_finite_times(tmp_path, value):
    (tmp_path / "p.txt").write_text(f"Emb:\n    time_gpu_avg: {value}\n")
    result = _run(tmp_path, "workload", "--num-layers", "2", "--hidden-size", "64",
                  "--num-attention-heads", "4", "--micro-batch-size", "1", "--stage", "0",
                  "--compute-profile", "p.txt")  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        f"Error: --compute-profile line 2: time_gpu_avg must be a number of microseconds from 0 "
        f"to 1e+12, got {value}\n"
    )
