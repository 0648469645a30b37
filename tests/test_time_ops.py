"""The step-time model prices the GEMMs megatron runs: formulas/ops.py's list of one layer's
matrix products (and the output layer's), forward and backward, against every `mm`, `addmm`,
`bmm` and `baddbmm` megatron-core's own code dispatches in one micro-batch on meta tensors
(the engine's run, local layer spec), FLOP for FLOP; recomputation adds what it re-runs."""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from typing import Any
from unittest import mock

import pytest

from inspector.inputs.versions import megatron_core_version
from tests.test_engine import _MOE, _MOE_TP1, _job


@functools.cache  # a job asked again (the recompute tests' baselines are CASES' jobs) runs once
def _recorded_gemm_flops(job: Any) -> dict[str, int]:
    """Run one micro-batch of the job's first stage; return 2 m n k per kind of product."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron

    aten = torch.ops.aten
    flops: collections.Counter[str] = collections.Counter()

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kind = func.overloadpacket
            if kind in (aten.mm, aten.bmm):
                a, b = args[0], args[1]
            elif kind in (aten.addmm, aten.baddbmm):
                a, b = args[1], args[2]
            else:
                return func(*args, **(kwargs or {}))
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            flops[kind.__name__] += 2 * batch * m * n * k
            return func(*args, **(kwargs or {}))

    megatron()
    # megatron-core 0.19's MoE router multiplies through Transformer Engine's general_gemm
    # (extensions/transformer_engine.py te_general_gemm, which looks `general_gemm` up when it
    # runs): cuBLAS's product, which no aten op shows, counted from its operands' shapes
    te = sys.modules.get("megatron.core.extensions.transformer_engine")
    original = getattr(te, "general_gemm", None)

    def counted(A, B, *args, layout="TN", **kwargs):  # type: ignore[no-untyped-def]
        rows = B.shape[-1] if layout[1] == "T" else B.shape[0]
        cols = A.shape[-1] if layout[0] == "N" else A.shape[0]
        inner = B.shape[0] if layout[1] == "T" else B.shape[-1]
        flops["te_general_gemm"] += 2 * rows * cols * inner
        return original(A, B, *args, layout=layout, **kwargs)

    with contextlib.ExitStack() as stack:
        if original is not None:
            stack.enter_context(mock.patch.object(te, "general_gemm", counted))
        stack.enter_context(Products())
        trace_stage(job, 0)
    return dict(flops)


def _priced(job: Any) -> tuple[int, int, int]:
    """Return formulas/ops.py's GEMM FLOPs: a layer and the output (forward + backward), the
    layer's forward, and what selective recomputation of the job's modules repeats."""
    from inspector.formulas.kernels import Gemm
    from inspector.formulas.ops import Shard, layer_ops, output_ops

    dims, lay = job.dims(), job.layout
    shard = Shard(tp=lay.tp, cp=lay.cp, ep=lay.ep, etp=lay.expert_tp,
                  sequence_parallel=lay.sequence_parallel,
                  micro_batch=job.schedule().micro_batch_size)  # fmt: skip
    layer = layer_ops(dims, shard, dims.num_experts is not None)
    output = output_ops(dims, shard)

    def gemms(ops: Any) -> int:
        return sum(op.flops for op in ops if isinstance(op, Gemm))

    total = sum(gemms(p.forward) + gemms(p.backward) for p in (layer, output))
    again = gemms(layer.recomputed(job.training.recompute_modules))
    return total, gemms(layer.forward), again


ONE = {"num_layers": 1, "pipeline_model_parallel_size": 1}
CASES = {
    "gelu-bias-tp2": {},
    "swiglu-gqa": {"swiglu": True, "group_query_attention": True, "num_query_groups": 2,
                   "disable_bias_linear": True},
    "sequence-parallel": {"sequence_parallel": True},
    "moe-tp1": {**_MOE_TP1, "data_parallel_size": 1},
    "moe-ep2-sp": {**_MOE, "data_parallel_size": 2, "expert_model_parallel_size": 2},
    "micro-batch-3": {"micro_batch_size": 3, "global_batch_size": 6},
}  # fmt: skip


@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_priced_gemms_are_the_products_megatron_runs(flags):
    job = _job(**{**flags, **ONE})
    recorded = _recorded_gemm_flops(job)
    assert set(recorded) >= {"mm", "bmm", "baddbmm"}  # linears, attention's scores and context
    assert sum(recorded.values()) == _priced(job)[0]


@pytest.mark.parametrize(("granularity", "repeated"), [("full", 1), ("selective", 2)])
def test_recomputation_adds_the_forward_it_repeats(granularity, repeated):
    """Full: the checkpointed layer's whole forward again (CheckpointFunction); selective: core
    attention's products again (megatron-core's default --recompute-modules core_attn)."""
    job = _job(recompute_granularity=granularity, **ONE)
    total, forward, core = _priced(job)
    again = (forward, core)[repeated - 1]
    assert sum(_recorded_gemm_flops(job).values()) == total + again


_ONE_RANK = {"data_parallel_size": 1}
_EXPERTS = {**_MOE_TP1, **_ONE_RANK}
MODULES = {
    "mlp": ({"disable_bias_linear": True}, "mlp", True),
    "core_attn-mlp": ({"disable_bias_linear": True, "swiglu": True}, "core_attn mlp", True),
    "layernorm": ({}, "layernorm", False),
    "moe": (_EXPERTS, "moe", True),
    "moe-ep2-sp": ({**_MOE, "data_parallel_size": 2, "expert_model_parallel_size": 2}, "moe", True),
    "moe_act": ({**_EXPERTS, "moe_grouped_gemm": True}, "moe_act", False),
    "mlp-on-moe": (_EXPERTS, "mlp", False),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "modules", "gemms"), MODULES.values(), ids=MODULES.keys())
def test_recompute_modules_add_the_products_megatron_runs_again(flags, modules, gemms):
    """Each --recompute-modules module re-runs its forward before its backward (formulas/ops.py
    RECOMPUTED): mlp the dense MLP's fc1 and fc2, moe the router, experts and shared experts;
    layernorm and moe_act re-run no product, and mlp nothing on an MoE layer (megatron checkpoints
    a dense layer's MLP only)."""
    job = _job(**{**flags, **ONE}, recompute_granularity="selective", recompute_modules=modules)
    total, _, again = _priced(job)
    assert (again > 0) == gemms
    recorded = sum(_recorded_gemm_flops(job).values())
    assert recorded - sum(_recorded_gemm_flops(_job(**{**flags, **ONE})).values()) == again
    if not flags.get("moe_grouped_gemm"):  # the grouped-GEMM stand-in dispatches no aten product
        assert recorded == total + again


@pytest.mark.skipif(megatron_core_version() < (0, 14), reason="shared_experts from 0.14")
def test_shared_experts_recompute_adds_the_shared_mlp_products():
    """moe_layer.py shared_experts_compute checkpoints the shared expert MLP: its fc1 and fc2 run
    again (megatron-core lists shared_experts from 0.14)."""
    flags = {**_EXPERTS, **ONE, "moe_shared_expert_intermediate_size": 64,
             "recompute_granularity": "selective"}  # fmt: skip
    job = _job(**flags, recompute_modules="shared_experts")
    total, _, again = _priced(job)
    tokens = job.dims().seq_length * job.schedule().micro_batch_size
    assert again == 2 * tokens * job.dims().hidden_size * 64 * 3  # fc1 (2 x 64, SwiGLU) and fc2
    assert sum(_recorded_gemm_flops(job).values()) == total + again
    # with moe too, the recomputed MoE layer checkpoints its shared experts again: both add up
    both = _job(**flags, recompute_modules="moe shared_experts")
    moe = _priced(_job(**flags, recompute_modules="moe"))[2]
    assert sum(_recorded_gemm_flops(both).values()) == total + moe + again


_MLA = {"multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16,
        "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "normalization": "RMSNorm",
        "position_embedding_type": "rope", "disable_bias_linear": True,
        "transformer_impl": "transformer_engine", **ONE}  # fmt: skip


def _te_forward_gemms(job: Any) -> list[tuple[int, int, int]]:
    """Run one micro-batch; return (rows, out, in) of every Transformer Engine forward GEMM (the
    stand-in allocates their outputs: no aten product to count)."""
    from unittest import mock

    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron
    from inspector.world.te.kernels import functions

    calls: list[tuple[int, int, int]] = []
    real = functions._forward_gemm

    def spy(ln_out: Any, weight: Any, setup: Any) -> Any:
        rows = ln_out.shape[0] * (setup.tp_size if setup.gathers_input else 1)
        calls.append((rows, weight.shape[0], weight.shape[1]))
        return real(ln_out, weight, setup)

    megatron()
    with mock.patch.object(functions, "_forward_gemm", spy):
        trace_stage(job, 0)
    return calls


@pytest.mark.parametrize("flags", [{}, {"sequence_parallel": True}, {"q_lora_rank": None}],
                         ids=["latents", "sequence-parallel", "no-q-latent"])
def test_mla_projections_are_the_gemms_megatron_runs_and_mla_up_proj_repeats_the_up_ones(flags):
    """formulas/ops.py splits multi-latent attention as MLASelfAttention runs it: the duplicated
    down projections on the rank's rows (s b / t with sequence parallelism), the column-parallel
    up projections on all rows, the row-parallel output; `--recompute-modules mla_up_proj` runs
    the two up projections' forward again (CheckpointWithoutOutput, `recompute_up_proj`)."""
    if megatron_core_version() < (0, 16):  # the version difference: tests/test_te_engine.py
        pytest.skip("megatron-core before 0.16 runs the fused MLA RoPE only under "
                    "--enable-experimental")  # fmt: skip
    from inspector.formulas.kernels import Gemm
    from inspector.formulas.ops import Shard, layer_ops

    job = _job(**{**_MLA, **flags})
    lay = job.layout
    shard = Shard(tp=lay.tp, sequence_parallel=lay.sequence_parallel,
                  micro_batch=job.schedule().micro_batch_size)  # fmt: skip
    ops = layer_ops(job.dims(), shard, False)
    priced = sorted((op.m, op.n, op.k) for op in ops.forward
                    if isinstance(op, Gemm) and op.name not in ("Q K^T", "P V"))  # fmt: skip
    assert sorted(_te_forward_gemms(job)) == priced and len(priced) == 7 - (flags == {"q_lora_rank": None})
    asked = _job(**{**_MLA, **flags}, recompute_granularity="selective", recompute_modules="mla_up_proj")
    again = [(op.m, op.n, op.k) for op in ops.recomputed(("mla_up_proj",)) if isinstance(op, Gemm)]
    recorded = collections.Counter(_te_forward_gemms(asked))
    recorded.subtract(collections.Counter(priced))
    assert sorted(recorded.elements()) == sorted(again) and len(again) == 2
