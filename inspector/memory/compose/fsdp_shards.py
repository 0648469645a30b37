"""A Megatron-FSDP stage's state for the planner, from the pieces' parameter counts.

`memory` lays out megatron's own buckets (world/fsdp.py); the planner divides each chunk's dense
(expert) elements over dp x cp (expert data-parallel) ranks, rounded up, leaving out the padding
to dp x a bucket's row length, under one row per bucket and rank (`build_data_parallel_buffer_index`);
`memory`, which confirms each plan shown, counts it (tests/test_fsdp.py bounds the difference).
Which buffers are sharded is megatron's table (world/fsdp.py `SHARDED`). In flight: two
neighbouring layers' (or the embedding's / output layer's) gathered weights and gradients under
optim_grads_params (per chunk: a chunk's layers run together); under optim_grads two buckets of
the plan's bucket size of gradients (Megatron-LM's default with --overlap-grad-reduce, which plans
turn on) on a stage's first chunk, a later chunk's whole gradients (one bucket: MegatronFSDP's
`disable_bucketing` for chunks after the first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inspector.job.job import Job
from inspector.job.optimizer_precision import ADAM_MOMENTS, MASTER_COPY
from inspector.memory.measure import StateBytes
from inspector.world.fsdp import SHARDED


@dataclass(frozen=True)
class FsdpState(StateBytes):
    """A Megatron-FSDP rank's state, and the gathered buffers it holds at once."""

    gathered: int = 0


def fsdp_stage_state(
    job: Job, pieces: Any, chunks: Sequence[Any], runs: Sequence[Sequence[tuple[Any, int]]]
) -> FsdpState:
    """Return the stage's most loaded rank's state (`runs`: each chunk's parameters, as runs)."""
    lay, training = job.layout, job.training
    strategy = training.sharding_strategy
    fp32 = training.fp32_grads if training.fp32_grads is not None else job.model.bf16
    totals = [0, 0, 0]
    psize = gsize = 4
    for chunk in runs:
        for expert in (False, True):
            numel = sum(p.numel * n for p, n in chunk if p.expert == expert)
            if numel:
                psize = next(p.dtype for p, _ in chunk if p.expert == expert).itemsize
                gsize = 4 if fp32 else psize
                d = lay.expert_dp if expert else lay.dp * lay.cp
                moments = training.optimizer_precision.moments()
                for i, part in enumerate(_bytes(strategy, numel, d, psize, gsize, moments)):
                    totals[i] += part
    groups = [_groups(pieces, shape) for shape in chunks]
    gathered = 0
    if strategy == "optim_grads_params":
        gathered = max(_pair(each) for each in groups) * (psize + gsize)
    elif strategy == "optim_grads":
        # Megatron-LM's default bucket size; MegatronFSDP drops it after the first chunk
        bucket = max(40_000_000, 1_000_000 * lay.dp * lay.cp)
        first = min(sum(groups[0]), 2 * bucket)
        gathered = max([first, *(sum(each) for each in groups[1:])]) * gsize
    return FsdpState(totals[0], totals[1], totals[2], gathered=gathered)


def _bytes(strategy: str, numel: int, d: int, psize: int, gsize: int,
           moments: int = ADAM_MOMENTS) -> tuple[int, int, int]:  # fmt: skip
    """Return (weights, gradients, optimizer) bytes of `numel` elements sharded over d ranks
    (`moments`: Adam's bytes an element, in the precision-aware optimizer's dtypes)."""
    params, main, grads = SHARDED[strategy]
    shard = -(-numel // d)
    return (
        (shard if params else numel) * psize,
        (shard if grads else numel) * gsize,
        (shard if main else numel) * (MASTER_COPY + moments),
    )


def _groups(pieces: Any, shape: Any) -> list[int]:
    """Return the elements gathered together in one chunk, in order: embedding, layers, output."""

    def size(runs: Sequence[tuple[Any, int]]) -> int:
        return sum(p.numel * n for p, n in runs)

    groups = [size(pieces.embedding)] if shape.embedding else []
    groups += [size(pieces.layers[moe]) for moe in shape.layers]
    return groups + ([size(pieces.output)] if shape.output else [])


def _pair(sizes: Sequence[int]) -> int:
    """Return the largest sum of two neighbours (the one in use and the one prefetched)."""
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in zip(sizes, sizes[1:], strict=False))
