"""Presets: published sizes, checked by the tests' parameter-count formula (tests/counting.py)."""

from __future__ import annotations

import json
import math

import pytest

from inspector.errors import ConfigError
from inspector.inputs.presets import PRESETS, get_preset
from inspector.job.dsa import DSA_BUILT_SINCE
from inspector.job.versions import LATENT_MOE_SINCE, hybrid_moe_layers, megatron_version
from tests.counting import parameter_count
from tests.test_dsa_share import SHARES
from tests.test_gdn import GDN_IN_GPT
from tests.test_versions import GPT_OSS, SHARED_EXPERT_GATE

VERSION = megatron_version()


# Published counts stated only to the billion ("This model has 56B model parameters"): the
# count must round to them
ROUNDED = {"nemotron-h-8b": 0.5e9, "nemotron-h-56b": 0.5e9}


@pytest.mark.parametrize("name", list(PRESETS))
def test_published_count(name):
    preset = PRESETS[name]
    count = parameter_count(dict(preset.args))
    if name in ROUNDED:
        assert abs(count - preset.published_params) < ROUNDED[name], count
        return
    assert abs(count - preset.published_params) / preset.published_params < 0.005, (
        count,
        preset.published_params,
    )


def test_counts_of_the_new_presets():
    # the tests' formula, written out: Nemotron-H 8B 8,100,852,736 (published "8B"), 56B
    # 56,324,350,464 ("56B"); Nemotron 3 Super 120,668,687,360 without its MTP layer (120.6B);
    # Nemotron 3 Ultra 549,308,968,960 without its MTP layer (550B); GLM-5 743,911,199,232
    # without its MTP layer (744B); GLM-5.2 the same less 57 indexers of 9,371,904
    counts = {name: parameter_count(dict(PRESETS[name].args)) for name in (
        "nemotron-h-8b", "nemotron-h-56b", "nemotron-3-super-120b-a12b",
        "nemotron-3-ultra-550b-a55b", "glm-5", "glm-5.2")}  # fmt: skip
    assert counts == {"nemotron-h-8b": 8_100_852_736, "nemotron-h-56b": 56_324_350_464,
                      "nemotron-3-super-120b-a12b": 120_668_687_360,
                      "nemotron-3-ultra-550b-a55b": 549_308_968_960,
                      "glm-5": 743_911_199_232, "glm-5.2": 743_377_000_704}  # fmt: skip
    # with its MTP layer (an indexer of its own): 753,329,921,024, the Hub's 753B for
    # zai-org/GLM-5.2
    with_mtp = parameter_count(dict(PRESETS["glm-5.2"].args, mtp_num_layers=1))
    assert with_mtp == 753_329_921_024 and round(with_mtp / 1e9) == 753


# LatentMoE presets: megatron's own build's count (the formula's), the published count, and the
# LatentMoE layers (each one fc1 and one fc2 latent projection, no bias); their MTP layers are not
# included in either count
LATENT_MOE_COUNTS = {
    "nemotron-3-super-120b-a12b": (120_668_687_360, 120.6e9, 40),  # 0.06% over 120.6B
    "nemotron-3-ultra-550b-a55b": (549_308_968_960, 550e9, 48),  # 0.13% under 550B
}


@pytest.mark.slow
@pytest.mark.skipif(VERSION < LATENT_MOE_SINCE, reason="LatentMoE needs megatron-core 0.16")
@pytest.mark.parametrize("name", LATENT_MOE_COUNTS)
def test_megatron_builds_the_latent_moe_presets_at_their_published_size(cli, name):
    # Nemotron 3 Super's and Ultra's LatentMoE (moe_layer.py fc1/fc2_latent_proj, experts on the
    # latent width): megatron's own build counts what the formula counts, within 0.5% of the
    # published size
    built, published, latent_layers = LATENT_MOE_COUNTS[name]
    result = cli("params", "--model", name, "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    count = sum(math.prod(r["global_shape"]) for r in rows if not r["tied"])
    assert count == built == parameter_count(dict(PRESETS[name].args))
    assert abs(count - published) / published < 0.005
    assert sum("latent_proj" in r["name"] for r in rows) == latent_layers * 2


def _buildable(name: str) -> list:
    """Skip presets the installed megatron-core cannot build (tests/test_versions.py asserts why)."""
    if PRESETS[name].args.get("moe_latent_size"):
        return [pytest.mark.skip(reason="built by the test above (megatron-core 0.16+)")]
    if PRESETS[name].args.get("moe_shared_expert_gate") and not SHARED_EXPERT_GATE:
        return [pytest.mark.skip(reason="shared-expert gate needs megatron-core 0.16")]
    if "E" in PRESETS[name].args.get("hybrid_override_pattern", "") and not hybrid_moe_layers():
        return [pytest.mark.skip(reason="hybrid MoE layers need megatron-core 0.16")]
    if PRESETS[name].args.get("experimental_attention_variant") and VERSION < DSA_BUILT_SINCE:
        return [pytest.mark.skip(reason="DSA needs megatron-core 0.18 (tests/test_dsa.py)")]
    if PRESETS[name].args.get("dsa_indexer_topk_freq") and not SHARES:
        return [pytest.mark.skip(reason="DSA's shared top-k needs megatron-core 0.19 "
                                 "(tests/test_dsa_share.py)")]  # fmt: skip
    if PRESETS[name].args.get("quick_geglu") and not GPT_OSS:
        return [pytest.mark.skip(reason="gpt-oss's layers need megatron-core 0.15")]
    if PRESETS[name].args.get("experimental_attention_variant") and not GDN_IN_GPT:
        return [pytest.mark.skip(reason="gated delta net layers need megatron-core 0.16")]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=_buildable(n)) for n in PRESETS])
def test_tool_builds_the_counted_model(cli, name):
    result = cli("params", "--model", name, "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    # megatron-core 0.18's DSA MTP layer has no indexer (Megatron-LM core_v0.18.2 gpt_builders)
    assert sum(math.prod(r["global_shape"]) for r in rows if not r["tied"]) == parameter_count(
        dict(PRESETS[name].args), mtp_indexer=megatron_version() >= (0, 19)
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


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=_buildable(n)) for n in PRESET_LAYOUTS])
def test_preset_golden(cli, golden, name):
    layout = PRESET_LAYOUTS[name].split()
    tree = cli("tree", "--model", name, *layout)
    params = cli("params", "--model", name, *layout)
    assert tree.code == 0 and params.code == 0, tree.err + params.err
    golden(f"preset_{name}_tree.txt", tree.out)
    golden(f"preset_{name}_params.csv", params.out)


def test_models_shows_each_preset_s_parameter_count_and_source(cli):
    # its help promises "sizes and sources"; it listed neither counts nor sources
    out = cli("models").out
    table, sources = out.split("\nSources:\n")
    for preset in PRESETS.values():
        row = next(line.split() for line in table.splitlines() if line.startswith(preset.name + " "))
        count = float(row[1][:-1]) * (1e9 if row[1].endswith("B") else 1e6)
        assert abs(count - preset.published_params) <= (0.05e9 if row[1].endswith("B") else 0.5e6)
        assert f"  {preset.name}: {preset.source}; " in sources


def test_a_preset_argument_is_refused_only_where_this_megatron_core_does_not_model_it():
    # resolve._check_preset asks unmodelled.refusal_message, as a script's flags are asked: a flag
    # modelled on some releases only (--fp4-param-gather: 0.18+) stops a preset elsewhere alone
    from inspector.errors import ConfigError
    from inspector.inputs import versions
    from inspector.inputs.resolve import _check_preset

    args = {"fp4_param_gather": True}
    if versions.within(versions.FP4_PARAM_RELEASES, versions.megatron_core_version()):
        _check_preset("p", args, ("model", "training"))
    else:
        with pytest.raises(ConfigError, match=r"^--fp4-param-gather is not modelled: .*\(--model p "
                           r"sets --fp4-param-gather True\)$"):  # fmt: skip
            _check_preset("p", args, ("model", "training"))
    _check_preset("p", args, ("model",))  # a training argument stops no model-only command
