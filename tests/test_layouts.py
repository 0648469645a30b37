"""Parallel layouts: virtual pipeline, uneven stages, experts, sequence/context parallel."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tests.test_versions import GROUPED_MLP, SHARED_EXPERT_GATE

SMALL = "--transformer-impl local --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000".split()
# No MoE biases, and sequence parallel wherever experts meet tensor parallelism: megatron-core 0.13
# refuses both otherwise (tests/test_versions.py records the difference).
MOE = SMALL + "--num-experts 4 --moe-ffn-hidden-size 32 --disable-bias-linear".split()


def flags(text: str, *extra: str) -> list[str]:
    return text.split() + list(extra)


def blocks(text: str) -> dict[str, list[str]]:
    """Map each `# stage ...` comment line to the names of its rows."""
    result: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines()[2:]:
        if line.startswith("#"):
            current = line
            result[current] = []
        else:
            result[current].append(line.split(";")[0])
    return result


def layers_in(names: list[str]) -> list[int]:
    return sorted(
        {int(m.group(1)) for n in names if (m := re.match(r"decoder\.layers\.(\d+)\.", n))}
    )


def test_virtual_pipeline_example(cli):
    # issue #5: 8 layers, pp=2, 2 chunks
    out = cli(
        "params", *flags("--num-layers 8 --pp 2 --num-virtual-stages-per-pipeline-rank 2", *SMALL)
    ).out
    got = blocks(out)
    assert [h.split(":")[0] for h in got] == [
        "# stage 0 chunk 0", "# stage 0 chunk 1", "# stage 1 chunk 0", "# stage 1 chunk 1"]  # fmt: skip
    names = list(got.values())
    assert [layers_in(n) for n in names] == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert names[0][0] == "embedding.word_embeddings.weight"
    assert not any(n.startswith("embedding") for n in names[1] + names[2] + names[3])
    assert names[3][-3:] == [
        "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]  # fmt: skip
    assert not any(
        n.startswith(("decoder.final", "output")) for n in names[0] + names[1] + names[2]
    )


def test_both_virtual_flags_agree(cli):
    a = cli(
        "params", *flags("--num-layers 8 --pp 2 --num-virtual-stages-per-pipeline-rank 2", *SMALL)
    )
    b = cli(
        "params", *flags("--num-layers 8 --pp 2 --num-layers-per-virtual-pipeline-stage 2", *SMALL)
    )
    assert a.out == b.out


def test_virtual_tree_headings(cli):
    out = cli(
        "tree", *flags("--num-layers 8 --pp 2 --num-virtual-stages-per-pipeline-rank 2", *SMALL)
    ).out
    # each chunk under its own summary: megatron's interleaved order puts layers 0-1 on stage 0's
    # first chunk, 2-3 on stage 1's, 4-5 and 6-7 on the second chunks
    assert re.findall(r"^(# stage \d+ chunk \d+): layers (\S+),", out, flags=re.M) == [
        ("# stage 0 chunk 0", "0-1"), ("# stage 0 chunk 1", "4-5"),
        ("# stage 1 chunk 0", "2-3"), ("# stage 1 chunk 1", "6-7")]  # fmt: skip


@pytest.mark.parametrize(
    "args, expected",
    [
        ("--num-layers 30 --pp 4 --decoder-first-pipeline-num-layers 6 --decoder-last-pipeline-num-layers 6",
         [range(0, 6), range(6, 15), range(15, 24), range(24, 30)]),
        ("--num-layers 10 --pp 4 --decoder-last-pipeline-num-layers 1",
         [range(0, 3), range(3, 6), range(6, 9), range(9, 10)]),
        ("--num-layers 7 --pp 4 --pipeline-model-parallel-layout Et|tt|tt|ttL",
         [range(0, 1), range(1, 3), range(3, 5), range(5, 7)]),
        ("--num-layers 14 --pp 4 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
         [range(0, 3), range(3, 7), range(7, 11), range(11, 14)]),
    ],
)  # fmt: skip
def test_uneven_stages(cli, args, expected):
    result = cli("params", *flags(args, *SMALL))
    assert result.code == 0, result.err
    assert [layers_in(n) for n in blocks(result.out).values()] == [list(r) for r in expected]


def json_rows(cli, args):
    result = cli("params", *args, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)["parameters"]


LAYOUTS = [
    "--num-layers 4 --pp 2 --dp 2 --ep 2",
    "--num-layers 4 --pp 2 --tp 2 --dp 2 --ep 4 --expert-tensor-parallel-size 1 --sequence-parallel",
    "--num-layers 4 --tp 2 --dp 2 --ep 2 --expert-tensor-parallel-size 2 --sequence-parallel",
    "--num-layers 4 --dp 4 --ep 4 --moe-grouped-gemm",
    "--num-layers 8 --pp 4 --num-virtual-stages-per-pipeline-rank 2 --dp 2 --ep 2",
]


@pytest.mark.slow
@pytest.mark.parametrize("args", LAYOUTS + ["--num-layers 6 --pp 2 --tp 2 --dense"])
def test_every_layer_and_expert_once(cli, args):
    dense = "--dense" in args
    rows = json_rows(cli, flags(args.replace("--dense", ""), *(SMALL if dense else MOE)))
    num_layers = int(args.split()[1])
    assert max(Counter(r["name"] for r in rows).values()) == 1
    homes: dict[int, set] = {}
    experts: dict[int, set] = {}
    for r in rows:
        m = re.match(r"decoder\.layers\.(\d+)\.", r["name"])
        if m:
            homes.setdefault(int(m.group(1)), set()).add((r["stage"], r["chunk"]))
        if m and ".mlp.experts." in r["name"]:
            e = re.search(r"\.experts\.(?:local_experts\.)?(\d+)(?:-(\d+))?\.", r["name"])
            first, last = int(e.group(1)), int(e.group(2) or e.group(1))
            experts.setdefault(int(m.group(1)), set()).update(range(first, last + 1))
    assert sorted(homes) == list(range(num_layers))
    assert all(len(v) == 1 for v in homes.values())
    assert experts == ({} if dense else {layer: set(range(4)) for layer in range(num_layers)})


def test_rank_view_shows_only_its_experts(cli):
    args = flags("--num-layers 2 --dp 2 --ep 2", *MOE)
    full = json_rows(cli, args)
    for rank, mine in ((0, {0, 1}), (1, {2, 3})):
        out = cli("params", *args, "--rank", str(rank)).out
        names = [line.split(";")[0] for line in out.splitlines() if ";" in line][1:]
        experts = {int(m.group(1)) for n in names if (m := re.search(r"local_experts\.(\d+)\.", n))}
        assert experts == mine
        assert len(names) == len([r for r in full if r["expert"] is None or r["expert"] in mine])


def test_moe_stage_comment_states_one_gpu(cli):
    # The comment states what ONE GPU of the stage holds (shared rows and one expert-parallel
    # rank's experts), then the total of the rows, which hold every expert-parallel rank's experts.
    args = flags("--num-layers 2 --pp 2 --dp 2 --ep 2", *MOE)
    rows = json_rows(cli, args)
    comments = [line for line in cli("params", *args).out.splitlines() if line.startswith("# ")]
    for stage, comment in enumerate(comments):
        mine = [r for r in rows if r["stage"] == stage]
        gpu = sum(r["numel"] for r in mine if r["expert_parallel_rank"] in (None, 0))
        assert gpu == sum(r["numel"] for r in mine if r["expert_parallel_rank"] in (None, 1))
        every = sum(r["numel"] for r in mine)
        assert comment.endswith(
            f", {gpu} params, {4 * gpu} bytes per GPU; all 2 expert-parallel ranks: "
            f"{every} params, {4 * every} bytes"
        ), comment


def test_json_attributes_are_megatrons(cli):
    """partition_dim / tensor_parallel in json equal the attributes on megatron's own parameters."""
    from inspector.job.job import make_job
    from inspector.world.build import build, select_view

    text = "--num-layers 2 --pp 2 --tp 2 --dp 2 --ep 2 --expert-tensor-parallel-size 1 --sequence-parallel"
    rows = json_rows(cli, flags(text, *MOE))
    job = make_job(dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        num_experts=4, moe_ffn_hidden_size=32, disable_bias_linear=True, sequence_parallel=True,
        pipeline_model_parallel_size=2, tensor_model_parallel_size=2, data_parallel_size=2,
        expert_model_parallel_size=2, expert_tensor_parallel_size=1,
    ))  # fmt: skip
    attrs = {}
    built = build(job, select_view(job))
    for chunk in built.chunks:
        for expert_rank, model in zip(built.expert_ranks, chunk.models):
            for name, p in model.module.named_parameters():
                sharded = bool(getattr(p, "tensor_model_parallel", False))
                value = (sharded, p.partition_dim if sharded else None, list(p.shape))
                attrs[(chunk.stage, expert_rank, name)] = value
    for r in rows:
        key = (r["stage"], r["expert_parallel_rank"] or 0, r["local_name"])
        assert attrs[key] == (r["tensor_parallel"], r["partition_dim"], r["shape"]), r["name"]


@pytest.mark.parametrize(
    "name, args",
    [
        ("layout_vpp.csv", flags("--num-layers 8 --pp 2 --num-virtual-stages-per-pipeline-rank 2", *SMALL)),
        ("layout_uneven.csv", flags("--num-layers 10 --pp 4 --decoder-first-pipeline-num-layers 1 "
                                    "--decoder-last-pipeline-num-layers 3", *SMALL)),
        ("layout_string.csv", flags("--num-layers 7 --pp 4 --pipeline-model-parallel-layout Et|tt|tt|ttL", *SMALL)),
        ("layout_moe_ep2.csv", flags("--num-layers 2 --pp 2 --dp 2 --ep 2", *MOE)),
        pytest.param("layout_moe_grouped.csv", flags("--num-layers 2 --dp 2 --ep 2 --moe-grouped-gemm", *MOE),
                     marks=pytest.mark.skipif(not GROUPED_MLP, reason="0.17+ build SequentialMLP (test_versions)")),
        ("layout_moe_etp.json", flags("--num-layers 2 --tp 2 --dp 2 --ep 2 --expert-tensor-parallel-size 1 "
                                      "--sequence-parallel --format json", *MOE)),
        ("layout_sequence_parallel.csv", flags("--num-layers 2 --tp 2 --sequence-parallel", *SMALL)),
    ],
)  # fmt: skip
def test_layout_golden(cli, golden, name, args):
    result = cli("params", *args)
    assert result.code == 0, result.err
    golden(name, result.out)


def test_topology_expert_groups_golden(cli, golden):
    result = cli(
        "topology",
        *flags("--num-layers 2 --tp 2 --dp 2 --ep 2 --sequence-parallel --format table", *MOE),
    )
    assert result.code == 0, result.err
    golden("topology_ep2_table.txt", result.out)


@pytest.mark.parametrize(
    "args, message",
    [
        # the middle stages must split evenly
        ("--num-layers 30 --pp 4 --decoder-first-pipeline-num-layers 7",
         "--num-layers 30 minus --decoder-first-pipeline-num-layers 7 leaves 23 layers, which do not split evenly over the 3 middle stages (23 % 3 = 2)"),
        # a layout string must place exactly num_layers layers
        ("--num-layers 6 --pp 4 --pipeline-model-parallel-layout Et|tt|tt|ttL",
         "--pipeline-model-parallel-layout 'Et|tt|tt|ttL' places 7 transformer layers ('t') but --num-layers is 6"),
        # embedding + loss counted as layers must divide
        ("--num-layers 13 --pp 4 --account-for-embedding-in-pipeline-split",
         "--num-layers 13 plus 1 for --account-for-embedding-in-pipeline-split = 14 cannot be split evenly over --pp 4 stages (14 % 4 = 2)"),
        # chunks of the virtual pipeline must divide a stage
        ("--num-layers 8 --pp 2 --num-layers-per-virtual-pipeline-stage 3",
         "--num-layers 8 / --pp 2 = 4 layers per stage do not split into chunks of --num-layers-per-virtual-pipeline-stage 3 (4 % 3 = 1)"),
        # virtual pipeline needs a pipeline
        ("--num-layers 8 --num-virtual-stages-per-pipeline-rank 2",
         "--num-virtual-stages-per-pipeline-rank needs --pp larger than 1 (the interleaved schedule)"),
        # experts must split over expert-parallel ranks
        ("--num-layers 2 --num-experts 3 --ep 2 --dp 2",
         "--num-experts 3 is not divisible by --expert-model-parallel-size 2 (3 % 2 = 1)"),
        # expert groups are carved out of tp x cp x dp ranks
        ("--num-layers 2 --num-experts 4 --ep 4 --dp 2",
         "--expert-model-parallel-size 4 x --expert-tensor-parallel-size 1 = 4 does not divide --tp 1 x --context-parallel-size 1 x --dp 2 = 2 (megatron carves expert groups out of those ranks; megatron-core's initialize_model_parallel raises 'world_size (2) is not divisible by expert_tensor_model_pipeline_parallel size (4)')"),
        # megatron's local attention refuses context parallelism (TE's takes it)
        ("--context-parallel-size 2",
         "--context-parallel-size 2 needs --transformer-impl transformer_engine: megatron-core's local DotProductAttention refuses context parallelism"),
    ],
)  # fmt: skip
def test_layout_errors(cli, args, message):
    result = cli("params", *flags(args, *SMALL))
    assert (result.code, result.out, result.err) == (2, "", f"Error: {message}\n")


@pytest.mark.parametrize(
    "name, args",
    [
        ("layout_distopt.csv", flags("--num-layers 4 --pp 2 --dp 4 --partitioning distopt", *SMALL)),
        ("layout_distopt_overlap.csv", flags("--num-layers 4 --dp 8 --bf16 --partitioning distopt "
                                             "--overlap-grad-reduce --ddp-bucket-size 20000", *SMALL)),
        ("layout_distopt_moe.csv", flags("--num-layers 2 --dp 4 --ep 2 --partitioning distopt", *MOE)),
        ("layout_distopt_moe_rank3.csv", flags("--num-layers 2 --dp 4 --ep 2 --partitioning distopt --rank 3", *MOE)),
    ],
)  # fmt: skip
def test_distopt_golden(cli, golden, name, args):
    result = cli("params", *args)
    assert result.code == 0, result.err
    golden(name, result.out)


def test_distopt_owners_are_data_parallel_ranks(cli):
    rows = json_rows(cli, flags("--num-layers 4 --pp 2 --dp 8 --overlap-grad-reduce --ddp-bucket-size 5000 "
                                "--partitioning distopt", *SMALL))  # fmt: skip
    owners = [r["partitioning_ranks"] for r in rows]
    assert all(o and o == sorted(set(o)) and 0 <= o[0] and o[-1] < 8 for o in owners)
    # megatron lays parameters out in reverse order: the last layer's rows go to the low ranks
    stage0 = [r for r in rows if r["stage"] == 0]
    assert stage0[-1]["partitioning_ranks"][0] <= stage0[1]["partitioning_ranks"][0]
    # the tied word embedding gets its own bucket, shared by every data-parallel rank
    assert rows[0]["name"] == "embedding.word_embeddings.weight"
    assert rows[0]["partitioning_ranks"] == list(range(8))


def test_bf16_is_cast_whole_like_megatron_lm(cli):
    rows = json_rows(cli, flags("--num-layers 2 --bf16", *SMALL))
    assert {r["dtype"] for r in rows} == {"bfloat16"}  # norms too (Float16Module's cast)
    fp32 = cli("params", *flags("--num-layers 2", *SMALL)).out.splitlines()
    bf16 = cli("params", *flags("--num-layers 2 --bf16", *SMALL)).out.splitlines()
    # same rows; the stage comment's byte count halves
    assert fp32[3:] == bf16[3:] and fp32[2] != bf16[2]


@pytest.mark.skipif(not SHARED_EXPERT_GATE, reason="needs megatron-core 0.16 (test_versions)")
def test_shared_expert_gate_is_one_weight_per_layer(cli):
    # Qwen1.5-MoE gates its shared expert: megatron-core's SharedExpertMLP adds gate_weight [1, h].
    args = [*MOE, "--num-layers", "2", "--moe-shared-expert-intermediate-size", "64"]
    gated = json.loads(cli("params", *args, "--moe-shared-expert-gate", "--format", "json").out)
    plain = json.loads(cli("params", *args, "--format", "json").out)
    gates = [r for r in gated["parameters"] if r["name"].endswith("shared_experts.gate_weight")]
    assert [(r["name"], r["shape"]) for r in gates] == [
        ("decoder.layers.0.mlp.shared_experts.gate_weight", [1, 64]),
        ("decoder.layers.1.mlp.shared_experts.gate_weight", [1, 64]),
    ]
    assert len(gated["parameters"]) == len(plain["parameters"]) + 2


def test_shared_expert_gate_needs_shared_experts(cli):
    # the gate scales the shared experts' output; without them there is nothing to gate
    result = cli("tree", *MOE, "--moe-shared-expert-gate")
    assert (result.code, result.err) == (
        2,
        "Error: --moe-shared-expert-gate needs --moe-shared-expert-intermediate-size (it gates the "
        "shared experts)\n",
    )


@pytest.mark.parametrize(
    "layout, expected",
    [
        # megatron's documented repetition syntax: (...)*n, x*n, cosmetic commas
        ("Et*2|(tt|)*2,t*2L", [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        ("E(t|)*3tL", [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
    ],
)  # fmt: skip
def test_layout_repetition_syntax(cli, layout, expected):
    result = cli("params", *flags("--num-layers", str(expected[-1][-1] + 1), "--pp", "4",
                                  "--pipeline-model-parallel-layout", layout, *SMALL))  # fmt: skip
    assert result.code == 0, result.err
    assert [layers_in(n) for n in blocks(result.out).values()] == [list(r) for r in expected]


def test_layout_repetition_gives_virtual_stages(cli):
    # (t|)*8 is 8 stages: 2 chunks per stage on --pp 4
    result = cli("params", *flags("--num-layers 8 --pp 4 --pipeline-model-parallel-layout",
                                  "E(t|)*7tL", *SMALL))  # fmt: skip
    assert result.code == 0, result.err
    heads = [h for h in blocks(result.out)]
    assert len(heads) == 8 and all(" chunk " in h for h in heads)


@pytest.mark.parametrize(
    "layout, message",
    [
        # the repetition unrolls to 5 stages, which --pp 4 cannot hold
        ("(t|)*4tt", "--pipeline-model-parallel-layout '(t|)*4tt' has 5 stages, not a multiple of "
                     "--pp 4 (megatron-core: the layout must be divisible by "
                     "pipeline_model_parallel_size)"),
        # x is no layer type
        ("Et|tt|tx|tL", "--pipeline-model-parallel-layout 'Et|tt|tx|tL': invalid layer character 'x' "
                        "(megatron-core knows E embedding, L loss, t transformer layer, m MTP layer, "
                        "| between stages, (...)*n and x*n repetition)"),
        # t*3 repeats: 2 + 3 + 1 + 1 = 7 transformer layers, not 6
        ("Et*2|t*3|t|tL", "--pipeline-model-parallel-layout 'Et*2|t*3|t|tL' places 7 transformer "
                          "layers ('t') but --num-layers is 6"),
    ],
)  # fmt: skip
def test_layout_repetition_errors(cli, layout, message):
    result = cli("params", *flags("--num-layers 6 --pp 4 --pipeline-model-parallel-layout",
                                  layout, *SMALL))  # fmt: skip
    assert (result.code, result.err) == (2, f"Error: {message}\n")


def test_moe_table_totals_say_one_gpu_and_all_expert_ranks(cli):
    # The table's rows list every expert-parallel rank's experts: its last two rows give what one
    # GPU holds (as the title line says) and the rows' sum, labelled as such.
    result = cli("params", *flags("--num-layers 2 --tp 2 --dp 2 --ep 2 --sequence-parallel "
                                  "--format table", *MOE))
    assert result.code == 0, result.err
    for block in result.out.strip().split("\n\n")[1:]:  # under the job line
        title, _, _, *rows = block.splitlines()
        gpu = re.search(r"(\d+) params, (\d+) bytes per GPU", title)
        assert gpu
        *params, per_gpu, total = rows
        assert per_gpu.split()[:2] == ["per", "GPU"]
        assert [int(x.replace(",", "")) for x in per_gpu.split()[-2:]] == [int(gpu[1]), int(gpu[2])]
        assert total.startswith("total, all 2 expert-parallel ranks")
        numbers = [int(row.split()[-2].replace(",", "")) for row in params]
        assert int(total.split()[-2].replace(",", "")) == sum(numbers) > int(gpu[1])
