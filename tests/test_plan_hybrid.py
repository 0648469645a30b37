"""`plan` for hybrid (Mamba) models: each layer kind's bytes and kernels, the plan `memory` measures."""

from __future__ import annotations

import json
import shlex

import pytest

from inspector.job.versions import (
    hybrid_gdn_layers,
    hybrid_moe_layers,
    hybrid_pattern_separators,
    hybrid_stage_sizes_read,
)
from tests.conftest import run_cli

# hidden 512: d_inner 1024, 16 Mamba heads of 64, 8 groups of state 128
SMALL = dict(hidden_size=512, num_attention_heads=8, seq_length=1024, max_position_embeddings=1024,
             bf16=True, normalization="RMSNorm", disable_bias_linear=True, vocab_size=1000,
             ffn_hidden_size=1536, mamba_num_heads=16, micro_batch_size=1, global_batch_size=8,
             use_distributed_optimizer=True)  # fmt: skip
MODEL = ("--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "1024",
         "--max-position-embeddings", "1024", "--bf16", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--vocab-size", "1000", "--ffn-hidden-size", "1536",
         "--mamba-num-heads", "16")  # fmt: skip


def _job(pattern: str, **flags):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    args = {**SMALL, "num_layers": len(pattern.replace("|", "")), "hybrid_override_pattern": pattern,
            **flags}  # fmt: skip
    return make_job(merge_sources(Sources(flags=args), ("model", "layout", "training")).args)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                   {"tensor_model_parallel_size": 2},
                                   # 2 groups over tp x cp 4: B and C repeated twice after the
                                   # all-to-all (MambaContextParallel's group_repeat_count)
                                   {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                    "context_parallel_size": 2, "mamba_num_groups": 2}])  # fmt: skip
def test_each_kind_keeps_what_the_engine_measures(flags) -> None:
    # with cp, MambaContextParallel also keeps this rank's slices of the convolution's weight and
    # bias and of the per-head vectors (`_slice_conv_param`, `_slice_vector_param`): 5 KiB here
    _check_kinds("M*-M*-M*-", flags, (10 if "context_parallel_size" in flags else 5) * 1024)


GDN_SIZES = dict(swiglu=True, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                 linear_value_head_dim=64)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not hybrid_gdn_layers(), reason="G: megatron-core 0.17+")
@pytest.mark.parametrize("flags", [{}, {"tensor_model_parallel_size": 2, "sequence_parallel": True}])
def test_a_gdn_layer_keeps_about_what_the_engine_measures(flags) -> None:
    # the GDN estimate leaves out the fused gating's small temporaries: 33 bytes a token at tp 1
    _check_kinds("G-G-G-", {**GDN_SIZES, **flags}, 34 * 1024)


def _check_kinds(pattern: str, flags: dict, slack: int) -> None:
    # a layer's bytes kept for backward: the net of its segment of megatron's forward on fake
    # tensors (every kind's middle copy), against the planner's per-kind forms
    from inspector.memory.closed.activations import layer_activations
    from inspector.memory.engine.compose import cut
    from inspector.memory.engine.stage import trace_stage
    from inspector.plan.price import job_dims

    job = _job(pattern, **flags)
    segments = cut(trace_stage(job, 0)[0].forward, len(pattern)).layers
    dims = job_dims(job)
    for i in (3, 4, 5):
        measured = sum(step[0] for step in segments[i])
        formed = layer_activations(dims, job.layout, i, 1, "none", job.training.flash_attention).total
        # left out: per-head fp32 vectors (Mamba), the norms' fp32 rstd (attention, MLP): < 5 KiB
        assert 0 <= measured - formed < slack, (pattern[i], measured, formed)


def test_attention_and_mlp_layers_are_a_gpt_layer_cut_in_two() -> None:
    from inspector.formulas.kernels import ops_seconds
    from inspector.formulas.ops import Shard, layer_ops
    from inspector.job.hardware import get_gpu
    from inspector.plan.hybrid import hybrid_kernels
    from inspector.plan.price import job_dims

    dims = job_dims(_job("M*-"))
    shard, gpu = Shard(tp=2, sequence_parallel=True, micro_batch=2), get_gpu("h100")
    gpt = layer_ops(_job("M*-").dims(), shard, False)
    halves = [hybrid_kernels(dims, shard, symbol) for symbol in "*-"]
    assert [op.name for half in halves for op in half.forward] == [op.name for op in gpt.forward]
    assert sorted(op.name for half in halves for op in half.backward) == sorted(
        op.name for op in gpt.backward)  # fmt: skip
    both = sum(ops_seconds(h.forward, gpu) + ops_seconds(h.backward, gpu) for h in halves)
    assert both == pytest.approx(ops_seconds(gpt.forward, gpu) + ops_seconds(gpt.backward, gpu))
    mamba = hybrid_kernels(dims, shard, "M")
    names = [op.name for op in mamba.forward]
    assert names.index("in_proj") < names.index("ssd C B^T") < names.index("out_proj")


CASES = [("M*-M*-M-", ("--pp", "2"))]
if hybrid_stage_sizes_read():  # megatron-core's MambaStack reads the first/last stage sizes
    CASES.append(("M*-M*-M-", ("--pp", "4", "--decoder-first-pipeline-num-layers", "1",
                               "--decoder-last-pipeline-num-layers", "1")))  # fmt: skip
if hybrid_moe_layers():  # E: megatron-core 0.16+
    CASES.append(("ME*-ME*-", ("--num-experts", "4", "--moe-router-topk", "2", "--pp", "2")))
if hybrid_pattern_separators():  # '|': megatron-core 0.17+
    CASES.append(("M*M-M*|M-", ()))
    # four segments: pp 2 with 2 virtual stages a rank, or pp 4 (Megatron-LM derives the vpp)
    CASES.append(("M*|M-|M*|M-", ("--pp", "2")))
    # '/': an MTP depth of a Mamba and an attention layer on the last stage (megatron-core 0.17+)
    CASES.append(("M*M-M*|M-/M*", ("--position-embedding-type", "rope")))
# context parallelism: ring attention for `*`, MambaContextParallel's all-to-alls for `M`
CASES.append(("M*M-M*M-", ("--context-parallel-size", "2")))
# G: gated delta net layers (megatron-core 0.17+), 4 key heads and 8 value heads of 64
GDN = ("--swiglu", "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
       "--linear-key-head-dim", "64", "--linear-value-head-dim", "64")  # fmt: skip
if hybrid_gdn_layers():
    CASES.append(("MG*-MG*-", ("--pp", "2", *GDN)))


@pytest.mark.slow
@pytest.mark.parametrize("pattern, extra", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_memory_measures_the_plans_plan_prints(pattern: str, extra: tuple[str, ...]) -> None:
    layers = str(len(pattern.split("/")[0].replace("|", "")))
    model = (*MODEL, "--num-layers", layers, "--hybrid-override-pattern", pattern, *extra)
    found = assert_memory_measures_the_plans(model)
    if pattern == "M*M-M*|M-":  # the pattern's segments: 6 layers, then 2
        assert {tuple(p["split"]) for p in found["plans"]} == {(6, 2)}
    if pattern == "M*|M-|M*|M-":  # chunk c of rank r: segment c x pp + r
        assert {(p["layout"]["vpp"], tuple(p["split"])) for p in found["plans"]} == {(2, (2,) * 4)}
    if "--context-parallel-size" in extra:
        assert {p["layout"]["cp"] for p in found["plans"]} == {2}
        assert all(p["time_shares"]["context"] > 0 for p in found["plans"])
    assert all(any("chunked delta rule" in note for note in p["notes"]) == ("G" in pattern)
               for p in found["plans"])  # fmt: skip


def assert_memory_measures_the_plans(model: tuple[str, ...]) -> dict:
    """Run plan, then memory with each printed plan's flags: the same bytes, stage by stage."""
    result = run_cli("plan", *model, "--gpus", "8", "--global-batch-size", "16", "--top", "2",
                     "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    found = json.loads(result.out)
    rows = [json.dumps({k: p[k] for k in ("layout", "micro_batch_size", "recompute", "split",
                                          "distributed_optimizer")}) for p in found["plans"]]  # fmt: skip
    assert len(set(rows)) == len(rows)  # no layout printed twice
    hybrid = "--hybrid-override-pattern" in model
    assert found["plans"] and all(
        any("chunked scan of Mamba-2" in note for note in p.get("notes", ())) == hybrid
        for p in found["plans"])  # fmt: skip
    for plan in found["plans"]:
        flags = [w for f in plan["flags"] for w in shlex.split(f)]
        given, kept, k = {f for f in flags if f.startswith("--")} | {"--pp"}, [], 0
        while k < len(model):  # the model's flags the plan's do not say again
            valued = k + 1 < len(model) and not model[k + 1].startswith("--")
            if model[k] not in given:
                kept += model[k : k + 1 + valued]
            k += 1 + valued
        memory = run_cli("memory", *kept, *flags, "--dp", str(plan["layout"]["dp"]), "--format", "json")
        assert memory.code == 0, memory.err
        totals = [s.get("total_bytes", s.get("total")) for s in json.loads(memory.out)["stages"]]
        assert totals == [s["total"] for s in plan["stages"]]
    return found


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--recompute-granularity", "full"), "plan does not search --recompute-granularity full"),
        (("--hybrid-override-pattern", "M+M-"), "+ (multi-latent attention"),
        # megatron-core refuses virtual stages without '|' on every release, naming the installed
        (("--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"),
         "refuses virtual pipeline stages for a hybrid model without '|'"),
    ],
    ids=["full recompute", "multi-latent attention", "virtual stages without |"],
)
def test_what_plan_does_not_search_for_a_hybrid_model_is_named(extra, words) -> None:
    args = ["--num-layers", "4", "--hybrid-override-pattern", "M*M-"]
    if extra[0] == "--hybrid-override-pattern":
        args = args[:2]
    result = run_cli("plan", *MODEL, *args, *extra, "--gpus", "8", "--global-batch-size", "16")
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("Error:") and words in result.err, result.err


def test_ratios_without_a_pattern_are_named() -> None:
    result = run_cli("plan", *MODEL, "--num-layers", "4", "--hybrid-attention-ratio", "0.25",
                     "--gpus", "8", "--global-batch-size", "16")  # fmt: skip
    assert result.code == 2
    assert "without --hybrid-override-pattern: plan needs the pattern" in result.err


@pytest.mark.skipif(not hybrid_gdn_layers(), reason="G: megatron-core 0.17+")
def test_a_gdn_layer_is_priced_by_its_own_sizes() -> None:
    from inspector.formulas.ops import Shard
    from inspector.plan.hybrid import hybrid_kernels, hybrid_layer_flops
    from inspector.plan.price import job_dims

    dims = job_dims(_job("MG*-", **GDN_SIZES))
    # Megatron-LM's gdn_layer_flops (training.py core_v0.19.0), by hand: s 1024, h 512, in_proj
    # 2 x 256 + 2 x 512 + 2 x 8 = 1552 wide, conv over 1024 channels of width 4, 8 value heads of 64
    forward = 2 * 1024 * (512 * 1552 + 4 * 1024 + 8 * 64**2 * 4 + 512 * 8 * 64)
    assert hybrid_layer_flops(dims, "G", 1) == 3 * forward
    names = [op.name for op in hybrid_kernels(dims, Shard(tp=2, micro_batch=1), "G").forward]
    assert names.index("in_proj") < names.index("delta rule beta K K^T") < names.index("out_proj")


def _request(pattern: str, **flags):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request

    args = {**SMALL, "num_layers": len(pattern.replace("|", "")), "hybrid_override_pattern": pattern,
            **flags}  # fmt: skip
    merged = merge_sources(Sources(flags=args), ("model", "layout", "training")).args
    return make_request(merged, PlanFlags(gpus=8))


def test_context_parallelism_is_searched_for_mamba_and_attention_layers() -> None:
    from inspector.plan.layouts import layouts

    found = {(lay.tp, lay.cp, lay.pp) for lay in layouts(_request("M*M-M*M-"))}
    assert {(1, 2, 1), (1, 4, 1), (2, 2, 2)} <= found


def test_a_mamba_layer_prices_its_context_parallel_all_to_alls() -> None:
    from inspector.job.hardware import get_gpu
    from inspector.job.layout import Layout
    from inspector.plan.hybrid import context_time, symbol_time
    from inspector.plan.network import Network
    from inspector.plan.price import job_dims

    dims, net = job_dims(_job("M*-")), Network(get_gpu("h100"), 8)
    lay = Layout(tp=2, cp=2, dp=2, sequence_parallel=True)
    # 6 all-to-alls forward, 6 backward: z, x, B, C, dt (in_width 2 x 1024 + 2 x 8 x 128 + 16 =
    # 4112) to the head split, the scan's output (1024) back, each rank's 512 tokens over tp 2
    alpha, bandwidth = net.link(4)
    moved = 512 * (4112 + 1024) / 2 * 2 * (2 - 1) / 2
    assert context_time(dims, lay, net, 0.0, 1, "none", "M", ("core_attn",)) == pytest.approx(
        2 * (6 * alpha + moved / bandwidth))  # fmt: skip
    assert context_time(dims, lay, net, 0.0, 1, "none", "-", ("core_attn",)) == 0.0
    attention = symbol_time(dims, lay, net, 0.0, 1, "none", "*", ("core_attn",))
    assert attention[2] == context_time(dims, lay, net, 0.0, 1, "none", "*", ("core_attn",)) >= 0


@pytest.mark.skipif(not hybrid_pattern_separators(), reason="'|': megatron-core 0.17+")
def test_a_patterns_segments_are_searched_as_virtual_stages() -> None:
    from inspector.plan.search import Capped, settings

    def priced(req):  # the settings themselves (a capped split is found later, none for hybrids)
        return [item for item in settings(req) if not isinstance(item, Capped)]

    found = {(lay.pp, lay.vpp, split) for _, lay, split, _, _ in priced(_request("M*|M-|M*|M-"))}
    # 4 segments: pp 4 one each, pp 2 two virtual stages a rank; pp 1 would need the interleaved
    # schedule without pipelining (Megatron-LM refuses it)
    assert {(pp, vpp) for pp, vpp, _ in found} == {(4, None), (2, 2)}
    assert {split for _, _, split in found} == {(2, 2, 2, 2)}
    given = _request("M*|M-|M*|M-", num_virtual_stages_per_pipeline_rank=2)
    assert {lay.vpp for _, lay, _, _, _ in priced(given)} == {2}


@pytest.mark.skipif(not hybrid_gdn_layers(), reason="G: megatron-core 0.17+")
def test_context_parallelism_with_gdn_layers_is_refused_naming_the_release() -> None:
    from inspector.plan.layouts import layouts

    assert {lay.cp for lay in layouts(_request("MG*-", **GDN_SIZES))} == {1}
    result = run_cli("plan", *MODEL, *GDN, "--hybrid-override-pattern", "MG*-", "--num-layers", "4",
                     "--context-parallel-size", "2", "--gpus", "8", "--global-batch-size", "16")  # fmt: skip
    assert result.code == 2 and result.out == ""
    assert "--context-parallel-size 2 with gated delta net layers" in result.err, result.err
    assert "megatron-core 0.16 and 0.17" in result.err

