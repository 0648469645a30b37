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
