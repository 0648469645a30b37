"""`workload -o DIR` and `-o FILE` never damage what they are given (issue #30, family 2).

The command-line cases run the real CLI (in-process); the signal cases run a small writer in a
process of its own, kill it at seeded random moments (SIGINT, SIGTERM, SIGKILL) and check that
the folder holds the previous export or the new one, whole, beside the user's own files, with
its mode, and no `.inspect-model-*` temporary (after SIGKILL: once the next write has run, as
docs/output.md says; a killed process cannot clean up).
"""

from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inspector import export
from inspector.errors import OutputError
from tests.conftest import default_signals

JOB = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
JOB += ["--vocab-size", "1000", "--micro-batch-size", "1", "--gpu-tflops", "100"]
INDEX = "stage,layers,file\n"


def _export(tag: str, stages: int = 3, size: int = 200_000) -> dict[str, str]:
    files = {f"stage{i:03d}.txt": f"{tag}{i}\n" + tag * size for i in range(stages)}
    files["index.csv"] = INDEX + "".join(f"{i},{i},stage{i:03d}.txt\n" for i in range(stages))
    return files


def _state(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_existing_folder_is_written_into_keeping_its_files_and_mode(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o750)
    (out / "notes.txt").write_text("mine\n")
    result = cli("workload", *JOB, "-o", str(out))
    assert (result.code, result.err) == (0, "")
    assert sorted(_state(out)) == ["index.csv", "notes.txt", "stage000.txt"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_symlink_named_by_o_stays_a_link(cli, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    assert cli("workload", *JOB, "-o", str(tmp_path / "link")).code == 0
    assert os.readlink(tmp_path / "link") == "real"
    assert sorted(os.listdir(tmp_path / "real")) == ["index.csv", "stage000.txt"]


def test_a_new_folder_gets_the_umask_mode(cli, tmp_path):
    previous = os.umask(0o027)
    try:
        assert cli("workload", *JOB, "-o", str(tmp_path / "new")).code == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o750


def test_a_previous_export_with_more_stages_is_replaced_whole(cli, tmp_path):
    out = tmp_path / "out"
    assert cli("workload", *JOB, "--pp", "2", "-o", str(out)).code == 0
    (out / "notes.txt").write_text("mine\n")
    assert cli("workload", *JOB, "-o", str(out)).code == 0
    assert sorted(os.listdir(out)) == ["index.csv", "notes.txt", "stage000.txt"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-o", ""], "Error: -o needs a folder name, got an empty one\n"),
        (["--output="], "Error: -o needs a folder name, got an empty one\n"),
        (["-o", "a" * 300], "Error: -o " + "a" * 40 + "..." + "a" * 40 + " (300 characters): "
         "cannot write: file name too long\n"),
        (["-o", "user/sub"], None),
    ],
)
def test_bad_folders_are_refused_and_nothing_changes(cli, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "sub").write_text("a file\n")
    result = cli("workload", *JOB, *argv)
    assert result.code == 2 and result.out == ""
    assert result.err == (message or "Error: -o user/sub exists and is not a folder\n")
    assert sorted(os.listdir(tmp_path)) == ["user"]
    assert os.listdir(tmp_path / "user") == ["sub"]


def test_a_users_own_file_with_an_export_name_is_refused_untouched(cli, tmp_path):
    (tmp_path / "index.csv").write_text("my,own\n")
    result = cli("workload", *JOB, "-o", str(tmp_path))
    assert result.code == 2 and result.err == (
        f"Error: -o {tmp_path} already holds index.csv, which no earlier inspect-model export "
        "there wrote; move it or give another folder\n"
    )
    assert _state(tmp_path) == {"index.csv": "my,own\n"}


@pytest.mark.parametrize("why", ["no-renameat2", "subfolder"])
def test_without_an_exchange_the_files_are_replaced_in_place(tmp_path, monkeypatch, why):
    out = tmp_path / "out"
    export.write_export(str(out), _export("a", stages=3, size=10))
    (out / "keep").mkdir()
    if why == "no-renameat2":
        monkeypatch.setattr(export, "_renameat2", lambda: None)
    export.write_export(str(out), _export("b", stages=2, size=10))
    assert sorted(os.listdir(out)) == ["index.csv", "keep", "stage000.txt", "stage001.txt"]
    for name, text in _export("b", stages=2, size=10).items():
        assert (out / name).read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_full_disk_is_an_error_line_and_the_old_export_stays(tmp_path):
    out = tmp_path / "out"
    export.write_export(str(out), _export("a", size=10))
    code = f"from inspector.export import write_export\nwrite_export({str(out)!r}, {_export('b')!r})"
    result = subprocess.run(
        ["bash", "-c", 'ulimit -f 100; exec "$@"', "bash", sys.executable, "-"],
        input=_CLI_ERRORS + code, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.stderr == f"Error: -o {out}: cannot write: file too large\n"
    assert _state(out) == _export("a", size=10)
    assert sorted(os.listdir(tmp_path)) == ["out"]


_CLI_ERRORS = """
import sys
from inspector.errors import InspectorError
def hook(kind, exc, tb):
    if isinstance(exc, InspectorError):
        sys.stderr.write(f"Error: {exc}\\n"); sys.exit(2)
    sys.__excepthook__(kind, exc, tb)
sys.excepthook = hook
"""

WRITER = """
import sys
from inspector.export import write_export
from inspector.output import write_atomic
{exports}
print("ready", flush=True)
for n in range(10**9):
    {write}
"""


def _kill_at_random_moments(tmp_path: Path, signum: int, write: str, exports: str) -> Path:
    """Start the writer, kill it after a seeded random delay, and yield after each kill."""
    rng = random.Random(signum)
    for _ in range(8):
        process = subprocess.Popen(
            [sys.executable, "-c", WRITER.format(exports=exports, write=write)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent.parent,
            preexec_fn=default_signals,
        )  # fmt: skip
        try:
            assert process.stdout is not None and process.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.0, 0.15))
            process.send_signal(signum)
            process.wait(timeout=30)
        finally:  # a writer the signal did not stop must not loop on through the rest of the suite
            if process.poll() is None:
                process.kill()
                process.wait()
        yield


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_signal_leaves_the_old_or_the_new_export_whole(tmp_path, signum):
    out = tmp_path / "out"
    a, b = _export("a"), _export("b")
    export.write_export(str(out), a)
    out.chmod(0o750)
    (out / "notes.txt").write_text("mine\n")
    exports = "from tests.test_export import _export\na, b = _export('a'), _export('b')"
    write = f"write_export({str(out)!r}, (a, b)[n % 2])"
    for _ in _kill_at_random_moments(tmp_path, signum, write, exports):
        state = _state(out)
        assert state.pop("notes.txt") == "mine\n"
        assert state in (a, b)
        assert stat.S_IMODE(out.stat().st_mode) == 0o750
        if signum == signal.SIGKILL:
            export.write_export(str(out), a)  # the next write removes what SIGKILL left
        assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_leaves_the_old_or_the_new_file_whole(tmp_path, signum):
    target = tmp_path / "t.csv"
    a, b = "a" * 3_000_000, "b" * 3_000_000
    target.write_text(a)
    write = f"write_atomic({str(target)!r}, (a, b)[n % 2])"
    exports = "a, b = 'a' * 3_000_000, 'b' * 3_000_000"
    for _ in _kill_at_random_moments(tmp_path, signum, write, exports):
        assert target.read_text() in (a, b)
        assert os.listdir(tmp_path) == ["t.csv"]


def test_stale_temporaries_of_live_processes_are_kept(tmp_path):
    mine = tmp_path / f".inspect-model-{os.getpid()}-x.tmp"
    mine.write_text("busy\n")
    gone = tmp_path / ".inspect-model-999999999-y"
    gone.mkdir()
    export.write_export(str(tmp_path / "out"), _export("a", size=1))
    assert sorted(os.listdir(tmp_path)) == [mine.name, "out"]


def test_check_export_target_refuses_before_the_build():
    with pytest.raises(OutputError, match="-o needs a folder name"):
        export.check_export_target("")
