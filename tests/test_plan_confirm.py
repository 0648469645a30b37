"""`plan` confirms its printed plans by megatron's engine alone, as `memory` would measure them.

plan/confirm.py runs the engine on the chunk shapes the plan's split gives, without building the
stages: each plan's activations must equal those of `memory`'s whole computation (every stage
built by megatron, its state sized, then the engine run on the built chunks).
"""

from __future__ import annotations

import pytest

from inspector.inputs.resolve import Sources, merge_sources
from inspector.job.versions import fsdp_with_pipeline
from inspector.plan import confirm
from inspector.plan.request import PlanFlags, make_request
from inspector.plan.search import search

pytestmark = pytest.mark.slow  # searches confirmed by the engine: ~12 s of CPU

SEARCHES = {
    # the 405B's split (embedding and loss alone on their chunks: stages traced whole), at tp 1-2
    "interleaved, embedding alone": (
        dict(num_layers=6, hidden_size=256, num_attention_heads=8, seq_length=512,
             max_position_embeddings=512, global_batch_size=8, bf16=True,
             pipeline_model_parallel_size=4, num_virtual_stages_per_pipeline_rank=2,
             account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
             transformer_impl="local"),
        8,
    ),
    # an uneven interleaved split: the plan pastes it as a layout string
    "layout string": (
        dict(num_layers=5, hidden_size=256, num_attention_heads=8, seq_length=512,
             max_position_embeddings=512, global_batch_size=8, bf16=True,
             pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2,
             transformer_impl="local"),
        4,
    ),
    # Transformer Engine, context parallelism searched, MoE: small traces shared between stages
    "te moe": (
        dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=1024,
             max_position_embeddings=1024, global_batch_size=16, bf16=True, num_experts=4,
             disable_bias_linear=True, transformer_impl="transformer_engine"),
        8,
    ),
}  # fmt: skip

FSDP = dict(use_megatron_fsdp=True, use_distributed_optimizer=True, ckpt_format="fsdp_dtensor")
# Megatron-FSDP (megatron asks for the distributed optimizer with it, so always on): the state and
# the buffers in flight come from one built stage of each kind, the chunks' bucket layouts by
# megatron's FSDP code (memory/fsdp_buffers.py); each strategy shards another set of buffers
SEARCHES |= {
    # the embedding and loss alone, two middle stages alike (built once); the first chunk of
    # each stage bucketed by the bucket size, the others one bucket
    "fsdp optim, interleaved": (
        dict(SEARCHES["interleaved, embedding alone"][0], **FSDP,
             data_parallel_sharding_strategy="optim"),
        8,
    ),
    "fsdp optim_grads, layout string": (
        dict(SEARCHES["layout string"][0], **FSDP, data_parallel_sharding_strategy="optim_grads"),
        4,
    ),
    # expert buckets sharded over the expert data-parallel group, every layer an FSDP unit
    "fsdp optim_grads_params, te moe": (
        dict(SEARCHES["te moe"][0], **FSDP, data_parallel_sharding_strategy="optim_grads_params"),
        8,
    ),
    # the strategy searched (optim_grads and optim_grads_params), context parallelism too
    "fsdp searched": (
        dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=1024,
             max_position_embeddings=1024, global_batch_size=8, bf16=True, **FSDP),
        8,
    ),
}  # fmt: skip
# Megatron-FSDP with pp > 1 runs on megatron-core 0.13 only (job/versions.py fsdp_with_pipeline)
FSDP_PIPELINED = ("fsdp optim, interleaved", "fsdp optim_grads, layout string")
FSDP_PP = 2 if fsdp_with_pipeline() else 1
if not fsdp_with_pipeline():
    for name in FSDP_PIPELINED:
        del SEARCHES[name]


@pytest.mark.skipif(fsdp_with_pipeline(), reason="megatron-core 0.13's custom_fsdp runs pp > 1")
def test_fsdp_with_pipeline_stages_is_refused_where_megatron_cannot_run_it() -> None:
    from inspector.errors import ConfigError

    flags = dict(SEARCHES["layout string"][0], **FSDP, data_parallel_sharding_strategy="optim_grads")
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    with pytest.raises(ConfigError, match="spans one pipeline stage's ranks, not the world's"):
        make_request(args, PlanFlags(4, top=2))


@pytest.mark.parametrize("name", list(SEARCHES))
def test_engine_alone_measures_what_memory_measures(name: str) -> None:
    flags, gpus = SEARCHES[name]
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    result = search(make_request(args, PlanFlags(gpus, top=2)))
    assert result.plans
    for plan in result.plans:
        assert confirm.engine_runs(plan) and confirm.engine_shapes(plan) is not None
        fast = confirm.measured(plan)
        whole = confirm._measured_as_memory(plan)
        assert fast.stages == whole.stages, plan.job.layout


def test_fsdp_plans_print_the_peak_memory_measures() -> None:
    # Megatron-FSDP plans print `memory`'s stage totals, which hold the gathered parameters and
    # gradients in flight: the printed peak is that total, once (`memory` run here on its own).
    from inspector.memory.measure import Hardware, measure
    from inspector.world.build import build, select_view

    flags = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512,
                 max_position_embeddings=512, global_batch_size=8, bf16=True,
                 use_megatron_fsdp=True, use_distributed_optimizer=True, ckpt_format="fsdp_dtensor",
                 data_parallel_sharding_strategy="optim_grads_params")  # fmt: skip
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    result = search(make_request(args, PlanFlags(4, top=2)))
    assert result.plans
    for plan in result.plans:
        report = measure(build(plan.job, select_view(plan.job), expert_ranks=(0,)), Hardware())
        assert any(s.fsdp_in_flight for s in report.stages)
        assert [s.total for s in plan.stages] == [s.total for s in report.stages]


def test_the_engine_runs_an_fsdp_job_alike_under_every_strategy() -> None:
    # confirm.measured runs megatron's engine once per layout for the FSDP strategies a search
    # tries (confirm._ENGINE): the strategy's buffers are FSDP's own (`_fsdp_held`), and the
    # engine must measure the rest the same under each; the gradient buckets the sharded-gradient
    # strategies make in the backward (engine/fsdp_grads.py) are the only difference
    from inspector.job.job import make_job
    from inspector.memory.engine.fsdp_grads import BUCKETS
    from inspector.memory.engine.run import run_job
    from inspector.world.build import build, select_view

    runs = []
    for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        job = make_job(dict(
            num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512,
            max_position_embeddings=512, global_batch_size=8, micro_batch_size=1, bf16=True,
            pipeline_model_parallel_size=FSDP_PP, data_parallel_size=2, **FSDP,
            data_parallel_sharding_strategy=strategy,
        ))  # fmt: skip
        runs.append(run_job(job, build(job, select_view(job), expert_ranks=(0,)).stages))
    assert runs[0].not_run is None and len(runs[0].runs) == FSDP_PP
    assert runs[0] == runs[1]
    if FSDP_PP > 1:  # at pp 1 the buckets in flight do not reach this job's peak
        assert runs[1] != runs[2]

    def without_buckets(run):
        return [tuple((e.bytes, e.where) for e in trace.backward if BUCKETS not in e.where)
                for trace in run.replay.traces]  # fmt: skip

    for job_runs in runs[2:]:
        for stage, run in job_runs.runs.items():
            plain = runs[0].runs[stage]
            assert any(BUCKETS in e.where for t in run.replay.traces for e in t.backward)
            assert [t.forward for t in run.replay.traces] == [t.forward for t in plain.replay.traces]
            assert without_buckets(run) == [tuple((e.bytes, e.where) for e in t.backward)
                                            for t in plain.replay.traces]  # fmt: skip
