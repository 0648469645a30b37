"""`inspect-model diff` and `params --check`: golden pairs, exit codes, and bad input."""

from __future__ import annotations

import json

import pytest

SMALL = "--transformer-impl local --num-layers 8 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000 --seq-length 32".split()
PAIRS = {
    "pp2_to_pp4": ("--pp 2 --tp 2", "--pp 4 --tp 2"),
    "tp2_to_tp4": ("--pp 2 --tp 2", "--pp 2 --tp 4"),
    "layer_added": ("--pp 2", "--pp 2 --num-layers 10"),
    "untie": ("--pp 2", "--pp 2 --untie-embeddings-and-output-weights"),
    "dp2_to_dp4": ("--pp 2 --dp 2", "--pp 2 --dp 4"),
    "identical": ("--pp 2", "--pp 2"),
}


def tables(cli, tmp_path, name):
    paths = []
    for side, extra in zip(("old", "new"), PAIRS[name]):
        result = cli("params", *SMALL, *extra.split())
        assert result.code == 0, result.err
        path = tmp_path / f"{name}_{side}.csv"
        path.write_text(result.out)
        paths.append(path)
    return paths


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_diff_golden(cli, golden, tmp_path, monkeypatch, name, fmt):
    monkeypatch.chdir(tmp_path)
    old, new = tables(cli, tmp_path, name)
    result = cli("diff", old.name, new.name, "--format", fmt)
    assert result.code == (0 if name == "identical" else 1), result.err
    golden(f"diff_{name}.{ {'text': 'txt', 'markdown': 'md', 'json': 'json'}[fmt] }", result.out)


def diff_json(cli, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    old, new = tables(cli, tmp_path, name)
    return json.loads(cli("diff", old.name, new.name, "--format", "json").out)


def test_pp_change_says_which_layers_moved_first(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    old, new = tables(cli, tmp_path, "pp2_to_pp4")
    lines = cli("diff", old.name, new.name).out.splitlines()
    # 8 layers: pp2 puts 0-3 | 4-7; pp4 puts 0-1 | 2-3 | 4-5 | 6-7
    # 12 rows per layer: each run of two layers moves 24 parameters
    assert lines[1:4] == ["  layers 2-3: stage 0 -> stage 1 (24 parameters)",
                          "  layers 4-5: stage 1 -> stage 2 (24 parameters)",
                          "  layers 6-7: stage 1 -> stage 3 (24 parameters)"]  # fmt: skip
    # one unit in the summary: 3 runs of 24 and the final norm's 2 rows and the output layer
    assert "  moved between stages: 75 parameters" in lines
    assert lines[7].startswith("  largest stage: stage 0 with ")


def test_tp_change_is_one_pattern_per_parameter_kind(cli, tmp_path, monkeypatch):
    d = diff_json(cli, tmp_path, monkeypatch, "tp2_to_tp4")
    qkv = [
        c
        for c in d["changes"]
        if c["kind"] == "shape" and c["pattern"].endswith("linear_qkv.weight")
    ]
    assert qkv == [{"kind": "shape", "pattern": "decoder.layers.*.self_attention.linear_qkv.weight",
                    "old": "(96, 64)", "new": "(48, 64)", "count": 8, "layers": "0-7"}]  # fmt: skip
    assert d["moves"] == [] and d["added"] == [] and d["removed"] == []


def test_added_layers_are_one_entry(cli, tmp_path, monkeypatch):
    d = diff_json(cli, tmp_path, monkeypatch, "layer_added")
    # 8 -> 10 layers on pp=2: 0-3 | 4-7 becomes 0-4 | 5-9
    assert d["added"] == ["layers 8-9"]
    assert d["moves"] == [{"what": "layer 4", "old": "stage 1", "new": "stage 0", "params": 12}]
    # 12 rows per layer (2 norms x 2, qkv and proj weight and bias, fc1 and fc2 weight and bias)
    assert (d["added_params"], d["removed_params"]) == (24, 0)


def test_untie_adds_the_output_weight_preconditioners(cli, tmp_path, monkeypatch):
    d = diff_json(cli, tmp_path, monkeypatch, "untie")
    precs = [c for c in d["changes"] if c["kind"] == "precs"]
    assert [c["pattern"] for c in precs] == ["output_layer.weight"]
    assert precs[0]["old"] == "[]" and precs[0]["new"].startswith("[torch.Size([1024, 1024])")


def test_dp_change_moves_ownership_only(cli, tmp_path, monkeypatch):
    d = diff_json(cli, tmp_path, monkeypatch, "dp2_to_dp4")
    assert {c["kind"] for c in d["changes"]} == {"owners"}
    assert d["topology"] is not None and d["moves"] == []


def test_one_rank_is_one_rank(cli, tmp_path):
    # issue #46 sweep: "pipe 1 x data 1 x model 1 = 1 ranks"
    for name, extra in (("one", ()), ("two", ("--tp", "2"))):
        assert cli("params", "--num-layers", "2", *extra, "-o", str(tmp_path / f"{name}.csv")).code == 0
    result = cli("diff", str(tmp_path / "one.csv"), str(tmp_path / "two.csv"))
    assert "topology: pipe 1 x data 1 x model 1 = 1 rank -> pipe 1 x data 1 x model 2 = 2 ranks\n" in result.out


def test_json_and_text_inputs_diff_the_same(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for side, extra in zip(("old", "new"), PAIRS["pp2_to_pp4"]):
        (tmp_path / f"{side}.json").write_text(
            cli("params", *SMALL, *extra.split(), "--format", "json").out
        )
        (tmp_path / f"{side}.csv").write_text(cli("params", *SMALL, *extra.split()).out)
    from_json = json.loads(cli("diff", "old.json", "new.json", "--format", "json").out)
    from_text = json.loads(cli("diff", "old.csv", "new.csv", "--format", "json").out)
    for d in (from_json, from_text):
        d.pop("old"), d.pop("new")
    assert from_json == from_text


def test_stdin(cli, tmp_path):
    old, new = tables(cli, tmp_path, "identical")
    result = cli("diff", "-", str(new), stdin=old.read_text())
    assert result.code == 0 and result.out == f"- and {new} are identical\n"


@pytest.mark.parametrize(
    "content, message",
    [
        ("hello\n", "bad.csv is not an inspect-model params table (line 1: expected the header 'name;module;shape;partitioning_ranks;precs', got 'hello')"),
        ("name;module;shape;partitioning_ranks;precs\na;b;(1,);0\n", "bad.csv line 2: expected 5 ';'-separated fields, got 4"),
        ("name;module;shape;partitioning_ranks;precs\na;M();(x);0;[]\n", "bad.csv line 2: expected name;module;(shape);ranks;precs, got 'a;M();(x);0;[]'"),
        ("name;module;shape;partitioning_ranks;precs\na;M();(1,);0;[]\na;M();(1,);0;[]\n", "bad.csv line 3: a already appears on line 2"),
        ("name;module;shape;partitioning_ranks;precs\n# stage zero\n", "bad.csv line 2: expected a '# stage S: ...' comment, got '# stage zero'"),
    ],
)  # fmt: skip
def test_bad_tables(cli, tmp_path, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.csv").write_text(content)
    (tmp_path / "good.csv").write_text(cli("params", *SMALL).out)
    result = cli("diff", "bad.csv", "good.csv")
    assert (result.code, result.out, result.err) == (2, "", f"Error: {message}\n")


def test_check_gate(cli, tmp_path):
    table = tmp_path / "table.csv"
    table.write_text(cli("params", *SMALL, "--pp", "2").out)
    fresh = cli("params", *SMALL, "--pp", "2", "--check", str(table))
    assert (fresh.code, fresh.out) == (0, f"{table} is up to date\n")
    stale = cli("params", *SMALL, "--pp", "4", "--check", str(table))
    assert stale.code == 1 and "layers 2-3: stage 0 -> stage 1" in stale.out
    assert table.read_text() == cli("params", *SMALL, "--pp", "2").out  # --check writes nothing
