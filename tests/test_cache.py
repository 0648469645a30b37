"""The result cache: a hit is the same text without torch; any change to the key misses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from inspector import cache, world

SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000 --pp 2".split()


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("INSPECT_MODEL_NO_CACHE", "0")
    return tmp_path / "inspect-model"


def test_hit_gives_the_same_text_without_building(cli, cache_on, monkeypatch):
    cold = cli("params", *SMALL)
    assert cold.code == 0 and len(list(cache_on.iterdir())) == 1

    def no_building(*args, **kwargs):
        raise AssertionError("a cache hit must not build")

    monkeypatch.setattr(world, "build_stage", no_building)
    assert cli("params", *SMALL).out == cold.out
    with pytest.raises(AssertionError, match="must not build"):
        cli("params", *SMALL, "--no-cache")  # bypasses the cache, so it builds


def test_errors_are_not_cached(cli, cache_on):
    assert cli("params", *SMALL, "--tp", "3").code == 2
    assert not cache_on.exists() or list(cache_on.iterdir()) == []


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
