"""`plan`: composed memory equals `memory`, the pasted flags confirm the plan, bad input."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.conftest import run_cli

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
        preset="llama3-8b", num_layers=4, pp=2, dp=2, tp=2, sequence_parallel=True, bf16=True,
    ),
    "pp1 no distopt": dict(num_layers=4, dp=2, use_distributed_optimizer=False),
}


def _job(preset: str | None = None, **flags):
    from inspector.job import make_job
    from inspector.resolve import Sources, merge_sources

    flags.setdefault("micro_batch_size", 1)
    flags.setdefault("use_distributed_optimizer", True)
    args = merge_sources(Sources(preset=preset, flags=flags), ("model", "layout", "training")).args
    return make_job(args)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composed_state_equals_memory_stage_by_stage(name: str) -> None:
    # The planner's memory is composed from two small builds; `memory` builds the whole job.
    from inspector import plan_memory as pm
    from inspector.build import build, select_view
    from inspector.memory import Hardware, measure
    from inspector.ranks import rank_shard_indices

    job = _job(**LAYOUTS[name])
    report = measure(build(job, select_view(job), expert_ranks=(0,)), Hardware())
    pairs = sorted({(d, e) for _, d, e in rank_shard_indices(job.layout)})
    last = job.layout.pp - 1
    for stage in report.stages:
        n = len(stage.layers)
        shapes = [
            pm.ChunkShape(len(c), stage.stage == 0 and k == 0, stage.stage == last and k == n - 1)
            for k, c in enumerate(stage.layers)
        ]
        state, params = pm.stage_state(job, stage.stage, shapes, pairs)
        assert state == stage.state, (name, stage.stage)
        assert params == stage.parameters


def _plan(*args: str) -> dict:
    result = run_cli("plan", *args, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)


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
    ],
)
def test_memory_with_the_pasted_flags_confirms_the_plan(args: tuple[str, ...]) -> None:
    plan = _plan(*args)["plans"][0]
    model = [a for a in args if a not in ("--gpus",)]
    drop = {"--gpus", "--gpu-memory", "--global-batch-size", "--pp"}
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
    flags = [f for f in flags if f not in ("--bf16",)] + (["--bf16"] if "--bf16" in kept else [])
    kept = [a for a in kept if a != "--bf16"]
    dp = plan["layout"]["dp"]
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
    assert result.out.startswith("No layout fits in 0.01 GiB per GPU: the smallest any layout needs is ")


def test_global_batch_is_required() -> None:
    result = run_cli("plan", "--gpus", "2")
    assert result.code == 2
    assert "--global-batch-size is required" in result.err


def test_text_output_has_table_flags_and_timeline() -> None:
    result = run_cli("plan", "--gpus", "4", "--global-batch-size", "8", "--num-layers", "4",
                     "--explain")
    assert result.code == 0, result.err
    assert "Megatron-LM flags of plan 1:" in result.out
    assert "stage 0" in result.out and "Why plan 1" in result.out
