"""`plan`: composed memory equals `memory`, the pasted flags confirm the plan, bad input."""

from __future__ import annotations

import json
import shlex

import pytest

from inspector.job.versions import hybrid_moe_layers, hybrid_pattern_separators
from tests.conftest import formulas_only, run_cli
from tests.test_versions import GROUPED_MLP, MTP_IN_LAYOUT, SHARED_EXPERT_GATE

LAYOUTS = {
    "dense tp2 distopt": dict(num_layers=8, pp=2, dp=4, tp=2, bf16=True),
    "vpp with buckets": dict(
        num_layers=8, pp=4, dp=3, global_batch_size=12, bf16=True, overlap_grad_reduce=True,
        ddp_bucket_size=1000000, num_virtual_stages_per_pipeline_rank=2,
    ),
    "uneven fp32": dict(
        num_layers=7, pp=3, dp=5, decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=2,
    ),
    "moe ep2": dict(num_layers=4, pp=2, dp=4, ep=2, num_experts=4, disable_bias_linear=True, bf16=True),
    "llama te sp untied": dict(
        preset="llama3-8b", num_layers=4, pp=2, dp=2, tensor_model_parallel_size=2,
        sequence_parallel=True, bf16=True,
    ),
    "pp1 no distopt": dict(num_layers=4, dp=2, use_distributed_optimizer=False),
    "moe every other layer": dict(  # --moe-layer-freq 2: stage 0 holds an MoE and a dense layer
        num_layers=4, pp=2, dp=4, ep=2, num_experts=4, moe_layer_freq=2, disable_bias_linear=True,
        bf16=True,
    ),
    "deepseek mla mtp": dict(  # first layer dense (the list form), MLA, an MTP block
        preset="deepseek-v3", num_layers=4, moe_layer_freq="[0,1,1,1]", num_experts=8, pp=2, dp=4,
        ep=2, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True, moe_router_topk=2,
        no_rope_fusion=True,  # megatron-core 0.13 runs MLA's fused RoPE only as experimental
    ),
    "bf16 grads": dict(num_layers=4, pp=2, dp=4, tp=2, bf16=True, grad_reduce_in_bf16=True),
    "grouped experts in small buckets": dict(  # TE's grouped MLP: runs of equal expert weights
        num_layers=4, pp=2, dp=4, ep=2, num_experts=16, moe_grouped_gemm=True,
        transformer_impl="transformer_engine", disable_bias_linear=True, hidden_size=256,
        num_attention_heads=8, moe_ffn_hidden_size=128, bf16=True, overlap_grad_reduce=True,
        ddp_bucket_size=100000,
    ),
    "grouped experts unaligned": dict(  # 200 x 100 elements: each expert weight padded to 64
        num_layers=4, pp=2, dp=4, ep=2, num_experts=8, moe_grouped_gemm=True,
        transformer_impl="transformer_engine", disable_bias_linear=True, hidden_size=200,
        num_attention_heads=8, moe_ffn_hidden_size=100, overlap_grad_reduce=True,
        ddp_bucket_size=70000,
    ),
    "embedding and loss alone, 1F1B": dict(  # stages 0 and 3 hold no transformer layer
        num_layers=2, pp=4, dp=2, global_batch_size=8, account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    ),
    "embedding and loss alone": dict(  # Llama 3 405B's split: chunks of no transformer layer
        num_layers=6, pp=4, dp=2, global_batch_size=8, bf16=True, num_virtual_stages_per_pipeline_rank=2,
        account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
    ),
}
# hybrid (Mamba) models: pieces by pattern symbol; MoE layers from megatron-core 0.16, `|` from 0.17
_HYBRID = dict(hidden_size=256, num_attention_heads=8, normalization="RMSNorm",
               disable_bias_linear=True, bf16=True, vocab_size=1000)  # fmt: skip
LAYOUTS["hybrid tp2 sp"] = dict(
    num_layers=6, hybrid_override_pattern="M*-MM-", pp=2, dp=2, tensor_model_parallel_size=2,
    sequence_parallel=True,
    **_HYBRID,
)
if hybrid_moe_layers():
    LAYOUTS["hybrid moe ep2 untied"] = dict(
        num_layers=6, hybrid_override_pattern="MEM*E-", num_experts=4, pp=2, dp=4, ep=2,
        untie_embeddings_and_output_weights=True, **_HYBRID,
    )
if hybrid_pattern_separators():
    LAYOUTS["hybrid pinned stages"] = dict(  # '|': 3 layers on stage 0, 1 on stage 1
        num_layers=4, hybrid_override_pattern="M*M|-", pp=2, dp=2, **_HYBRID,
    )


# Transformer Engine: flash attention (megatron-core's local spec stores the s x s scores)
BLOCK = ("--num-layers", "8", "--seq-length", "4096", "--max-position-embeddings", "4096",
         "--gpus", "4", "--global-batch-size", "8", "--bf16", "--gpu-memory", "2.3", "--pp", "2",
         "--transformer-impl", "transformer_engine")


def _job(preset: str | None = None, **flags):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    flags.setdefault("micro_batch_size", 1)
    flags.setdefault("use_distributed_optimizer", True)
    args = merge_sources(Sources(preset=preset, flags=flags), ("model", "layout", "training")).args
    return make_job(args)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composed_state_equals_memory_stage_by_stage(name: str) -> None:
    # The planner's memory is composed from two small builds; `memory` builds the whole job.
    job = _job(**LAYOUTS[name])
    assert job.layout.sequence_parallel == ("sequence_parallel" in LAYOUTS[name])
    _assert_composed_equals_memory(job, name)


def _assert_composed_equals_memory(job, name: str) -> None:
    from inspector.memory.compose import stage_state as pm
    from inspector.memory.measure import Hardware, measure
    from inspector.world.build import build, select_view
    from inspector.world.ranks import rank_shard_indices

    report = measure(build(job, select_view(job), expert_ranks=(0,)), Hardware())
    pairs = sorted({(d, e) for _, d, e in rank_shard_indices(job.layout)})
    last = job.layout.pp - 1
    for stage in report.stages:
        n = len(stage.layers)
        shapes = [
            pm.ChunkKinds.of(job.model, c, stage.stage == 0 and k == 0, stage.stage == last and k == n - 1)
            for k, c in enumerate(stage.layers)
        ]
        state, params = pm.stage_state(job, stage.stage, shapes, pairs)
        assert state == stage.state, (name, stage.stage)
        assert params == stage.parameters


SCALED = {  # name: (flags, whether megatron's expert weights come one per local expert)
    "deepseek grouped, MLA, MTP": (
        dict(preset="deepseek-v3", num_layers=4, moe_layer_freq="[0,1,1,1]", num_experts=16,
             moe_router_topk=2, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True),
        True,
    ),
    "qwen grouped, gated shared expert": (  # the gate: megatron-core 0.16+ (test_versions.py)
        dict(preset="qwen1.5-moe-a2.7b", num_layers=2, num_experts=16, moe_grouped_gemm=True,
             tensor_model_parallel_size=2, sequence_parallel=True, bf16=True,
             moe_shared_expert_gate=SHARED_EXPERT_GATE),
        True,
    ),
    "grouped, fc1 and fc2 alike": (  # one run of 2 x local experts: fc1's, then fc2's
        dict(num_layers=2, num_experts=16, moe_grouped_gemm=True, disable_bias_linear=True,
             transformer_impl="transformer_engine", hidden_size=256, num_attention_heads=8,
             moe_ffn_hidden_size=128, bf16=True),
        True,
    ),
    "sequential experts": (  # one expert's fc1 and fc2, repeated per expert
        dict(preset="mixtral-8x7b", num_layers=2, num_experts=16, hidden_size=256,
             num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
             moe_ffn_hidden_size=512, bf16=True),
        True,
    ),
    "legacy grouped experts": (  # one weight holding every local expert: built for every ep
        dict(num_layers=2, num_experts=16, moe_grouped_gemm=True, disable_bias_linear=True,
             hidden_size=256, num_attention_heads=8, moe_ffn_hidden_size=128,
             transformer_impl="local"),  # megatron-core's local spec: the legacy GroupedMLP
        not GROUPED_MLP,  # 0.17+ builds SequentialMLP there: a weight per expert
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCALED))
@pytest.mark.parametrize("etp", [None, 1])
def test_pieces_scaled_to_another_expert_size_equal_megatrons_build(name, etp) -> None:
    # The planner builds one expert-parallel size per (tp, expert tp) and scales the runs of
    # per-expert weights to the other sizes; megatron's own build of each size must agree.
    import inspector.caches as caches
    from inspector.memory.compose import pieces as pp
    from inspector.world.pieces import build_pieces

    caches.clear()
    flags, scales = SCALED[name]
    sizes = dict(dp=16, expert_tensor_parallel_size=etp)
    built = build_pieces(_job(**flags, **sizes, ep=2))
    assert any(p.expert for named in built.parts() for _, p in named)  # ep > 1 weights
    assert pp.scalable(built, 8, True) == scales
    for first in (2, 1):  # scaled from an expert-parallel build, and from one without
        caches.clear()
        for ep in (first, *(ep for ep in (1, 2, 4, 8, 16) if ep != first)):
            job = _job(**flags, **sizes, ep=ep)
            assert pp.pieces_for(job) == pp.as_pieces(build_pieces(job)), (first, ep)
            assert pp.scalable_builds() == int(scales)


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes", [dict(ep=4), dict(ep=8, expert_tensor_parallel_size=1), dict(ep=1)]
)
def test_composed_state_from_scaled_pieces_equals_memory(sizes) -> None:
    # Pieces scaled from another expert-parallel size's build still compose `memory`'s state.
    import inspector.caches as caches
    from inspector.memory.compose import pieces as pp

    caches.clear()
    flags = dict(
        preset="deepseek-v3", num_layers=4, moe_layer_freq="[0,1,1,1]", num_experts=16, pp=2,
        dp=4, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True, moe_router_topk=2,
        overlap_grad_reduce=True, ddp_bucket_size=40000000,
        no_rope_fusion=True,  # megatron-core 0.13 runs MLA's fused RoPE only as experimental
    )
    pp.pieces_for(_job(**flags, **{**sizes, "ep": 2}))
    job = _job(**flags, **sizes)
    assert not pp.is_cached(job) and pp.scalable_builds() == 1
    _assert_composed_equals_memory(job, str(sizes))
    assert pp.is_cached(job)


def test_stage_activations_read_neither_data_nor_expert_parallel_size() -> None:
    # The planner prices activations once for layouts that differ only in dp or ep.
    from dataclasses import replace

    from inspector.memory.compose.stage_activations import stage_activation_bytes

    job = _job(
        preset="deepseek-v3", num_layers=4, moe_layer_freq="[0,1,1,1]", num_experts=16, pp=2,
        dp=4, ep=2, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True,
        moe_router_topk=2,
    )
    dims = job.dims()
    for stage, chunks in ((0, [[0, 1]]), (1, [[2, 3]]), (0, [[0], [2]]), (1, [[1], [3]])):
        for recompute in ("none", "selective", "full"):
            args = (stage, chunks, 1, 8, recompute, True)
            expected = stage_activation_bytes(dims, job.layout, *args)
            for dp, ep, etp in ((8, 4, None), (16, 16, 2), (1, 1, 2)):
                par = replace(job.layout, dp=dp, ep=ep, etp=etp)
                assert stage_activation_bytes(dims, par, *args) == expected, (dp, ep, etp)


def test_stage_chunk_bytes_shared_by_chunk_equal_the_stage_alone() -> None:
    # price.py shares each chunk's bytes across stages by (layer kinds, recipe): a key that left
    # out the kinds, or a memo that skipped megatron's uniform-N check, would change a plan.
    from inspector.errors import ConfigError
    from inspector.memory.compose.stage_activations import stage_chunk_bytes

    job = _job(
        preset="deepseek-v3", num_layers=8, moe_layer_freq="[0,1,1,0,1,1,1,1]", num_experts=16,
        pp=2, dp=4, ep=2, tensor_model_parallel_size=2, sequence_parallel=True, bf16=True,
        moe_router_topk=2,
    )
    dims, lay = job.dims(), job.layout
    stages = ((0, [[0, 1], [4, 5]]), (1, [[2, 3], [6, 7]]), (1, [[4, 5], [0, 1]]))
    for recipe in (("none", "uniform", 1), ("full", "block", 1), ("full", "uniform", 2)):
        memo: dict = {}
        for stage, chunks in stages:
            keys = [(tuple(map(dims.is_moe_layer, c)), recipe) for c in chunks]
            alone = stage_chunk_bytes(dims, lay, stage, chunks, 1, recipe, True)
            assert stage_chunk_bytes(dims, lay, stage, chunks, 1, recipe, True, memo=memo,
                                     keys=keys) == alone, (recipe, stage)
    memo = {}
    stage_chunk_bytes(dims, lay, 0, [[0, 1]], 1, ("full", "uniform", 2), True, memo=memo,
                      keys=[((False, True), "u2")])
    with pytest.raises(ConfigError, match="stage 1 chunk 1"):  # uniform 2 does not divide 3
        stage_chunk_bytes(dims, lay, 1, [[0, 1], [2, 3, 4]], 1, ("full", "uniform", 2), True,
                          memo=memo, keys=[((False, True), "u2"), ((True, False, True), "u2")])


def _plan(*args: str) -> dict:
    # a test that reads only the first plan asks for one (--top 1): `plan` confirms the plans it
    # prints by megatron's engine in ranked order, so the first is the first of any longer list
    result = run_cli("plan", *args, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ("--num-layers", "6", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "1"),
        ("--num-layers", "5", "--gpus", "2", "--global-batch-size", "4", "--bf16",
         "--gpu-memory", "2", "--pp", "2"),
        ("--model", "llama3-8b", "--num-layers", "4", "--hidden-size", "512",
         "--num-attention-heads", "8", "--ffn-hidden-size", "1024", "--gpus", "8",
         "--global-batch-size", "16", "--bf16", "--seq-length", "1024", "--gpu-memory", "4",
         "--pp", "2"),
        # every split kind the planner emits: a layout string, --decoder-last-pipeline-num-layers,
        # virtual stages, and --account-for-embedding/loss with virtual stages
        ("--num-layers", "9", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "2",
         "--pp", "4"),
        ("--num-layers", "10", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "2",
         "--pp", "4"),
        ("--num-layers", "8", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "2",
         "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
        ("--num-layers", "14", "--vocab-size", "512", "--gpus", "4", "--global-batch-size", "8",
         "--gpu-memory", "2", "--pp", "4"),
        # the embedding and the loss each a chunk of their own (6 + 2 = 8 virtual stages of 1),
        # with the training flags a plan keeps as given
        ("--num-layers", "6", "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "2",
         "--pp", "4", "--num-virtual-stages-per-pipeline-rank", "2", "--bf16",
         "--grad-reduce-in-bf16", "--attention-dropout", "0", "--hidden-dropout", "0"),
        # a dense layer, then MoE layers; MLA; MTP (and its embedding) on the last stage
        ("--model", "deepseek-v3", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
         "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8", "--global-batch-size", "16",
         "--seq-length", "1024", "--bf16", "--gpu-memory", "40", "--pp", "2"),
        # 4/1: a layout string, whose last stage must name the MTP layer ('m') before the loss
        # (megatron-core 0.14+: tests/test_versions.py)
        pytest.param(
            ("--model", "deepseek-v3", "--num-layers", "5", "--moe-layer-freq", "[0,1,1,1,1]",
             "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8", "--global-batch-size",
             "16", "--seq-length", "1024", "--bf16", "--gpu-memory", "40", "--pp", "2"),
            marks=pytest.mark.skipif(not MTP_IN_LAYOUT, reason="0.13 refuses MTP in a layout"),
        ),
        # 2.3 GiB: the layout misses without recomputation, and block 1 fits
        # (test_block_recompute_is_found_and_beats_full_recompute)
        BLOCK,
        # block fixed: megatron leaves the MTP layer alone (activations.mtp_recompute)
        ("--model", "deepseek-v3", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
         "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8", "--global-batch-size", "16",
         "--seq-length", "1024", "--bf16", "--gpu-memory", "40", "--pp", "2",
         "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"),
    ],
    ids=["dense", "pp2 bf16", "llama", "layout string", "decoder last", "vpp", "accounted vpp",
         "embedding alone", "deepseek", "deepseek layout", "block", "deepseek block"],
)
def test_memory_with_the_pasted_flags_confirms_the_plan(args: tuple[str, ...]) -> None:
    # the closed forms on both sides: where `memory` runs megatron's engine the plan shows the
    # engine's peak instead (plan/confirm.py; tests/test_plan_pin.py confirms those plans)
    with formulas_only():
        plan = _plan(*args, "--top", "1")["plans"][0]
    model = [a for a in args if a not in ("--gpus",)]
    drop = {"--gpus", "--gpu-memory", "--global-batch-size", "--pp",
            "--num-virtual-stages-per-pipeline-rank"}
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in drop:
            skip = True
            continue
        kept.append(a)
    del model
    flags = [w for f in plan["flags"] for w in shlex.split(f)]
    flags = [f for f in flags if f not in ("--overlap-param-gather",)]
    valued = {f: i + 1 < len(flags) and not flags[i + 1].startswith("--")
              for i, f in enumerate(flags) if f.startswith("--")}
    rest, i = [], 0  # the model flags: what the plan's own flags do not say again
    while i < len(kept):
        if kept[i] in valued:
            i += 2 if valued[kept[i]] else 1
            continue
        rest.append(kept[i])
        i += 1
    kept = rest
    dp = plan["layout"]["dp"]
    # The plan prices activations by the closed forms: it is confirmed by `memory`'s formula path
    # (the engine's peak, where it runs, is higher: the transients and buffers formulas miss).
    with formulas_only():
        result = run_cli("memory", *kept, *flags, "--dp", str(dp), "--format", "json")
    assert result.code == 0, result.err
    memory = json.loads(result.out)
    totals = [s["total_bytes"] if "total_bytes" in s else s["total"] for s in memory["stages"]]
    assert totals == [s["total"] for s in plan["stages"]]
    assert max(totals) <= plan_memory_limit(args)


def plan_memory_limit(args: tuple[str, ...]) -> int:
    return round(float(args[args.index("--gpu-memory") + 1]) * (1 << 30))


def test_gpus_no_layout_can_use_is_an_error() -> None:
    # 13 GPUs: pp 13 exceeds the 12 layers, and dp 13 does not divide the batch of 8.
    result = run_cli("plan", "--gpus", "13", "--global-batch-size", "8")
    assert result.code == 2
    assert result.err.startswith("Error: --gpus 13 admits no layout")
    assert result.out == ""


def test_a_model_that_fits_nowhere_names_the_smallest_memory() -> None:
    result = run_cli("plan", "--gpus", "2", "--global-batch-size", "4", "--gpu-memory", "0.01")
    assert result.code == 0
    report = result.out.split("\n\n", 1)[1]  # under the job line and its note
    assert report.startswith("No layout fits in 0.01 GiB per GPU: the smallest any layout needs is ")


def test_global_batch_is_required() -> None:
    result = run_cli("plan", "--gpus", "2")
    assert result.code == 2
    assert "--global-batch-size is required" in result.err


def test_a_global_batch_of_zero_is_refused_as_a_size() -> None:
    # issue #46 sweep: 0 was told it was missing ("--global-batch-size is required")
    result = run_cli("plan", "--gpus", "2", "--global-batch-size", "0")
    assert (result.code, result.err) == (2, "Error: --global-batch-size must be at least 1, got 0\n")


@pytest.mark.slow
def test_text_output_has_table_flags_and_timeline() -> None:
    result = run_cli("plan", "--gpus", "4", "--global-batch-size", "8", "--num-layers", "4",
                     "--explain")
    assert result.code == 0, result.err
    assert "Megatron-LM flags of plan 1:" in result.out
    assert "stage 0" in result.out and "Why plan 1" in result.out


@pytest.mark.parametrize("vpp", [1, 2])
def test_timeline_replays_megatrons_schedule(vpp: int) -> None:
    # Every rank runs m x v forwards and as many backwards, in megatron's order; the replay's
    # length agrees with the time model's pipeline term (m t + (p - 1) t / v for equal stages).
    from dataclasses import replace

    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search
    from inspector.render.plan import _rank_order, timeline

    args = merge_sources(Sources(flags=dict(num_layers=8, global_batch_size=16)),
                         ("model", "layout", "training")).args
    req = make_request(args, PlanFlags(8, top=1))
    plan = search(replace(req, fixed={"pp": 4, "vpp": vpp, "mbs": 1, "tp": 1})).plans[0]
    m = plan.job.schedule().num_microbatches
    rows = timeline(plan)
    assert [sum(kind == "F" for *_, kind in row) for row in rows] == [m * vpp] * 4
    assert [sum(kind == "B" for *_, kind in row) for row in rows] == [m * vpp] * 4
    end = max(stop for row in rows for _, stop, _ in row)
    assert abs(end / plan.time.pipeline - 1) < 0.15
    # stage 0 of the interleaved order: warm-up 2 (p - 1) + (v - 1) p forwards, chunk 0 first
    order = _rank_order(0, 4, m, vpp)
    warm = 3 if vpp == 1 else 2 * 3 + 4
    assert [k for k, *_ in order[:warm]] == ["F"] * warm and order[warm + 1][0] == "B"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layers", "extra", "flag"),
    [
        ("9", (), "--pipeline-model-parallel-layout"),
        ("10", ("--decoder-last-pipeline-num-layers", "1"), "--decoder-last-pipeline-num-layers"),
        ("14", ("--vocab-size", "512"), "--account-for-loss-in-pipeline-split"),
    ],
)
def test_uneven_splits_are_emitted_as_megatron_flags(layers: str, extra: tuple, flag: str) -> None:
    # The cases above that `memory` confirms really are the uneven kinds (the output layer of
    # the default vocabulary weighs on the last stage; a small one lets the accounted split win).
    # 10 layers: the split is pinned. With the host's launches priced (plan/host.py) this
    # host-bound job's best split is 2/3/3/2 (the embedding's and the loss's launches on the end
    # stages; the account flags), 10% faster than 3/3/3/1, which the search found before.
    plan = _plan("--num-layers", layers, *extra, "--gpus", "4", "--global-batch-size", "8",
                 "--gpu-memory", "2", "--pp", "4", "--top", "1")["plans"][0]
    assert any(f.split()[0] == flag for f in plan["flags"])


@pytest.mark.skipif(not MTP_IN_LAYOUT, reason="megatron-core 0.13 refuses MTP in a layout string")
def test_a_layout_string_places_the_mtp_layers_with_the_loss() -> None:
    from inspector.plan.split import split_flags

    assert split_flags((4, 1), 5, 2, 1, mtp=1) == {"pipeline_model_parallel_layout": "Etttt|tmL"}
    assert split_flags((4, 1), 5, 2, 1) == {"pipeline_model_parallel_layout": "Etttt|tL"}
    plan = _plan("--model", "deepseek-v3", "--num-layers", "5", "--moe-layer-freq", "[0,1,1,1,1]",
                 "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8",
                 "--global-batch-size", "16", "--seq-length", "1024", "--bf16",
                 "--gpu-memory", "40", "--pp", "2", "--top", "1")["plans"][0]
    # the MTP layer (m) in the last virtual stage, beside the loss (L), whatever split wins (the
    # host's launches pace this small model: plan/host.py; its best plan may interleave)
    [layout] = [f for f in plan["flags"] if f.startswith("--pipeline-model-parallel-layout ")]
    pattern = layout.split(" ", 1)[1]
    assert pattern.endswith("|tmL'") and pattern.count("m") == 1


def test_the_embedding_and_the_loss_may_each_fill_a_virtual_stage() -> None:
    # Llama 3's 405B split (6 layers + embedding + loss over 4 x 2 virtual stages of 1): megatron
    # builds chunk 0 of stage 0 with no transformer layer, and the planner prices and emits it.
    plan = _plan("--num-layers", "6", "--gpus", "4", "--global-batch-size", "8",
                 "--gpu-memory", "2", "--pp", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                 "--bf16", "--top", "1")["plans"][0]
    assert plan["split"] == [0, 1, 1, 1, 1, 1, 1, 0]
    assert plan["stages"][0]["layers"] == [[], [3]]
    assert plan["stages"][3]["layers"] == [[2], []]
    assert "--account-for-embedding-in-pipeline-split" in plan["flags"]
    assert "--account-for-loss-in-pipeline-split" in plan["flags"]


def test_the_plan_keeps_the_given_dropout_and_gradient_dtype() -> None:
    # --grad-reduce-in-bf16 halves the gradient buffer (megatron's DDP: grad dtype = param dtype),
    # dropout 0 drops the masks; both come back among the flags to paste.
    base = ("--num-layers", "4", "--gpus", "2", "--global-batch-size", "4", "--bf16",
            "--gpu-memory", "2", "--pp", "2", "--micro-batch-size", "1", "--top", "1")
    fp32 = _plan(*base)["plans"][0]
    bf16 = _plan(*base, "--grad-reduce-in-bf16", "--attention-dropout", "0",
                 "--hidden-dropout", "0")["plans"][0]
    assert fp32["layout"] == bf16["layout"]
    for a, b in zip(fp32["stages"], bf16["stages"], strict=True):
        assert b["gradients"] * 2 == a["gradients"]
        assert b["activations"] < a["activations"]
    assert {"--grad-reduce-in-bf16", "--attention-dropout 0.0", "--hidden-dropout 0.0"} <= set(bf16["flags"])
    assert not {"--grad-reduce-in-bf16", "--attention-dropout 0.0"} & set(fp32["flags"])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_plan_output_is_identical_from_run_to_run(fmt: str) -> None:
    # The search's wall time goes to the terminal only (stderr), never into stdout.
    import inspector.caches as caches

    args = ("plan", "--num-layers", "4", "--gpus", "4", "--global-batch-size", "8", "--format", fmt)
    first = run_cli(*args)
    caches.clear()  # price again from scratch, as a new process would
    second = run_cli(*args)
    assert first.code == second.code == 0
    assert first.out == second.out
    assert "\"seconds\"" not in first.out and " s (" not in first.out


def _block_request(memory_gib: float | None = None, **flags):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request

    flags = {**dict(num_layers=8, seq_length=4096, max_position_embeddings=4096, bf16=True,
                    global_batch_size=8, transformer_impl="transformer_engine"), **flags}
    args = merge_sources(Sources(flags=flags, searched=True), ("model", "layout", "training")).args
    return make_request(args, PlanFlags(4, gpu_memory=memory_gib))


@pytest.mark.parametrize("pinned", [False, True])
def test_sequence_parallelism_only_where_tp_splits_the_tokens(pinned):
    # issue #46 sweep: a sequence tp does not divide (1026 at tp 4) under --sequence-parallel is
    # refused by the job (megatron's first forward asserts); the search stopped on it. Unpinned,
    # such a layout runs without sequence parallelism; pinned on, it is not a candidate.
    from inspector.plan.layouts import layouts

    extra = dict(sequence_parallel=True) if pinned else {}
    req = _block_request(seq_length=1026, max_position_embeddings=1026, **extra)
    got = {(lay.tp, lay.sequence_parallel) for lay in layouts(req)}
    assert (2, True) in got and (4, True) not in got
    assert ((4, False) in got) is not pinned


def test_sequence_parallel_without_tp_is_kept_on_for_the_searched_tp():
    # issue #46 sweep: `plan --sequence-parallel` (tp searched) was read as tp 1, so Megatron-LM's
    # "Disabling sequence parallelism" pinned it off in every layout (tp 2 priced without it)
    from inspector.inputs.resolve import Sources, merge_sources

    assert _block_request(sequence_parallel=True).fixed["sp"] is True
    flags = dict(num_layers=8, sequence_parallel=True)
    memory = merge_sources(Sources(flags=flags), ("model", "layout", "training"))
    assert memory.args["sequence_parallel"] is False and "turned off because --tp is 1" in memory.notes[-1]
    pinned = merge_sources(Sources(flags={**flags, "tensor_model_parallel_size": 1}, searched=True),
                           ("model", "layout", "training"))  # fmt: skip
    assert pinned.args["sequence_parallel"] is False


def _priced(req, lay, split, recompute: str, method: str = "uniform", n: int = 1):
    from inspector.plan.candidates import candidate_job
    from inspector.plan.timing import evaluate

    job = candidate_job(req, lay, 1, (recompute, method, n), True, req.flash)
    assert job is not None
    return evaluate(job, split, req)


def test_block_recompute_is_found_and_beats_full_recompute() -> None:
    # BLOCK's winner: its layout and split miss 2.3 GiB without recomputation (and with
    # selective), and fit with megatron's block recomputation of one layer per chunk, which is
    # faster than checkpointing every layer; `memory` confirms its bytes (the pasted-flags test).
    # By the closed forms: megatron's engine, which `memory` runs for this model,
    # needs more than 2.3 GiB there (plan/confirm.py drops such plans).
    # (tp 1 and 2 virtual stages pinned: with the host's launches priced, plan/host.py, this
    # host-bound job's fastest plan is another layout, which fits without recomputation)
    pinned = ("--tp", "1", "--num-virtual-stages-per-pipeline-rank", "2")
    with formulas_only():
        plan = _plan(*BLOCK, *pinned, "--top", "1")["plans"][0]
    assert (plan["recompute"], plan["recompute_method"], plan["recompute_num_layers"]) == (
        "full", "block", 1)
    assert {"--recompute-granularity full", "--recompute-method block",
            "--recompute-num-layers 1"} <= set(plan["flags"])
    from inspector.job.layout import Layout
    from inspector.plan.layouts import layout_for

    req = _block_request(2.3)
    base = Layout(**{k: plan["layout"][k] for k in ("tp", "pp", "dp", "cp")})
    split = tuple(plan["split"])
    lay = layout_for(base, req.model, split, plan["layout"]["vpp"])
    none, selective = (_priced(req, lay, split, r) for r in ("none", "selective"))
    block, full = _priced(req, lay, split, "full", "block", 1), _priced(req, lay, split, "full")
    assert none.peak > req.memory and selective.peak > req.memory
    assert block.peak == plan["peak_bytes"] <= req.memory
    assert block.time.seconds == plan["step_seconds"] < full.time.seconds
    # the same search with full recomputation of every layer (method fixed) is slower
    uniform = _plan(*BLOCK, *pinned, "--recompute-granularity", "full", "--recompute-method",
                    "uniform", "--top", "1")
    assert uniform["plans"][0]["recompute_method"] == "uniform"
    assert uniform["plans"][0]["step_seconds"] > plan["step_seconds"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--recompute-granularity", "full"), ("full", "block", 1)),  # block stays open
        (("--recompute-granularity", "full", "--recompute-method", "block",
          "--recompute-num-layers", "3"), ("full", "block", 3)),  # exactly as given
        (("--recompute-granularity", "full", "--recompute-method", "uniform"), ("full", "uniform", 1)),
        (("--recompute-granularity", "none"), ("none", None, None)),  # a 4/4 split fits
    ],
    ids=["granularity", "block 3", "uniform", "none"],
)
def test_the_plan_keeps_the_given_recompute_method_and_layers(flags: tuple, expected) -> None:
    with formulas_only():  # the search's choice at the closed forms' edge (as the test above)
        result = _plan(*BLOCK, *flags)
    got = [(p["recompute"], p["recompute_method"], p["recompute_num_layers"]) for p in result["plans"]]
    assert got[0] == expected
    assert {g[0] for g in got} == {expected[0]}
    if "--recompute-method" in flags or expected[0] == "none":
        assert set(got) == {expected}


@pytest.mark.parametrize(
    ("split", "pp", "flags"),
    [
        ((3, 3, 2, 2), 4, {}),  # 1F1B
        ((3, 2, 3, 2, 2, 2), 2, {}),  # interleaved, 3 chunks per rank
        ((4, 2, 3, 3), 2, dict(num_experts=4, moe_layer_freq=3, disable_bias_linear=True)),  # MoE mix
    ],
    ids=["1f1b", "interleaved", "moe every third"],
)
def test_planner_block_activations_equal_stage_activations(split, pp, flags) -> None:
    # The planner's cached per-stage activations (N part of the key: every N priced in turn on
    # the same layout) equal activations.stage_activations, which `memory` reports, for block N.
    import math

    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.layout import Layout
    from inspector.memory.closed.activations import stage_activations
    from inspector.plan.layouts import layout_for
    from inspector.plan.price import price_memory
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.split import chunk_layers

    vpp = len(split) // pp
    args = merge_sources(Sources(flags=dict(num_layers=sum(split), bf16=True, global_batch_size=16,
                                            **flags)), ("model", "layout", "training")).args
    req = make_request(args, PlanFlags(2 * pp, top=1))
    lay = layout_for(Layout(tp=1, pp=pp, dp=2), req.model, split, vpp)
    assert lay is not None and lay.chunks == vpp
    placed = chunk_layers(split, pp, vpp)
    longest = max(len(c) for stage in placed for c in stage)
    assert longest >= 3 and len({len(c) for stage in placed for c in stage}) > 1
    seen = set()
    for n in range(1, longest + 2):
        job = _priced(req, lay, split, "full", "block", n).job
        _, stages = price_memory(job, split)
        schedule = job.schedule()
        for st in stages:
            ref = stage_activations(job.dims(), job.layout, st.stage, placed[st.stage],
                                    1, schedule.num_microbatches, "full", req.flash,
                                    recompute_method="block", recompute_num_layers=n)
            assert (st.activations, st.in_flight) == (math.ceil(ref.total), ref.in_flight), (n, st.stage)
        seen.add(tuple(st.activations for st in stages))
    assert len(seen) == longest  # N = longest and N = longest + 1 checkpoint the same layers


@pytest.mark.parametrize("vpp", [1, 2])
def test_block_step_time_lies_between_none_and_full(vpp: int) -> None:
    # Each checkpointed layer repeats its forward (a third of its FLOPs): the step time grows
    # strictly with N, from no recomputation to every layer (uniform 1 = block N with N the
    # longest chunk).
    from inspector.job.layout import Layout
    from inspector.plan.layouts import layout_for
    from inspector.plan.split import even_split

    req = _block_request()
    split = even_split(8, 2 * vpp)
    lay = layout_for(Layout(tp=1, pp=2, dp=2), req.model, split, vpp)
    longest = 8 // (2 * vpp)
    times = [_priced(req, lay, split, "none").time.seconds]
    times += [_priced(req, lay, split, "full", "block", n).time.seconds for n in range(1, longest)]
    times.append(_priced(req, lay, split, "full").time.seconds)
    assert times == sorted(set(times)), times
    assert _priced(req, lay, split, "full", "block", longest).time.seconds == times[-1]


def test_when_the_closed_forms_fit_nothing_megatrons_engine_has_the_last_word(monkeypatch) -> None:
    """The search screens candidates by the closed forms; where megatron's engine runs the job and
    measures the least-memory candidate within the budget (DeepSeek-V3 with fp8 parameters: 80.8
    GiB by the closed forms, 78.2 measured), that plan is shown; otherwise the reported least
    peak is the engine's, as `memory` would print it."""
    from dataclasses import replace

    import inspector.plan.search as search_module

    req = _block_request(0.5, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                         micro_batch_size=1, recompute_granularity="none")  # fmt: skip
    real = search_module.measured
    calls = []

    def engine(plan, under=False):
        calls.append(plan)
        out = real(plan)
        return replace(out, stages=tuple(replace(s, activations=0) for s in out.stages)) if under else out

    monkeypatch.setattr(search_module, "measured", engine)
    none = search_module.search(req)
    assert not none.plans and len(calls) == 1
    assert none.smallest_peak == real(calls[0]).peak  # memory's peak, not the closed forms'
    budget = max(s.state.total for s in calls[0].stages) + 1  # what the state alone needs
    monkeypatch.setattr(search_module, "measured", lambda plan: engine(plan, under=True))
    shown = search_module.search(replace(req, memory=budget))
    assert [p.peak for p in shown.plans] == [budget - 1]


def test_when_megatrons_engine_refuses_every_plan_the_least_it_measured_is_quoted(monkeypatch) -> None:
    """Every plan the closed forms fit measures over the budget in megatron's engine: the
    message quotes the least of those measured peaks (and that plan), not the fastest plan's."""
    from dataclasses import replace

    import inspector.plan.confirm as confirm_module
    import inspector.plan.search as search_module

    req = _block_request(8.0)
    seen = []

    def over(plan):  # each plan measures a different amount over the budget, slowest least
        extra = req.memory + 2**40 // (1 + len(seen))
        out = replace(plan, stages=tuple(replace(s, activations=s.activations + extra)
                                         for s in plan.stages))  # fmt: skip
        seen.append(out)
        return out

    monkeypatch.setattr(confirm_module, "measured", over)
    monkeypatch.setattr(confirm_module, "engine_runs", lambda plan: True)
    result = search_module.search(req)
    assert not result.plans and len(seen) > 1
    least = min(seen, key=lambda p: p.peak)
    assert result.smallest_peak == least.peak < seen[0].peak
    assert result.smallest is least


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "implementation", "expected"),
    [
        # megatron-core's local spec, asked for; Megatron-LM's default is Transformer Engine, so
        # the pasted flags must say local
        ((), ("--transformer-impl", "local"), ["--transformer-impl local"]),
        (("--num-experts", "4", "--disable-bias-linear"),
         ("--transformer-impl", "transformer_engine", "--moe-grouped-gemm", "--fp8-format",
          "hybrid", "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"),
         ["--moe-grouped-gemm", "--fp8-format hybrid", "--fp8-recipe tensorwise",
          "--fp8-amax-history-len 16"]),
    ],
    ids=["local", "te fp8 moe"],
)
def test_the_printed_flags_in_a_launch_script_build_the_planned_job(tmp_path, shape, implementation,
                                                                     expected) -> None:  # fmt: skip
    # the model's shape is the user's to paste; how it runs (spec, grouped GEMM, fp8) the plan says
    shape = ("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
             "--seq-length", "512", "--max-position-embeddings", "512", "--vocab-size", "1024",
             "--bf16", *shape)  # fmt: skip
    with formulas_only():
        plan = _plan(*shape, *implementation, "--gpus", "4", "--global-batch-size", "8", "--top", "1")
    plan = plan["plans"][0]
    for flag in expected:
        assert flag in plan["flags"]
    # Megatron-LM reads the script: its defaults (Transformer Engine) under what it names
    script = tmp_path / "train.sh"
    words = [w for f in plan["flags"] for w in shlex.split(f)]
    script.write_text("torchrun --nproc-per-node 4 pretrain_gpt.py "
                      + " ".join(shlex.quote(w) for w in (*shape, *words)) + "\n")
    with formulas_only():
        planned = run_cli("params", *shape, *implementation, "--format", "json")
        scripted = run_cli("params", "--from-script", str(script), "--format", "json")
    assert planned.code == 0 and scripted.code == 0, scripted.err
    assert json.loads(scripted.out)["header"]["config"] == json.loads(planned.out)["header"]["config"]
