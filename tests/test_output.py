"""`-o FILE` is atomic: on any failure the old file is left exactly as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from inspector import output
from inspector.cli import streams
from inspector.errors import OutputError
from inspector.world import stage as world
from tests.conftest import default_signals


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


@pytest.mark.slow
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


# --- how -o writes a file (issue #16 category 1) ------------------------------------------


def test_dash_is_standard_output(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    output.write_output("-", "table\n")  # run_cli captures sys.stdout
    result = cli("models")
    assert result.code == 0 and os.listdir(tmp_path) == []


def test_dash_writes_no_file_named_dash(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    output.write_output("-", "table\n")
    assert capsys.readouterr().out == "table\n" and os.listdir(tmp_path) == []


def test_symlink_is_followed_and_stays_a_link(tmp_path):
    target = tmp_path / "real.csv"
    target.write_text("old\n")
    (tmp_path / "link.csv").symlink_to("real.csv")
    output.write_atomic(str(tmp_path / "link.csv"), "new\n")
    assert os.readlink(tmp_path / "link.csv") == "real.csv"
    assert target.read_text() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["link.csv", "real.csv"]


def test_dangling_symlink_creates_its_target(tmp_path):
    (tmp_path / "link.csv").symlink_to("made.csv")
    output.write_atomic(str(tmp_path / "link.csv"), "new\n")
    assert (tmp_path / "made.csv").read_text() == "new\n"
    assert (tmp_path / "link.csv").is_symlink()


@pytest.mark.parametrize("mode", [0o644, 0o664, 0o640, 0o755])
def test_existing_file_keeps_its_mode(tmp_path, mode):
    target = tmp_path / "t.csv"
    target.write_text("old\n")
    target.chmod(mode)
    output.write_atomic(str(target), "new\n")
    assert (target.stat().st_mode & 0o7777, target.read_text()) == (mode, "new\n")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_new_file_gets_the_umask_mode(tmp_path, umask):
    previous = os.umask(umask)
    try:
        output.write_atomic(str(tmp_path / "t.csv"), "new\n")
    finally:
        os.umask(previous)
    assert (tmp_path / "t.csv").stat().st_mode & 0o777 == 0o666 & ~umask


def test_dev_null_discards(tmp_path):
    output.write_atomic(os.devnull, "anything\n")  # no error, and /dev/null stays a device
    assert not os.path.isfile(os.devnull)


def test_output_is_utf8_bytes_with_lf(tmp_path):
    output.write_atomic(str(tmp_path / "t.txt"), "█ bar\n")
    assert (tmp_path / "t.txt").read_bytes() == "█ bar\n".encode()


@pytest.mark.parametrize(
    "errno_name", ["ENOSPC", "EFBIG", "EDQUOT", "EIO"]
)
def test_write_error_is_an_error_and_leaves_nothing(tmp_path, monkeypatch, errno_name):
    import errno

    target = tmp_path / "t.csv"
    target.write_text("old\n")
    code = getattr(errno, errno_name)

    def failing_fsync(fd):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OutputError, match=f"-o {target}: cannot write: "):
        output.write_atomic(str(target), "new\n")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["t.csv"]


def test_keyboard_interrupt_during_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "t.csv"
    target.write_text("old\n")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output.write_atomic(str(target), "new\n")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["t.csv"]


# A process that is inside the write (fsync made slow) when the signal arrives.
SLOW_WRITE = """
import os, sys, time
from inspector import output
real = os.fsync
def slow(fd):
    print("writing", flush=True)
    time.sleep(30)
os.fsync = slow
output.write_atomic(sys.argv[1], "new\\n" * 100000)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_during_write_leaves_old_file_and_no_temporary(tmp_path, signum):
    target = tmp_path / "t.csv"
    target.write_text("old\n")
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=default_signals,
    )
    assert process.stdout is not None and process.stdout.readline() == "writing\n"
    process.send_signal(signum)
    # longer than the write's 30 s: a signal the kernel gives another of the child's threads
    # (torch's) is handled by Python's main thread when the sleeping write returns
    code = process.wait(timeout=120)
    # the process still dies of the signal (Python re-raises an uncaught KeyboardInterrupt's)
    assert code == -signum
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["t.csv"]


def test_ctrl_c_in_the_cli_exits_130_quietly_without_a_temporary(tmp_path):
    target = tmp_path / "t.csv"
    target.write_text("old\n")
    code = SLOW_WRITE.replace(
        'output.write_atomic(sys.argv[1], "new\\n" * 100000)',
        "from inspector.cli import main; import inspector.cli.cache as c\n"
        "c.cached = lambda *a, **k: 'new\\n'\n"
        "sys.exit(main(['params', '-o', sys.argv[1]]))",
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code, str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signals,
    )
    assert process.stdout is not None and process.stdout.readline() == "writing\n"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert (process.returncode, err) == (130, "")  # typer: KeyboardInterrupt is Exit(130)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["t.csv"]


# --- standard output (issue #16 category 2) -----------------------------------------------

WRITE_STDOUT = (
    "import sys; from inspector import output; from inspector.cli import streams; streams.guard_streams();"
    "output.write_output(None, sys.argv[1] * int(sys.argv[2]))"
)


def test_closed_pipe_ends_quietly_with_141():
    process = subprocess.Popen(
        [sys.executable, "-c", WRITE_STDOUT, "line\n", "1000000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stdout.readline() == b"line\n"
    process.stdout.close()  # as `| head -1` does
    assert process.wait(timeout=60) == streams.BROKEN_PIPE_EXIT
    assert process.stderr is not None and process.stderr.read() == b""


@pytest.mark.parametrize(
    "env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C"}, {"PYTHONIOENCODING": "latin-1"}],
)
def test_stdout_is_utf8_whatever_the_locale(env):
    full = {**os.environ, **env}
    result = subprocess.run(
        [sys.executable, "-c", WRITE_STDOUT, "█ ▏\n", "2"], capture_output=True, env=full
    )
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout == "█ ▏\n█ ▏\n".encode()


def test_deleted_working_folder_still_prints(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    env = {**os.environ, "INSPECT_MODEL_NO_CACHE": "1"}
    result = subprocess.run(
        ["bash", "-c", 'cd gone && rmdir ../gone && exec "$@"', "bash", sys.executable,
         "-m", "inspector", "models"],
        cwd=tmp_path, capture_output=True, env=env, text=True,
    )
    assert (result.returncode, result.stderr) == (0, "") and "gpt2-small" in result.stdout
