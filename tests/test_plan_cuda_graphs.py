"""`plan` with Transformer Engine's per-layer CUDA graphs (--cuda-graph-impl transformer_engine):
the search leaves out full recomputation as megatron-core refuses it beside them, prints the
graphs among each plan's flags, and every printed plan's peak is `memory`'s for its layout, the
graphs' static inputs and memory pool included (memory/engine/cuda_graphs.py)."""

from __future__ import annotations

import json

from tests.test_cuda_graphs import needs_graphs

TINY = ("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "512",
        "--max-position-embeddings", "512", "--vocab-size", "1024", "--bf16", "--position-embedding-type",
        "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear")  # fmt: skip
SEARCH = ("--gpus", "4", "--global-batch-size", "16", "--gpu-memory", "2", "--top", "3")
GRAPHS = ("--cuda-graph-impl", "transformer_engine")


def _plans(cli, *flags: str) -> list[dict]:
    result = cli("plan", *TINY, *SEARCH, *flags, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)["plans"]


def _memory_total(cli, flags: list[str]) -> int:
    """Return `memory`'s worst stage total for a plan's Megatron-LM flags."""
    words = [word for flag in flags for word in flag.split()]
    sizes = {"--tensor-model-parallel-size": "--tp", "--pipeline-model-parallel-size": "--pp"}
    words = [sizes.get(word, word) for word in words]
    result = cli("memory", *TINY, "--dp", "4", *words, "--format", "json")
    assert result.code == 0, result.err
    found = json.loads(result.out)
    return found["stages"][found["worst_stage"]]["total"]


@needs_graphs
def test_each_printed_plan_holds_the_graphs_as_memory_counts_them(cli) -> None:
    plans = _plans(cli, *GRAPHS)
    assert plans and all(p["recompute"] != "full" for p in plans)
    first = plans[0]
    assert "--cuda-graph-impl transformer_engine" in first["flags"]
    assert first["layout"]["tp"] == first["layout"]["pp"] == 1  # dp 4: `_memory_total`'s layout
    assert first["peak_bytes"] == _memory_total(cli, first["flags"])
    # the same layout without graphs holds less: no static inputs, no pool
    eager = [f for f in first["flags"] if not f.startswith("--cuda-graph")]
    assert _memory_total(cli, eager) < first["peak_bytes"]


@needs_graphs
def test_whole_layer_graphs_take_the_layers_launches_off_the_step(cli) -> None:
    # plan/host.py `graphed_layers`: a graphed layer is replayed by one launch a pass; this tiny
    # model's step is the host's launches, so the graphs shorten it
    eager, graphed = _plans(cli)[0], _plans(cli, *GRAPHS)[0]
    assert graphed["time_shares"]["host"] < eager["time_shares"]["host"]
    assert graphed["step_seconds"] < eager["step_seconds"]


@needs_graphs
def test_megatron_core_s_refusals_of_graphs_are_the_plan_s(cli) -> None:
    for recompute in (("--recompute-granularity", "full"), ("--recompute-method", "block")):
        result = cli("plan", *TINY, *SEARCH, *GRAPHS, *recompute)
        assert result.code == 2 and result.out == ""
        assert "full recompute is only supported with full iteration CUDA graph." in result.err
    result = cli("plan", *TINY, *SEARCH, "--cuda-graph-impl", "local")
    assert result.code == 2
    assert result.err.startswith("Error: --cuda-graph-impl local is not modelled by plan")
