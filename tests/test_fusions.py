"""Megatron-LM's fusion switches (`--no-bias-gelu-fusion`, `--no-bias-swiglu-fusion`,
`--no-bias-dropout-fusion`, `--no-rope-fusion`, `--no-masked-softmax-fusion`,
`--no-gradient-accumulation-fusion`) reach the TransformerConfig the engine runs, as
Megatron-LM's `core_transformer_config_from_args` and `validate_args` set them."""

from __future__ import annotations

import pytest

from inspector.job.versions import etp_bias_refused
from tests.test_engine import _job


def _config(**flags):
    from inspector.memory.engine.runtime import runtime_config

    return runtime_config(_job(**flags))


@pytest.mark.parametrize(("flags", "fused"), [
    ({}, True),  # gelu with linear biases: fused by default
    ({"no_bias_gelu_fusion": True}, False),
    ({"disable_bias_linear": True}, False),  # validate_args: no biases, no bias-gelu fusion
    ({"swiglu": True, "disable_bias_linear": True}, True),  # bias_swiglu_fusion, biases or not
    ({"swiglu": True, "no_bias_swiglu_fusion": True}, False),
    ({"swiglu": True, "no_bias_gelu_fusion": True}, True),  # the gelu switch leaves swiglu alone
    ({"no_bias_swiglu_fusion": True}, True),  # and the swiglu switch leaves gelu alone
])  # fmt: skip
def test_bias_activation_fusion_follows_megatron_lm(flags, fused):
    assert _config(**flags)["bias_activation_fusion"] is fused


@pytest.mark.parametrize("flags", [
    {}, {"no_bias_gelu_fusion": True}, {"no_bias_dropout_fusion": True},
    {"disable_bias_linear": True}, {"swiglu": True, "no_bias_swiglu_fusion": True},
])  # fmt: skip
def test_step_time_prices_the_fusions_and_biases_the_engine_runs(flags):
    # formulas/ops.py picks the bias kernels from ModelDims: the same switches as the engine's
    # TransformerConfig, or plan would price a fused kernel where megatron runs three
    config, dims = _config(**flags), _job(**flags).dims()
    assert dims.bias_activation_fusion is config["bias_activation_fusion"]
    assert dims.bias_dropout_fusion is config["bias_dropout_fusion"]
    assert dims.add_bias_linear is not flags.get("disable_bias_linear", False)


def test_each_switch_turns_off_its_own_fusion_only():
    te = {"transformer_impl": "transformer_engine", "position_embedding_type": "rope"}
    base = _config(**te)
    assert base["bias_dropout_fusion"] and base["apply_rope_fusion"]
    assert base["masked_softmax_fusion"] and base["gradient_accumulation_fusion"]
    for flag, field in (("no_bias_dropout_fusion", "bias_dropout_fusion"),
                        ("no_rope_fusion", "apply_rope_fusion"),
                        ("no_masked_softmax_fusion", "masked_softmax_fusion"),
                        ("no_gradient_accumulation_fusion", "gradient_accumulation_fusion")):  # fmt: skip
        changed = _config(**te, **{flag: True})
        assert {k for k in base if base[k] != changed[k]} == {field}, flag


def test_the_unfused_bias_gelu_runs_megatron_s_other_path():
    """The fused bias-GeLU (fused_bias_gelu.py, a TorchScript function) runs op by op on meta
    tensors; the unfused path is MLP.forward's `bias + activation`: fewer allocations, the same
    tensors held for backward (fc2's input and GeLU's input)."""
    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron

    megatron()
    one = {"pipeline_model_parallel_size": 1, "num_layers": 1}
    fused = trace_stage(_job(**one), 0)[0]
    unfused = trace_stage(_job(**one, no_bias_gelu_fusion=True), 0)[0]
    assert len(unfused.forward) < len(fused.forward)
    assert unfused.held == fused.held


def test_moe_with_biases_runs_once_the_fusion_is_off(cli):
    """megatron-core 0.16's MLP fuses an expert's bias and GeLU only without the router's
    per-token scales; `--no-bias-gelu-fusion` takes its unfused path (megatron-core 0.13 refuses
    biases in MoE layers outright)."""
    moe = ["memory", "--micro-batch-size", "1", "--num-layers", "2", "--num-experts", "4",
           "--dp", "2", "--expert-model-parallel-size", "2", "--no-cache"]  # fmt: skip
    fused = cli(*moe)
    assert fused.code == 2
    unfused = cli(*moe, "--no-bias-gelu-fusion")
    if not etp_bias_refused():
        assert unfused.code == 2 and "Bias is not supported for MoE" in unfused.err
        return
    assert "per_token_scale" in fused.err
    assert unfused.code == 0, unfused.err
    assert "megatron's forward, backward and optimizer step run" in unfused.out


def test_plan_keeps_the_fusion_switches_and_memory_confirms_its_plan(cli):
    import json

    model = ["--num-experts", "4", "--num-layers", "4", "--no-bias-gelu-fusion"]
    found = cli("plan", "--gpus", "8", "--global-batch-size", "64", "--top", "1", "--format",
                "json", "--no-cache", *model)
    if not etp_bias_refused():  # megatron-core 0.13: no biases in MoE layers
        assert found.code == 2 and "--disable-bias-linear" in found.err
        return
    assert found.code == 0, found.err
    [plan] = json.loads(found.out)["plans"]
    assert "--no-bias-gelu-fusion" in plan["flags"]
