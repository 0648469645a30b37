"""Run one pipeline stage's micro-batch as megatron-core does, and return its traces."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from inspector.engine.microbatch import Trace, run_microbatch, runtime_config
from inspector.job.job import Job


def trace_stage(job: Job, stage: int) -> tuple[Trace, ...]:
    """Return one micro-batch's trace for each chunk of `stage` (expert-parallel rank 0).

    The stage is built afresh with the job's runtime settings (the structural builds other
    commands share are never run), wrapped in megatron's DDP as Megatron-LM's get_model does.
    """
    from inspector.world.stage import stage_world

    schedule = job.schedule()
    # apex's FusedLayerNorm cannot run here; torch's LayerNorm saves the same tensors for
    # backward (input, mean, rstd; apex's FusedLayerNormAffineFunction: input, mean, invvar).
    model = replace(job.model, apex=False)
    runtime = runtime_config(job)
    with stage_world(model, job.layout, stage, checkpoint=False, runtime=runtime) as chunks:
        return tuple(
            run_microbatch(
                job, _ddp(job, chunk.module, stage, index), chunk.module, schedule.num_microbatches
            )
            for index, chunk in enumerate(chunks)
        )


def _ddp(job: Job, gpt: Any, stage: int, chunk: int) -> Any:
    from inspector.world.ddp import wrap_in_megatron_ddp
    from inspector.world.shards import DistOptSettings

    training = job.training
    settings = DistOptSettings.for_job(
        job,
        grad_reduce_in_fp32=training.fp32_grads,
        use_distributed_optimizer=training.use_distributed_optimizer,
    )
    return wrap_in_megatron_ddp(gpt, settings, pipeline_rank=stage, chunk=chunk, running=True)
