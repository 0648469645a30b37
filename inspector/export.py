"""`-o DIR`: write an export (several files and an index naming them) into a folder, whole.

What a user may expect of `workload -o DIR` (docs/output.md):
- DIR may be new or an existing folder (or a symlink to one, which stays a link). Files in it that
  are not the export's own stay as they were; the export's own are the index (`index.csv`, its
  header the one we write) and the files that index names, i.e. a previous export. A file of
  another origin where the new export puts one of its names is refused, never overwritten.
- The folder keeps its mode and owner; a new folder gets the umask's mode, as `mkdir` gives.
- Readers see the previous export or the new one, never a mix: the new files and hard links to
  the folder's other files are put in a new folder beside DIR, which is exchanged with DIR in one
  step (Linux renameat2 RENAME_EXCHANGE), and the old folder is then removed. SIGINT, SIGTERM and
  SIGHUP are held until that is done. SIGKILL cannot be held: it can leave a `.inspect-model-PID-*`
  folder beside DIR (with DIR whole, old or new), which the next write there removes once
  process PID is gone.
- Where the exchange cannot be made (no renameat2, DIR a mount point, a subfolder or another
  user's file in DIR, a parent folder we may not write), the files are replaced one by one, each
  atomically, the index last; then only SIGKILL at the wrong moment can leave a mix.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import errno
import os
import shutil
import stat
import tempfile

from inspector.errors import OutputError
from inspector.guard import (
    TEMPORARY_PREFIX,
    remove_stale_temporaries,
    signals_released,
    write_guard,
)
from inspector.output import reason_of, replace_file, shown_path

_RENAME_EXCHANGE = 2  # linux/fs.h


class _NoExchange(OSError):
    """renameat2 RENAME_EXCHANGE is not available here (old kernel or C library, file system)."""
_AT_FDCWD = -100


def write_export(path: str, files: dict[str, str], index: str = "index.csv") -> None:
    """Write `files` (name -> text; `index` lists the others in a `file` column) into folder path."""
    shown = shown_path(path)
    target = check_export_target(path)
    strays = sorted(name for name in files if not plain_name(name))
    if strays or index not in files:
        stray = f"a file named {strays[0]!r}" if strays else f"no {index}"
        raise OutputError(f"-o {shown}: the export holds {stray}, not a file name in the folder; "
                          "nothing was written (a damaged result cache? run with --no-cache)")  # fmt: skip
    try:
        new = not os.path.isdir(target)
        existing = {} if new else _existing_entries(target)
        own = _previous_export(target, existing, files[index], index)
        clashes = sorted(name for name in files if name in existing and name not in own)
        if clashes:
            raise OutputError(
                f"-o {shown} already holds {clashes[0]}, which no earlier inspect-model export "
                "there wrote; move it or give another folder"
            )
        keep = sorted(set(existing) - own - set(files))
        remove_stale_temporaries(os.path.dirname(target))
        if new or _can_exchange(target, keep):
            try:
                return _write_by_exchange(target, files, keep, new)
            except _NoExchange:
                pass  # the file system cannot exchange (EINVAL): write in place
        _write_in_place(target, files, own, index)
    except OSError as exc:
        raise OutputError(f"-o {shown}: cannot write: {reason_of(exc)}") from None


def plain_name(name: object) -> bool:
    """Return whether name is a file name inside a folder: no folder part, not . or .., no NUL."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and os.sep not in name and "\0" not in name)  # fmt: skip


def check_export_target(path: str) -> str:
    """Return the real folder that `-o path` names (it need not exist), or raise OutputError.

    Cheap (no writing), so a command can call it before spending time on the build.
    """
    shown = shown_path(path)
    if path == "":
        raise OutputError("-o needs a folder name, got an empty one")
    try:
        target = os.path.realpath(path)
        info = os.stat(target) if os.path.lexists(target) else None
    except OSError as exc:
        raise OutputError(f"-o {shown}: {reason_of(exc)}") from None
    if info is not None and not stat.S_ISDIR(info.st_mode):
        raise OutputError(f"-o {shown} exists and is not a folder")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise OutputError(f"-o {shown}: folder {parent} does not exist")
    writable = target if info is not None else parent
    if not os.access(writable, os.W_OK | os.X_OK):
        raise OutputError(
            f"-o {shown}: cannot create files in folder {writable} (permission denied)"
        )
    return target


def _existing_entries(target: str) -> dict[str, os.stat_result]:
    """Return the folder's entries: name -> lstat."""
    return {name: os.lstat(os.path.join(target, name)) for name in sorted(os.listdir(target))}


def _previous_export(
    target: str, existing: dict[str, os.stat_result], new_index: str, name: str
) -> set[str]:
    """Return the names a previous export left in the folder: its index and the files listed."""
    if not existing or name not in existing or not stat.S_ISREG(existing[name].st_mode):
        return set()
    with open(os.path.join(target, name), encoding="utf-8", errors="replace") as stream:
        head = stream.read(1 << 20)
    rows = list(csv.reader(head.splitlines()))
    if not rows or rows[0] != next(csv.reader(new_index.splitlines())) or "file" not in rows[0]:
        return set()
    column = rows[0].index("file")
    listed = {row[column] for row in rows[1:] if len(row) > column}
    return {name} | {n for n in listed if n in existing and plain_name(n)}


def _can_exchange(target: str, keep: list[str]) -> bool:
    """Return whether the folder can be rebuilt beside itself and exchanged in one step."""
    if os.path.ismount(target) or not os.access(os.path.dirname(target), os.W_OK | os.X_OK):
        return False
    info = os.stat(target)
    if info.st_uid != os.geteuid() or _renameat2() is None:
        return False
    for name in keep:
        entry = os.lstat(os.path.join(target, name))
        if not (stat.S_ISREG(entry.st_mode) or stat.S_ISLNK(entry.st_mode)):
            return False
        if entry.st_uid != os.geteuid():
            return False  # a protected-hardlinks kernel refuses to link another user's file
    return True


def _write_by_exchange(target: str, files: dict[str, str], keep: list[str], new: bool) -> None:
    """Build the folder anew beside target, then exchange the two (or rename, where new)."""
    parent = os.path.dirname(target)
    with write_guard():
        staging = tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-", dir=parent)
        try:
            for name in keep:
                os.link(os.path.join(target, name), os.path.join(staging, name), follow_symlinks=False)
            with signals_released():
                _write_files(staging, files)
            if new:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(staging, 0o777 & ~umask)
                os.rename(staging, target)
                return
            info = os.stat(target)
            os.chmod(staging, stat.S_IMODE(info.st_mode))
            with contextlib.suppress(OSError):
                os.chown(staging, info.st_uid, info.st_gid)
            _exchange(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(staging, ignore_errors=True)  # the previous export, now at staging


def _write_files(folder: str, files: dict[str, str]) -> None:
    for name, text in files.items():
        with open(os.path.join(folder, name), "x", encoding="utf-8", newline="\n") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())


def _write_in_place(target: str, files: dict[str, str], own: set[str], index: str) -> None:
    """Replace the export's files one by one, each atomically, the index last; drop stale ones."""
    with write_guard():
        for name, text in files.items():
            if name != index:
                replace_file(os.path.join(target, name), text.encode("utf-8"))
        for name in sorted(own - set(files)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(target, name))
        replace_file(os.path.join(target, index), files[index].encode("utf-8"))


def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None


def _exchange(first: str, second: str) -> None:
    """Swap two paths in one step (renameat2 RENAME_EXCHANGE), or raise OSError."""
    function = _renameat2()
    if function is None:
        raise _NoExchange(errno.ENOSYS, "renameat2 is not available")
    done = function(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if done != 0:
        code = ctypes.get_errno()
        kind = _NoExchange if code in (errno.EINVAL, errno.ENOSYS, errno.EXDEV) else OSError
        raise kind(code, os.strerror(code))
