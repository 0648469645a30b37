"""`-o FILE` is atomic: on any failure the old file is left exactly as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from inspector import output, world
from inspector.errors import OutputError


def test_failing_mid_build_leaves_old_file(cli, tmp_path, monkeypatch):
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    original = world.build_stage

    def breaks_on_stage_1(model, layout, stage, expert_rank=0):
        if stage == 1:
            raise world.ConfigError("simulated failure while building stage 1")
        return original(model, layout, stage, expert_rank)

    monkeypatch.setattr(world, "build_stage", breaks_on_stage_1)
    result = cli("params", "--pp", "2", "-o", str(target))
    assert (result.code, result.out) == (2, "")
    assert target.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["table.csv"]


def test_failing_rename_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "table.csv"
    target.write_text("old\n")

    def no_rename(src, dst):
        raise OSError("disk vanished")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OutputError, match="disk vanished"):
        output.write_atomic(str(target), "new\n" * 1000)
    assert target.read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["table.csv"]


def test_missing_folder_is_an_input_error(cli, tmp_path):
    result = cli("params", "-o", str(tmp_path / "nowhere" / "t.csv"))
    assert result.code == 2 and result.err.startswith("Error: -o ")


@pytest.mark.parametrize("delay", [1.0, 3.5])
def test_killed_process_leaves_old_or_complete_file(cli, tmp_path, delay):
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    argv = [sys.executable, "-m", "inspector", "params", "--pp", "4", "-o", str(target)]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # either untouched, or (if it finished before the kill) the whole new table
    assert target.read_text() in ("old\n", cli("params", "--pp", "4").out)
    leftovers = [name for name in os.listdir(tmp_path) if name != "table.csv"]
    assert all(
        name.startswith(".inspect-model-") for name in leftovers
    )  # never a partial table.csv
