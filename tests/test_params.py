"""`inspect-model params`: golden tables backed by counts and formulas computed here."""

from __future__ import annotations

import json
import re

import pytest

from tests.counting import parameter_count

EXAMPLE = [  # the local spec, as the table this project started from shows it
    "--transformer-impl",
    "local",
    "--num-layers",
    "8",
    "--hidden-size",
    "1024",
    "--num-attention-heads",
    "16",
    "--pp",
    "2",
    "--tp",
    "2",
    "--dp",
    "2",
]


def rows_of(text: str) -> list[list[str]]:
    return [line.split(";") for line in text.splitlines()[2:] if not line.startswith("#")]


def test_issue_example_rank0(cli):
    result = cli("params", *EXAMPLE, "--rank", "0")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0].count("ProcessCoord(") == 8
    assert lines[1] == "name;module;shape;partitioning_ranks;precs"
    assert not any(line.startswith("#") for line in lines)  # a rank file has no comment lines
    rows = {r[0]: r for r in rows_of(result.out)}
    assert rows["embedding.word_embeddings.weight"][2:] == ["(25216, 1024)", "0", "[]"]
    assert rows["decoder.layers.0.self_attention.linear_qkv.weight"][2:] == [
        "(1536, 1024)",
        "0",
        "[torch.Size([1536, 1536]), torch.Size([1024, 1024])]",
    ]
    assert rows["decoder.layers.0.self_attention.linear_proj.weight"][2] == "(1024, 512)"
    assert rows["decoder.layers.0.mlp.linear_fc1.weight"][2] == "(2048, 1024)"
    assert rows["decoder.layers.0.mlp.linear_fc2.weight"][2] == "(1024, 2048)"
    assert rows["decoder.layers.1.input_layernorm.bias"][2:] == ["(1024,)", "0", "[]"]
    layers = {
        int(m.group(1)) for m in (re.match(r"decoder\.layers\.(\d+)\.", n) for n in rows) if m
    }
    assert layers == {0, 1, 2, 3}
    for name, row in rows.items():
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        owner = "1" if layer and int(layer.group(1)) >= 2 else "0"
        assert row[3] == owner, name
        if owner == "1":  # rank 0 (data index 0) does not own it: precs left empty
            assert row[4] == ""


def test_rank_views_of_other_ranks(cli):
    all_rows = rows_of(cli("params", *EXAMPLE).out)
    rank3 = cli("params", *EXAMPLE, "--rank", "3").out  # stage 0, data index 1
    assert rank3.splitlines()[0] == "name;module;shape;partitioning_ranks;precs"
    rows3 = rows_of("x\n" + rank3)
    stage0 = [
        r for r in all_rows if not re.match(r"decoder\.layers\.[4-7]\.|decoder\.final|output", r[0])
    ]
    assert [r[:4] for r in rows3] == [r[:4] for r in stage0]
    assert all((r[4] == "") == (r[3] == "0") for r in rows3)


@pytest.mark.parametrize(
    "name, args",
    [
        ("params_default_pp2_tp2.csv", ["--pp", "2", "--tp", "2"]),
        ("params_example.csv", EXAMPLE),
        ("params_example_stage1.csv", EXAMPLE + ["--stage", "1"]),
        ("params_example_rank0.csv", EXAMPLE + ["--rank", "0"]),
        ("params_example_rank5.csv", EXAMPLE + ["--rank", "5"]),
        ("params_example_block512.csv", EXAMPLE + ["--block-size", "512"]),
        ("params_example_cost.csv", EXAMPLE + ["--partitioning", "cost"]),
        ("params_example.json", EXAMPLE + ["--format", "json"]),
        ("params_example_table.txt", EXAMPLE + ["--format", "table"]),
    ],
)
def test_params_golden(cli, golden, name, args):
    result = cli("params", *args)
    assert result.code == 0, result.err
    golden(name, result.out)


def expected_parameter_count(a: dict) -> int:
    """GPT parameter count from the architecture (tests/counting.py), in this file's short names."""
    args = {
        "num_layers": a["layers"], "hidden_size": a["hidden"], "num_attention_heads": a["heads"],
        "group_query_attention": "groups" in a, "num_query_groups": a.get("groups"),
        "seq_length": a["seq"], "vocab_size": a["vocab"], "ffn_hidden_size": a.get("ffn"),
        "disable_bias_linear": a.get("no_bias", False), "swiglu": a.get("swiglu", False),
        "normalization": "RMSNorm" if a.get("rms") else "LayerNorm",
        "position_embedding_type": "rope" if a.get("rope") else "learned_absolute",
        "untie_embeddings_and_output_weights": a.get("untie", False),
    }  # fmt: skip
    return parameter_count(args, tp=a["tp"])


def flags_for(a: dict) -> list[str]:
    flags = [
        "--num-layers",
        str(a["layers"]),
        "--hidden-size",
        str(a["hidden"]),
        "--num-attention-heads",
        str(a["heads"]),
        "--seq-length",
        str(a["seq"]),
        "--vocab-size",
        str(a["vocab"]),
        "--tp",
        str(a["tp"]),
        "--pp",
        str(a["pp"]),
        "--format",
        "json",
    ]
    if "groups" in a:
        flags += ["--group-query-attention", "--num-query-groups", str(a["groups"])]
    if "ffn" in a:
        flags += ["--ffn-hidden-size", str(a["ffn"])]
    for key, flag in (
        ("no_bias", "--disable-bias-linear"),
        ("untie", "--untie-embeddings-and-output-weights"),
        ("swiglu", "--swiglu"),
    ):
        if a.get(key):
            flags.append(flag)
    if a.get("rms"):
        flags += ["--normalization", "RMSNorm"]
    if a.get("rope"):
        flags += ["--position-embedding-type", "rope"]
    return flags


CONFIGS = [
    dict(layers=4, hidden=64, heads=4, seq=32, vocab=1000, tp=1, pp=1),
    dict(layers=4, hidden=64, heads=4, seq=32, vocab=1000, tp=2, pp=2),
    dict(layers=8, hidden=128, heads=8, seq=64, vocab=5000, tp=4, pp=4, untie=True),
    dict(layers=8, hidden=128, heads=8, seq=64, vocab=5000, tp=8, pp=8, no_bias=True),
    dict(layers=6, hidden=96, heads=6, seq=16, vocab=777, tp=3, pp=3, untie=True, no_bias=True),
    dict(
        layers=4, hidden=64, heads=8, groups=2, seq=32, vocab=1000, tp=2, pp=1, swiglu=True, ffn=160
    ),
    dict(
        layers=4,
        hidden=64,
        heads=4,
        seq=32,
        vocab=1000,
        tp=1,
        pp=2,
        rms=True,
        rope=True,
        untie=True,
    ),
    dict(layers=12, hidden=64, heads=4, seq=32, vocab=50257, tp=4, pp=6),
    dict(layers=2, hidden=32, heads=2, seq=8, vocab=100, tp=2, pp=2, untie=True),
    dict(
        layers=16,
        hidden=256,
        heads=16,
        groups=4,
        seq=128,
        vocab=32000,
        tp=4,
        pp=8,
        swiglu=True,
        no_bias=True,
        rms=True,
        rope=True,
        untie=True,
        ffn=688,
    ),
]


@pytest.mark.parametrize("a", CONFIGS, ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_parameters_are_conserved(cli, a):
    result = cli("params", *flags_for(a))
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    total = sum(
        r["numel"] * (a["tp"] if r["tensor_parallel"] else 1) for r in rows if not r["tied"]
    )
    assert total == expected_parameter_count(a)
    # every global layer sits on exactly one stage
    stages_of: dict[int, set[int]] = {}
    for r in rows:
        m = re.match(r"decoder\.layers\.(\d+)\.", r["name"])
        if m:
            stages_of.setdefault(int(m.group(1)), set()).add(r["stage"])
    assert sorted(stages_of) == list(range(a["layers"]))
    assert all(len(s) == 1 for s in stages_of.values())
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))
    tied = [r for r in rows if r["tied"]]
    if a.get("untie") or a["pp"] == 1:
        assert tied == []
    else:  # the last stage's copy of the word embeddings
        assert [(r["name"], r["stage"], r["precs"]) for r in tied] == [
            ("output_layer.weight", a["pp"] - 1, [])
        ]


def test_json_matches_megatron_attributes(cli):
    rows = json.loads(cli("params", *EXAMPLE, "--format", "json").out)["parameters"]
    by = {r["name"]: r for r in rows}
    qkv = by["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (qkv["tensor_parallel"], qkv["partition_dim"], qkv["global_shape"]) == (
        True,
        0,
        [3072, 1024],
    )
    proj = by["decoder.layers.0.self_attention.linear_proj.weight"]
    assert (proj["tensor_parallel"], proj["partition_dim"], proj["global_shape"]) == (
        True,
        1,
        [1024, 1024],
    )
    assert by["decoder.layers.0.self_attention.linear_proj.bias"]["tensor_parallel"] is False
    assert by["embedding.word_embeddings.weight"]["global_shape"] == [50432, 1024]
    assert by["output_layer.weight"]["tied"] is True
    assert (
        by["decoder.layers.5.mlp.linear_fc1.weight"]["local_name"]
        == "decoder.layers.1.mlp.linear_fc1.weight"
    )


def test_output_is_byte_identical_across_runs(cli):
    assert cli("params", *EXAMPLE).out == cli("params", *EXAMPLE).out


def test_untied_output_layer_gets_preconditioners(cli):
    rows = {
        r[0]: r
        for r in rows_of(cli("params", "--pp", "2", "--untie-embeddings-and-output-weights").out)
    }
    assert rows["output_layer.weight"][4] == "[torch.Size([50304, 50304]), torch.Size([768, 768])]"


def test_output_file_is_atomic(cli, tmp_path):
    target = tmp_path / "table.csv"
    target.write_text("old\n")
    bad = cli("params", "--tp", "5", "-o", str(target))
    assert bad.code == 2 and target.read_text() == "old\n"
    good = cli("params", "-o", str(target))
    assert good.code == 0 and good.out == ""
    assert target.read_text() == cli("params").out
    assert [p.name for p in tmp_path.iterdir()] == ["table.csv"]


@pytest.mark.parametrize("norm, per_layer", [("LayerNorm", 4), ("RMSNorm", 2)])
def test_qk_layernorm_adds_per_head_norms(cli, norm, per_layer):
    args = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 1000 --qk-layernorm".split()
    rows = json.loads(cli("params", *args, "--normalization", norm, "--format", "json").out)["parameters"]
    qk = [r for r in rows if "_layernorm." in r["name"] and ("q_layernorm" in r["name"] or "k_layernorm" in r["name"])]
    # one norm over the head dimension (64 / 4 = 16) for queries and one for keys, per layer
    assert len(qk) == 2 * per_layer and {tuple(r["shape"]) for r in qk} == {(16,)}
