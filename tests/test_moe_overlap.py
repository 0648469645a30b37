"""The MoE all-to-all overlap (`--overlap-moe-expert-parallel-comm`, `--delay-wgrad-compute`):
megatron's rules, the extra warm-up micro-batch, and the merged layer pairs plan prices."""

from __future__ import annotations

import pytest

from inspector.errors import ConfigError
from inspector.inputs.resolve import Sources, merge_sources
from inspector.job.dims import microbatches_in_flight, schedule_passes, warmup_steps
from inspector.job.job import make_job
from inspector.plan.overlap import Nodes, merged_share, pair_seconds
from inspector.plan.request import PlanFlags, make_request
from inspector.plan.search import search

MOE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512,
           max_position_embeddings=512, vocab_size=1000, num_experts=8, moe_router_topk=2,
           disable_bias_linear=True, bf16=True, micro_batch_size=1,
           moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
           data_parallel_size=2, global_batch_size=8)  # fmt: skip


def _job(**flags):
    args = merge_sources(Sources(flags={**MOE, **flags}), ("model", "layout", "training")).args
    return make_job(args)


def test_a_pair_is_its_compute_when_the_all_to_all_hides():
    # comp stream: attn_f 1, mlp_b 2, mlp_f 1, attn_b 2; each exchange far shorter than the
    # compute it runs beside: the pair takes the compute stream's 6 s
    t = Nodes(attn_f=1, mlp_f=1, combine_f=0, attn_b=2, attn_dw=0, mlp_b=2, mlp_dw=0,
              combine_b=0, alltoall=0.01)  # fmt: skip
    assert pair_seconds(t) == pytest.approx(6.0)


def test_a_pair_is_its_four_exchanges_when_they_dominate():
    t = Nodes(attn_f=0.1, mlp_f=0.1, combine_f=0, attn_b=0.2, attn_dw=0, mlp_b=0.2, mlp_dw=0,
              combine_b=0, alltoall=1.0)  # fmt: skip
    assert pair_seconds(t) == pytest.approx(4.0)


def test_delayed_weight_gradients_let_the_dispatch_backward_start_earlier():
    # the dispatch backward waits for mlp_b; with --delay-wgrad-compute the MLP's weight
    # gradients (1 s of its 2) run after it is issued, beside it
    whole = Nodes(attn_f=1, mlp_f=1, combine_f=0, attn_b=1, attn_dw=0, mlp_b=2, mlp_dw=0,
                  combine_b=0, alltoall=1.5)  # fmt: skip
    split = Nodes(attn_f=1, mlp_f=1, combine_f=0, attn_b=1, attn_dw=0, mlp_b=1, mlp_dw=1,
                  combine_b=0, alltoall=1.5)  # fmt: skip
    # by hand, one steady pair (megatron's order, model_chunk_schedule_plan.py run()):
    # without: combine_b 1.5 | attn_f 1, mlp_b 2 (from 1.5: to 3.5) | dispatch_f 1.5-3.0,
    # dispatch_b 3.5-5.0, mlp_f 3.5-4.5, combine_f 5.0-6.5, attn_b 5.0-6.0 -> 6.5 with the next
    # pair's combine_b waiting on attn_b (6.0) and attn_f on combine_f (6.5)
    assert pair_seconds(whole) == pytest.approx(6.5)
    assert pair_seconds(split) < pair_seconds(whole)


def test_merged_share_counts_megatrons_warm_up():
    # no pipeline: the first forward alone, then forward i + 1 beside backward i
    assert merged_share(0, 1, 4, 1) == pytest.approx(3 / 4)
    # interleaved, p 2, v 2, m 4: stage 0 warms up 2 (p - 1) + (v - 1) p + 1 = 5 of 8 steps
    assert warmup_steps(0, 2, 4, 2, 2, extra=1) == 5
    assert merged_share(0, 2, 4, 2) == pytest.approx(3 / 8)
    assert merged_share(1, 2, 4, 2) == pytest.approx(5 / 8)


def test_the_overlap_holds_one_more_micro_batch():
    # schedules.py get_pp_rank_microbatches: "one extra micro-batch forward step before the 1f1b
    # stages"; without a pipeline the combined schedule holds two micro-batches
    assert microbatches_in_flight(0, 1, 4) == 1
    assert microbatches_in_flight(0, 1, 4, extra=1) == 2
    assert microbatches_in_flight(0, 2, 4, 2) + 1 == microbatches_in_flight(0, 2, 4, 2, extra=1)
    passes = schedule_passes(0, 1, 3, extra=1)
    assert passes == [(True, 0), (True, 0), (False, 0), (True, 0), (False, 0), (False, 0)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(expert_model_parallel_size=1, data_parallel_size=1),
         "--overlap-moe-expert-parallel-comm needs expert parallelism (--expert-model-parallel-size "
         "above 1) (megatron-core's TransformerConfig)"),
        (dict(moe_token_dispatcher_type="allgather"),
         "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall or flex, "
         "not allgather (megatron-core's TransformerConfig)"),
        (dict(pipeline_model_parallel_size=2),
         "--overlap-moe-expert-parallel-comm with --pp 2 needs a virtual pipeline "
         "(--num-virtual-stages-per-pipeline-rank): 'virtual_pipeline_model_parallel_size must be "
         "specified when pipeline_model_parallel_size > 1' (megatron-core's TransformerConfig)"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
         "--overlap-moe-expert-parallel-comm does not run with --recompute-granularity full "
         "(megatron-core's TransformerConfig)"),
        (dict(bf16=False), "--overlap-moe-expert-parallel-comm needs --bf16 or --fp16 "
         "(megatron-core's TransformerConfig)"),
    ],
)  # fmt: skip
def test_megatron_refuses_these_overlaps(flags, message):
    with pytest.raises(ConfigError) as error:
        _job(overlap_moe_expert_parallel_comm=True, **flags)
    assert str(error.value) == message


def test_delayed_weight_gradients_need_the_overlap_and_transformer_engine():
    with pytest.raises(ConfigError, match="needs --overlap-moe-expert-parallel-comm"):
        _job(delay_wgrad_compute=True, transformer_impl="transformer_engine")
    with pytest.raises(ConfigError, match="needs --transformer-impl transformer_engine"):
        _job(delay_wgrad_compute=True, overlap_moe_expert_parallel_comm=True,
             transformer_impl="local")  # fmt: skip


def test_memory_holds_the_extra_micro_batch(cli):
    args = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "512", "--vocab-size", "1000", "--num-experts", "8", "--bf16",
            "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall", "--ep", "2",
            "--dp", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--transformer-impl", "local", "--format", "json"]  # fmt: skip
    import json

    plain = json.loads(cli("memory", *args).out)["stages"][0]
    result = cli("memory", *args, "--overlap-moe-expert-parallel-comm")
    assert result.code == 0, result.err
    merged = json.loads(result.out)["stages"][0]
    assert merged["activations"]["in_flight"] == [2] and plain["activations"]["in_flight"] == [1]
    assert merged["total"] > plain["total"]


def _plan(**extra):
    flags = {**MOE, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "context_parallel_size": 1, "recompute_granularity": "none", "global_batch_size": 64,
             **extra}  # fmt: skip
    flags.pop("data_parallel_size")
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    return search(make_request(args, PlanFlags(16, gpu="h100", top=1, gpus_per_node=8))).plans[0]


def test_plan_hides_the_all_to_all_it_overlaps():
    # ep 2 over 16 ranks of 8 per node: every exchange inside a node; the merged passes take
    # what their pair takes beyond the compute, the first forward and last backward all of it
    exposed, hidden = _plan(), _plan(overlap_moe_expert_parallel_comm=True)
    assert exposed.job.layout == hidden.job.layout
    assert hidden.time.shares()["expert"] < exposed.time.shares()["expert"]
    assert hidden.time.shares()["compute"] == pytest.approx(exposed.time.shares()["compute"])
    assert max(s.activations for s in hidden.stages) > max(s.activations for s in exposed.stages)
    from inspector.plan.flags import megatron_flags

    pasted = megatron_flags(hidden.job, hidden.split)
    assert "--overlap-moe-expert-parallel-comm" in pasted
    assert "--moe-token-dispatcher-type alltoall" in pasted


def test_workload_says_simai_does_not_overlap(cli):
    args = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "512", "--vocab-size", "1000", "--num-experts", "8", "--bf16",
            "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall", "--ep", "2",
            "--dp", "2", "--micro-batch-size", "1", "--global-batch-size", "8", "--gpu", "h100",
            "--transformer-impl", "local", "--stage", "0"]  # fmt: skip
    plain = cli("workload", *args)
    result = cli("workload", *args, "--overlap-moe-expert-parallel-comm")
    assert result.code == 0 and result.out == plain.out
    assert "--overlap-moe-expert-parallel-comm hides behind" in result.err
    assert "overlap" not in plain.err


class _Group:  # what get_pp_rank_microbatches asks of the pipeline group
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(("pp", "chunks", "m"), [(2, 2, 8), (4, 2, 16), (8, 4, 32), (4, 3, 2)])
def test_warm_up_under_the_overlap_is_megatrons(pp, chunks, m):
    import inspect
    import types

    from megatron.core.pipeline_parallel import schedules

    if "overlap_moe_expert_parallel_comm" not in inspect.signature(
        schedules.get_pp_rank_microbatches
    ).parameters:  # megatron-core 0.13 has no combined 1F1B (the flag came in 0.14)
        pytest.skip("no --overlap-moe-expert-parallel-comm in this megatron-core")
    for rank in range(pp):
        comm = types.SimpleNamespace(pp_group=_Group(pp, rank),
                                     virtual_pipeline_model_parallel_size=chunks)  # fmt: skip
        total, _, warmup, remaining = schedules.get_pp_rank_microbatches(
            m, chunks, pp, overlap_moe_expert_parallel_comm=True, p2p_communicator=comm
        )
        assert warmup_steps(rank, pp, m, chunks, pp, extra=1) == warmup
        assert merged_share(rank, pp, m, chunks) == pytest.approx(remaining / total)


def test_an_moe_layer_without_expert_tp_runs_its_tp_collectives_in_the_attention_nodes():
    # fine_grained_callables.py: the attention node runs attention (its gather and reduction
    # under SP) and the shared experts (`shared_experts_compute`); with expert TP 1 the experts'
    # node has no TP collective. With expert TP the dispatcher's gather and reduction of the
    # received tokens run in the experts' node (`dispatch_postprocess`, `combine_preprocess`).
    from inspector.formulas.ops import LayerOps
    from inspector.job.hardware import GPUS
    from inspector.plan.overlap import layer_nodes

    empty, h100 = LayerOps((), (), ()), GPUS["h100"]
    alone = layer_nodes(empty, h100, (), 1.0, 0.4, True, attn_tensor=1.0)
    assert (alone.attn_f, alone.attn_b, alone.mlp_f, alone.mlp_b) == pytest.approx((0.2, 0.2, 0, 0))
    split = layer_nodes(empty, h100, (), 1.0, 0.4, True)
    assert (split.attn_f, split.attn_b, split.mlp_f, split.mlp_b) == pytest.approx((0.1,) * 4)


def test_tp_collectives_in_the_attention_nodes_shorten_an_exchange_bound_pair():
    # 0.4 s of TP collectives; exchanges of 1 s. By hand, megatron's order
    # (model_chunk_schedule_plan.py run()), all in the attention's nodes:
    # combine_b 0-1 | attn_f 0-0.7, mlp_b 1-2, dispatch_f 1-2, dispatch_b 2-3, mlp_dw 2-2.3,
    # mlp_f 2.3-3.3, combine_f 3.3-4.3, attn_b 3.3-4.5; the next combine_b waits on attn_b: 4.5.
    # Split half and half: mlp_b 1-2.1, dispatch_b 2.1-3.1, mlp_dw -2.4, mlp_f 2.4-3.5,
    # combine_f 3.5-4.5, attn_b 3.5-4.6: 4.6.
    attn = Nodes(attn_f=0.7, mlp_f=1.0, combine_f=0, attn_b=1.2, attn_dw=0, mlp_b=1.0,
                 mlp_dw=0.3, combine_b=0, alltoall=1.0)  # fmt: skip
    split = Nodes(attn_f=0.6, mlp_f=1.1, combine_f=0, attn_b=1.1, attn_dw=0, mlp_b=1.1,
                  mlp_dw=0.3, combine_b=0, alltoall=1.0)  # fmt: skip
    assert pair_seconds(attn) == pytest.approx(4.5)
    assert pair_seconds(split) == pytest.approx(4.6)


@pytest.mark.parametrize(("moe", "shared", "etp", "forward"), [
    (False, 0, 1, 4), (True, 0, 1, 2), (True, 128, 1, 4), (True, 0, 2, 4),
])  # fmt: skip
def test_an_moe_layer_without_expert_tp_or_shared_experts_runs_attentions_collectives_only(
    moe, shared, etp, forward
):
    # with sequence parallelism a dense layer gathers and reduces around attention and around
    # the MLP (Korthikanti et al. 2022, 4.2.2), forward and backward; an MoE layer with expert TP
    # 1 routes and dispatches the sequence-parallel shard as it is (moe_layer.py, the dispatcher's
    # expert-TP group of size 1), so only attention's remain, unless shared experts (an MLP
    # sharded over TP: shared_experts.py's gather and reduction) or expert TP bring the others;
    # QKV's and a TP-sharded fc1's backward gather their input again for the weight gradient,
    # exposed beyond the data-gradient GEMM (tests/test_regather.py)
    import inspector.caches as caches
    from inspector.formulas.kernels import ops_seconds
    from inspector.formulas.ops import linear
    from inspector.job.dims import ModelDims
    from inspector.job.hardware import GPUS
    from inspector.job.layout import Layout
    from inspector.plan.cost import _layer_time
    from inspector.plan.network import Network

    experts = dict(num_experts=8, moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=shared or None)
    dims = ModelDims(2, 256, 8, 512, 1024, swiglu=True, flash_attention=True,
                     **(experts if moe else {}))  # type: ignore[arg-type]  # fmt: skip
    lay = Layout(tp=2, dp=4, ep=2 if etp == 1 else 1, etp=etp, sequence_parallel=True)
    net = Network(GPUS["h100"], 8)
    caches.clear()
    _, tensor, _, _ = _layer_time(dims, lay, net, 0.0, 1, "none", 0)
    alpha, bandwidth = net.link(2)
    one = alpha + 512 * 256 * 2 * (2 - 1) / 2 / bandwidth  # s b h elements of 2 bytes, ring of 2
    # QKV: 4 heads and 4 groups of 32 a rank; fc1: 2 x 1024 / 2 (dense) or 2 x 128 / 2 (shared)
    fc1 = {(False, 0): [1024], (True, 128): [128]}.get((moe, shared), [])
    dgrads = [ops_seconds(linear("", 512, 256, out)[1:2], GPUS["h100"]) for out in [384, *fc1]]
    again = sum(max(0.0, one - dgrad) for dgrad in dgrads)
    assert tensor == pytest.approx(2 * forward * one + again)  # the backward runs as many


def test_a_layer_run_alone_waits_for_each_node_before_it():
    # model_chunk_schedule_plan.py run() with one side None: forward attn 1, dispatch 2,
    # experts 1.5, combine 2 + 0.25 -> 6.75; backward: combine 2 + 0.5, experts 2 (to 4.5),
    # dispatch 4.5-6.5 beside the experts' weight gradients (1, on the compute stream),
    # attention 1.5 after both (8.0), its weight gradients 0.5 -> 8.5
    from inspector.plan.overlap import alone_seconds

    t = Nodes(attn_f=1, mlp_f=1.5, combine_f=0.25, attn_b=1.5, attn_dw=0.5, mlp_b=2, mlp_dw=1,
              combine_b=0.5, alltoall=2)  # fmt: skip
    assert alone_seconds(t) == pytest.approx((6.75, 8.5))


def test_uneven_chunks_leave_layers_alone_in_merged_steps():
    # interleaved, p 2, v 2, m 4, stage 1: the table runs chunks 0 0 1 1 | 0 0 1 1 (groups of
    # p); warm-up 2 (p - s - 1) + (v - 1) p + 1 = 3 forwards, then forward step k + 3 beside
    # backward step k (its chunk v - 1 - table[k]): (1, 1), (0, 1), (0, 0), (1, 0), (1, 1).
    # Chunk 0 holds 3 MoE layers, chunk 1 two: (0, 1) runs 2 pairs and chunk 0's last
    # forward alone; (1, 0) 2 pairs and chunk 0's first backward alone: 1 of each over 4
    # micro-batches. Even chunks leave none; no virtual pipeline, none.
    from inspector.plan.overlap import alone_passes

    uneven = [[True] * 3, [True] * 2]
    assert alone_passes(1, 2, 4, uneven) == ((True, False, 0.25), (True, True, 0.25))
    assert alone_passes(1, 2, 4, [[True] * 2, [True] * 2]) == ()
    assert alone_passes(1, 2, 4, [[True] * 3]) == ()
    # a dense first layer in the forward chunk's rest is reported as dense
    assert alone_passes(1, 2, 4, [[True, True, False], [True] * 2]) == (
        (False, True, 0.25), (True, False, 0.25))


def test_plan_prices_a_layer_alone_beyond_the_half_pair_it_was_given(monkeypatch):
    # cost.stage_work: each MoE pass run alone adds what it takes alone beyond half of the
    # merged pair its layer is priced at; the stage's expert term moves by exactly that
    import inspector.caches as caches
    from inspector.job.dims import ModelDims
    from inspector.job.hardware import GPUS
    from inspector.job.layout import Layout
    from inspector.plan import cost
    from inspector.plan.network import Network

    dims = ModelDims(5, 256, 8, 512, 1024, swiglu=True, flash_attention=True, num_experts=8,
                     moe_ffn_hidden_size=128)  # type: ignore[arg-type]  # fmt: skip
    lay = Layout(tp=1, pp=2, vpp=2, dp=4, ep=4)
    net = Network(GPUS["h100"], 2)
    caches.clear()
    chunks = [[0, 1, 2], [3, 4]]
    even = cost.stage_work(dims, lay, net, None, 1, "none", chunks, False,
                           overlap=(0.5, True, 0.0, ()))  # fmt: skip
    alone = ((True, False, 0.25), (True, True, 0.25))
    uneven = cost.stage_work(dims, lay, net, None, 1, "none", chunks, False,
                             overlap=(0.5, True, 0.0, alone))  # fmt: skip
    args = (dims, lay, net, 0.0, 1, "none", 0, ("core_attn",))
    compute, tensor, _, _ = cost._layer_time(*args, 0.0, False, 0.0, False)
    pair, forward, backward, _ = cost._pair_times(*args, True, 0.0, False)
    half = max(pair, compute + tensor) / 2
    assert forward > half and backward > half
    assert uneven.expert - even.expert == pytest.approx(0.25 * (forward - half) + 0.25 * (backward - half))
    assert uneven.compute == even.compute


def test_a_combined_step_runs_forward_and_backward_layer_by_layer():
    # model_chunk_schedule_plan.py TransformerModelChunkSchedulePlan.run: the forward's
    # pre-process and the backward's post-process, forward layer i with backward layer L-1-i,
    # then the forward's post-process and the backward's pre-process
    from inspector.memory.engine.allocator import Event
    from inspector.memory.engine.microbatch import Trace
    from inspector.memory.engine.schedule import combined

    def events(*steps):
        total, out = 0, []
        for size, where in steps:
            total += size
            out.append(Event(size, total, where))
        return tuple(out)

    forward = events((1, "embedding"), (10, "layer 0 mlp"), (10, "layer 1 mlp"), (5, "loss"))
    backward = events((1, "embedding"), (10, "layer 0"), (10, "layer 1"), (5, "loss"),
                      (-5, "loss: Backward"), (-10, "layer 1 mlp: Backward"),
                      (-10, "layer 0 mlp: Backward"), (-1, "embedding: Backward"))  # fmt: skip
    step = combined(Trace(forward, (), ()), Trace(backward[:4], backward[4:], ()))
    assert [e.where for e in step] == [
        "embedding", "loss: Backward", "layer 0 mlp", "layer 1 mlp: Backward", "layer 1 mlp",
        "layer 0 mlp: Backward", "loss", "embedding: Backward"]  # fmt: skip
    # over the 26 the backward's micro-batch holds: at most one layer more at any point
    assert [e.allocated for e in step] == [27, 22, 32, 22, 32, 22, 27, 26]


def test_memory_runs_the_overlaps_forward_with_the_backward_not_after_it():
    # combined_1f1b_schedule_for_no_pipelining: the first forward alone, then each forward
    # together with the previous micro-batch's backward; holding the older micro-batch whole
    # beneath the forward would count one micro-batch more than megatron keeps
    from inspector.memory.engine.run import run_memory
    from inspector.memory.engine.schedule import top_event as _top

    job = _job(overlap_moe_expert_parallel_comm=True, transformer_impl="local")
    run = run_memory(job, 0)
    assert "with the backward of micro-batch" in run.peak.moment
    assert run.peak.micro_batches == 2
    [trace] = run.replay.traces
    whole = trace.held + _top(trace.forward).allocated
    plain = run_memory(_job(transformer_impl="local"), 0).peak.bytes
    assert plain < run.peak.bytes < whole


@pytest.mark.parametrize(("m", "paired"), [(1, 0), (3, 2)])
def test_only_an_older_micro_batchs_backward_runs_with_a_forward(m, paired):
    # combined_1f1b_schedule_for_no_pipelining: the first forward alone, the last backward alone
    from inspector.memory.engine.allocator import Event
    from inspector.memory.engine.microbatch import Trace
    from inspector.memory.engine.schedule import replay_passes

    trace = Trace((Event(1, 1, "x"),), (Event(-1, 0, "x"),), ())
    passes = list(replay_passes((trace,), 0, 1, m, extra=1))
    assert sum(p.paired is not None for p in passes) == paired
    assert [p.paired for p in passes if p.paired] == [(0, i) for i in range(paired)]
