"""A result cache for tree/topology/params text, so repeated questions skip torch altogether.

The key is a hash of everything that determines the output: the command and its options, the
merged Megatron-LM arguments (presets, config files and scripts already resolved), this tool's
version and a hash of its own source files, and the installed megatron-core and torch versions
(read from package metadata, which imports neither). Entries live in the user's cache directory
($XDG_CACHE_HOME/inspect-model, else ~/.cache/inspect-model); `--no-cache` bypasses it and
INSPECT_MODEL_NO_CACHE=1 turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    root = Path(__file__).resolve().parent
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


def load(entry: str) -> str | None:
    """Return a cached output, or None."""
    try:
        return (directory() / f"{entry}.txt").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def store(entry: str, text: str) -> None:
    """Save an output; a cache that cannot be written is silently skipped."""
    from inspector.output import write_atomic

    try:
        directory().mkdir(parents=True, exist_ok=True)
        write_atomic(str(directory() / f"{entry}.txt"), text)
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
