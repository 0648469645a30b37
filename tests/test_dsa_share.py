"""DSA's top-k shared across layers (GLM-5.2's IndexShare, megatron-core 0.19+): which layers
megatron builds an indexer on, the pipeline splits it refuses, and the refusal before 0.19."""

from __future__ import annotations

import json

import pytest

from inspector.inputs.versions import DSA_INDEX_SHARE_RELEASES, megatron_core_version, within
from tests.test_dsa import DSA

SHARES = within(DSA_INDEX_SHARE_RELEASES, megatron_core_version())
shares = pytest.mark.skipif(not SHARES, reason="megatron-core 0.19+ shares DSA's top-k")
# GLM-5.2's schedule (HF zai-org/GLM-5.2 config.json: index_topk_freq 4, index_skip_topk_offset 3)
# on 8 layers: layers 1-3 compute their top-k, then every 4th (7); 4-6 and 8 reuse it
SHARED = [*DSA, "--num-layers", "8", "--dsa-indexer-topk-freq", "4",
          "--dsa-indexer-skip-topk-offset", "3"]  # fmt: skip


def _indexed_layers(out: str) -> set[str]:
    return {".".join(p["name"].split(".")[:3]) for p in json.loads(out)["parameters"]
            if ".indexer." in p["name"]}  # fmt: skip


@shares
def test_megatron_builds_the_indexer_only_where_the_top_k_is_computed(cli):
    # dsa.py DSAttention: `if not self.skip_topk: self.indexer = build_module(...)`, skip_topk
    # from is_dsa_skip_topk_layer(layer_number, offset, freq); an MTP layer is numbered from 1
    # again (multi_token_prediction.py), so it computes its own
    result = cli("params", *SHARED, "--mtp-num-layers", "1", "--position-embedding-type", "none",
                 "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    assert _indexed_layers(result.out) == {
        "decoder.layers.0", "decoder.layers.1", "decoder.layers.2", "decoder.layers.6",
        "mtp.layers.0"}  # fmt: skip


@shares
def test_a_stage_that_starts_on_a_reusing_layer_is_refused(cli):
    # experimental_attention_variant_module_specs.py _validate_dsa_index_share_pipeline_split:
    # stage 1 of --pp 2 starts at layer 5, which reuses layer 3's top-k on stage 0
    result = cli("params", *SHARED, "--pp", "2")
    assert result.code == 2
    assert result.err.startswith("Error: megatron-core refused to build stage 1: DSA index-share "
                                 "pipeline split is invalid: local layer 5 reuses top-k indices "
                                 "from computing layer 3")  # fmt: skip
    # --decoder-first-pipeline-num-layers 6: stage 1 starts at layer 7, a computing layer
    split = cli("params", *SHARED, "--pp", "2", "--decoder-first-pipeline-num-layers", "6")
    assert split.code == 0, split.err


@pytest.mark.skipif(SHARES, reason="megatron-core 0.19+ shares DSA's top-k")
def test_index_share_is_refused_by_the_version_that_added_it(cli):
    result = cli("params", "--model", "glm-5.2")
    assert result.code == 2
    assert result.err == (
        "Error: --dsa-indexer-topk-freq is not modelled: DSA's top-k shared across layers "
        "(GLM-5.2's IndexShare) is megatron-core 0.19's (TransformerConfig.dsa_indexer_topk_freq); "
        "this megatron-core has no such field (--model glm-5.2 sets --dsa-indexer-topk-freq 4)\n"
    )


@shares
def test_workload_refuses_the_shared_top_k_by_name(cli):
    # report/workload_dsa.py writes an indexer's collectives on every DSA layer; the layers that
    # reuse the top-k have none, so workload stops rather than write them
    result = cli("workload", *SHARED, "--gpu", "h100", "--stage", "0")
    assert result.code == 2
    assert result.err.startswith("Error: workload does not write --dsa-indexer-topk-freq 4 yet")


@shares
def test_plan_refuses_the_shared_top_k_by_name(cli):
    # plan prices an indexer on every DSA layer (formulas/dsa_ops.py); megatron builds none on
    # the layers that reuse the top-k, so plan stops rather than price them
    result = cli("plan", *SHARED, "--gpus", "8", "--global-batch-size", "16")
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("Error: plan does not price --dsa-indexer-topk-freq 4 yet")
