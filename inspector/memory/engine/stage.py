"""Run a pipeline stage's micro-batch as megatron-core does, and return each chunk's trace.

A chunk's trace is composed (compose.py) from a small chunk megatron builds with the same
pieces: the embedding if the chunk has it, its first and last transformer layers and one middle
layer of each kind (dense, MoE) the chunk holds between them, the final norm, output layer, loss
and MTP block if it has them. That chunk sits in a small job with the job's every setting but
the pipeline: one stage (embedding and loss), two (one of them) or three (neither: the middle
one), split evenly, so megatron builds the same modules. Only the chunk's own stage is built.

Full recomputation that groups layers composes too (megatron-core 0.16
TransformerBlock._checkpointed_forward, per chunk): `--recompute-method uniform` with N > 1
layers checkpoints groups of N layers, so a group stands for the groups of its kinds (the first
group, one middle group of each kind, the last); `--recompute-method block` checkpoints the
chunk's first N layers one by one and runs the rest plainly, so a recomputed layer and a plain
one are different kinds, and the small chunk checkpoints as many first layers as it holds
recomputed ones.

Where one layer does not stand for the others, the stage itself is traced, every layer run:
an MTP block a layout string places off the last stage, a chunk without transformer layers, a
hybrid (Mamba) stack, whose layers follow its pattern.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from inspector.job.gdn import gdn_layers
from inspector.job.job import Job
from inspector.job.layout import Layout
from inspector.memory.engine.compose import compose
from inspector.memory.engine.microbatch import Trace, run_microbatch
from inspector.memory.engine.runtime import runtime_config


@dataclass(frozen=True)
class ChunkShape:
    """What megatron put on one chunk: its layers (0-based, global) and the pieces around them."""

    layers: tuple[int, ...]
    embedding: bool
    output: bool
    mtp: int  # multi-token-prediction layers on the chunk


# a piece of a chunk: its layers' kinds, one layer or a group megatron checkpoints
# together, and whether `--recompute-method block` recomputes it
Kind = tuple[bool, bool]  # a layer's (MoE MLP, gated delta net in place of attention)
Piece = tuple[tuple[Kind, ...], bool]
# the small chunks' traces by embedding, output, layer kinds and layers the small chunk recomputes
Cache = dict[tuple[bool, bool, tuple[Kind, ...], int], Trace]


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
        traces, group = trace_stage(job, stage), _group(job)
        return tuple(
            compose(trace, len(shape.layers), range(len(shape.layers) // group), shape.layers, group)
            for trace, shape in zip(traces, shapes, strict=True)
        )
    empty = [k for k, shape in enumerate(shapes) if _whole(job, shape)]  # no layer to stand for
    run = dict(zip(empty, trace_stage(job, stage, empty), strict=True)) if empty else {}
    return tuple(
        compose(run[k], 0, (), ()) if k in run else _composed(job, shape, cache)
        for k, shape in enumerate(shapes)
    )


def _whole(job: Job, shape: ChunkShape) -> bool:
    """Return whether pieces of the chunk's kinds cannot stand for its layers."""
    mtp = shape.mtp and (not shape.output or shape.mtp != job.model.mtp_num_layers)
    # a hybrid stack's layers are of several kinds in the pattern's order, and Transformer
    # Engine's layer offload treats each layer by its number (world/te/cpu_offload.py): every
    # one runs
    offload = job.training.offloading
    return bool(mtp) or not shape.layers or job.model.hybrid or bool(offload and offload.layers)


def _group(job: Job) -> int:
    """Return how many layers megatron checkpoints together: N with uniform full recomputation."""
    training = job.training
    uniform = training.recompute == "full" and training.recompute_method == "uniform"
    return training.recompute_num_layers if uniform else 1


def _pieces(job: Job, shape: ChunkShape) -> list[Piece]:
    """Return the chunk's pieces in order: groups of `_group` layers, and with block
    recomputation whether each layer is among the chunk's first N (recomputed)."""
    training, group = job.training, _group(job)
    block = training.recompute == "full" and training.recompute_method == "block"
    gdn = gdn_layers(job.model)
    kinds = [(job.model.is_moe_layer(layer), gdn[layer]) for layer in shape.layers]
    return [
        (tuple(kinds[k : k + group]), block and k < training.recompute_num_layers)
        for k in range(0, len(kinds), group)
    ]


def _small_pieces(pieces: Sequence[Piece]) -> tuple[tuple[Piece, ...], list[int]]:
    """Return the small chunk's pieces, and which one each chunk piece runs as.

    A piece's trace holds the frees of what its neighbours made (its input, saved for its
    backward; the gradient it receives), so the first and last pieces stand for themselves and
    one middle piece of each kind for the pieces in between. Block recomputation's recomputed
    layers come first in the chunk, so they do in the small chunk.
    """
    if len(pieces) <= 2:
        return tuple(pieces), list(range(len(pieces)))
    middle = list(dict.fromkeys(pieces[1:-1]))
    small = (pieces[0], *middle, pieces[-1])
    return small, [0, *(1 + middle.index(k) for k in pieces[1:-1]), len(small) - 1]


def _composed(job: Job, shape: ChunkShape, cache: Cache) -> Trace:
    small, picks = _small_pieces(_pieces(job, shape))
    kinds = tuple(kind for layers, _ in small for kind in layers)
    recomputed = sum(len(layers) for layers, block in small if block)
    key = (shape.embedding, shape.output, kinds, recomputed or job.training.recompute_num_layers)
    if key not in cache:
        cache[key] = _small_trace(job, *key)
    return compose(cache[key], len(kinds), picks, shape.layers, _group(job))


def _small_trace(
    job: Job, embedding: bool, output: bool, kinds: tuple[Kind, ...], recompute_num_layers: int
) -> Trace:
    """Trace one micro-batch of a chunk megatron builds with these pieces, in a small job that
    passes megatron `recompute_num_layers`."""
    from inspector.world.stage import stage_world

    pp = 1 if embedding and output else 2 if embedding or output else 3
    stage = 0 if embedding else pp - 1 if output else 1
    model = replace(job.model, num_layers=pp * len(kinds))
    if model.num_experts is not None:
        model = replace(model, moe_layer_freq=tuple(int(moe) for moe, _ in kinds * pp))
    if model.linear_attention_freq is not None:
        model = replace(model, linear_attention_freq=tuple(int(gdn) for _, gdn in kinds * pp))
    lay = job.layout
    layout = Layout(
        tp=lay.tp, pp=pp, dp=lay.dp, cp=lay.cp, ep=lay.ep, etp=lay.etp,
        sequence_parallel=lay.sequence_parallel,
    )  # fmt: skip
    # one micro-batch's run: the all-to-all overlap merges passes of the schedule (replayed
    # by schedule.py), so the small job, whose pipeline has no virtual stages, runs without it
    training = replace(
        job.training, ep_overlap=False, delay_wgrad=False, recompute_num_layers=recompute_num_layers,
        cuda_graph_scope=_small_scope(job.training.cuda_graph_scope, kinds),
    )
    small = replace(job, model=model, layout=layout, training=training)
    world = stage_world(model, layout, stage, checkpoint=False, runtime=runtime_config(small))
    with moe_build(job), world as chunks:
        gpt = chunks[0].module
        return run_microbatch(job, _ddp(small, gpt, stage, 0), gpt, job.schedule().num_microbatches)


def _small_scope(scope: tuple[str, ...], kinds: tuple[Kind, ...]) -> tuple[str, ...]:
    """Return the graph scope for a small chunk: without `mlp` where it has no dense layer.

    megatron-core checks the scope against the whole model (TransformerConfig: 'mlp cuda graph
    is only supported for dense layers'), which the job passed; `mlp` graphs only dense MLPs
    (transformer/cuda_graphs.py `_layer_is_graphable`), so a chunk of MoE layers runs the same.
    """
    if any(not moe for moe, _ in kinds):
        return scope
    return tuple(word for word in scope if word != "mlp")


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
    from inspector.memory.engine.moe import dispatcher_streams

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
