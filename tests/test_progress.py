"""The progress line on stderr: only on a terminal, only after a second, erased at the end."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys

import pytest

from inspector.cli import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_nothing_when_stderr_is_not_a_terminal(cli):
    # Captured streams (as in pipes and CI) are not terminals: not a byte of progress
    result = cli("tree", "--num-layers", "4", "--pp", "2", "--hidden-size", "64",
                 "--num-attention-heads", "4")  # fmt: skip
    assert result.code == 0 and result.err == ""


def test_nothing_in_the_first_second():
    # A quick run shows nothing even on a terminal.
    stream = Terminal()
    with Progress(stream) as progress:
        progress(0, 2)
        progress(2, 2)
    assert stream.getvalue() == ""


def test_one_line_rewritten_then_erased():
    stream = Terminal()
    with Progress(stream, delay=0.0) as progress:
        progress(0, 2)
        progress(1, 2)
        progress(2, 2)
    text = stream.getvalue()
    assert "\n" not in text  # one line, rewritten with \r
    assert text.count("\r") == 4 and text.endswith("\r\x1b[K")
    assert "building with megatron-core: 1 of 2 stage builds" in text


def test_a_pipe_gets_nothing():
    stream = io.StringIO()  # not a terminal
    with Progress(stream, delay=0.0) as progress:
        progress(1, 2)
    assert stream.getvalue() == ""


@pytest.mark.slow
def test_real_terminal_shows_progress_and_erases_it(tmp_path):
    # A real run with stderr on a pseudo-terminal; the line shows at once (delay 0), since a
    # small build can finish inside the usual second.
    main, secondary = pty.openpty()
    env = dict(os.environ, INSPECT_MODEL_NO_CACHE="1", XDG_CACHE_HOME=str(tmp_path),
               INSPECT_MODEL_PROGRESS_DELAY="0")
    args = ["tree", "--num-layers", "4", "--pp", "2", "--hidden-size", "64",
            "--num-attention-heads", "4"]  # fmt: skip
    process = subprocess.run(
        [sys.executable, "-m", "inspector", *args], stdout=subprocess.PIPE,
        stderr=secondary, env=env, timeout=120, check=False,
    )  # fmt: skip
    os.close(secondary)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert process.returncode == 0 and process.stdout.startswith(b"# stage 0")
    assert b"building with megatron-core: " in seen and seen.endswith(b"\r\x1b[K")
