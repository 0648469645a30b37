"""Files and streams in and out: `-o FILE` written the way a user expects, and guarded stdio.

`-o FILE` semantics (docs/errors.md, "Output files and streams"):
- `-o -` is standard output, as `-` is standard input for `diff`.
- FILE is replaced atomically: the text goes to a temporary file `.inspect-model-PID-*.tmp` in
  the same folder, which is renamed over FILE once complete. On any failure the temporary file
  is removed and FILE is left exactly as it was; SIGINT, SIGTERM and SIGHUP are held until the
  rename or removal is done. A temporary that SIGKILL left is removed by the next write there.
- A symlink is followed: its final target is the file replaced, so the link stays a link and
  whatever reads the target sees the new table. That is what `> FILE` does, and replacing the
  link instead would leave its target stale. A dangling link creates its target, as `>` does.
- Only regular files are written. A folder, a character or block device (`/dev/full`), a fifo
  or a socket is refused with an `Error:`, never replaced by a plain file. The one exception is
  `/dev/null`, which discards the output as `> /dev/null` does.
- An existing file keeps its permission bits (and its owner and group where we may set them); a
  new file gets the mode the umask gives (0666 & ~umask), as `> FILE` would. A read-only
  existing file is refused, as `> FILE` refuses it. A hard link is broken by the rename.

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
import stat
import sys
from collections.abc import Iterator
from typing import Any, TextIO, cast

from inspector.errors import InputError, OutputError
from inspector.guard import (
    TEMPORARY_PREFIX,
    remove_stale_temporaries,
    signals_released,
    write_guard,
)

STDIO = "-"
BROKEN_PIPE_EXIT = 128 + 13  # as a shell reports a process killed by SIGPIPE
_KINDS = {
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a fifo (named pipe)",
    stat.S_ISSOCK: "a socket",
}


def write_output(path: str | None, text: str) -> None:
    """Write a command's text to standard output (no -o, or `-o -`) or to FILE atomically."""
    if path is None or path == STDIO:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_atomic(path, text)


def write_atomic(path: str, text: str | bytes, flag: str = "-o") -> None:
    """Replace the regular file at path (a symlink's target) with text (or bytes), or raise
    OutputError.

    Either the whole new file appears or the old one stays as it was; no temporary file is
    left behind, also when the run is interrupted during the write.
    """
    target = check_target(path, flag)
    if target == os.devnull:
        return
    try:
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
        replace_file(target, data)
    except _CannotCreate as exc:
        folder = os.path.dirname(target)
        raise OutputError(
            f"{flag} {shown_path(path)}: cannot create a file in folder {folder} ({reason_of(exc)})"
        ) from None
    except OSError as exc:
        via = "" if os.path.abspath(path) == target else f" (the target of the link, {target})"
        raise OutputError(f"{flag} {shown_path(path)}: cannot write{via}: {reason_of(exc)}") from None


def check_target(path: str, flag: str = "-o") -> str:
    """Return the real path that `-o path` replaces, or raise OutputError saying why it cannot.

    Cheap (no writing), so a command can call it before spending time on the build.
    """
    shown = shown_path(path)
    if path == "":
        raise OutputError(f"{flag} needs a file name, got an empty one{_dash_hint(flag)}")
    if path.endswith(("/", os.sep)) and not os.path.isdir(path):
        raise OutputError(f"{flag} {shown} ends in '/', so it names a folder, not a file")
    try:
        info: os.stat_result | None = os.stat(path)  # the kernel follows the links
    except FileNotFoundError:
        info = None
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            raise OutputError(f"{flag} {shown}: {_file_in_the_way(path)} is not a folder") from None
        raise OutputError(f"{flag} {shown}: {reason_of(exc)}") from None
    try:
        target = os.path.realpath(path)
    except OSError as exc:  # the working folder was deleted
        raise OutputError(f"{flag} {shown}: {reason_of(exc)}") from None
    if target == os.devnull:
        return target  # `-o /dev/null` discards the output, as `> /dev/null` does
    if info is not None:
        _check_existing(flag, shown, target, info)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise OutputError(f"{flag} {shown}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {shown}: cannot create files in folder {folder} (permission denied)")
    return target


def _check_existing(flag: str, shown: str, target: str, info: os.stat_result) -> None:
    """Raise OutputError unless the existing file `flag` names is a regular file we may replace."""
    if stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{flag} {shown} is a folder, not a file")
    for test, kind in _KINDS.items():
        if test(info.st_mode):
            raise OutputError(
                f"{flag} {shown} is {kind}, not a regular file; {flag} writes regular files "
                f"only{_dash_hint(flag)}"
            )
    if not os.access(target, os.W_OK):
        raise OutputError(f"{flag} {shown} is read-only (permission denied)")


def _dash_hint(flag: str) -> str:
    return " (use -o - for standard output)" if flag == "-o" else ""


def _file_in_the_way(path: str) -> str:
    """Return the nearest existing parent of path (a file where a folder should be)."""
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return shown_path(parent)


class _CannotCreate(OSError):
    """The temporary file could not be created in the target's folder."""


def replace_file(target: str, data: bytes) -> None:
    """Write data to a temporary file beside target and rename it over target (raises OSError)."""
    import tempfile  # here, not at the top: it costs every run's start-up a few milliseconds

    mode, owner = _keep_mode(target)
    folder = os.path.dirname(target)
    remove_stale_temporaries(folder)
    with write_guard():
        try:
            handle, temporary = tempfile.mkstemp(
                prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-", suffix=".tmp", dir=folder
            )
        except OSError as exc:
            raise _CannotCreate(exc.errno, exc.strerror, exc.filename) from exc
        try:
            with signals_released(), os.fdopen(handle, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fchmod(stream.fileno(), mode)
                if owner is not None:
                    with contextlib.suppress(OSError):
                        os.fchown(stream.fileno(), *owner)
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def _keep_mode(target: str) -> tuple[int, tuple[int, int] | None]:
    """Return the mode (and owner, group) the new file gets: the old file's, else the umask's."""
    try:
        info = os.stat(target)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask, None
    return stat.S_IMODE(info.st_mode), (info.st_uid, info.st_gid)


MAX_INPUT_BYTES = 64 << 20  # a file read in: configs, scripts, tables, tokenizers (docs/limits.md)
IDLE_SECONDS = 10.0  # a pipe or fifo that sends nothing for this long is refused, never waited on


def read_text(path: str) -> str:
    """Return a file's text (`-` is standard input), or raise InputError naming it.

    Line endings are normalised to `\\n` and a leading UTF-8 byte-order mark is dropped, so a
    table checked out with CRLF line endings, or saved by an editor that adds a BOM, reads as
    the same table.
    """
    shown = "- (standard input)" if path == STDIO else shown_path(path)
    data = read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = "" if path == STDIO else f"byte {exc.start}: "
        raise InputError(f"{shown} is not UTF-8 text ({where}{exc.reason})") from None
    return _without_bom(text.replace("\r\n", "\n").replace("\r", "\n"))


def read_bytes(path: str, limit: int = MAX_INPUT_BYTES) -> bytes:
    """Return a file's bytes (`-` is standard input), or raise InputError naming it, within
    bounds: at most `limit` bytes (an endless file is refused, not read into memory), and a pipe
    or fifo that sends nothing for IDLE_SECONDS is refused (a fifo nobody writes would otherwise
    wait forever). A device is refused; a fifo is opened without waiting for its writer."""
    shown = "- (standard input)" if path == STDIO else shown_path(path)
    if path == STDIO:
        if sys.stdin is None:
            raise InputError("- (standard input) is closed")
        try:
            fd = sys.stdin.fileno()
        except (OSError, ValueError, AttributeError):  # replaced by a non-file stream
            return str(sys.stdin.read(limit + 1)).encode("utf-8", "surrogateescape")[: limit + 1]
        return _read_fd(fd, shown, limit, os.isatty(fd))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise InputError(f"{shown} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{shown} is a folder, not a file") from None
    except OSError as exc:
        raise InputError(f"{shown} cannot be read ({reason_of(exc)})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{shown} is a folder, not a file")
        if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
            raise InputError(f"{shown} is a device, not a file")
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise InputError(f"{shown} is {info.st_size:,} bytes; files read in are at most "
                             f"{limit:,} bytes (docs/limits.md)")  # fmt: skip
        return _read_fd(fd, shown, limit, False)
    finally:
        os.close(fd)


def _read_fd(fd: int, shown: str, limit: int, terminal: bool) -> bytes:
    """Read fd to its end, at most limit bytes, waiting at most IDLE_SECONDS for each chunk
    (a terminal waits for its user)."""
    import select

    chunks: list[bytes] = []
    total = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        if not terminal and not poller.poll(int(IDLE_SECONDS * 1000)):
            raise InputError(f"{shown} sent nothing for {IDLE_SECONDS:g} seconds (a pipe or fifo "
                             "that nothing writes to?)")  # fmt: skip
        try:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
        except BlockingIOError:
            continue
        except OSError as exc:
            raise InputError(f"{shown} cannot be read ({reason_of(exc)})") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise InputError(f"{shown} holds more than {limit:,} bytes; files read in are at "
                             "most that (docs/limits.md)")  # fmt: skip


def _without_bom(text: str) -> str:
    return text[1:] if text.startswith("\ufeff") else text


def shown_path(path: str, limit: int = 80) -> str:
    """Return a path as a message shows it: shortened in the middle when very long."""
    if len(path) <= limit:
        return path
    return f"{path[: limit // 2]}...{path[-(limit // 2) :]} ({len(path)} characters)"


def reason_of(exc: OSError) -> str:
    """Return an OSError's reason in words, lower case, without the path it repeats."""
    if exc.errno == errno.ENOENT and exc.filename in (None, "", "."):
        return "the working folder no longer exists"
    words = exc.strerror or str(exc) or exc.__class__.__name__
    return words[:1].lower() + words[1:]


# --- standard streams ---------------------------------------------------------------------


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
