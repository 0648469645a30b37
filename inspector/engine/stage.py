"""Run a pipeline stage's micro-batch as megatron-core does, and return each chunk's trace.

A chunk's trace is composed (compose.py) from a small chunk megatron builds with the same
pieces: the embedding if the chunk has it, its first and last transformer layers and one middle
layer of each kind (dense, MoE) the chunk holds between them, the final norm, output layer, loss
and MTP block if it has them. That chunk sits in a small job with the job's every setting but
the pipeline: one stage (embedding and loss), two (one of them) or three (neither: the middle
one), split evenly, so megatron builds the same modules. Only the chunk's own stage is built.

Where one layer does not stand for the others, the stage itself is traced, every layer run:
full recomputation by blocks or of several layers per checkpoint (megatron checkpoints a
group, or only the first layers of the chunk), an MTP block a layout string places off the last
stage, a chunk without transformer layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from inspector.engine.compose import compose
from inspector.engine.microbatch import Trace, run_microbatch, runtime_config
from inspector.job.job import Job
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig


@dataclass(frozen=True)
class ChunkShape:
    """What megatron put on one chunk: its layers (0-based, global) and the pieces around them."""

    layers: tuple[int, ...]
    embedding: bool
    output: bool
    mtp: int  # multi-token-prediction layers on the chunk


Cache = dict[tuple[bool, bool, tuple[bool, ...]], Trace]


def trace_chunks(
    job: Job,
    stage: int,
    shapes: Sequence[ChunkShape],
    cache: Cache | None = None,
    whole: bool = False,
) -> tuple[Trace, ...]:
    """Return one micro-batch's trace for each chunk of `stage`, composed where one layer serves.

    `cache` keeps the small chunks' traces across the stages of one job; `whole` runs every
    layer of the stage instead (the tests' reference).
    """
    cache = {} if cache is None else cache
    if whole or any(_whole(job, shape) for shape in shapes if shape.layers):
        traces = trace_stage(job, stage)
        return tuple(
            compose(trace, len(shape.layers), range(len(shape.layers)), shape.layers)
            for trace, shape in zip(traces, shapes, strict=True)
        )
    empty = [k for k, shape in enumerate(shapes) if _whole(job, shape)]  # no layer to stand for
    run = dict(zip(empty, trace_stage(job, stage, empty), strict=True)) if empty else {}
    return tuple(
        compose(run[k], 0, (), ()) if k in run else _composed(job, shape, cache)
        for k, shape in enumerate(shapes)
    )


def _whole(job: Job, shape: ChunkShape) -> bool:
    """Return whether one layer of each kind cannot stand for the chunk's layers."""
    training = job.training
    grouped = training.recompute == "full" and (
        training.recompute_method == "block" or (training.recompute_num_layers or 1) > 1
    )
    mtp = shape.mtp and (not shape.output or shape.mtp != job.model.mtp_num_layers)
    return grouped or bool(mtp) or not shape.layers


def _small_layers(model: ModelConfig, shape: ChunkShape) -> tuple[tuple[bool, ...], list[int]]:
    """Return the small chunk's layer kinds (True: MoE), and which one each chunk layer runs as.

    A layer's trace holds the frees of what its neighbours made (its input, saved for its
    backward; the gradient it receives), so the first and last layers stand for themselves and
    one middle layer of each kind for the layers in between.
    """
    kinds = [model.is_moe_layer(layer) for layer in shape.layers]
    if len(kinds) <= 2:
        return tuple(kinds), list(range(len(kinds)))
    middle = list(dict.fromkeys(kinds[1:-1]))
    small = (kinds[0], *middle, kinds[-1])
    return small, [0, *(1 + middle.index(k) for k in kinds[1:-1]), len(small) - 1]


def _composed(job: Job, shape: ChunkShape, cache: Cache) -> Trace:
    kinds, picks = _small_layers(job.model, shape)
    key = (shape.embedding, shape.output, kinds)
    if key not in cache:
        cache[key] = _small_trace(job, *key)
    return compose(cache[key], len(kinds), picks, shape.layers)


def _small_trace(job: Job, embedding: bool, output: bool, kinds: tuple[bool, ...]) -> Trace:
    """Trace one micro-batch of a chunk megatron builds with these pieces, in a small job."""
    from inspector.world.stage import stage_world

    pp = 1 if embedding and output else 2 if embedding or output else 3
    stage = 0 if embedding else pp - 1 if output else 1
    model = replace(job.model, num_layers=pp * len(kinds))
    if model.num_experts is not None:
        model = replace(model, moe_layer_freq=tuple(int(k) for k in kinds * pp))
    lay = job.layout
    layout = Layout(
        tp=lay.tp, pp=pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, etp=lay.etp,
        sequence_parallel=lay.sequence_parallel,
    )  # fmt: skip
    # one micro-batch's run: the all-to-all overlap merges passes of the schedule (replayed
    # by schedule.py), so the small job, whose pipeline has no virtual stages, runs without it
    training = replace(job.training, ep_overlap=False, delay_wgrad=False)
    small = replace(job, model=model, layout=layout, training=training)
    world = stage_world(model, layout, stage, checkpoint=False, runtime=runtime_config(job))
    with moe_build(job), world as chunks:
        gpt = chunks[0].module
        return run_microbatch(job, _ddp(small, gpt, stage, 0), gpt, job.schedule().num_microbatches)


def trace_stage(job: Job, stage: int, chunks: Sequence[int] | None = None) -> tuple[Trace, ...]:
    """Return one micro-batch's trace for each chunk of `stage` (expert-parallel rank 0), every
    layer run; only the `chunks` given (their indices), when given.

    The stage is built afresh with the job's runtime settings (the structural builds other
    commands share are never run), wrapped in megatron's DDP as Megatron-LM's get_model does.
    """
    from inspector.world.stage import stage_world

    schedule = job.schedule()
    runtime = runtime_config(job)
    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime)
    with moe_build(job), world as built:
        return tuple(
            run_microbatch(
                job, _ddp(job, chunk.module, stage, index), chunk.module, schedule.num_microbatches
            )
            for index, chunk in enumerate(built)
            if chunks is None or index in chunks
        )


def moe_build(job: Job) -> contextlib.AbstractContextManager[None]:
    """Return what megatron needs to build an MoE job's token dispatchers here (moe.py)."""
    if job.model.num_experts is None:
        return contextlib.nullcontext()
    from inspector.engine.moe import dispatcher_streams

    return dispatcher_streams()


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
