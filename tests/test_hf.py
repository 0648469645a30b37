"""Hugging Face config.json files, mapped as Megatron-Bridge maps them, against published counts.

The configs in fixtures/hf/ are written from the published config.json of each model (their values,
not the files); the counts are the published totals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from inspector.errors import InputError
from inspector.inputs.hf import read_hf_config
from inspector.inputs.presets import PRESETS
from tests.counting import parameter_count

HF = Path(__file__).resolve().parent.parent / "fixtures" / "hf"

PUBLISHED = {
    "llama3.1-8b": 8_030_261_248,  # HF meta-llama/Llama-3.1-8B
    "llama3.1-70b": 70_553_706_496,  # HF meta-llama/Llama-3.1-70B
    "llama3.1-405b": 405_853_388_800,  # HF meta-llama/Llama-3.1-405B
    "qwen3-8b": 8_190_735_360,  # HF Qwen/Qwen3-8B: 8.2B
    "qwen3-30b-a3b": 30_532_122_624,  # HF Qwen/Qwen3-30B-A3B: 30.5B
    "qwen3-235b-a22b": 235_093_634_560,  # HF Qwen/Qwen3-235B-A22B: 235B
    "mixtral-8x7b": 46_702_792_704,  # HF mistralai/Mixtral-8x7B-v0.1
    "deepseek-v3": 685_000_000_000,  # HF deepseek-ai/DeepSeek-V3: 671B + 14B MTP module
    # HF deepseek-ai/DeepSeek-V3.2-Exp (and DeepSeek-V3.2) model card: 685B params
    "deepseek-v3.2": 685_000_000_000,
    "kimi-k2": 1_026_500_000_000,  # HF moonshotai/Kimi-K2-Instruct: 1026.5B (model card: 1T)
    "gpt-oss-20b": 20_910_000_000,  # OpenAI gpt-oss model card, arXiv:2508.10925: 20.91B total
    "gpt-oss-120b": 116_830_000_000,  # the same card: 116.83B total
    # HF Qwen/Qwen3-Next-80B-A3B-Instruct model card: 80B in total (79.67B counted, -0.41%)
    "qwen3-next-80b-a3b": 80_000_000_000,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_count(name):
    args = read_hf_config(str(HF / f"{name}.json")).args
    count = parameter_count(args)
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.005, (count, PUBLISHED[name])


@pytest.mark.parametrize(
    "name, preset",
    [("llama3.1-405b", "llama3.1-405b"), ("mixtral-8x7b", "mixtral-8x7b"),
     ("qwen3-30b-a3b", "qwen3-30b-a3b"), ("deepseek-v3", "deepseek-v3"), ("deepseek-v3.2", "deepseek-v3.2"),
     ("kimi-k2", "kimi-k2"),
     ("gpt-oss-20b", "gpt-oss-20b"), ("gpt-oss-120b", "gpt-oss-120b"),
     ("qwen3-next-80b-a3b", "qwen3-next-80b-a3b")],
)  # fmt: skip
def test_mapping_builds_the_presets_architecture(name, preset):
    # the presets were written from the papers and Megatron-LM's recipes, independently
    args = read_hf_config(str(HF / f"{name}.json")).args
    # Megatron-Bridge leaves kv_channels at megatron's default under MLA, whose head sizes are
    # qk_head_dim and v_head_dim; Megatron-LM's DeepSeek-V3 recipe passes --kv-channels 128.
    lengths = ("seq_length", "max_position_embeddings", "transformer_impl", "kv_channels")
    expected = {k: v for k, v in PRESETS[preset].args.items() if k not in lengths}
    assert {k: args.get(k) for k in expected} == expected


def test_the_tool_builds_the_mapped_model(cli):
    result = cli("params", "--hf-config", str(HF / "llama3.1-8b.json"), "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    assert sum(math.prod(r["global_shape"]) for r in rows if not r["tied"]) == 8_030_261_248
    assert "Ignored from" in result.err and "rope_theta" in result.err


def test_config_detects_a_hugging_face_file(cli):
    hf = cli("params", "--hf-config", str(HF / "qwen3-8b.json"))
    detected = cli("params", "--config", str(HF / "qwen3-8b.json"))
    assert detected.out == hf.out
    assert "read as a Hugging Face config.json (it has architectures/model_type)" in detected.err


def write(tmp_path: Path, **changes: object) -> str:
    config = json.loads((HF / "llama3.1-8b.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_unknown_keys_are_listed(tmp_path):
    parsed = read_hf_config(write(tmp_path, my_key=1, other_key="x"))
    assert parsed.notes[-1] == ("keys this tool does not know (check they change nothing a GPU "
                                "holds): my_key other_key")  # fmt: skip


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
         "Gemma2ForCausalLM (model_type gemma2) is not modelled: Gemma 2's sliding-window layers, "
         "logit soft-capping and extra norms are not modelled"),
        ({"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"]},
         "GlmMoeDsaForCausalLM (model_type glm_moe_dsa) is not modelled: GLM-5's sparse-attention "
         "indexer (no Hadamard rotation, interleaved RoPE, its own k-norm epsilon, the top-k "
         "shared across layers) is not modelled; DeepSeek-V3.2's is"),
        ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
         "Phi3ForCausalLM (model_type 'phi3') is not an architecture this tool maps; it maps "
         "Llama (llama), Mistral (mistral), Mixtral (mixtral), Qwen2 (qwen2), Qwen3 (qwen3), "
         "Qwen3-MoE (qwen3_moe), DeepSeek-V3 (deepseek_v3), Kimi-K2 (kimi_k2), DeepSeek-V3.2 "
         "(deepseek_v32), gpt-oss (gpt_oss), "
         "Nemotron-H (nemotron_h), Qwen3-Next (qwen3_next), as Megatron-Bridge does"),
    ],
)  # fmt: skip
def test_architectures_refused_by_name(tmp_path, changes, message):
    path = write(tmp_path, **changes)
    with pytest.raises(InputError) as error:
        read_hf_config(path)
    assert str(error.value) == f"{path}: {message}"


def test_values_that_build_another_model_are_refused_together(cli, tmp_path):
    path = write(tmp_path, sliding_window=4096, hidden_act="gelu")
    result = cli("params", "--hf-config", path)
    assert result.err == (
        f'Error: {path}: "hidden_act": gelu is not modelled: a gated MLP with another activation '
        'is not modelled; --swiglu (silu) is; "sliding_window": 4096 is not modelled: '
        "sliding-window attention changes attention FLOPs and scores (--window-size is refused)\n"
    )


def test_flags_override_the_hf_config(cli):
    path = str(HF / "qwen3-8b.json")
    result = cli("params", "--hf-config", path, "--num-layers", "2", "--format", "json")
    assert json.loads(result.out)["header"]["config"]["num_layers"] == 2


def test_not_an_hf_config(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"num_layers": 2}')
    with pytest.raises(InputError) as error:
        read_hf_config(str(path))
    assert str(error.value) == (f'{path}: --hf-config takes a Hugging Face config.json (with '
                                '"architectures" and "model_type")')  # fmt: skip


def test_gpt_oss_window_pattern_other_than_the_bridges_is_refused(tmp_path):
    config = json.loads((HF / "gpt-oss-20b.json").read_text())
    config["layer_types"] = ["full_attention"] * 24
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    parsed = read_hf_config(str(path))
    assert [r.argument for r in parsed.refused] == ['"layer_types": ...']
    # the published file: the bridge's window (sliding_window - 1, 0) on every other layer
    args = read_hf_config(str(HF / "gpt-oss-20b.json")).args
    assert (args["window_size"], args["window_attn_skip_freq"]) == ("127,0", 2)
    assert (args["position_embedding_type"], args["rotary_scaling_factor"]) == ("yarn", 32.0)
