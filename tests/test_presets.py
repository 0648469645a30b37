"""Presets: published sizes, checked by a parameter-count formula written here."""

from __future__ import annotations

import json
import math

import pytest

from inspector.errors import ConfigError
from inspector.presets import PRESETS, get_preset


def parameter_count(a: dict) -> int:
    """Total parameters of a GPT/Llama/MoE architecture (tp=1 vocab padding to a multiple of 128)."""
    h, layers, heads = a["hidden_size"], a["num_layers"], a["num_attention_heads"]
    groups = a.get("num_query_groups", heads) if a.get("group_query_attention") else heads
    kv = h // heads
    vocab = math.ceil(a["vocab_size"] / 128) * 128
    bias = not a.get("disable_bias_linear", False)
    qkv_bias = bias or a.get("add_qkv_bias", False)
    gated = 2 if a.get("swiglu") else 1
    norm = h if a.get("normalization") == "RMSNorm" else 2 * h
    attention = (
        h * (heads + 2 * groups) * kv
        + qkv_bias * (heads + 2 * groups) * kv
        + heads * kv * h
        + bias * h
    )

    def mlp(ffn: int) -> int:
        return h * ffn * gated + bias * ffn * gated + ffn * h + bias * h

    if a.get("num_experts"):
        e = a["num_experts"]
        ffn_layer = e * h + bias * e + e * mlp(a["moe_ffn_hidden_size"])
        if a.get("moe_shared_expert_intermediate_size"):
            ffn_layer += mlp(a["moe_shared_expert_intermediate_size"])
    else:
        ffn_layer = mlp(a.get("ffn_hidden_size", 4 * h))
    total = vocab * h + layers * (2 * norm + attention + ffn_layer) + norm
    if a.get("position_embedding_type", "learned_absolute") == "learned_absolute":
        total += a["max_position_embeddings"] * h
    if a.get("untie_embeddings_and_output_weights"):
        total += vocab * h
    return total


@pytest.mark.parametrize("name", list(PRESETS))
def test_published_count(name):
    preset = PRESETS[name]
    count = parameter_count(dict(preset.args))
    assert abs(count - preset.published_params) / preset.published_params < 0.005, (
        count,
        preset.published_params,
    )


@pytest.mark.parametrize("name", list(PRESETS))
def test_tool_builds_the_counted_model(cli, name):
    result = cli("params", "--model", name, "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    assert sum(math.prod(r["global_shape"]) for r in rows if not r["tied"]) == parameter_count(
        dict(PRESETS[name].args)
    )


def test_default_is_gpt2_small(cli):
    assert cli("params", "--model", "gpt2-small").out == cli("params").out


def test_every_preset_has_sources():
    for preset in PRESETS.values():
        assert preset.source and preset.published_source and preset.summary


def test_unknown_preset_suggests_closest():
    with pytest.raises(ConfigError) as error:
        get_preset("llama3-8")
    assert str(error.value) == (
        "unknown --model 'llama3-8' (closest: llama3-8b, llama3-70b, llama2-7b); "
        "`inspect-model models` lists the presets"
    )


def test_models_lists_every_preset(cli):
    out = cli("models").out
    assert all(name in out for name in PRESETS)


def test_flags_override_the_preset(cli):
    rows = json.loads(
        cli("params", "--model", "llama3-8b", "--num-layers", "2", "--format", "json").out
    )
    assert {
        r["name"].split(".")[2]
        for r in rows["parameters"]
        if r["name"].startswith("decoder.layers")
    } == {"0", "1"}
    assert rows["header"]["config"]["hidden_size"] == 4096


PRESET_LAYOUTS = {
    "gpt2-medium": "--tp 2 --pp 2",
    "gpt3-175b": "--tp 8 --pp 16",
    "llama2-7b": "--tp 2 --pp 2",
    "llama2-70b": "--tp 8 --pp 4",
    "llama3-8b": "--tp 2 --pp 2",
    "llama3-70b": "--tp 8 --pp 4",
    "llama3.1-405b": "--tp 8 --pp 16 --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
    "mixtral-8x7b": "--pp 4 --dp 8 --ep 8",  # RMSNorm: no sequence parallel, so no tp with ep
    "qwen1.5-moe-a2.7b": "--pp 2 --dp 4 --ep 4",
}


@pytest.mark.parametrize("name", list(PRESET_LAYOUTS))
def test_preset_golden(cli, golden, name):
    layout = PRESET_LAYOUTS[name].split()
    tree = cli("tree", "--model", name, *layout)
    params = cli("params", "--model", name, *layout)
    assert tree.code == 0 and params.code == 0, tree.err + params.err
    golden(f"preset_{name}_tree.txt", tree.out)
    golden(f"preset_{name}_params.csv", params.out)
