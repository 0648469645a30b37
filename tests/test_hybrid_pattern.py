"""Megatron-LM 0.17+'s --hybrid-layer-pattern, with its `|` stage boundaries."""

from __future__ import annotations

import json

import pytest

import inspector.inputs.hybrid_pattern as hybrid_pattern
import inspector.job.hybrid_model as hybrid_model
from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version
from inspector.job.hybrid_model import main_layers, pipe_segments
from inspector.job.model import ModelConfig
from inspector.job.versions import hybrid_pattern_separators
from tests.test_hybrid import SMALL

HIDDEN = dict(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1000,
              transformer_impl="transformer_engine")


def test_layer_count_and_segments_as_megatron_counts_them():
    # hybrid_layer_allocation.py get_hybrid_total_layer_count / _pipeline_segment_count
    assert main_layers("M*|M-|/MM/MM") == "M*M-"
    assert pipe_segments("M*|M-|/M|M") == 3
    assert pipe_segments(None) == 1


@pytest.fixture
def separators(monkeypatch):
    monkeypatch.setattr(hybrid_model, "hybrid_pattern_separators", lambda: True)


@pytest.mark.parametrize(("pattern", "pp", "uneven", "error"), [
    ("M*|M-|", 2, False, "has 3 pipeline segments, not divisible by --pp 2 (3 % 2 = 1)"),
    ("M*|M-", 2, True, "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"),
])  # fmt: skip
def test_separators_follow_megatron_lm_validate_args(separators, pattern, pp, uneven, error):
    model = ModelConfig(**HIDDEN, hybrid_override_pattern=pattern)
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")
                       .replace("|", r"\|")):  # fmt: skip
        hybrid_model.validate_hybrid(model, 1, pp, uneven)


def test_one_segment_a_stage_is_accepted(separators):
    hybrid_model.validate_hybrid(ModelConfig(**HIDDEN, hybrid_override_pattern="M*M|-"), 1, 2)


def test_more_segments_than_stages_are_virtual_stages(separators):
    # Megatron-LM 0.17+ validate_args "Derive VPP from pipe segments in the pattern", and
    # megatron-core's select_pipeline_segment builds segment vp_stage x pp + pp_rank per chunk
    model = ModelConfig(**HIDDEN, hybrid_override_pattern="M|*|M|-")
    hybrid_model.validate_hybrid(model, 1, 2, vpp=2)
    with pytest.raises(ConfigError, match=r"4 pipeline segments, but --pp 2 x 4 virtual stages"):
        hybrid_model.validate_hybrid(model, 1, 2, vpp=4)
    with pytest.raises(ConfigError, match="4 pipeline segments for --pp 1: Megatron-LM makes them"):
        hybrid_model.validate_hybrid(model, 1, 1)
    with pytest.raises(ConfigError, match="4 pipeline segments for --pp 2: Megatron-LM makes them 2"):
        hybrid_model.validate_hybrid(model, 1, 2)  # a job without its virtual stages
    no_pipes = ModelConfig(**HIDDEN, hybrid_override_pattern="M*M-")
    with pytest.raises(ConfigError, match=r"without '\|' in its --hybrid-layer-pattern cannot be "):
        hybrid_model.validate_hybrid(no_pipes, 1, 2, vpp=2)


def test_the_pattern_sets_the_virtual_pipeline_size_as_megatron_lm_does(monkeypatch):
    monkeypatch.setattr(hybrid_pattern, "megatron_core_version", lambda: (0, 19))
    merged = {"hybrid_layer_pattern": "M-|M*|-M|*M", "pipeline_model_parallel_size": 2}
    hybrid_pattern.layer_pattern(merged)
    assert merged["num_virtual_stages_per_pipeline_rank"] == 2
    merged = {"hybrid_layer_pattern": "M-|M*|-M|*M", "pipeline_model_parallel_size": 4}
    hybrid_pattern.layer_pattern(merged)  # one segment a stage: none set
    assert "num_virtual_stages_per_pipeline_rank" not in merged
    merged = {"hybrid_layer_pattern": "M-|M*|-M|*M"}  # --pp 1: the job refuses it (below)
    hybrid_pattern.layer_pattern(merged)
    assert "num_virtual_stages_per_pipeline_rank" not in merged
    merged = {"hybrid_layer_pattern": "M-|M*|-M|*M", "pipeline_model_parallel_size": 2,
              "num_virtual_stages_per_pipeline_rank": 4}  # read after it, as Megatron-LM does
    hybrid_pattern.layer_pattern(merged)
    assert merged["num_virtual_stages_per_pipeline_rank"] == 4


@pytest.mark.skipif(megatron_core_version() < (0, 17), reason="'|' stage boundaries: 0.17+")
def test_each_chunk_builds_its_segment(cli):
    # pp 2 with 4 segments: rank 0 holds segments 0 and 2, rank 1 segments 1 and 3
    # (select_pipeline_segment: segment_index = vp_stage * pp_size + pp_rank)
    result = cli("params", "--hybrid-layer-pattern", "M-|M*|-M|*M", "--pp", "2",
                 "--hidden-size", "256", "--num-attention-heads", "8", "--vocab-size", "1000")
    assert result.code == 0, result.err
    heads = [line.split(":")[0] + ":" + line.split(":")[1].split(",")[0]
             for line in result.out.splitlines() if line.startswith("# stage")]
    assert heads == ["# stage 0 chunk 0: layers 0-1", "# stage 0 chunk 1: layers 4-5",
                     "# stage 1 chunk 0: layers 2-3", "# stage 1 chunk 1: layers 6-7"], heads
    assert "decoder.layers.4.mlp.linear_fc1.weight" in result.out  # segment 2 is "-M"


def test_layer_pattern_replaces_num_layers_as_megatron_lm_does(monkeypatch):
    monkeypatch.setattr(hybrid_pattern, "megatron_core_version", lambda: (0, 19))
    merged = {"hybrid_layer_pattern": "M*M|-", "num_layers": 8, "pipeline_model_parallel_size": 2}
    notes = hybrid_pattern.layer_pattern(merged)
    assert merged == {"hybrid_override_pattern": "M*M|-", "num_layers": 4,
                      "pipeline_model_parallel_size": 2}
    assert notes == ["Note: --hybrid-layer-pattern has 4 layers; --num-layers 8 is ignored, as "
                     "Megatron-LM ignores it"]  # fmt: skip
    merged = {"hybrid_layer_pattern": "M*M-/M*/M*", "mtp_num_layers": 1}
    notes = hybrid_pattern.layer_pattern(merged)
    assert merged == {"hybrid_override_pattern": "M*M-/M*/M*", "num_layers": 4, "mtp_num_layers": 2}
    assert notes == ["Note: --hybrid-layer-pattern has 2 MTP depths; --mtp-num-layers 1 is "
                     "replaced by them, as Megatron-LM replaces it"]  # fmt: skip
    with pytest.raises(ConfigError, match="cannot both be specified"):
        hybrid_pattern.layer_pattern({"hybrid_layer_pattern": "M*", "hybrid_override_pattern": "*M"})


def test_a_later_source_s_pattern_replaces_a_preset_s(monkeypatch):
    # a preset's --hybrid-override-pattern under a script's --hybrid-layer-pattern (Megatron-
    # Bridge's Nemotron 3.5 Lightning: Nano's pattern with MTP depths): later sources win, as for
    # every other argument; it stopped with "cannot both be specified"
    from inspector.inputs.presets import PRESETS
    from inspector.inputs.resolve import Sources, merge_sources

    monkeypatch.setattr(hybrid_pattern, "megatron_core_version", lambda: (0, 19))
    nano = PRESETS["nemotron-3-nano-30b-a3b"].args["hybrid_override_pattern"]
    sources = Sources(preset="nemotron-3-nano-30b-a3b", flags={"hybrid_layer_pattern": nano + "/*E"})
    args = merge_sources(sources, ("model",)).args
    assert (args["hybrid_override_pattern"], args["mtp_num_layers"]) == (nano + "/*E", 1)


@pytest.mark.skipif(megatron_core_version() >= (0, 17), reason="Megatron-LM 0.17+ has the flag")
def test_older_megatron_lm_has_no_layer_pattern(cli):
    result = cli("params", *SMALL, "--hybrid-layer-pattern", "M*M-")
    assert result.code == 2
    assert "--hybrid-layer-pattern is an argument of Megatron-LM 0.17+" in result.err


@pytest.mark.skipif(not hybrid_pattern_separators(), reason="megatron-core 0.17+ reads '|'")
def test_pipe_places_the_layers_of_each_stage(cli):
    result = cli("params", *SMALL, "--hybrid-layer-pattern", "M*M|-", "--pp", "2",
                 "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    layers = {(r["stage"], r["name"].split(".")[2]) for r in json.loads(result.out)["parameters"]
              if r["name"].startswith("decoder.layers.")}  # fmt: skip
    # HybridModel's select_pipeline_segment: stage 0 the first segment, stage 1 the second
    assert sorted(layers) == [(0, "0"), (0, "1"), (0, "2"), (1, "3")]


@pytest.mark.skipif(not hybrid_pattern_separators(), reason="megatron-core 0.17+ reads '/'")
def test_mtp_depths_build_the_mtp_pattern(cli):
    result = cli("params", *SMALL, "--hybrid-layer-pattern", "M*M-/M*/M*",
                 "--position-embedding-type", "rope", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    names = [r["name"] for r in json.loads(result.out)["parameters"]]
    # HybridModel's MultiTokenPredictionBlock: one MTP layer a depth, each of the MTP pattern
    mixers = {n.split(".mtp_model_layer.layers.")[1].split(".")[:2][1] for n in names
              if ".mtp_model_layer.layers." in n}  # fmt: skip
    assert {n.split(".")[2] for n in names if n.startswith("mtp.layers.")} == {"0", "1"}
    assert mixers == {"mixer", "self_attention"}


@pytest.mark.skipif(not hybrid_pattern_separators(), reason="megatron-core 0.17+ reads '|'")
def test_workload_writes_each_stage_its_segment(cli):
    names = []
    for stage in ("0", "1"):
        result = cli("workload", *SMALL, "--hybrid-layer-pattern", "M*M|-", "--pp", "2",
                     "--micro-batch-size", "1", "--global-batch-size", "1", "--seq-length", "512",
                     "--gpu", "h100", "--stage", stage, "--no-cache")  # fmt: skip
        assert result.code == 0, result.err
        names.append([line.split("\t")[0] for line in result.out.splitlines()[5:]])
    assert names == [["embedding_layer", "mamba_layer", "attention_layer", "mamba_layer"],
                     ["mlp_layer", "final_column", "cross_entropy1", "cross_entropy2",
                      "cross_entropy3"]]  # fmt: skip


def test_mamba_sizes_are_checked_only_where_a_mamba_layer_is_built():
    # MambaMixer's asserts (heads divisible by groups) run in its constructor: a pattern without
    # `M` builds none, so hidden 64's 2 default Mamba heads against 8 groups stop nothing there
    small = {**HIDDEN, "hidden_size": 64, "num_attention_heads": 4, "num_layers": 2}
    hybrid_model.validate_hybrid(ModelConfig(**small, hybrid_override_pattern="*-"))
    with pytest.raises(ConfigError, match=r"Mamba heads 2 are not divisible by --mamba-num-groups 8"):
        hybrid_model.validate_hybrid(ModelConfig(**small, hybrid_override_pattern="M-"))
