"""Transformer Engine's userbuffers in `plan`'s time (`--tp-comm-overlap`, inspector/plan/
userbuffers.py): each tensor-parallel collective beside the GEMM TE pairs it with, by TE's
default method for that linear (module/base.py `initialize_ub`)."""

from __future__ import annotations

import pytest

import inspector.caches as caches
from inspector.formulas.ops import Shard
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS
from inspector.job.layout import Layout
from inspector.plan import cost
from inspector.plan.network import Network
from inspector.plan.userbuffers import BACKWARD, FORWARD, pair_seconds, userbuffers_seconds

NET = Network(GPUS["h100"], 8)
# a Llama-like TE layer: h 8192, 64 heads, 8 groups, sequence 8192, SwiGLU, flash attention
DENSE = ModelDims(1, 8192, 64, 8192, 128256, num_query_groups=8, ffn_hidden_size=28672, swiglu=True,
                  flash_attention=True, rotary=True, te_attention=True, add_bias_linear=False)  # fmt: skip


def test_each_method_exposes_what_its_schedule_leaves() -> None:
    # ring exchange, tp 4: three chunks' sends beside three of the four GEMM chunks
    assert pair_seconds("ring_exchange", 1.0, 0.5, 4, 132) == 0.0
    assert pair_seconds("ring_exchange", 1.0, 1.0, 4, 132) == pytest.approx(0.25)
    # pipeline: the GEMM on 132 - 16 SMs, 4 splits, the last split's reduce-scatter exposed
    slowed = 132 / 116
    assert pair_seconds("pipeline", 1.0, 0.5, 4, 132) == pytest.approx(slowed + 0.5 / 4 - 1)
    # bulk: all of the collective beside all of the GEMM on 132 - 16 SMs
    assert pair_seconds("bulk", 1.0, 2.0, 4, 132) == pytest.approx(1.0)
    assert pair_seconds("bulk", 1.0, 0.1, 4, 132) == pytest.approx(slowed - 1)


def test_every_collective_of_a_dense_layer_has_its_pair() -> None:
    # TE's default methods: 4 collectives forward, 4 backward and the 2 weight-gradient gathers
    # (Korthikanti et al.'s 4 + 4 with sequence parallelism, network.regather_seconds' 2), each
    # beside a GEMM the layer runs (formulas/ops.py's names)
    from inspector.plan.kernel_seconds import layer_kernels

    assert [name for name, *_ in FORWARD] == ["qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop"]
    assert sorted(method for _, method, *_ in BACKWARD) == ["bulk"] * 4 + ["ring_exchange"] * 2
    ops = layer_kernels(DENSE, Shard(4, 1, 1, 4, True, 1), False)
    names = {op.name for op in (*ops.forward, *ops.backward)}
    assert {gemm for _, _, gemm, _ in (*FORWARD, *BACKWARD)} <= names
    assert len(FORWARD) + len(BACKWARD) == 4 + 4 + 2


def _tensor(dims: ModelDims) -> float:
    caches.clear()
    lay = Layout(tp=4, dp=2, sequence_parallel=True)
    return cost.stage_work(dims, lay, NET, None, 1, "none", [[0]], False).tensor


def test_the_overlap_hides_a_big_layer_s_collectives() -> None:
    from dataclasses import replace

    plain, overlapped = _tensor(DENSE), _tensor(replace(DENSE, tp_comm_overlap=True))
    # what stays: the 16 SMs the pipeline and bulk pairs take from their GEMMs, a split exposed
    assert 0 < overlapped < plain
    shard = Shard(4, 1, 1, 4, True, 1)
    lay = Layout(tp=4, dp=2, sequence_parallel=True)
    dims = replace(DENSE, tp_comm_overlap=True)
    once = userbuffers_seconds(dims, lay, NET, shard, False, 0.0, "none", ())
    again = userbuffers_seconds(dims, lay, NET, shard, False, 0.0, "full", ())
    assert again > once  # the recomputed forward runs its pairs again
    assert overlapped == pytest.approx(once)


def test_plan_prices_and_prints_the_overlap() -> None:
    from tests.conftest import run_cli

    args = ["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "4", "--pp", "1",
            "--sequence-parallel", "--global-batch-size", "8", "--micro-batch-size", "1", "--bf16",
            "--top", "1", "--format", "json", "--no-cache"]  # fmt: skip
    import json

    plain = json.loads(run_cli(*args).out)["plans"][0]
    overlapped = json.loads(run_cli(*args, "--tp-comm-overlap").out)["plans"][0]
    assert "--tp-comm-overlap" in overlapped["flags"] and "--tp-comm-overlap" not in plain["flags"]
    assert overlapped["time_shares"]["tensor"] < plain["time_shares"]["tensor"]
