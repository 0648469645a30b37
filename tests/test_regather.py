"""The weight gradients' all-gathers of sequence-parallel column-parallel linears (plan/network.py
`regather_seconds`): Transformer Engine's `_Linear.backward` / `_LayerNormLinear.backward` gather
the saved T / t rows again, beside the data-gradient GEMM; what the gather takes beyond that GEMM
is exposed."""

from __future__ import annotations

import pytest

import inspector.caches as caches
from inspector.formulas.kernels import ops_seconds
from inspector.formulas.ops import linear
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS
from inspector.job.layout import Layout
from inspector.plan.cost import _layer_time
from inspector.plan.network import Network

# a Llama-3-8B layer: h 4096, 32 heads in 8 groups of 128, fc1 2 x 14336, 8192 tokens
LLAMA = ModelDims(1, 4096, 32, 8192, 128256, ffn_hidden_size=14336, num_query_groups=8,
                  swiglu=True, flash_attention=True, rotary=True, te_attention=True)  # fmt: skip
TOKENS, H = 8192, 4096


def _one(net: Network, tp: int, width: int) -> float:
    """A ring collective of TOKENS x width 16-bit elements over tp ranks (alpha + bytes (t-1)/t / B)."""
    alpha, bandwidth = net.link(tp)
    return alpha + TOKENS * width * 2 * (tp - 1) / tp / bandwidth


def _dgrad(name: str, fan_in: int, fan_out: int) -> float:
    return ops_seconds(linear(name, TOKENS, fan_in, fan_out)[1:2], GPUS["h100"])


def test_tp8_sequence_parallel_exposes_the_qkv_gather_beyond_its_dgrad() -> None:
    """At tp 8 QKV's data gradient (6 of 48 heads' columns, 768 wide) takes less than the gather
    of the 8192 x 4096 input: the rest is exposed; fc1's (3584 wide) hides its gather. Without
    sequence parallelism nothing is gathered again."""
    net, lay = Network(GPUS["h100"], 8), Layout(tp=8, dp=1, sequence_parallel=True)
    caches.clear()
    _, tensor, _, _ = _layer_time(LLAMA, lay, net, 0.0, 1, "none", 0)
    gather = _one(net, 8, H)
    qkv, fc1 = _dgrad("QKV", H, (4 + 2) * 128), _dgrad("MLP fc1", H, 2 * 14336 // 8)
    assert gather > qkv and gather < fc1  # the case this test is about
    assert tensor == pytest.approx(8 * gather + (gather - qkv))
    # without sequence parallelism the forward keeps the whole input: 8 all-reduces, no gather
    _, tensor, _, _ = _layer_time(LLAMA, Layout(tp=8, dp=1), net, 0.0, 1, "none", 0)
    alpha, bandwidth = net.link(8, 8)  # an all-reduce of 8 ranks: NVLink SHARP's bandwidth
    assert tensor == pytest.approx(8 * (alpha + TOKENS * H * 2 * 7 / 8 / bandwidth))


def test_across_nodes_both_gathers_are_exposed() -> None:
    """tp 16 over nodes of 8: InfiniBand's gathers outlast QKV's and fc1's data gradients."""
    net, lay = Network(GPUS["h100"], 8), Layout(tp=16, dp=1, sequence_parallel=True)
    caches.clear()
    _, tensor, _, _ = _layer_time(LLAMA, lay, net, 0.0, 1, "none", 0)
    gather = _one(net, 16, H)
    qkv, fc1 = _dgrad("QKV", H, (2 + 2 * 1) * 128), _dgrad("MLP fc1", H, 2 * 14336 // 16)
    assert tensor == pytest.approx(8 * gather + (gather - qkv) + (gather - fc1))
