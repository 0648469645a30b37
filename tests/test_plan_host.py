"""The host's pace in `plan` (inspector/plan/host.py; issue #45 item 2): the kernels a stage
launches and the layer passes megatron's Python runs per micro-batch, the GPU's wait where the
host is slower (max(GPU, host), per segment between the MoE dispatchers' host syncs), CUDA
graphs taking the layers' host cost away, and a big model left GPU-bound."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

import inspector.caches as caches
from inspector.formulas.kernels import Gemm
from inspector.formulas.ops import Shard
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS
from inspector.job.job import Training
from inspector.job.layout import Layout
from inspector.plan import cost, host
from inspector.plan.kernel_seconds import embedding_ops, output_kernels
from inspector.plan.network import Network

# a tiny Transformer Engine GPT: 2 layers, h 256, 4 heads, sequence 128, rotary, flash attention
TINY = ModelDims(2, 256, 4, 128, 1024, flash_attention=True, rotary=True, te_attention=True)
NET = Network(GPUS["h100"], 8)


def _work(dims: ModelDims = TINY, recompute: str = "none", **kwargs: object) -> cost.StageTime:
    caches.clear()
    return cost.stage_work(dims, Layout(tp=1, dp=1), NET, None, 1, recompute, [[0, 1]], True,
                           has_embedding=True, **kwargs)  # type: ignore[arg-type]  # fmt: skip


def _edges() -> tuple[int, int]:
    """Return the output layer's, loss's and embedding's kernels and GEMMs (formulas/ops.py)."""
    out = output_kernels(TINY, Shard(1, 1, 1, 1, False, 1))
    kernels = [*out.forward, *out.backward, *(op for ops in embedding_ops(TINY, Shard(1, 1, 1, 1, False, 1))
                                              for op in ops)]  # fmt: skip
    return len(kernels), sum(isinstance(op, Gemm) for op in kernels)


def test_a_tiny_layer_launches_the_kernels_counted_by_hand() -> None:
    """megatron-core's TE layer (transformer_layer.py), forward: input norm and QKV (TE
    LayerNormLinear: 2), fused RoPE (1), flash attention (1), the output projection (1), the
    bias-dropout-add (1), pre-MLP norm and fc1 (2), GeLU (1), fc2 (1), bias-dropout-add (1): 11, 4
    of them GEMMs (QKV, projection, fc1, fc2); backward: each GEMM's data and weight gradient
    (8), fc1's bias gradient, the two norms', the two bias-dropout-adds', GeLU's, RoPE's and flash
    attention's backward: 16. Two layers, each run forward and backward (2 passes), the output
    layer and loss on the last stage, the embedding on the first; full recomputation runs each
    layer's forward kernels and Python again."""
    (seg,) = _work().host.segments
    edges, edge_gemms = _edges()
    assert seg.units == (2 * (11 + 16) + edges, 2 * (4 + 8) + edge_gemms, 4, 0, 0)
    (full,) = _work(recompute="full").host.segments
    assert full.units == (2 * (11 + 16 + 11) + edges, 2 * (4 + 8 + 4) + edge_gemms, 6, 0, 0)


def test_the_gpu_waits_for_a_slower_host() -> None:
    # max(GPU, host) per segment: a host at 2 ms over 1 ms of GPU work makes the GPU wait 1 ms
    costs = (1e-4, 0.0, 0.0, 0.0, 0.0)
    one = host.HostWork((host.HostSegment(1e-3, (20, 0, 0, 0, 0)),))
    assert one.wait(costs) == pytest.approx(1e-3) and one.wait((4e-5, 0, 0, 0, 0)) == 0.0
    # a host sync (the MoE dispatcher's) ends a segment: the host's lead over the GPU in the
    # second cannot pay for the first's wait, as it would in one merged segment
    synced = host.HostWork((host.HostSegment(1e-3, (20, 0, 0, 0, 0), True),
                            host.HostSegment(2e-3, (10, 0, 0, 0, 0))))
    assert synced.wait(costs) == pytest.approx(1e-3)
    merged = host.merge(synced.segments, 0.0, (0, 0, 0, 0, 0))
    assert merged == synced
    assert host.HostWork((host.HostSegment(3e-3, (30, 0, 0, 0, 0)),)).wait(costs) == 0.0
    # the stage: its time per micro-batch is max(its GPU seconds, its host seconds)
    work = _work()
    gpu = work.compute + work.tensor + work.context + work.expert + work.p2p
    assert work.per_microbatch == pytest.approx(max(gpu, work.host.host()))
    assert work.host.host() == pytest.approx(sum(
        c * n for c, n in zip(host.COSTS, work.host.segments[0].units, strict=True)))
    assert work.host.host() > gpu  # this tiny layer is host-bound


def test_moe_layers_end_a_segment_where_their_dispatcher_syncs() -> None:
    moe = ModelDims(2, 256, 4, 128, 1024, flash_attention=True, te_attention=True, num_experts=4,
                    moe_ffn_hidden_size=128)  # type: ignore[arg-type]  # fmt: skip
    synced = _work(moe, host=(True, False)).host.segments
    # each MoE layer (the two of them one segment counted twice), then the rest
    assert [(s.sync, s.count) for s in synced] == [(True, 2), (False, 1)]
    each = host.HostWork((replace(synced[0], count=1),) * 2 + synced[1:])
    assert _work(moe, host=(True, False)).host.wait() == pytest.approx(each.wait())
    assert synced[0].units[3] == 2  # an MoE layer's two passes
    assert len(_work(moe, host=(False, False)).host.segments) == 1
    training = Training()
    assert host.host_syncs(replace(training, moe_token_dispatcher_type="alltoall"))
    assert host.host_syncs(replace(training, moe_token_dispatcher_type="allgather"))
    assert not host.host_syncs(replace(training, moe_token_dispatcher_type="alltoall",
                                       moe_expert_capacity_factor=1.0,
                                       moe_pad_expert_input_to_capacity=True))  # fmt: skip


def test_cuda_graphs_take_the_layers_host_cost_away() -> None:
    # megatron's graphs (--cuda-graph-impl, the whole layer) replay a layer's kernels from one
    # launch per pass, without its Python: only the output layer's and embedding's stay
    (seg,) = _work(host=(True, True)).host.segments
    edges, edge_gemms = _edges()
    assert seg.units == (4 + edges, edge_gemms, 0, 0, 0)
    assert _work(host=(True, True)).host.host() < _work().host.host() / 3
    training = Training()
    assert host.graphed_layers(replace(training, cuda_graph_impl="transformer_engine"))
    assert host.graphed_layers(replace(training, cuda_graph_impl="local", cuda_graph_scope=("full_iteration",)))
    assert not host.graphed_layers(replace(training, cuda_graph_impl="transformer_engine",
                                           cuda_graph_scope=("attn",)))  # fmt: skip
    assert not host.graphed_layers(training)


def test_a_big_layer_stays_gpu_bound() -> None:
    # the 7B functional test's layer (h 4096, sequence 8192, micro-batch 2, tp 4): the host's
    # launches take under half its GPU time, so the step is the GPU's, unchanged
    dims = ModelDims(2, 4096, 32, 8192, 131584, num_query_groups=8, flash_attention=True,
                     rotary=True, te_attention=True)  # fmt: skip
    caches.clear()
    work = cost.stage_work(dims, Layout(tp=4, dp=2), NET, None, 2, "none", [[0, 1]], False)
    assert work.wait == 0.0
    assert work.host.host() < (work.compute + work.tensor) / 2


def test_ci_goldens_calls_a_case_host_bound_where_its_busiest_stage_waits() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import ci_goldens

    def stage(gpu: float, host_seconds: float) -> cost.StageTime:
        units = tuple(host_seconds / c if c and i == 0 else 0.0 for i, c in enumerate(host.COSTS))
        work = host.HostWork((host.HostSegment(gpu, units),))
        return cost.StageTime(gpu, 0, 0, 0, 0, 0, 0, host=work, wait=work.wait())

    plan = SimpleNamespace(time=cost.StepTime(1.0, 1.0, 1.0, (stage(5e-4, 2.5e-3), stage(2e-3, 0.0))))
    assert ci_goldens.host_bound(plan)  # 2.5 ms of host against 0.5 ms of GPU: the busiest
    plan = SimpleNamespace(time=cost.StepTime(1.0, 1.0, 1.0, (stage(5e-4, 1e-3), stage(2e-3, 0.0))))
    assert not ci_goldens.host_bound(plan)  # the busiest stage is the GPU-bound one


def test_a_hybrid_model_s_layers_launch_their_kernels_too() -> None:
    """A hybrid layer is its pattern symbol's one module (megatron-core's HybridStack builds one
    a layer): a Mamba mixer's kernels (plan/hybrid.py `_mamba_ops`: its residual, in_proj, the
    convolution, the four chunk products, the state passing, the gated norm, out_proj; their
    backward) and an attention layer's half of a GPT layer's are counted as a GPT layer's are;
    they were not counted at all, and the hybrid functional tests came out 62-94% fast."""
    from inspector.job.hybrid_model import MambaShape
    from inspector.plan.hybrid import hybrid_kernels

    dims = replace(TINY, layer_symbols="M*", mamba=MambaShape(512, 8, 1, 16))
    shard = Shard(1, 1, 1, 1, False, 1)
    for i, symbol in enumerate("M*"):
        ops = hybrid_kernels(dims, shard, symbol)
        (seg,) = host.kind_segments(dims, shard, "none", i, 1e-3, 1, (), True, False)
        assert seg.units == (len(ops.forward) + len(ops.backward),
                             sum(isinstance(op, Gemm) for op in (*ops.forward, *ops.backward)), 2, 0, 0)
    mamba = hybrid_kernels(dims, shard, "M")
    assert [op.name for op in mamba.forward if isinstance(op, Gemm)] == [
        "in_proj", "ssd C B^T", "ssd chunk states", "ssd diagonal blocks", "ssd off-diagonal blocks",
        "out_proj"]


def test_a_local_spec_layer_s_kernels_are_counted_at_their_own_cost() -> None:
    """Megatron's local spec (--transformer-impl local) runs torch's own ops where a Transformer
    Engine layer runs TE's modules, whose Python per kernel is the heavier: the two are fitted
    apart (bench/host_fit.py; leave-one-out 21.2% -> 17.1% on the H100 functional tests). The
    same layer's kernels land in UNITS' last slot, and cost less there."""
    local = replace(TINY, te_attention=False)
    (seg,) = _work(local).host.segments
    kernels, local_kernels = host.UNITS.index("kernels"), host.UNITS.index("local_kernels")
    assert seg.units[kernels] == 0 and seg.units[local_kernels] > 0
    assert host.COSTS[local_kernels] < host.COSTS[kernels]

