"""The result cache: a hit is the same text without torch; any change to the key misses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inspector.cli import cache
from inspector.world import stage as world

SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000 --pp 2".split()


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("INSPECT_MODEL_NO_CACHE", "0")
    return tmp_path / "inspect-model"


def test_hit_gives_the_same_text_without_building(cli, cache_on, monkeypatch):
    cold = cli("params", *SMALL)
    assert cold.code == 0 and len(list(cache_on.glob("*.txt"))) == 1

    def no_building(*args, **kwargs):
        raise AssertionError("a cache hit must not build")

    monkeypatch.setattr(world, "build_stage", no_building)
    assert cli("params", *SMALL).out == cold.out
    with pytest.raises(AssertionError, match="must not build"):
        cli("params", *SMALL, "--no-cache")  # bypasses the cache, so it builds


def test_errors_are_not_cached(cli, cache_on):
    assert cli("params", *SMALL, "--tp", "3").code == 2
    assert not cache_on.exists() or list(cache_on.glob("*.txt")) == []


BASE = ("params", {"num_layers": 2}, {"stage": None, "rank": None, "fmt": "csv"})


@pytest.mark.parametrize(
    "change",
    [
        lambda c, a, o: ("tree", a, o),
        lambda c, a, o: (c, {**a, "num_layers": 3}, o),
        lambda c, a, o: (c, {**a, "apex": False}, o),
        lambda c, a, o: (c, {**a, "data_parallel_size": 2}, o),
        lambda c, a, o: (c, a, {**o, "stage": 1}),
        lambda c, a, o: (c, a, {**o, "rank": 0}),
        lambda c, a, o: (c, a, {**o, "fmt": "json"}),
        lambda c, a, o: (c, a, {**o, "partitioning": "cost"}),
        lambda c, a, o: (c, a, {**o, "block_size": 128}),
    ],
)
def test_any_change_to_the_request_misses(change):
    assert cache.key(*change(*BASE)) != cache.key(*BASE)


@pytest.mark.parametrize("what", ["tool", "sources", "megatron-core", "torch"])
def test_any_change_of_versions_misses(what, monkeypatch):
    before = cache.key(*BASE)
    if what == "tool":
        monkeypatch.setattr(cache, "__version__", "9.9.9")
    elif what == "sources":
        monkeypatch.setattr(cache, "_source_hash", lambda: "edited")
    else:
        real = cache._installed
        monkeypatch.setattr(cache, "_installed", lambda p: "0.0" if p == what else real(p))
    assert cache.key(*BASE) != before


@pytest.mark.slow
def test_a_hit_does_not_import_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "INSPECT_MODEL_NO_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    code = (
        "import sys; from inspector.cli import main; main(['params', *sys.argv[1:]]);"
        "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)"
    )
    cold = subprocess.run(
        [sys.executable, "-c", code, *SMALL], capture_output=True, text=True, env=env
    )
    warm = subprocess.run(
        [sys.executable, "-c", code, *SMALL], capture_output=True, text=True, env=env
    )
    assert cold.stderr.endswith("torch imported: True\n")
    assert warm.stderr.endswith("torch imported: False\n")
    assert warm.stdout == cold.stdout and warm.stdout.count("\n") > 20


# --- integrity: a damaged entry is a miss, never an answer (issue #16 category 5) ---------

TEXT = "{ProcessCoord(pipe=0, data=0, model=0): 0}\nname;module;shape\n█ bars ▏\n"


def test_entry_round_trips():
    assert cache.decode(cache.encode(TEXT)) == TEXT
    assert cache.encode(TEXT).startswith(b"inspect-model cache 3 mac=")


def _damage(kind: str, raw: bytes) -> bytes:
    header, _, body = raw.partition(b"\n")
    return {
        "cut-short": raw[: len(raw) - 7],
        "cut-in-header": raw[:20],
        "empty": b"",
        "garbage": b"\x00\xff garbage \x13" * 10,
        "appended": raw + b"extra line\n",
        "body-edited": header + b"\n" + body.replace(b"bars", b"barz"),
        "utf16": raw.decode("utf-8").encode("utf-16"),
        "crlf": raw.replace(b"\n", b"\r\n"),
        "no-header": body,
        "old-format": TEXT.encode(),
        "wrong-length": header.replace(b"length=", b"length=1") + b"\n" + body,
        "wrong-sha": header.replace(b"mac=", b"mac=0") + b"\n" + body,
        "other-version": header.replace(b"cache 3", b"cache 2") + b"\n" + body,
        "extra-field": header + b" more=1\n" + body,
    }[kind]


DAMAGE = [
    "cut-short", "cut-in-header", "empty", "garbage", "appended", "body-edited", "utf16", "crlf",
    "no-header", "old-format", "wrong-length", "wrong-sha", "other-version", "extra-field",
]


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_entry_is_not_decoded(kind):
    assert cache.decode(_damage(kind, cache.encode(TEXT))) is None


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_entry_is_a_miss_and_is_replaced(cli, cache_on, kind):
    cold = cli("params", *SMALL)
    (entry,) = cache_on.glob("*.txt")
    entry.write_bytes(_damage(kind, entry.read_bytes()))
    again = cli("params", *SMALL)
    assert (again.code, again.out) == (0, cold.out)
    secret = (cache_on / cache.SECRET).read_bytes()
    assert cache.decode(entry.read_bytes(), entry.stem, secret) == cold.out  # replaced


def test_entry_that_is_a_folder_or_fifo_is_a_miss(cli, cache_on):
    cold = cli("params", *SMALL)
    (entry,) = cache_on.glob("*.txt")
    entry.unlink()
    os.mkfifo(entry)  # reading it would block forever
    assert cli("params", *SMALL).out == cold.out
    entry.unlink()
    entry.mkdir()
    assert cli("params", *SMALL).out == cold.out and entry.is_dir()


def test_cache_folder_that_is_a_file_is_skipped(cli, cache_on):
    cache_on.parent.mkdir(exist_ok=True)
    cache_on.write_text("not a folder\n")
    result = cli("params", *SMALL)
    assert result.code == 0 and result.out.count("\n") > 10
    assert cache_on.read_text() == "not a folder\n"


def test_entry_write_leaves_no_temporary(cli, cache_on):
    cli("params", *SMALL)
    names = sorted(p.name for p in cache_on.iterdir())
    assert names == sorted([cache.SECRET, *(f"{p.stem}.txt" for p in cache_on.glob("*.txt"))])


def test_an_entry_edited_with_its_checksum_recomputed_is_a_miss(cli, cache_on):
    # issue #46: a sha256 anyone can recompute let an edited entry be printed as the answer; the
    # header's MAC needs the secret beside the entries, so an edit is a miss and is rebuilt
    cold = cli("params", *SMALL)
    (entry,) = cache_on.glob("*.txt")
    edited = cold.out.replace("decoder.layers", "decoder.lawyers")
    entry.write_bytes(cache.encode(edited, entry.stem, b"not the secret"))
    again = cli("params", *SMALL)
    assert (again.code, again.out) == (0, cold.out)


@pytest.mark.parametrize("damage", ["short", "folder", "empty"])
def test_a_damaged_secret_is_replaced_and_every_entry_rebuilt(cli, cache_on, damage):
    cold = cli("params", *SMALL)
    secret = cache_on / cache.SECRET
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 32
    secret.unlink()
    if damage == "folder":
        secret.mkdir()
    else:
        secret.write_bytes(b"abc" if damage == "short" else b"")
    again = cli("params", *SMALL)
    assert (again.code, again.out) == (0, cold.out)
    if damage != "folder":  # a folder in its place cannot be replaced: the cache is not used
        assert len(secret.read_bytes()) == 32


def test_an_entry_copied_over_another_commands_is_a_miss(cli, cache_on):
    # issue #30: the header binds an entry to its key, so another command's entry, copied over
    # this one (whole and with a valid checksum), is never served as this command's output.
    params = cli("params", *SMALL)
    tree = cli("tree", *SMALL)
    entries = sorted(cache_on.glob("*.txt"), key=lambda p: p.stat().st_mtime_ns)
    assert len(entries) == 2
    entries[0].write_bytes(entries[1].read_bytes())  # tree's entry under params' key
    again = cli("params", *SMALL)
    assert (again.code, again.out) == (0, params.out) and again.out != tree.out


def test_a_huge_damaged_entry_is_a_miss_without_reading_it(cli, cache_on):
    # issue #30: a 6 GiB sparse entry was read whole (MemoryError) before its header was checked.
    cold = cli("params", *SMALL)
    (entry,) = cache_on.glob("*.txt")
    with open(entry, "r+b") as stream:
        stream.truncate(6 << 30)
    assert cli("params", *SMALL).out == cold.out
    assert entry.stat().st_size < 1 << 20  # replaced by the fresh result


@pytest.mark.parametrize("value", ["relative/cache", "."])
def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path, value):
    # The XDG Base Directory rule: a relative path in XDG_CACHE_HOME is invalid and ignored.
    monkeypatch.setenv("XDG_CACHE_HOME", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.directory() == tmp_path / ".cache" / "inspect-model"


def test_the_docs_name_the_commands_that_are_cached():
    # docs/inputs.md said only tree, topology and params were cached; memory and workload are too
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = "".join(path.read_text() for path in (root / "inspector" / "cli").glob("*.py"))
    cached = re.findall(r'cache\.cached\(\s*"(\w+)"', code)
    page = (root / "docs" / "inputs.md").read_text()
    sentence = page.split("**The result cache.**")[1].split(" keep their output")[0]
    assert sorted(re.findall(r"`(\w+)`", sentence)) == sorted(cached)


def test_a_hit_still_says_the_inputs_notes(cli, cache_on):
    # the merge's notes are held until the job is accepted (a refused job prints its Error: line
    # alone); a hit was accepted when it was made, so it says them as the cold run did
    hf = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "llama3.1-8b.json")
    args = ("params", "--hf-config", hf, "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--num-query-groups", "4", "--ffn-hidden-size", "128",
            "--vocab-size", "1000")  # fmt: skip
    cold, hot = cli(*args), cli(*args)
    assert cold.code == hot.code == 0, cold.err
    assert "Ignored from" in cold.err and "Note from" in cold.err
    assert hot.err == cold.err and hot.out == cold.out
