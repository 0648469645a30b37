"""The engine: megatron's forward and backward on meta tensors, counted as the CUDA allocator does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.errors import ConfigError
from tests.composition import assert_composed_equals_whole
from tests.test_versions import MTP_FULL_RECOMPUTE_FAILS

pytestmark = pytest.mark.slow  # megatron's forward and backward on whole stages: ~56 s of CPU (tests/README.md)

GPU = Path(__file__).resolve().parents[2] / "shared" / "gpu"


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=2, tensor_model_parallel_size=2, data_parallel_size=2,
        micro_batch_size=2, global_batch_size=8, bf16=True, use_distributed_optimizer=True,
        transformer_impl="local",
    )  # fmt: skip
    return make_job({**args, **flags})


def test_caching_allocator_rounds_to_512_bytes():
    from inspector.memory.engine.allocator import rounded

    assert [rounded(n) for n in (0, 1, 511, 512, 513, 4096)] == [0, 512, 512, 512, 1024, 4096]


def test_tracker_counts_new_storages_only_and_frees_them():
    import torch

    from inspector.memory.engine.allocator import Tracker

    before = torch.empty(100, device="meta")  # exists before recording: never counted
    tracker = Tracker()
    with tracker:
        x = torch.empty(1000, device="meta")  # 4000 bytes -> 4096
        x.view(10, 100)  # a view allocates nothing
        before.add_(1)  # in place on an old storage allocates nothing
        y = x * 2
        del y
    assert [e.bytes for e in tracker.events] == [4096, 4096, -4096]
    assert tracker.peak == 8192 and tracker.allocated == 4096
    del x
    assert tracker.allocated == 0


def test_dropout_keeps_a_bool_mask_as_on_cuda():
    import torch

    from inspector.memory.engine.allocator import Tracker
    from inspector.memory.engine.cuda import cuda_on_meta

    x = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tracker = Tracker()
    with cuda_on_meta(), tracker:
        out = torch.nn.functional.dropout(x, 0.1)
    # output (bf16, 2 MiB) and mask (bool, 1 MiB): not a bf16 mask as the CPU path keeps
    assert sorted(e.bytes for e in tracker.events) == [1 << 20, 2 << 20]
    assert out.grad_fn.name() == "NativeDropoutBackward0"


def test_rms_norm_keeps_no_fp32_copy_as_the_fused_cuda_kernel():
    import torch

    from inspector.memory.engine.allocator import Tracker
    from inspector.memory.engine.cuda import cuda_on_meta

    x = torch.empty(256, 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tracker = Tracker()
    with cuda_on_meta(), tracker:
        out = torch.nn.functional.rms_norm(x, (1024,), weight, 1e-5)
    assert sorted(e.bytes for e in tracker.events) == [1024, 512 << 10]  # rstd, bf16 output
    assert out.dtype == torch.bfloat16


def test_schedule_passes_replay_1f1b():
    from inspector.job.dims import live_microbatches, schedule_passes

    passes = schedule_passes(0, 2, 3)
    assert passes == [(True, 0), (True, 0), (False, 0), (True, 0), (False, 0), (False, 0)]
    # the same replay as live_microbatches: micro-batches in flight after each forward
    alive, points = 0, []
    for forward, _ in passes:
        alive += 1 if forward else -1
        if forward:
            points.append((alive,))
    assert points == live_microbatches(0, 2, 3)


def test_run_memory_finds_megatrons_global_buffer_and_is_deterministic():
    from inspector.memory.engine.run import run_memory

    job = _job()
    first, second = run_memory(job, 0), run_memory(job, 0)
    assert first == second
    # DotProductAttention's baddbmm input from megatron's global memory buffer:
    # [b * heads / tp, s, s] in bf16 = 2 * 2 * 32 * 32 * 2 bytes
    assert first.persistent == (("megatron's global memory buffer (mpu, bfloat16)", 2 * 2 * 32 * 32 * 2),)
    assert first.peak.bytes > 0 and first.peak.moment.startswith(("forward", "backward"))


def test_full_recomputation_lowers_the_peak():
    from inspector.memory.engine.run import run_memory

    plain = run_memory(_job(num_layers=4), 0).peak.bytes
    full = run_memory(
        _job(num_layers=4, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=1), 0
    ).peak.bytes  # fmt: skip
    assert full < plain


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize(
    "records, jobs",
    [(GPU / "memory-h200.json", GPU / "jobs"),  # shared/gpu: an H200
     (BENCH / "gpu-h100" / "memory-h100.json", BENCH / "gpu_jobs")],  # fmt: skip
    ids=["h200", "h100"],
)
def test_engine_matches_every_probed_gpu_rank(records, jobs):
    """The issue's targets: peak within 3% and never more than 2% under; static within 1%."""
    import sys

    if not records.exists():
        pytest.skip("shared/gpu not present")
    sys.path.insert(0, str(BENCH))
    from gpu_memory import rows

    from tests.test_versions import MTP_LOGITS_HELD

    runs = [run for run in json.loads(records.read_text())["runs"] if run["rc"] == 0]
    table = rows(records, jobs)
    assert len(table) == len(runs) >= 5
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        static_ratio, peak_ratio = float(cells[5]), float(cells[8])
        assert abs(static_ratio - 1) <= 0.01, row
        if cells[0] == "k2_mtp" and not MTP_LOGITS_HELD:
            # the GPU ran megatron-core 0.16.1; 0.13's and 0.17+'s multi-token prediction hold
            # about 0.5 GiB less at the loss (tests/test_versions.py), so their prediction is
            # under the 0.16.1 measurement
            assert 0.97 <= peak_ratio < 0.98, row
            continue
        assert 0.98 <= peak_ratio <= 1.03, row


@pytest.mark.parametrize(
    "flags",
    [
        dict(num_layers=6),  # 1F1B, a first and a last stage of 3 layers
        dict(num_layers=8, num_layers_per_virtual_pipeline_stage=2),  # interleaved, 2 chunks
        dict(num_layers=7, decoder_first_pipeline_num_layers=3, hidden_dropout=0.1,
             attention_dropout=0.1),  # uneven, with dropout masks
        dict(num_layers=6, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=1, swiglu=True, normalization="RMSNorm"),
        # Llama 3 405B's split: chunks of the embedding alone and of the loss alone run whole,
        # beside composed chunks of their stage
        dict(num_layers=6, num_virtual_stages_per_pipeline_rank=4,
             account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    ],  # fmt: skip
    ids=["dense", "vpp", "uneven", "recompute", "embedding-alone"],
)
def test_composed_stage_equals_every_layer_run(flags):
    """One layer of each kind stands for the rest: event for event, peak and persistent alike."""
    cache = assert_composed_equals_whole(_job(**flags), persistent=False)
    # the small chunks have at most 3 layers: the first, one middle one, the last
    assert all(len(kinds) <= 3 for _, _, kinds, _ in cache)


def test_a_failure_while_running_says_so_not_that_megatron_refused_to_build(monkeypatch):
    import torch

    from inspector.errors import ConfigError
    from inspector.memory.engine.run import run_memory

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this op")

    monkeypatch.setattr(torch, "baddbmm", broken)  # the unfused attention's scores
    with pytest.raises(ConfigError) as error:
        run_memory(_job(num_layers=2, pipeline_model_parallel_size=1), 0)
    message = str(error.value)
    assert "refused to build" not in message
    assert message.startswith("megatron-core failed running the forward of a micro-batch")
    assert "in decoder.layers.0.self_attention.core_attention:" in message and "no kernel for this op" in message


_MOE = dict(
    num_experts=4, moe_router_topk=2, swiglu=True, disable_bias_linear=True,
    normalization="LayerNorm", position_embedding_type="rope", hidden_dropout=0.0,
    attention_dropout=0.0, sequence_parallel=True,  # megatron's MoE with tp needs it
)  # fmt: skip


@pytest.mark.parametrize(
    "flags",
    [
        dict(num_layers=8, moe_layer_freq=2),  # MoE and dense layers, allgather, ep 1
        dict(num_layers=6, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
             moe_grouped_gemm=True),  # fmt: skip
    ],
    ids=["allgather-mixed", "alltoall-ep2-grouped"],
)
def test_composed_moe_stage_equals_every_layer_run(flags):
    """An MoE layer is its own kind: one of each kind stands for the rest, buffers included."""
    cache = assert_composed_equals_whole(_job(**_MOE, **flags))
    kinds = {moe for _, _, small, _ in cache for moe, _ in small}  # (MoE, GDN) per layer
    assert kinds == {True, False} if "moe_layer_freq" in flags else kinds == {True}


def _full(method: str, n: int) -> dict:
    return dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=n)


# (flags, the small chunks' layer counts, the layers each small chunk recomputes)
_GROUPED = {
    # 6 layers a chunk, the first 3 recomputed: first, middle, last recomputed and plain layers
    "block": (dict(num_layers=12, **_full("block", 3)), {4}, {2}),
    # interleaved: megatron counts the block per chunk (6 layers, the first 2 recomputed)
    "block-vpp": (dict(num_layers=24, num_layers_per_virtual_pipeline_stage=6,
                       **_full("block", 2)), {4}, {2}),  # fmt: skip
    # uneven: 4 layers, all recomputed (N beyond the chunk), then 7, the first 5 recomputed
    "block-uneven": (dict(num_layers=11, decoder_first_pipeline_num_layers=4,
                          **_full("block", 5)), {3, 4}, {3, 2}),  # fmt: skip
    # one stage: embedding and loss on the chunk
    "block-pp1": (dict(num_layers=8, pipeline_model_parallel_size=1, **_full("block", 3)), {4}, {2}),
    # an MTP layer on the last stage (megatron's block method leaves it alone)
    "block-mtp": (dict(num_layers=12, position_embedding_type="rope", mtp_num_layers=1,
                       **_full("block", 2)), {4}, {2}),  # fmt: skip
    # groups of 2 layers checkpointed together: 4 groups a chunk, small chunks of 3 groups
    "uniform": (dict(num_layers=16, **_full("uniform", 2)), {6}, {2}),
    "uniform-vpp": (dict(num_layers=32, num_layers_per_virtual_pipeline_stage=8,
                         **_full("uniform", 2)), {6}, {2}),  # fmt: skip
    # uneven: 2 groups of 3 (the chunk stands for itself), then 4 groups
    "uniform-uneven": (dict(num_layers=18, decoder_first_pipeline_num_layers=6,
                            **_full("uniform", 3)), {6, 9}, {3}),  # fmt: skip
}


@pytest.mark.parametrize("name", list(_GROUPED))
def test_grouped_full_recompute_composes_equal_to_every_layer_run(name):
    """Full recomputation by block or by groups of N layers (megatron-core
    TransformerBlock._checkpointed_forward) composes from small chunks, event for event."""
    flags, sizes, recomputed = _GROUPED[name]
    if "mtp_num_layers" in flags and MTP_FULL_RECOMPUTE_FAILS:  # megatron's own TypeError
        with pytest.raises(ConfigError, match="unexpected keyword argument 'padding_mask'"):
            assert_composed_equals_whole(_job(swiglu=True, normalization="RMSNorm", **flags))
        return
    cache = assert_composed_equals_whole(_job(swiglu=True, normalization="RMSNorm", **flags),
                                         persistent=False)  # fmt: skip
    assert {len(kinds) for _, _, kinds, _ in cache} == sizes
    assert {n for _, _, _, n in cache} == recomputed


def test_the_whole_trace_keeps_a_checkpointed_groups_running_order():
    """A group's backward recomputes its layers' forwards, then runs their backwards: the whole
    stage's trace, cut by groups, keeps megatron's order (cut by layer, it moved each layer's
    recomputation next to its own backward and lost the group's recompute working set)."""
    from inspector.memory.engine.compose import compose
    from inspector.memory.engine.run import chunk_shapes
    from inspector.memory.engine.stage import trace_chunks, trace_stage
    from inspector.world.build import View, build

    job = _job(num_layers=8, **_full("uniform", 2))
    shapes = chunk_shapes(build(job, View((0,)), expert_ranks=(0,)).stages[0])
    raw = trace_stage(job, 0)[0]
    whole = trace_chunks(job, 0, shapes, whole=True)[0]
    assert [e.bytes for e in whole.backward] == [e.bytes for e in raw.backward]
    by_layer = compose(raw, 4, range(4), range(4))
    peak = max(e.allocated for e in raw.backward)
    assert max(e.allocated for e in whole.backward) == peak
    assert max(e.allocated for e in by_layer.backward) < peak


@pytest.mark.parametrize(
    "flags",
    [
        # MoE and dense layers in groups of 2: every group (MoE, dense)
        dict(num_layers=16, moe_layer_freq=2, **_full("uniform", 2)),
        # all MoE, alltoall over ep 2: 6 layers a chunk, the first 2 recomputed
        dict(num_layers=12, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
             moe_grouped_gemm=True, **_full("block", 2)),
        # MoE and dense, recomputed and plain: six kinds of layer
        dict(num_layers=16, moe_layer_freq=2, **_full("block", 3)),
    ],  # fmt: skip
    ids=["uniform-mixed", "block-alltoall-ep2", "block-mixed"],
)
def test_grouped_full_recompute_composes_moe_stages(flags):
    """MoE layers in recomputed blocks and checkpointed groups compose too, buffers included."""
    cache = assert_composed_equals_whole(_job(**_MOE, **flags))
    layers = 8 if flags["num_layers"] == 16 else 6
    assert all(len(kinds) < layers for _, _, kinds, _ in cache)


_MOE_TP1 = {**_MOE, "sequence_parallel": False, "tensor_model_parallel_size": 1}


@pytest.mark.parametrize("ep, tp, etp", [(2, 1, 1), (4, 1, 1), (2, 2, 1)])
def test_alltoall_splits_are_balanced_over_expert_parallel_ranks(ep, tp, etp, monkeypatch):
    """Each rank sends tokens * topk / ep rows to every expert-parallel rank and receives as many."""
    from megatron.core.transformer.moe import token_dispatcher

    from inspector.memory.engine.run import run_memory

    calls = []
    real = token_dispatcher.all_to_all

    def recorded(group, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        out = real(group, input, output_split_sizes, input_split_sizes, **kwargs)  # 0.19: use_nccl_stream
        calls.append((list(output_split_sizes), list(input_split_sizes), input.shape[0], out.shape[0]))
        return out

    monkeypatch.setattr(token_dispatcher, "all_to_all", recorded)
    job = _job(**{**_MOE, "sequence_parallel": tp > 1}, num_layers=2, pipeline_model_parallel_size=1,
               tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp, data_parallel_size=4,
               expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall")  # fmt: skip
    run_memory(job, 0)
    routed = 32 * 2 // tp * 2  # the rank's tokens (seq x micro-batch, split by sequence parallelism) x topk
    dispatch = ([routed // ep] * ep, [routed // ep] * ep, routed, routed)
    assert calls and all(call == dispatch for call in calls)


def test_capacity_factor_pads_every_expert_to_its_capacity(monkeypatch):
    """--moe-pad-expert-input-to-capacity: each expert gets ceil(tokens * topk / experts * f) rows."""
    import math

    from megatron.core.transformer.moe import token_dispatcher

    from inspector.memory.engine.run import run_memory

    sizes = []
    real = token_dispatcher.all_to_all
    monkeypatch.setattr(
        token_dispatcher, "all_to_all",
        lambda g, x, o=None, i=None, **kw: sizes.append(x.shape[0]) or real(g, x, o, i, **kw),
    )  # fmt: skip
    job = _job(**_MOE_TP1, num_layers=1, pipeline_model_parallel_size=1,
               data_parallel_size=2, expert_model_parallel_size=2,
               moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.5,
               moe_pad_expert_input_to_capacity=True)  # fmt: skip
    run_memory(job, 0)
    capacity = math.ceil(64 * 2 / 4 * 1.5)
    assert sizes and set(sizes) == {capacity * 4}


def test_routed_experts_hold_what_megatron_saves_for_backward():
    """Hand count, from megatron-core's source, of what one MoE layer's experts keep.

    experts.py SequentialMLP.forward splits the permuted tokens by `tokens_per_expert` (balanced:
    n = tokens * topk / experts rows each) and runs each expert's MLP (mlp.py MLP.forward with
    per_token_scale): linear_fc1's output [n, 2f] is saved by the weighted SwiGLU
    (fused_bias_swiglu.py WeightedSwiGLUFunction: input and the probs, a view), whose output
    [n, f] linear_fc2 saves for its weight gradient; the experts' outputs [n, h] are freed once
    `torch.cat` has joined them into [tokens * topk, h], which lives until the combine.
    """
    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron

    megatron()
    job = _job(**_MOE_TP1, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=1,
               global_batch_size=2, ffn_hidden_size=128)  # fmt: skip
    forward = trace_stage(job, 0)[0].forward
    held = sum(e.bytes for e in forward if e.where.startswith("decoder.layers.0.mlp.experts"))
    tokens, topk, experts, h, f, bf16 = 32 * 2, 2, 4, 64, 128, 2
    n = tokens * topk // experts
    assert held == experts * (n * 2 * f + n * f) * bf16 + tokens * topk * h * bf16


def test_the_stage_after_a_standalone_mtp_stage_receives_every_sequence():
    """With MTP on a stage of its own (layout "Et|t|m|L": megatron's `mtp_standalone`), that
    stage sends the main hidden states and the MTP layer's, concatenated ([2s, b, h]:
    multi_token_prediction.py), and p2p_communication.py receives at the shape sent: the loss
    stage's input is twice a plain stage's, and megatron's loss runs on it."""
    from inspector.errors import ConfigError
    from inspector.memory.engine.run import run_job
    from inspector.world.build import build, select_view
    from inspector.world.setup import megatron

    megatron()
    s, b, h = 32, 2, 64
    job = _job(num_layers=2, position_embedding_type="rope", mtp_num_layers=1,
               untie_embeddings_and_output_weights=True, pipeline_model_parallel_size=4,
               pipeline_model_parallel_layout="Et|t|m|L", tensor_model_parallel_size=1,
               data_parallel_size=1, global_batch_size=4)  # fmt: skip
    try:
        stages = build(job, select_view(job), expert_ranks=(0,)).stages
    except ConfigError as refused:  # megatron-core 0.13: no MTP in a pipeline layout string
        assert "MTP layer is not supported for flexible pipeline layout" in str(refused)
        return
    runs = run_job(job, stages).runs
    received = {stage: [size for where, size in run.persistent if where == "inputs"]
                for stage, run in runs.items()}  # fmt: skip
    plain = s * b * h * 2  # bf16
    assert received[1] == received[2] == [plain]
    assert received[3] == [2 * plain]


def test_microbatch_group_size_sets_the_micro_batches_in_flight():
    # megatron-core's interleaved schedule warms up with (chunks - 1) x group forwards more on
    # stage 0 (schedules.py get_pp_rank_microbatches), so a group of 4 holds more in flight than
    # the default group, --pp 2
    from inspector.memory.engine.run import run_memory

    flags = dict(num_layers=4, num_virtual_stages_per_pipeline_rank=2, global_batch_size=32)
    plain = run_memory(_job(**flags), 0).peak
    grouped = run_memory(_job(**flags, microbatch_group_size_per_virtual_pipeline_stage=4), 0).peak
    assert grouped.micro_batches > plain.micro_batches
    assert grouped.bytes > plain.bytes


def test_transformer_engine_keeps_its_own_cublas_workspaces():
    # TE 2.20 cpp_extensions/gemm.py get_cublas_workspace: 32 MiB + 1 KiB on Hopper for its GEMMs,
    # and one per compute stream (4) more for grouped GEMMs; megatron's local spec runs torch's only
    from inspector.memory.engine.run import te_workspaces

    te = dict(transformer_impl="transformer_engine")
    moe = dict(num_experts=4, moe_router_topk=2, disable_bias_linear=True, **te)
    assert te_workspaces(_job()) == 0
    assert te_workspaces(_job(**te)) == 32 * 2**20 + 1024
    assert te_workspaces(_job(**moe)) == 32 * 2**20 + 1024  # SequentialMLP: plain GEMMs
    assert te_workspaces(_job(**moe, moe_grouped_gemm=True)) == 5 * (32 * 2**20 + 1024)


def test_the_routers_te_gemm_takes_tes_workspace_in_a_local_spec_job():
    # megatron's RouterGatingLinearFunction (moe/moe_utils.py) runs `te_general_gemm` wherever
    # megatron-core defines it, whatever the layer spec: TE's general_gemm then takes TE's own
    # workspace (cpp_extensions/gemm.py get_cublas_workspace: 32 MiB + 1 KiB on Hopper).
    # megatron-core 0.13-0.16 define it only when TE still has module.base.get_workspace, which
    # TE 2.11 (the stand-in's release) no longer has: they fall back to torch.mm, torch's
    # workspace; 0.19 takes TE's own workspace when get_workspace is gone (`_get_workspace = None`)
    import inspect

    from inspector.memory.engine.run import te_workspaces
    from inspector.world.setup import megatron

    megatron()
    from megatron.core.extensions import transformer_engine

    optional = "_get_workspace = None" in inspect.getsource(transformer_engine)
    local_moe = _job(num_experts=4, moe_router_topk=2, disable_bias_linear=True)
    assert te_workspaces(local_moe) == (32 * 2**20 + 1024 if optional else 0)
    assert te_workspaces(_job()) == 0  # no router: torch's workspaces only


def test_the_stand_ins_general_gemm_gives_the_routers_shapes():
    # the three calls of RouterGatingLinearFunction (moe_utils.py): forward TN, dgrad NN, wgrad NT
    import torch

    from inspector.world.setup import megatron

    megatron()
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    tokens, hidden, experts = 6, 8, 4
    weight = torch.empty(experts, hidden, dtype=torch.bfloat16, device="meta")
    inp = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta")
    grad = torch.empty(tokens, experts, dtype=torch.float32, device="meta")
    logits = general_gemm(weight, inp, torch.float32, layout="TN")[0]
    assert (logits.shape, logits.dtype) == ((tokens, experts), torch.float32)
    assert general_gemm(weight.float(), grad, torch.float32, layout="NN", grad=True)[0].shape == (
        tokens, hidden)
    assert general_gemm(inp.float(), grad, torch.float32, layout="NT", grad=True)[0].shape == (
        experts, hidden)
