"""FLOPs against Megatron-LM's `num_floating_point_operations`, evaluated by hand."""

from __future__ import annotations

import pytest

from inspector.errors import ConfigError
from inspector.formulas.flops import (
    iteration_flops,
    layer_flops,
    logit_flops,
    rank_flops,
    seconds_for,
    stage_flops,
)
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout


def megatron_flops(
    batch: int,
    s: int,
    layers: int,
    h: int,
    a: int,
    g: int,
    d: int,
    f: int,
    v: int,
    swiglu: bool = False,
    moe_layers: int = 0,
    moe_f: int = 0,
    topk: int = 0,
    shared_f: int = 0,
) -> float:
    """Evaluate `transformer_flops` of megatron/training/training.py (core_v0.16.1) by hand."""
    expansion = 3 if swiglu else 2
    q, kv = d * a, d * g
    self_attn = 3 * 2 * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)  # qkv, core (causal), out
    mlp = (
        3
        * 2
        * h
        * (
            f * expansion * (layers - moe_layers)
            + (moe_f * topk * expansion + shared_f * expansion) * moe_layers
        )
    )
    return batch * s * (mlp + self_attn * layers + 3 * 2 * h * v)


def test_gpt3_175b() -> None:
    batch, s, L, h, v = 1536, 2048, 96, 12288, 51200
    dims = ModelDims(L, h, 96, s, v)
    expected = megatron_flops(batch, s, L, h, 96, 96, 128, 4 * h, v)
    assert iteration_flops(dims, batch) == pytest.approx(expected, rel=1e-12)
    # The classic closed form with the causal half: 72 B s L h^2 (1 + s/(12h) + v/(12hL)).
    closed = 72 * batch * s * L * h**2 * (1 + s / (12 * h) + v / (12 * h * L))
    assert iteration_flops(dims, batch) == pytest.approx(closed, rel=1e-12)
    # By hand, per token: 96 layers x (72h^2 + 6hs = 11,022,630,912) + logits 6hv (3,774,873,600).
    assert iteration_flops(dims, batch) / (batch * s) == 1_061_947_441_152


def test_llama3_70b_gqa_swiglu() -> None:
    batch, s, L, h, a, g, f, v = 512, 8192, 80, 8192, 64, 8, 28672, 128256
    dims = ModelDims(L, h, a, s, v, ffn_hidden_size=f, num_query_groups=g, swiglu=True)
    expected = megatron_flops(batch, s, L, h, a, g, 128, f, v, swiglu=True)
    assert iteration_flops(dims, batch) == pytest.approx(expected, rel=1e-12)
    # By hand, per token and layer: projections 6hd(a + 2g) + 6adh = 905,969,664, core attention
    # 6ads = 402,653,184, SwiGLU MLP 6hf * 3 = 4,227,858,432; 80 layers plus logits 6hv.
    per_token = 80 * (905_969_664 + 402_653_184 + 4_227_858_432) + 6 * 8192 * 128256
    assert per_token == 449_222_541_312  # ~6 x 69.5e9 non-embedding params + attention
    assert iteration_flops(dims, batch) / (batch * s) == per_token


def test_mixtral_top2_moe() -> None:
    batch, s, L, h, a, g, f, v = 256, 4096, 32, 4096, 32, 8, 14336, 32000
    dims = ModelDims(
        L,
        h,
        a,
        s,
        v,
        num_query_groups=g,
        swiglu=True,
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=f,
    )
    expected = megatron_flops(
        batch, s, L, h, a, g, 128, 4 * h, v, swiglu=True, moe_layers=L, moe_f=f, topk=2
    )
    assert iteration_flops(dims, batch) == pytest.approx(expected, rel=1e-12)


def test_moe_with_dense_layers_and_shared_experts() -> None:
    # DeepSeek-like: first layer dense (pattern), shared expert, top-6 of 64.
    L, h, s, v = 4, 2048, 4096, 102400
    pattern = (0, 1, 1, 1)
    dims = ModelDims(
        L,
        h,
        16,
        s,
        v,
        ffn_hidden_size=10944,
        swiglu=True,
        num_experts=64,
        moe_router_topk=6,
        moe_ffn_hidden_size=1408,
        moe_shared_expert_intermediate_size=2816,
        moe_layer_freq=pattern,
    )
    expected = megatron_flops(
        8,
        s,
        L,
        h,
        16,
        16,
        128,
        10944,
        v,
        swiglu=True,
        moe_layers=3,
        moe_f=1408,
        topk=6,
        shared_f=2816,
    )
    assert iteration_flops(dims, 8) == pytest.approx(expected, rel=1e-12)
    assert layer_flops(dims, 0, 1).mlp == 6 * s * h * 10944 * 3


def test_stages_sum_to_the_iteration() -> None:
    dims = ModelDims(24, 2048, 16, 2048, 50304)
    stages = [range(0, 6), range(6, 12), range(12, 18), range(18, 24)]
    per_stage = [stage_flops(dims, layers, 64, i == 3) for i, layers in enumerate(stages)]
    assert sum(per_stage) == pytest.approx(iteration_flops(dims, 64), rel=1e-12)
    assert per_stage[3] - per_stage[0] == pytest.approx(logit_flops(dims, 64))
    # One layer: 72 B s h^2 (1 + s/(12h)) with B = 64.
    assert layer_flops(dims, 0, 64).total == pytest.approx(72 * 64 * 2048 * 2048**2 * (1 + 1 / 12))


def test_rank_share_and_time() -> None:
    par = Layout(tp=8, pp=4, dp=16, cp=2)
    assert rank_flops(2.56e18, par) == 1e16
    # 1e18 FLOPs on 1000 GPUs of 1000 TFLOP/s at 50% MFU: 2 seconds.
    assert seconds_for(1e18, 1000, 1000.0, 0.5) == pytest.approx(2.0)


def test_mfu_out_of_range() -> None:
    # MFU is a fraction of peak.
    with pytest.raises(ConfigError, match="--mfu"):
        seconds_for(1e18, 8, 989.0, 45.0)


def test_gpu_tflops_not_positive() -> None:
    # A GPU without throughput never finishes.
    with pytest.raises(ConfigError, match="--gpu-tflops"):
        seconds_for(1e18, 8, 0.0, 0.4)
