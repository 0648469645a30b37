"""Files in and out: atomic writes (`-o`), and reads that fail with a clear error."""

from __future__ import annotations

import os
import sys
import tempfile

from inspector.errors import InputError


def write_atomic(path: str, text: str) -> None:
    """Write text to path via a temporary file in the same folder and a rename.

    Either the whole new file appears or the old one stays as it was.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"-o {path}: folder {folder} does not exist")
    handle, temporary = tempfile.mkstemp(prefix=".inspect-model-", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def read_text(path: str) -> str:
    """Return a file's text (`-` is standard input), or raise InputError naming it."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as stream:
            return stream.read()
    except FileNotFoundError:
        raise InputError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{path} is a folder, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} cannot be read ({exc.__class__.__name__}: {exc})") from None


def write_directory_atomic(path: str, files: dict[str, str]) -> None:
    """Write `files` (name -> text) as folder `path`: all of them appear at once, or none.

    They are written into a new temporary folder beside `path`, which then replaces it; an
    existing folder is replaced only if it holds nothing but files of those names (a previous
    export), so no other folder is ever removed.
    """
    import shutil

    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise InputError(f"-o {path}: folder {parent} does not exist")
    if os.path.lexists(target) and not os.path.isdir(target):
        raise InputError(f"-o {path}: exists and is not a folder")
    if os.path.isdir(target) and not set(os.listdir(target)) <= set(files):
        raise InputError(f"-o {path}: the folder holds other files; give a new or empty folder")
    staging = tempfile.mkdtemp(prefix=".inspect-model-", dir=parent)
    try:
        for name, text in files.items():
            with open(os.path.join(staging, name), "w", encoding="utf-8", newline="\n") as stream:
                stream.write(text)
        if os.path.isdir(target):
            old = tempfile.mkdtemp(prefix=".inspect-model-old-", dir=parent)
            os.replace(target, os.path.join(old, "previous"))
            os.replace(staging, target)
            shutil.rmtree(old)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
