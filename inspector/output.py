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

Standard output and error themselves are guarded by inspector/cli/streams.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from inspector.errors import InputError, OutputError
from inspector.guard import (
    TEMPORARY_PREFIX,
    remove_stale_temporaries,
    signals_released,
    write_guard,
)

STDIO = "-"
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
    write_files([(flag, path, text)])


def write_files(outputs: Sequence[tuple[str, str, str | bytes]]) -> None:
    """Write one command's files (flag, path, text) all or nothing, or raise OutputError.

    Every target is checked (check_targets: two flags naming one file are refused) and every
    file staged beside its target before the first is renamed into place, so a failure (a full
    disk, a signal) leaves every target as it was; the renames run with signals held.
    """
    targets = check_targets([(flag, path) for flag, path, _ in outputs])
    for target in targets:
        remove_stale_temporaries(os.path.dirname(target))
    staged: list[tuple[str, str, str, str]] = []  # flag, path, temporary, target
    with write_guard():
        try:
            for (flag, path, text), target in zip(outputs, targets, strict=True):
                if target != os.devnull:
                    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")
                    with _named(flag, path, target):
                        staged.append((flag, path, stage_file(target, data), target))
            for flag, path, temporary, target in staged:
                with _named(flag, path, target):
                    os.replace(temporary, target)
        except BaseException:
            for _, _, temporary, _ in staged:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
            raise


@contextlib.contextmanager
def _named(flag: str, path: str, target: str) -> Iterator[None]:
    """Turn an OSError writing `flag path` into OutputError saying so."""
    try:
        yield
    except _CannotCreate as exc:
        folder = os.path.dirname(target)
        raise OutputError(
            f"{flag} {shown_path(path)}: cannot create a file in folder {folder} ({reason_of(exc)})"
        ) from None
    except OSError as exc:
        via = "" if os.path.abspath(path) == target else f" (the target of the link, {target})"
        raise OutputError(f"{flag} {shown_path(path)}: cannot write{via}: {reason_of(exc)}") from None


def check_targets(outputs: Sequence[tuple[str, str]]) -> list[str]:
    """Return the real paths that the flags' files replace, or raise OutputError: each as
    check_target, and no two naming one file (the second would overwrite the first)."""
    targets: list[str] = []
    seen: dict[Any, tuple[str, str]] = {}
    for flag, path in outputs:
        if path == STDIO and flag != "-o":  # it would be a file named '-' beside the report
            raise OutputError(f"{flag} - would write a file named '-', not standard output (which "
                              f"-o - gives the report); name a file (./- for that one)")  # fmt: skip
        target = check_target(path, flag)
        if target == os.devnull:
            targets.append(target)
            continue
        identity = _identity(target)  # a hard link names an existing file twice
        read = _READ.get(identity) if identity is not None else None
        if read is not None:
            raise OutputError(f"{flag} {shown_path(path)} would replace {shown_path(read)}, a file "
                              "this command reads; give the output another name")  # fmt: skip
        for name in (target, identity):
            if name in seen:
                other, other_path = seen[name]
                raise OutputError(f"{flag} {shown_path(path)} and {other} {shown_path(other_path)} "
                                  "name the same file; give each its own")  # fmt: skip
        seen[target] = (flag, path)
        if identity is not None:
            seen[identity] = (flag, path)
        targets.append(target)
    return targets


# The files this command has read (configs, scripts, tokenizers, logs): (device, inode) -> the name
# given. An output that would replace one is refused: the input is the user's, not a draft.
_READ: dict[tuple[int, int], str] = {}


def forget_reads() -> None:
    """Start a command with no files read (the CLI's entry point; tests run several in one process)."""
    _READ.clear()


def _identity(target: str) -> tuple[int, int] | None:
    try:
        info = os.stat(target)
    except OSError:
        return None  # not there yet
    return (info.st_dev, info.st_ino)


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
    remove_stale_temporaries(os.path.dirname(target))
    with write_guard():
        temporary = stage_file(target, data)
        try:
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise


def stage_file(target: str, data: bytes) -> str:
    """Return a temporary file beside target holding data, with the mode (and owner) target
    keeps, for the caller to rename over target inside its write_guard() (raises OSError, the
    temporary removed; _CannotCreate where none can be made)."""
    import tempfile  # here, not at the top: it costs every run's start-up a few milliseconds

    mode, owner = _keep_mode(target)
    try:
        handle, temporary = tempfile.mkstemp(
            prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-", suffix=".tmp", dir=os.path.dirname(target)
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
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return temporary


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
    return _read_path(path, shown, limit)


def _read_path(path: str, shown: str, limit: int, head: bool = False) -> bytes:
    """Read a named file as read_bytes does (`head`: its first limit + 1 bytes, as read_head)."""
    with _opening(shown):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{shown} is a folder, not a file")
        if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode):
            raise InputError(f"{shown} is a device, not a file")
        if stat.S_ISREG(info.st_mode):
            _READ[(info.st_dev, info.st_ino)] = path
        if not head and stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise InputError(f"{shown} is {info.st_size:,} bytes; files read in are at most "
                             f"{limit:,} bytes (docs/limits.md)")  # fmt: skip
        return _read_fd(fd, shown, limit, False, head)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _opening(shown: str) -> Iterator[None]:
    """Turn an OS error opening or reading `shown` into InputError naming it (read_bytes,
    read_head)."""
    try:
        yield
    except FileNotFoundError:
        raise InputError(f"{shown} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{shown} is a folder, not a file") from None
    except OSError as exc:
        raise InputError(f"{shown} cannot be read ({reason_of(exc)})") from None


def _read_fd(fd: int, shown: str, limit: int, terminal: bool, head: bool = False) -> bytes:
    """Read fd to its end, at most limit bytes, waiting at most IDLE_SECONDS for each chunk
    (a terminal waits for its user); `head`: return the first limit + 1 bytes instead of
    refusing more."""
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
        if total > limit and head:
            return b"".join(chunks)
        if total > limit:
            raise InputError(f"{shown} holds more than {limit:,} bytes; files read in are at "
                             "most that (docs/limits.md)")  # fmt: skip


def read_head(path: str, limit: int) -> tuple[str, bool]:
    """Return at most `limit` bytes of a file (`-`: standard input) as text, and whether there
    was more: a log that never ends (a FIFO, a file still growing) is read that far and no
    further; a fifo that sends nothing for IDLE_SECONDS is refused by name. Bytes that are not
    UTF-8 read as U+FFFD; raise InputError naming a file that cannot be read."""
    shown = "- (standard input)" if path == STDIO else shown_path(path)
    with _opening(shown):
        if path == STDIO:
            if sys.stdin is None:
                raise InputError("- (standard input) is closed")
            data = sys.stdin.buffer.read(limit + 1)
        else:  # opened without waiting for a fifo's writer, read as read_bytes reads
            data = _read_path(path, shown, limit, head=True)
    text = data[:limit].decode("utf-8", errors="replace").replace("\r\n", "\n")
    return _without_bom(text), len(data) > limit


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
