"""Exact per-stage state memory for many layouts, composed from a few real megatron builds.

`memory` builds every stage of one job; a planner weighs thousands of layouts. The parameters a
stage holds depend only on which pieces megatron puts there — the embedding (first stage), its
transformer layers, the final norm and output layer (last stage) — and each piece's local shapes
depend only on (tp, ep, expert-tp, dtype, spec), never on pp, dp or cp. So the pieces are built
once per such key (world/pieces.py, scaled to other expert-parallel sizes by memory/compose/pieces.py), and
`stage_state` lays out any stage's chunks as megatron's DistributedDataParallel would
(memory/compose/ddp_buffers.py) and prices its most loaded rank with memory.state_bytes, as `memory` does;
tests/test_plan.py proves composed = `memory` stage by stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import inspector.caches as caches
from inspector.job.hybrid_model import layer_kinds
from inspector.job.job import Job
from inspector.job.optimizer_precision import OptimizerBytes
from inspector.memory.compose.ddp_buffers import (
    Group,
    Spans,
    buffer_groups,
    buffer_layout,
    pad,
    place,
)
from inspector.memory.compose.fsdp_shards import fsdp_stage_state
from inspector.memory.compose.pieces import Pieces, Run, chunk_runs, pieces_for
from inspector.memory.measure import (
    StateBytes,
    job_optimizer_bytes,
    optimizer_bytes_per_element,
    state_bytes,
)
from inspector.world.shards import BufferLayout, resolve_bucket_size


@dataclass(frozen=True)
class ChunkKinds:
    """What one chunk holds: its layers' kinds (True: an MoE MLP; a hybrid layer's pattern
    symbol), in order, and whether the embedding / output layer are on it."""

    layers: tuple[bool | str, ...]
    embedding: bool
    output: bool

    @classmethod
    def of(cls, model: Any, layers: Sequence[int], embedding: bool, output: bool) -> ChunkKinds:
        """Return the shape of a chunk holding the model's 0-based global `layers`."""
        if model.hybrid or model.gdn:
            kinds = layer_kinds(model)
            return cls(tuple(kinds[i] for i in layers), embedding, output)
        return cls(tuple(model.is_moe_layer(i) for i in layers), embedding, output)


@caches.memo(maxsize=65536)
def _chunk_buffers(
    pieces_id: int,
    shape: ChunkKinds,
    pp: int,
    distributed: bool,
    dp_size: int,
    expert_dp_size: int,
    bucket_size: int | None,
) -> tuple[BufferLayout, ...]:
    """Return megatron's grad buffers for one chunk's parameters (see the module docstring)."""
    grad_dtype = _BY_ID[pieces_id].grad_dtype
    buffers = []
    for index, ((expert, dtype), runs) in enumerate(_chunk_groups(pieces_id, shape, pp)):
        dp = expert_dp_size if expert else dp_size
        # NVFP4 weights: their packed param buffer's end (0.18+, under the distributed optimizer)
        packed: list[int] | None = [] if distributed and any(p.nvfp4 for p, _ in runs) else None
        if bucket_size is None and packed is None and not (
                distributed and any(p.shared_embedding for p, _ in runs)):  # fmt: skip
            # one bucket, closed at the end: only its end padding depends on dp
            spans, end = _one_bucket(pieces_id, shape, pp, index, distributed)
            buckets = [(0, pad(end, math.lcm(dp, 128)) if distributed else end, end)]
        else:
            spans, buckets = place(runs, distributed, dp, bucket_size, packed)
        kept = sum(param.kept * count for param, count in runs)
        shared = distributed and any(param.mxfp8 for param, _ in runs)  # (779-793)
        buffers.append(replace(buffer_layout(
            spans, buckets, expert, dtype, grad_dtype, distributed, dp, kept, shared
        ), param_numel=packed[-1] if packed else None))  # fmt: skip
    return tuple(buffers)


@caches.memo(maxsize=65536)
def _chunk_groups(
    pieces_id: int, shape: ChunkKinds, pp: int
) -> tuple[Group, ...]:
    return buffer_groups(_chunk_runs(pieces_id, shape, pp)[0])


@caches.memo(maxsize=65536)
def _one_bucket(
    pieces_id: int, shape: ChunkKinds, pp: int, group: int, distributed: bool
) -> tuple[Spans, int]:
    """Return a buffer's spans and its end before padding, where it is one bucket."""
    spans, buckets = place(_chunk_groups(pieces_id, shape, pp)[group][1], distributed, 1, None)
    return spans, buckets[-1][2]


@caches.memo(maxsize=65536)
def _chunk_runs(pieces_id: int, shape: ChunkKinds, pp: int) -> tuple[tuple[Run, ...], int]:
    """Return chunk_runs for a chunk of this shape, and its parameter count."""
    runs = chunk_runs(_BY_ID[pieces_id], shape.layers, shape.embedding, shape.output, pp)
    return runs, sum(param.numel * count for param, count in runs)


_BY_ID: dict[int, Pieces] = caches.table()


def stage_state(
    job: Job, stage: int, chunks: Sequence[ChunkKinds], shard_pairs: Sequence[tuple[int, int]]
) -> tuple[StateBytes, int]:
    """Return the most loaded rank's state bytes for one stage, and its parameter count.

    `shard_pairs`: the (data index, expert data index) pairs of the stage's ranks, as
    ranks.rank_shard_indices gives them (memory.measure picks its rank among the same).
    """
    pieces = pieces_for(job)
    _BY_ID[id(pieces)] = pieces
    lay, training = job.layout, job.training
    if training.megatron_fsdp:
        runs = [_chunk_runs(id(pieces), shape, lay.pp) for shape in chunks]
        state = fsdp_stage_state(job, pieces, chunks, [each for each, _ in runs])
        return state, sum(count for _, count in runs)
    distributed = training.use_distributed_optimizer
    bucket = resolve_bucket_size(
        training.ddp_bucket_size,
        overlap_grad_reduce=training.overlap_grad_reduce,
        dp_cp_size=lay.dp * lay.cp,
    )
    keys = [  # bucketed: stage 0's first chunk only
        (id(pieces), shape, lay.pp, distributed, lay.dp * lay.cp, lay.expert_dp,
         bucket if stage == 0 and index == 0 else None)
        for index, shape in enumerate(chunks)
    ]
    buffers = [buffer for key in keys for buffer in _chunk_buffers(*key)]
    each = job_optimizer_bytes(job)
    optimizer = [_chunk_optimizer(*key, each) for key in keys]
    best = most_loaded(buffers, distributed, shard_pairs, optimizer, each)
    return best, sum(_chunk_runs(id(pieces), shape, lay.pp)[1] for shape in chunks)


def most_loaded(
    buffers: Sequence[BufferLayout], distributed: bool, shard_pairs: Sequence[tuple[int, int]],
    optimizer: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    each: OptimizerBytes | None = None,
) -> StateBytes:
    """Return memory.state_bytes of the first rank in `shard_pairs` holding the most bytes.

    Only the optimizer's share depends on the rank (its `owned_numel` shard of each buffer), so
    each data index's shard bytes are summed over the dense buffers and each expert index's over
    the expert buffers (`optimizer`: each chunk's, `_chunk_optimizer`), instead of pricing every
    rank's buffers again.
    """
    if not distributed:  # every rank holds the same bytes
        return state_bytes(buffers, distributed, *shard_pairs[0], *_bytes(each))
    dense = _summed([chunk[0] for chunk in optimizer])
    expert = _summed([chunk[1] for chunk in optimizer])
    nd, ne = len(dense), len(expert)  # an index past a row's end holds nothing there
    loads = [(dense[d] if d < nd else 0) + (expert[e] if e < ne else 0) for d, e in shard_pairs]
    best = loads.index(max(loads))  # the first rank holding the most
    return state_bytes(buffers, distributed, *shard_pairs[best], *_bytes(each))


def _bytes(each: OptimizerBytes | None) -> tuple[OptimizerBytes, ...]:
    return () if each is None else (each,)


def _summed(rows: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """Return per index the sum of the rows that are not empty."""
    kept = [row for row in rows if row]
    return kept[0] if len(kept) == 1 else tuple(map(sum, zip(*kept, strict=True)))


@caches.memo(maxsize=65536)
def _chunk_optimizer(
    pieces_id: int,
    shape: ChunkKinds,
    pp: int,
    distributed: bool,
    dp_size: int,
    expert_dp_size: int,
    bucket_size: int | None,
    each: OptimizerBytes,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return per data index, and per expert data index, the optimizer bytes of its shards of
    the chunk's dense (expert) buffers; empty where the chunk has none."""
    buffers = _chunk_buffers(
        pieces_id, shape, pp, distributed, dp_size, expert_dp_size, bucket_size
    )
    return (
        _optimizer_elements(buffers, False, each), _optimizer_elements(buffers, True, each)
    )


def _optimizer_elements(
    buffers: Sequence[BufferLayout], expert: bool, optimizer: OptimizerBytes
) -> tuple[int, ...]:
    """Return per data index the optimizer bytes of its shards of the dense (or expert) buffers."""
    rows = []
    for buffer in buffers:
        if buffer.expert == expert:
            each = optimizer_bytes_per_element(buffer, optimizer)
            rows.append([owned * each for owned in buffer.owned_numel])
    return tuple(map(sum, zip(*rows, strict=True)))

