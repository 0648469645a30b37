"""A result cache for tree/topology/params text, so repeated questions skip torch altogether.

The key is a hash of everything that determines the output: the command and its options, the
merged Megatron-LM arguments (presets, config files and scripts already resolved), this tool's
version and a hash of its own source files, and the installed megatron-core and torch versions
(read from package metadata, which imports neither). Entries live in the user's cache directory
($XDG_CACHE_HOME/inspect-model, else ~/.cache/inspect-model); `--no-cache` bypasses it and
INSPECT_MODEL_NO_CACHE=1 turns it off.

Each entry starts with a header line carrying an HMAC-SHA256 of the entry's key and the text
after it, under a random secret kept beside the entries (`secret.key`, made on first use, mode
0600), and the text's byte length, checked on every load (the header first, against the file's
size): an entry cut short, overwritten, edited (its checksum recomputed without the secret),
re-encoded or copied over another key's is a miss, never an answer, and the fresh result replaces
it. A damaged secret is replaced, which makes every entry a miss. Entries are written atomically
(temporary file, rename). An entry is text: nothing in it is unpickled or run; `workload`'s file
names are checked before they are trusted (`valid`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
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
    """Return the cache folder (not created until something is stored).

    The XDG rule: an XDG_CACHE_HOME that is not an absolute path is ignored, as is an empty one.
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
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


FORMAT = "inspect-model cache 3"
MAX_HEADER = 256  # bytes: the format, a MAC, a length and a key fit in well under this
SECRET = "secret.key"
SECRET_BYTES = 32


def _secret() -> bytes | None:
    """Return the cache's secret, made (or remade, if damaged) on first use; None if the cache
    folder cannot hold one (the cache is then not used)."""
    path = directory() / SECRET
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb", buffering=0) as stream:
            if stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
                secret = stream.read(SECRET_BYTES + 1)
                if len(secret) == SECRET_BYTES:
                    return secret
    except OSError:
        pass
    secret = os.urandom(SECRET_BYTES)
    temporary = path.with_name(f".{SECRET}.{os.getpid()}")
    try:
        directory().mkdir(parents=True, exist_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as stream:
            stream.write(secret)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        return None
    return secret


def _mac(secret: bytes, entry: str, data: bytes) -> str:
    return hmac.new(secret, entry.encode("ascii", "replace") + b"\n" + data, "sha256").hexdigest()


def encode(text: str, entry: str = "", secret: bytes = b"") -> bytes:
    """Return an entry's bytes: a header line with the MAC of its key and text, the text's
    length and the key, then the text."""
    data = text.encode("utf-8", "surrogateescape")
    header = f"{FORMAT} mac={_mac(secret, entry, data)} length={len(data)} key={entry}\n"
    return header.encode("ascii") + data


def _header_fields(header: bytes) -> dict[str, str] | None:
    """Return a header line's name=value fields, or None unless it is this format's."""
    fields = header.decode("ascii", "replace").split(" ")
    if " ".join(fields[:3]) != FORMAT or len(fields) != 6:
        return None
    pairs = dict(field.partition("=")[::2] for field in fields[3:])
    return pairs if sorted(pairs) == ["key", "length", "mac"] else None


def decode(raw: bytes, entry: str = "", secret: bytes = b"") -> str | None:
    """Return the text of an entry's bytes, or None unless the header vouches for every byte.

    An entry cut short, padded, overwritten with garbage, edited, re-encoded, empty or copied
    from another key (another command's output) is a miss.
    """
    header, newline, data = raw.partition(b"\n")
    fields = _header_fields(header) if newline else None
    if fields is None or fields["key"] != entry or fields["length"] != str(len(data)):
        return None
    if not hmac.compare_digest(fields["mac"], _mac(secret, entry, data)):
        return None
    return data.decode("utf-8", "surrogateescape")


def _path(entry: str) -> Path:
    return directory() / f"{entry}.txt"


def load(entry: str, secret: bytes) -> str | None:
    """Return a cached output, or None (a miss) when absent, unreadable or damaged.

    The header is read and checked against the file's size before the rest is read, so a
    damaged entry of any size costs one short read.
    """
    path = _path(entry)
    try:
        # O_NONBLOCK: opening a fifo that took an entry's name must not wait for a writer.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb", buffering=0) as stream:
            info = os.fstat(stream.fileno())
            if not stat.S_ISREG(info.st_mode):
                return None  # a folder or a device that took an entry's name
            header = stream.readline(MAX_HEADER)
            fields = _header_fields(header.rstrip(b"\n"))
            if fields is None or fields["length"] != str(info.st_size - len(header)):
                return None
            raw = header + stream.read(info.st_size - len(header))
    except OSError:
        return None
    return decode(raw, entry, secret)


def store(entry: str, text: str, secret: bytes) -> None:
    """Save an output (replacing a damaged entry); a cache that cannot be written is skipped."""
    from inspector.output import replace_file

    try:
        directory().mkdir(parents=True, exist_ok=True)
        replace_file(str(_path(entry)), encode(text, entry, secret))
    except OSError:
        pass


def cached(
    command: str,
    args: dict[str, Any],
    options: dict[str, Any],
    use_cache: bool,
    produce: Callable[[], str],
    valid: Callable[[str], bool] = lambda text: True,
) -> str:
    """Return a command's output from the cache, or produce (and store) it.

    `valid`: whether an entry's text is one produce could have made; another (an entry written
    over by someone who fixed its checksum) is a miss, never trusted."""
    secret = _secret() if use_cache and enabled() else None
    if secret is None:
        return produce()
    entry = key(command, args, options)
    hit = load(entry, secret)
    if hit is not None and valid(hit):
        return hit
    text = produce()
    store(entry, text, secret)
    return text
