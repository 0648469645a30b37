"""A result cache for tree/topology/params text, so repeated questions skip torch altogether.

The key is a hash of everything that determines the output: the command and its options, the
merged Megatron-LM arguments (presets, config files and scripts already resolved), this tool's
version and a hash of its own source files, and the installed megatron-core and torch versions
(read from package metadata, which imports neither). Entries live in the user's cache directory
($XDG_CACHE_HOME/inspect-model, else ~/.cache/inspect-model); `--no-cache` bypasses it and
INSPECT_MODEL_NO_CACHE=1 turns it off.

Each entry starts with a header line carrying the sha256 and byte length of the text after it,
checked on every load: an entry cut short, overwritten or re-encoded is a miss, never an answer,
and the fresh result replaces it. Entries are written atomically (temporary file, rename).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from inspector import __version__


def directory() -> Path:
    """Return the cache folder (not created until something is stored)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "inspect-model"


def enabled() -> bool:
    """Return whether the cache is on (INSPECT_MODEL_NO_CACHE turns it off)."""
    return os.environ.get("INSPECT_MODEL_NO_CACHE", "") in ("", "0")


@cache
def _source_hash() -> str:
    """Hash this package's Python sources, so any change to the tool misses the cache."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent  # the whole inspector package
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def key(command: str, args: dict[str, Any], options: dict[str, Any]) -> str:
    """Return the cache key for one command's output."""
    material = {
        "command": command,
        "args": args,
        "options": options,
        "tool": __version__,
        "sources": _source_hash(),
        "megatron-core": _installed("megatron-core"),
        "torch": _installed("torch"),
    }
    text = json.dumps(material, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


FORMAT = "inspect-model cache 1"


def encode(text: str) -> bytes:
    """Return an entry's bytes: a header line with the text's sha256 and length, then the text."""
    data = text.encode("utf-8", "surrogateescape")
    header = f"{FORMAT} sha256={hashlib.sha256(data).hexdigest()} length={len(data)}\n"
    return header.encode("ascii") + data


def decode(raw: bytes) -> str | None:
    """Return the text of an entry's bytes, or None unless the header vouches for every byte.

    An entry cut short, padded, overwritten with garbage, re-encoded or empty is a miss.
    """
    header, newline, data = raw.partition(b"\n")
    if not newline:
        return None
    fields = header.decode("ascii", "replace").split(" ")
    if " ".join(fields[:3]) != FORMAT or len(fields) != 5:
        return None
    expected = {"sha256": hashlib.sha256(data).hexdigest(), "length": str(len(data))}
    for field in fields[3:]:
        name, _, value = field.partition("=")
        if expected.pop(name, None) != value:
            return None
    if expected:
        return None
    return data.decode("utf-8", "surrogateescape")


def _path(entry: str) -> Path:
    return directory() / f"{entry}.txt"


def load(entry: str) -> str | None:
    """Return a cached output, or None (a miss) when absent, unreadable or damaged."""
    path = _path(entry)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None  # never read a fifo or a device that took an entry's name
        raw = path.read_bytes()
    except OSError:
        return None
    return decode(raw)


def store(entry: str, text: str) -> None:
    """Save an output (replacing a damaged entry); a cache that cannot be written is skipped."""
    from inspector.output import replace_file

    try:
        directory().mkdir(parents=True, exist_ok=True)
        replace_file(str(_path(entry)), encode(text))
    except OSError:
        pass


def cached(
    command: str,
    args: dict[str, Any],
    options: dict[str, Any],
    use_cache: bool,
    produce: Callable[[], str],
) -> str:
    """Return a command's output from the cache, or produce (and store) it."""
    if not (use_cache and enabled()):
        return produce()
    entry = key(command, args, options)
    hit = load(entry)
    if hit is not None:
        return hit
    text = produce()
    store(entry, text)
    return text
