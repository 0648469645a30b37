"""Exact per-stage memory for many layouts, composed from a few real megatron builds.

`memory` builds every stage of one job; a planner weighs thousands of layouts. The parameters a
stage holds depend only on which pieces megatron puts there — the embedding (first stage), its
transformer layers, the final norm and output layer (last stage) — and each piece's local shapes
depend only on (tp, ep, expert-tp, dtype, spec), never on pp, dp or cp. So `Pieces` builds the
model once per such key with two layers on two pipeline stages (and once with one layer on one
stage, where a tied output layer has no weight of its own) — an MoE layer and a dense one where the
model mixes both kinds (--moe-layer-freq) —, reads every parameter's numel, dtype
and DDP flags (`allreduce`, `shared_embedding`) off megatron's modules, and `compose_stage`
lays out any stage's chunks as megatron's DistributedDataParallel would. Two expert-parallel sizes
differ only in how many experts a rank holds, megatron's num_moe_experts // ep (MoELayer), and in
the expert-parallel flag (allreduce=False) that the experts' weights carry when ep > 1:
where megatron's names show those weights per local expert (SequentialMLP's `local_experts.{i}.`,
TEGroupedMLP's `weight{i}`), the pieces built for one ep serve every other with those weights
repeated for the new count (`_scalable`; tests check them equal to megatron's own builds).


  megatron-core `_ParamAndGradBuffer.__init__` (distributed/param_and_grad_buffer.py): one buffer
  per (param dtype, grad dtype), expert-parallel parameters (allreduce=False, only when ep > 1)
  in buffers of their own; parameters taken in reverse order; with the distributed optimizer each
  starts at a multiple of 64, a `shared_embedding` parameter gets a bucket of its own, and each
  bucket ends at a multiple of lcm(dp x cp, 128) (expert buffers: the expert data-parallel size);
  a bucket closes once it holds `bucket_size` elements — only on stage 0, chunk 0 with
  --overlap-grad-reduce (Megatron-LM's get_model and DDP disable bucketing elsewhere).

The layouts become shards.BufferLayout records, so memory.state_bytes prices them exactly as
`memory` does; tests/test_plan.py proves composed = `memory` stage by stage.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from inspector.job.job import Job, Training
from inspector.job.layout import Layout
from inspector.report.memory import StateBytes, optimizer_bytes_per_element, state_bytes
from inspector.world.shards import (
    BucketLayout,
    BufferLayout,
    ParamShards,
    owned_numel,
    resolve_bucket_size,
)


@dataclass(frozen=True)
class Param:
    """One parameter as megatron's DDP sees it: size, dtype, and the flags that place it."""

    numel: int
    dtype: Any  # torch.dtype
    expert: bool  # allreduce=False: an expert-parallel buffer
    shared_embedding: bool


Run = tuple[Param, int]  # a parameter, and how many equal ones stand side by side from it


def runs_of(params: Sequence[Param]) -> tuple[Run, ...]:
    """Return parameters as runs of equal neighbours (TE's grouped MLP has one per expert)."""
    return tuple((param, len(list(equal))) for param, equal in itertools.groupby(params))


@dataclass(frozen=True)
class Pieces:
    """The parameters of each piece a stage can hold, in megatron's parameter order, as runs.

    `layers` maps a layer's kind (True: an MoE MLP) to its parameters. `output` is the last
    stage's final norm, output layer and MTP block with pp > 1, and `output_embedding` the
    embedding megatron also builds there for MTP (empty without MTP); `output_alone` the tail with
    pp == 1 (a tied output layer then reuses the embedding's weight).
    """

    embedding: tuple[Run, ...]
    embedding_alone: tuple[Run, ...]
    layers: dict[bool, tuple[Run, ...]]
    output_embedding: tuple[Run, ...]
    output: tuple[Run, ...]
    output_alone: tuple[Run, ...]
    grad_dtype: Any


def piece_key(job: Job) -> tuple[Any, ...]:
    """Return what a stage's parameter shapes depend on: model, tp, ep, expert-tp, SP."""
    lay = job.layout
    return (job.model, lay.tp, lay.ep, lay.expert_tp, lay.sequence_parallel, job.training.fp32_grads)


_PIECES: dict[tuple[Any, ...], Pieces] = {}
# piece_key less ep -> a build whose expert weights megatron names per local expert, and their count
_SCALABLE: dict[tuple[Any, ...], tuple[_Built, int]] = {}


def pieces_for(job: Job) -> Pieces:
    """Return the job's pieces, building the small models once per `piece_key` (or scaling)."""
    key = piece_key(job)
    if key not in _PIECES:
        experts, ep = job.model.num_experts, job.layout.ep
        local = None if experts is None else experts // ep  # megatron's num_local_experts
        family = key[:2] + key[3:]
        if local is not None and family in _SCALABLE:
            built, built_local = _SCALABLE[family]
            _PIECES[key] = _as_pieces(built, (built_local, local, ep > 1))
        else:
            built = _build_pieces(job)
            if local is not None and _scalable(built, local, ep > 1):
                _SCALABLE[family] = (built, local)
            _PIECES[key] = _as_pieces(built)
    return _PIECES[key]


Named = tuple[tuple[str, Param], ...]  # megatron's parameter names, and their Params, in order


@dataclass(frozen=True)
class _Built:
    """Each piece's named parameters, as the small builds gave them (see Pieces)."""

    embedding: Named
    embedding_alone: Named
    layers: dict[bool, Named]
    output_embedding: Named
    output: Named
    output_alone: Named
    grad_dtype: Any

    def parts(self) -> list[Named]:
        """Return every piece's parameters."""
        return [self.embedding, self.embedding_alone, *self.layers.values(),
                self.output_embedding, self.output, self.output_alone]


def _as_pieces(built: _Built, experts: tuple[int, int, bool] | None = None) -> Pieces:
    """Return the built pieces as runs; `experts` (local, to, parallel): with `to` local experts
    instead of the build's `local`, expert-parallel or not (`_scalable` builds only)."""

    def runs(named: Named) -> tuple[Run, ...]:
        if experts is None:
            return runs_of([param for _, param in named])
        return runs_of(_scaled_params(named, *experts))

    return Pieces(
        embedding=runs(built.embedding),
        embedding_alone=runs(built.embedding_alone),
        layers={kind: runs(named) for kind, named in built.layers.items()},
        output_embedding=runs(built.output_embedding),
        output=runs(built.output),
        output_alone=runs(built.output_alone),
        grad_dtype=built.grad_dtype,
    )


# megatron's names for one local expert's copy of a weight: SequentialMLP
# `...local_experts.{i}.linear_fc1.weight`, TEGroupedMLP `...linear_fc1.weight{i}`
_EXPERT_COPY = (
    re.compile(r"(.*\.local_experts\.)(\d+)(\..*)"),
    re.compile(r"(.*\.linear_fc[12]\.(?:weight|bias))(\d+)()"),
)


def _expert_copy(name: str) -> tuple[str, int] | None:
    """Return (the weight's name less the expert index, the local expert index), or None."""
    for pattern in _EXPERT_COPY:
        match = pattern.fullmatch(name)
        if match:
            return match[1] + "#" + match[3], int(match[2])
    return None


def _expert_blocks(named: Named) -> list[tuple[bool, Named]]:
    """Return the parameters cut where the copies of expert weights begin and end."""
    return [
        (copies, tuple(block))
        for copies, block in itertools.groupby(
            named, key=lambda item: _expert_copy(item[0]) is not None
        )
    ]


def _expert_order(block: Named, local: int) -> tuple[dict[str, Param], bool] | None:
    """Return one expert's weights and whether each weight's copies stand side by side.

    None unless the names show `local` alike experts (copies 0 .. local - 1 of each weight, one
    Param per weight) in one of megatron's orders: expert after expert (SequentialMLP) or
    weight after weight (TEGroupedMLP).
    """
    copies = [(_expert_copy(name), param) for name, param in block]
    weights: dict[str, Param] = {}
    order = []
    for copy, param in copies:
        if copy is None or weights.setdefault(copy[0], param) != param:
            return None
        order.append(copy)
    if order == [(w, i) for i in range(local) for w in weights]:
        return weights, False
    if order == [(w, i) for w in weights for i in range(local)]:
        return weights, True
    return None


def _scaled_params(named: Named, local: int, to: int, parallel: bool) -> list[Param]:
    """Return the parameters with every block of `local` experts' weights holding `to`, flagged
    expert-parallel (allreduce=False) where `parallel`."""
    params: list[Param] = []
    for copies, block in _expert_blocks(named):
        order = _expert_order(block, local) if copies else None
        if order is None:
            params.extend(param for _, param in block)
            continue
        weights, side_by_side = order
        flagged = [replace(param, expert=parallel) for param in weights.values()]
        if side_by_side:
            params.extend(param for param in flagged for _ in range(to))
        else:
            params.extend(param for _ in range(to) for param in flagged)
    return params


def _scalable(built: _Built, local: int, parallel: bool) -> bool:
    """Return whether the build's expert weights can be scaled to another expert count.

    Every block of copies must name `local` alike experts (local > 1, where megatron's two
    orders differ); the expert-parallel flag (megatron's allreduce=False) must be on exactly the
    copies, and only with expert parallelism; and the build must come back at `local`.
    """
    blocks = [(copies, block) for named in built.parts() for copies, block in _expert_blocks(named)]
    return (
        local > 1
        and any(copies for copies, _ in blocks)
        and all(
            all(param.expert == (copies and parallel) for _, param in block)
            and (not copies or _expert_order(block, local) is not None)
            for copies, block in blocks
        )
        and _as_pieces(built, (local, local, parallel)) == _as_pieces(built)
    )


def _params_of(module: Any) -> list[tuple[str, Param]]:
    """Return (name, Param) for every parameter with a gradient, in named_parameters() order."""
    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        expert = not getattr(p, "allreduce", True)
        shared = bool(getattr(p, "shared_embedding", False))
        out.append((name, Param(p.numel(), p.dtype, expert, shared)))
    return out


def _split(named: list[tuple[str, Param]]) -> tuple[Named, Named, Named]:
    """Split a stage's parameters into embedding, decoder layers and final norm / output."""
    head, layers, tail = [], [], []
    for item in named:
        if item[0].startswith("embedding."):
            head.append(item)
        elif item[0].startswith("decoder.layers."):
            layers.append(item)
        else:
            tail.append(item)
    return tuple(head), tuple(layers), tuple(tail)


def _first_chunks(job: Job) -> list[Any]:
    """Return each stage's GPTModel as megatron builds it on expert rank 0 (no checkpoint view)."""
    from inspector.world.stage import build_stage

    return [
        build_stage(job.model, job.layout, stage, 0, checkpoint=False)[0].module
        for stage in range(job.layout.pp)
    ]


def _build_pieces(job: Job) -> _Built:
    """Build two small models (2 layers on 2 stages, 1 layer on 1 stage) and cut them in pieces."""
    from inspector.world.stage import megatron

    lay = job.layout
    dp = lay.ep * lay.expert_tp  # any dp megatron accepts; dp changes no shape
    model = job.model
    kinds = {model.is_moe_layer(i) for i in range(model.num_layers)}
    small = replace(model, num_layers=2)
    if model.num_experts is not None:
        # stage 1's layer is of the model's last layer's kind (megatron builds an MTP block with
        # the last layer's spec); where the model mixes kinds, stage 0's is the other one
        tail = int(model.is_moe_layer(model.num_layers - 1))
        small = replace(small, moe_layer_freq=(1 - tail if len(kinds) == 2 else tail, tail))
    two = Job(
        small,
        Layout(tp=lay.tp, pp=2, dp=dp, ep=lay.ep, etp=lay.etp, sequence_parallel=lay.sequence_parallel),
        Training(micro_batch_size=1),
    )
    stage_0, stage_1 = _first_chunks(two)
    first = _split(_params_of(stage_0))
    last = _split(_params_of(stage_1))
    small_one = replace(small, num_layers=1)
    if model.num_experts is not None:
        small_one = replace(small_one, moe_layer_freq=small.moe_layer_freq[:1])  # type: ignore[index]
    one = Job(small_one, replace(two.layout, pp=1), two.training)
    alone = _split(_params_of(_first_chunks(one)[0]))
    megatron()
    import torch

    dtype = first[1][0][1].dtype
    fp32 = job.training.fp32_grads
    if fp32 is None:  # ddp.py: megatron's default, grad_reduce_in_fp32 = config.bf16
        fp32 = dtype == torch.bfloat16
    grad = torch.float32 if fp32 else dtype
    return _Built(
        embedding=first[0],
        embedding_alone=alone[0],
        layers={kind: first[1] if kind == small.is_moe_layer(0) else last[1] for kind in kinds},
        output_embedding=last[0],
        output=last[2],
        output_alone=alone[2],
        grad_dtype=grad,
    )


def chunk_runs(
    pieces: Pieces, layers: tuple[bool, ...], embedding: bool, output: bool, pp: int
) -> tuple[Run, ...]:
    """Return one chunk's parameters in megatron's order (embedding, layers, final norm/output), as runs.

    `layers`: each layer's kind, in order (True: an MoE MLP).
    """
    head: tuple[Run, ...] = ()
    tail: tuple[Run, ...] = ()
    if embedding:
        head = pieces.embedding if pp > 1 else pieces.embedding_alone
    if output:
        tail = pieces.output if pp > 1 else pieces.output_alone
        if pp > 1:
            head = pieces.output_embedding
    return _joined([head, *(pieces.layers[kind] for kind in layers), tail])


def _joined(parts: Sequence[Sequence[Run]]) -> tuple[Run, ...]:
    """Return the runs one after another, equal parameters merged where they meet."""
    out: list[Run] = []
    for part in parts:
        for param, count in part:
            if out and out[-1][0] == param:
                out[-1] = (param, out[-1][1] + count)
            else:
                out.append((param, count))
    return tuple(out)


def _groups(runs: Sequence[Run]) -> tuple[tuple[tuple[bool, Any], tuple[Run, ...]], ...]:
    """Return the runs of each buffer: one per (expert, dtype), dense buffers first."""
    grouped: dict[tuple[bool, Any], list[Run]] = {}
    for run in runs:
        grouped.setdefault((run[0].expert, run[0].dtype), []).append(run)
    return tuple(
        (key, _joined([members])) for key, members in sorted(grouped.items(), key=lambda kv: kv[0][0])
    )


Spans = list[tuple[int, int, int]]  # (start, end, bucket) of parameters side by side
Buckets = list[tuple[int, int, int]]  # (offset, end padded, unpadded numel)


def _placed(
    runs: Sequence[Run], distributed: bool, dp: int, bucket_size: int | None
) -> tuple[Spans, Buckets]:
    """Reimplement `_ParamAndGradBuffer`'s index arithmetic for one buffer, a run at a time.

    Within a run of equal parameters each starts a step (its numel, padded to 64 with the
    distributed optimizer) after the one before until a bucket closes, so a run is placed in as
    many pieces as it spans buckets; parameters side by side are kept as one span of elements,
    which is all the optimizer's shards (`owned_numel`) depend on.
    """
    divisor = math.lcm(dp, 128)
    spans: Spans = []
    buckets: Buckets = []
    start = bucket_start = in_bucket = end = 0

    def close(param_end: int) -> int:
        nonlocal bucket_start, in_bucket
        padded = _pad(param_end, divisor) if distributed else param_end
        buckets.append((bucket_start, padded, param_end - bucket_start))
        bucket_start, in_bucket = padded, 0
        return padded

    for param, count in reversed(runs):
        shared = param.shared_embedding and distributed
        step = _pad(param.numel, 64) if distributed else param.numel
        while count:
            if distributed:
                start = _pad(start, 64)
            if shared and in_bucket:
                start = close(start)
            if shared:  # a bucket of its own
                take, closes = 1, True
            else:
                take, closes = _placed_before_close(
                    start - bucket_start, param.numel, step, count, bucket_size
                )
            end = start + (take - 1) * step + param.numel
            _add_spans(spans, start, take, step, param.numel, len(buckets))
            in_bucket += take
            count -= take
            start = close(end) if closes else end
    if in_bucket:
        close(end)
    return spans, buckets


def _buffer(
    spans: Spans, buckets: Buckets, expert: bool, dtype: Any, grad_dtype: Any,
    distributed: bool, dp: int,
) -> BufferLayout:
    """Return one placed buffer as a BufferLayout, each rank's optimizer shard counted."""
    numel = buckets[-1][1]
    owned = (numel,) * dp
    if distributed:
        shards = [
            ParamShards("", 0, b, s, e, buckets[b][0], (buckets[b][1] - buckets[b][0]) // dp)
            for s, e, b in spans
        ]
        owned = owned_numel(shards, dp)
    return BufferLayout(
        expert=expert,
        param_dtype=dtype,
        grad_dtype=grad_dtype,
        dp_size=dp,
        numel=numel,
        numel_unpadded=sum(b[2] for b in buckets),
        buckets=tuple(BucketLayout(o, e - o, u) for o, e, u in buckets),
        owned_numel=owned,
    )


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def _placed_before_close(
    offset: int, numel: int, step: int, count: int, bucket_size: int | None
) -> tuple[int, bool]:
    """Return how many of `count` equal parameters the open bucket takes, and whether it closes.

    The first starts `offset` elements into the bucket, the i-th (from 0) ends at offset + i x
    step + numel; the bucket closes after the first whose end reaches `bucket_size`.
    """
    if bucket_size is None:
        return count, False
    need = bucket_size - offset - numel
    if need <= 0:
        return 1, True
    if step == 0:  # empty parameters never fill a bucket
        return count, False
    first_full = -(-need // step)
    return (first_full + 1, True) if first_full < count else (count, False)


def _add_spans(
    spans: list[tuple[int, int, int]], start: int, count: int, step: int, numel: int, bucket: int
) -> None:
    """Append `count` parameters starting `step` apart, merging those that touch."""
    for index in range(1 if step == numel else count):
        first = start + index * step
        last = first + (count * numel if step == numel else numel)
        if spans and spans[-1][2] == bucket and spans[-1][1] == first:
            spans[-1] = (spans[-1][0], last, bucket)
        else:
            spans.append((first, last, bucket))


@dataclass(frozen=True)
class ChunkShape:
    """What one chunk holds: its layers' kinds (True: an MoE MLP), in order, and whether the
    embedding / output layer are on it."""

    layers: tuple[bool, ...]
    embedding: bool
    output: bool

    @classmethod
    def of(cls, model: Any, layers: Sequence[int], embedding: bool, output: bool) -> ChunkShape:
        """Return the shape of a chunk holding the model's 0-based global `layers`."""
        return cls(tuple(model.is_moe_layer(i) for i in layers), embedding, output)


@lru_cache(maxsize=65536)
def _chunk_buffers(
    pieces_id: int,
    shape: ChunkShape,
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
        if bucket_size is None and not (distributed and any(p.shared_embedding for p, _ in runs)):
            # one bucket, closed at the end: only its end padding depends on dp
            spans, end = _one_bucket(pieces_id, shape, pp, index, distributed)
            buckets = [(0, _pad(end, math.lcm(dp, 128)) if distributed else end, end)]
        else:
            spans, buckets = _placed(runs, distributed, dp, bucket_size)
        buffers.append(_buffer(spans, buckets, expert, dtype, grad_dtype, distributed, dp))
    return tuple(buffers)


@lru_cache(maxsize=65536)
def _chunk_groups(
    pieces_id: int, shape: ChunkShape, pp: int
) -> tuple[tuple[tuple[bool, Any], tuple[Run, ...]], ...]:
    return _groups(_chunk_runs(pieces_id, shape, pp)[0])


@lru_cache(maxsize=65536)
def _one_bucket(
    pieces_id: int, shape: ChunkShape, pp: int, group: int, distributed: bool
) -> tuple[Spans, int]:
    """Return a buffer's spans and its end before padding, where it is one bucket."""
    spans, buckets = _placed(_chunk_groups(pieces_id, shape, pp)[group][1], distributed, 1, None)
    return spans, buckets[-1][2]


@lru_cache(maxsize=65536)
def _chunk_runs(pieces_id: int, shape: ChunkShape, pp: int) -> tuple[tuple[Run, ...], int]:
    """Return chunk_runs for a chunk of this shape, and its parameter count."""
    runs = chunk_runs(_BY_ID[pieces_id], shape.layers, shape.embedding, shape.output, pp)
    return runs, sum(param.numel * count for param, count in runs)


_BY_ID: dict[int, Pieces] = {}


def stage_state(
    job: Job, stage: int, chunks: Sequence[ChunkShape], shard_pairs: Sequence[tuple[int, int]]
) -> tuple[StateBytes, int]:
    """Return the most loaded rank's state bytes for one stage, and its parameter count.

    `shard_pairs`: the (data index, expert data index) pairs of the stage's ranks, as
    ranks.rank_shard_indices gives them (memory.measure picks its rank among the same).
    """
    pieces = pieces_for(job)
    _BY_ID[id(pieces)] = pieces
    lay, training = job.layout, job.training
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
    best = most_loaded(buffers, distributed, shard_pairs, [_chunk_optimizer(*key) for key in keys])
    return best, sum(_chunk_runs(id(pieces), shape, lay.pp)[1] for shape in chunks)


def most_loaded(
    buffers: Sequence[BufferLayout], distributed: bool, shard_pairs: Sequence[tuple[int, int]],
    optimizer: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
) -> StateBytes:
    """Return memory.state_bytes of the first rank in `shard_pairs` holding the most bytes.

    Only the optimizer's share depends on the rank (its `owned_numel` shard of each buffer), so
    each data index's shard bytes are summed over the dense buffers and each expert index's over
    the expert buffers (`optimizer`: each chunk's, `_chunk_optimizer`), instead of pricing every
    rank's buffers again.
    """
    if not distributed:  # every rank holds the same bytes
        return state_bytes(buffers, distributed, *shard_pairs[0])
    dense = _summed([chunk[0] for chunk in optimizer])
    expert = _summed([chunk[1] for chunk in optimizer])
    best = max(
        range(len(shard_pairs)),
        key=lambda k: dense.get(shard_pairs[k][0], 0) + expert.get(shard_pairs[k][1], 0),
    )
    return state_bytes(buffers, distributed, *shard_pairs[best])


def _summed(rows: Sequence[tuple[int, ...]]) -> dict[int, int]:
    """Return per index the sum of the rows that are not empty."""
    return dict(enumerate(map(sum, zip(*(row for row in rows if row), strict=True))))


@lru_cache(maxsize=65536)
def _chunk_optimizer(
    pieces_id: int,
    shape: ChunkShape,
    pp: int,
    distributed: bool,
    dp_size: int,
    expert_dp_size: int,
    bucket_size: int | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return per data index, and per expert data index, the optimizer bytes of its shards of
    the chunk's dense (expert) buffers; empty where the chunk has none."""
    buffers = _chunk_buffers(
        pieces_id, shape, pp, distributed, dp_size, expert_dp_size, bucket_size
    )
    return _optimizer_elements(buffers, expert=False), _optimizer_elements(buffers, expert=True)


def _optimizer_elements(buffers: Sequence[BufferLayout], expert: bool) -> tuple[int, ...]:
    """Return per data index the optimizer bytes of its shards of the dense (or expert) buffers."""
    rows = []
    for buffer in buffers:
        if buffer.expert == expert:
            each = optimizer_bytes_per_element(buffer)
            rows.append([owned * each for owned in buffer.owned_numel])
    return tuple(map(sum, zip(*rows, strict=True)))
