"""gpt-oss as megatron-core builds and runs it: attention sinks, sliding-window layers, the
clamped quick-GELU GLU with biased experts, YaRN positions (presets and configs: test_presets.py,
test_hf.py; Megatron-LM's examples/gptoss script: test_launch_examples.py)."""

from __future__ import annotations

import pytest

from tests.composition import assert_composed_equals_whole
from tests.test_engine import _job
from tests.test_versions import GPT_OSS as BUILDS

pytestmark = pytest.mark.skipif(not BUILDS, reason="gpt-oss's layers need megatron-core 0.15")

# gpt-oss's flags, small (Megatron-LM examples/gptoss/02_train.sh and Megatron-Bridge's
# gpt_oss_bridge.py): biased experts need expert tp 1 and no bias-dropout fusion in TEGroupedMLP
GPT_OSS = dict(
    transformer_impl="transformer_engine", normalization="RMSNorm", quick_geglu=True,
    glu_linear_offset=1.0, activation_func_clamp_value=7.0, softmax_type="learnable",
    window_size="3,0", window_attn_skip_freq=2, position_embedding_type="yarn",
    rotary_scaling_factor=32.0, num_experts=4, moe_router_topk=2, moe_grouped_gemm=True,
    moe_ffn_hidden_size=64, num_layers=4, expert_model_parallel_size=2,
    moe_token_dispatcher_type="alltoall", sequence_parallel=True, expert_tensor_parallel_size=1,
    no_bias_dropout_fusion=True, no_bias_gelu_fusion=True, group_query_attention=True,
    num_query_groups=2, moe_router_load_balancing_type="none",
)  # fmt: skip


def _stage0(job):
    from inspector.world.build import View, build

    return build(job, View((0,)), expert_ranks=(0,)).stages[0].chunks[0].module


def test_megatron_builds_sinks_windows_and_yarn():
    # megatron-core transformer/utils.py `is_layer_window_attention`: layer_number % 2 != 0 is
    # windowed; TE's DotProductAttention keeps (-1, 0) for a full causal layer
    model = _stage0(_job(**GPT_OSS))
    attention = [m for n, m in model.named_modules() if n.endswith("core_attention")]
    assert [a.window_size for a in attention] == [(3, 0), (-1, 0)]
    assert [tuple(a.softmax_offset.shape) for a in attention] == [(2,), (2,)]  # 4 heads / tp 2
    assert type(model.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    assert model.rotary_pos_emb.scaling_factor == 32.0
    experts = model.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "TEGroupedMLP" and experts.linear_fc1.use_bias


def test_the_clamped_glu_is_megatrons_own():
    """mlp.py / experts.py `glu`: the clamp keeps its inputs for backward, so the peak grows."""
    from inspector.memory.engine.run import run_memory

    clamped = run_memory(_job(**GPT_OSS), 0)
    plain = run_memory(_job(**{**GPT_OSS, "activation_func_clamp_value": None}), 0)
    assert clamped.peak.bytes > plain.peak.bytes


def test_composed_gpt_oss_stage_equals_every_layer_run():
    """A windowed and a full layer save the same (TE's fused kernel keeps no s x s scores)."""
    assert_composed_equals_whole(_job(**GPT_OSS))


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(swiglu=True), "--quick-geglu and --swiglu are mutually exclusive"),
        (dict(window_size=None), "--window-attn-skip-freq needs --window-size"),
        (dict(window_size="3"), "--window-size needs two integers"),
        (dict(window_attn_skip_freq="[1,0]"), "--window-attn-skip-freq lists 2 layers but "
         "--num-layers is 4"),
    ],
)  # fmt: skip
def test_bad_gpt_oss_flags(flags, message):
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        _job(**{**GPT_OSS, **flags})


def test_memory_runs_the_preset_and_megatrons_refusal_stays_megatrons(cli):
    base = ("memory", "--model", "gpt-oss-20b", "--num-layers", "2", "--bf16",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--use-distributed-optimizer")  # fmt: skip
    # Megatron-LM's default --bias-dropout-fusion: TEGroupedMLP refuses biases with it
    refused = cli(*base)
    assert refused.code == 2
    assert "bias_dropout_fusion is not supported in TEGroupedMLP" in refused.err
    result = cli(*base, "--no-bias-dropout-fusion")
    assert result.code == 0, result.err
    assert "megatron's forward, backward and optimizer step run on meta tensors" in result.out


def test_yarn_takes_megatron_lms_rope_fusion():
    # Megatron-LM's --rope-fusion default reaches GPTModel's yarn branch as its rope branch
    from inspector.memory.engine.runtime import runtime_config

    assert runtime_config(_job(**GPT_OSS))["apply_rope_fusion"] is True
    assert runtime_config(_job(**GPT_OSS, no_rope_fusion=True))["apply_rope_fusion"] is False
