"""`inspect-model tree`: golden outputs, and the default structure asserted on its own."""

from __future__ import annotations

import re

import pytest

from tests import invariants
from tests.test_versions import QK_NORM_IDENTITY

LAYER_CHILDREN = [
    ("input_layernorm", "FusedLayerNorm"),
    ("self_attention", "SelfAttention"),
    ("pre_cross_attn_layernorm", "IdentityOp"),
    ("cross_attention", "IdentityOp"),
    ("cross_attn_bda", "IdentityFuncOp"),
    ("pre_mlp_layernorm", "FusedLayerNorm"),
    ("mlp", "MLP"),
]
ATTENTION_CHILDREN = [
    ("core_attention", "DotProductAttention"),
    ("linear_proj", "RowParallelLinear"),
    ("linear_qkv", "ColumnParallelLinear"),
    *([("q_layernorm", "IdentityOp"), ("k_layernorm", "IdentityOp")] if QK_NORM_IDENTITY else []),
]


def parse_tree(text: str) -> dict:
    """Parse the SPEC tree format back into nested {'class': .., 'children': [(name, node)]}."""
    lines = text.splitlines()
    position = 0

    def node(indent: int) -> dict:
        nonlocal position
        match = re.fullmatch(" " * indent + r"Module: (\w+)", lines[position])
        assert match, f"line {position + 1}: {lines[position]!r}"
        position += 1
        result: dict = {"class": match.group(1), "children": []}
        prefix = " " * (indent + 2) + "Submodule: "
        while position < len(lines) and lines[position].startswith(prefix):
            name, cls = re.fullmatch(r"(\S+) \((\w+)\)", lines[position][len(prefix) :]).groups()
            position += 1
            child = node(indent + 4)
            assert child["class"] == cls
            result["children"].append((name, child))
        return result

    root = node(0)
    assert position == len(lines), "trailing lines"
    return root


def children(node: dict) -> list[tuple[str, str]]:
    return [(name, child["class"]) for name, child in node["children"]]


def child(node: dict, name: str) -> dict:
    return dict(node["children"])[name]


def test_default_tree_structure(cli):
    # Independent of the golden file: the structure issue #2 lists for GPT-2 small.
    result = cli("tree")
    assert result.code == 0
    assert result.out.endswith("\n") and not any(
        line != line.rstrip() for line in result.out.splitlines()
    )
    root = parse_tree(result.out)
    assert root["class"] == "GPTModel"
    assert children(root) == [
        ("embedding", "LanguageModelEmbedding"),
        ("decoder", "TransformerBlock"),
        ("output_layer", "ColumnParallelLinear"),
    ]
    assert children(child(root, "embedding")) == [
        ("word_embeddings", "VocabParallelEmbedding"),
        ("position_embeddings", "Embedding"),
        ("embedding_dropout", "Dropout"),
    ]
    decoder = child(root, "decoder")
    assert children(decoder) == [("layers", "ModuleList"), ("final_layernorm", "FusedLayerNorm")]
    layers = child(decoder, "layers")
    assert children(layers) == [(str(i), "TransformerLayer") for i in range(12)]
    for _, layer in layers["children"]:
        assert children(layer) == LAYER_CHILDREN
        attention = child(layer, "self_attention")
        assert children(attention) == ATTENTION_CHILDREN
        assert children(child(attention, "core_attention")) == [
            ("scale_mask_softmax", "FusedScaleMaskSoftmax"),
            ("attention_dropout", "Dropout"),
        ]
        assert children(child(layer, "mlp")) == [
            ("linear_fc1", "ColumnParallelLinear"),
            ("linear_fc2", "RowParallelLinear"),
        ]


def split_stages(text: str) -> dict[str, str]:
    blocks = re.split(r"^(# stage .*)\n", text, flags=re.M)
    assert blocks[0] == ""
    return dict(zip(blocks[1::2], blocks[2::2]))


def test_pp2_stages_hold_local_layers(cli):
    result = cli("tree", "--pp", "2")
    stages = split_stages(result.out)
    assert [heading.split(":")[0] for heading in stages] == ["# stage 0", "# stage 1"]
    first, last = (parse_tree(t) for t in stages.values())
    assert [n for n, _ in children(first)] == ["embedding", "decoder"]
    assert [n for n, _ in children(last)] == ["decoder", "output_layer"]
    for root in (first, last):  # megatron's local indices, as print(model) shows them
        assert children(child(child(root, "decoder"), "layers")) == [
            (str(i), "TransformerLayer") for i in range(6)
        ]
    assert "final_layernorm" not in dict(child(first, "decoder")["children"])
    assert "final_layernorm" in dict(child(last, "decoder")["children"])


def test_no_apex_uses_torch_norms(cli):
    text = cli("tree", "--no-apex").out
    assert "FusedLayerNorm" not in text
    # WrappedTorchNorm is a factory: it returns plain torch.nn.LayerNorm modules
    assert text.count("(LayerNorm)") == 12 * 2 + 1


def test_stage_and_rank_select_one_stage(cli):
    both = split_stages(cli("tree", "--pp", "2", "--tp", "2").out)
    heading = "# stage 1: layers 6-11, 40644864 params, 162579456 bytes"
    assert list(both)[1] == heading
    assert cli("tree", "--pp", "2", "--tp", "2", "--stage", "1").out == heading + "\n" + both[heading]
    # rank 3 of tp2 x pp2 (dp 1) is on stage 1
    assert cli("tree", "--pp", "2", "--tp", "2", "--rank", "3").out == heading + "\n" + both[heading]


def comment_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("# stage ")]


@pytest.mark.parametrize(
    "args",
    [
        ["--rank", "0"],  # pp 1: the whole model, still under its summary
        ["--pp", "2", "--tp", "2", "--dp", "2", "--rank", "5"],
        ["--num-layers", "8", "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "2",
         "--rank", "1"],
        ["--num-layers", "4", "--num-experts", "4", "--ep", "2", "--dp", "2", "--disable-bias-linear",
         "--rank", "1"],
    ],  # fmt: skip
)
def test_rank_summary_matches_the_params_rows(cli, args):
    """`tree --rank R` starts with a summary whose parameters add up the rows `params --rank R`
    writes (the file rank R would write, which has no comment lines)."""
    tree = cli("tree", *args)
    assert tree.code == 0, tree.err
    table = cli("params", *args)
    assert table.code == 0, table.err
    invariants.params_csv(table.out)
    assert tree.out.startswith("# stage ")
    summaries = [invariants._STAGE_COMMENT.match(line) for line in comment_lines(tree.out)]
    assert summaries and all(summaries)
    rows = [line.split(";") for line in table.out.splitlines()[1:] if ";" in line]
    held = sum(invariants._numel(row[2]) for row in rows if row[0] != "name")
    assert sum(int(match.group(1)) for match in summaries if match) == held


@pytest.mark.parametrize(
    "name, args",
    [
        ("tree_default.txt", []),
        ("tree_pp2.txt", ["--pp", "2"]),
        ("tree_no_apex.txt", ["--no-apex"]),
        ("tree_pp4_tp2_stage3.txt", ["--pp", "4", "--tp", "2", "--stage", "3"]),
    ],
)
def test_tree_golden(cli, golden, name, args):
    result = cli("tree", *args)
    assert result.code == 0, result.err
    golden(name, result.out)


@pytest.mark.parametrize(
    "args, message",
    [
        # the stage index must exist
        (
            ["--pp", "2", "--stage", "2"],
            "Error: --stage 2 is out of range for --pp 2 (stages 0-1)\n",
        ),
        # the rank must exist: 2 x 1 x 2 = 4 ranks
        (
            ["--pp", "2", "--tp", "2", "--rank", "4"],
            "Error: --rank 4 is out of range for a world of 4 ranks (--tp 2 x --dp 1 x --pp 2; ranks 0-3)\n",
        ),
        # heads must split over tensor-parallel ranks
        (
            ["--tp", "5"],
            "Error: --num-attention-heads 12 is not divisible by --tp 5 (12 % 5 = 2)\n",
        ),
        # an even pipeline split needs layers % pp == 0
        (
            ["--pp", "5"],
            "Error: --num-layers 12 cannot be split evenly over --pp 5 stages (12 % 5 = 2); use "
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers or "
            "--pipeline-model-parallel-layout for an uneven split\n",
        ),
    ],
)
def test_tree_errors(cli, args, message):
    result = cli("tree", *args)
    assert (result.code, result.out, result.err) == (2, "", message)
