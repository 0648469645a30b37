"""Guarded stdio.

Streams: stdout always carries UTF-8 (the output is byte-identical everywhere, whatever the
locale or PYTHONIOENCODING); stderr keeps the locale's encoding and backslash-escapes what it
cannot show. A write to stdout that fails (`> /dev/full`, `>&-`) is `Error:` and exit 2; a
closed pipe (`| head -1`) ends the run quietly with exit 141 (128 + SIGPIPE), as a Unix tool
killed by SIGPIPE reports it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO, cast

from inspector.errors import OutputError
from inspector.output import reason_of

BROKEN_PIPE_EXIT = 128 + 13  # as a shell reports a process killed by SIGPIPE


class _GuardedStdout:
    """Standard output that reports a failed write as OutputError, and a closed pipe quietly.

    Every write is flushed at once, so a failure surfaces in the command that wrote, never at
    interpreter exit as an 'Exception ignored' message.
    """

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with _stdout_errors():
            if self._stream is None:
                raise OSError(errno.EBADF, "it is closed")
            self._stream.flush()
            data = memoryview(text.encode("utf-8", "surrogateescape"))
            fd = self._stream.fileno()
            while data:  # os.write, because io's buffers drop a short write's error (EFBIG)
                data = data[os.write(fd, data) :]
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            with _stdout_errors():
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


@contextlib.contextmanager
def _stdout_errors() -> Iterator[None]:
    try:
        yield
    except BrokenPipeError:
        # The reader has gone (`| head -1`): print nothing more. Point fd 1 at /dev/null so
        # that the interpreter's last flush cannot fail, then end as SIGPIPE would.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ else 1)
            os.close(devnull)
        raise SystemExit(BROKEN_PIPE_EXIT) from None
    except OSError as exc:
        raise OutputError(f"cannot write to standard output ({reason_of(exc)})") from None


def guard_streams() -> None:
    """Make the process's real stdio safe to use: call once at the start of the CLI.

    Closed descriptors 0-2 are pointed at /dev/null (so a file opened later cannot take their
    number), stdout is switched to UTF-8 and guarded, and stderr escapes what its encoding
    cannot show. Streams that are not the real ones (tests capture them) are left alone.
    """
    for fd in (0, 1, 2):
        _reopen_if_closed(fd)
    if isinstance(sys.stdout, _GuardedStdout):
        return
    stdout = sys.stdout
    if stdout is None or stdout is sys.__stdout__:
        if stdout is not None and hasattr(stdout, "reconfigure"):
            with contextlib.suppress(OSError, ValueError):
                stdout.reconfigure(encoding="utf-8", errors="surrogateescape")
        sys.stdout = cast(TextIO, _GuardedStdout(stdout))
    if sys.stderr is not None and sys.stderr is sys.__stderr__:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            sys.stderr.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]


def _reopen_if_closed(fd: int) -> None:
    try:
        os.fstat(fd)
    except OSError:
        with contextlib.suppress(OSError):
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)


def write_error(message: str) -> None:
    """Print `Error: message` on stderr (where stderr is closed, say nothing)."""
    with contextlib.suppress(OSError, ValueError, SystemExit, OutputError):
        sys.stdout.flush()
    write_stderr(f"Error: {message}\n")


_HELD: list[str] = []  # the merge's notes of the command now running, until its job is accepted


def hold_notes(notes: tuple[str, ...] | list[str]) -> None:
    """Keep the notes of a command's inputs (the merge's "Note from config.json: ..." lines)
    until the job is accepted: a refused job prints its one `Error:` line and nothing else."""
    _HELD[:] = notes


def drop_notes() -> None:
    """Forget the held notes: the job was refused."""
    _HELD.clear()


def release_notes() -> None:
    """Print the held notes on stderr, once: the job was accepted."""
    notes = list(_HELD)
    _HELD.clear()
    for note in notes:
        write_stderr(f"{note}\n")


def write_stderr(text: str) -> None:
    """Write a note or an error on stderr; where it cannot be written (`2>/dev/full`), drop it.

    A failed write leaves its bytes in the stream's buffer, and Python's own flush at exit would
    fail again and turn the exit status into 120: stderr is pointed at /dev/null instead.
    """
    if sys.stderr is None:
        return
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)
            sys.stderr.flush()
