"""Each piece a stage can hold, as runs of parameters, for any expert-parallel size.

world/pieces.py builds a model twice per (model, tp, ep, expert-tp, SP, grad dtype) and reads
each piece's parameters off megatron's modules. Two expert-parallel sizes differ only in how many
experts a rank holds, megatron's num_moe_experts // ep (MoELayer), and in the expert-parallel flag
(allreduce=False) that the experts' weights carry when ep > 1 (megatron-core 0.19: or when
expert tp differs from tp): where megatron's names show those
weights per local expert (SequentialMLP's `local_experts.{i}.`, TEGroupedMLP's `weight{i}`), the
pieces built for one ep serve every other with those weights repeated for the new count
(`scalable`; tests check them equal to megatron's own builds). `chunk_runs` joins the pieces of
one chunk in megatron's parameter order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import inspector.caches as caches
from inspector.job.job import Job
from inspector.job.versions import experts_flagged_without_ep
from inspector.world.pieces import Built, Named, Param, build_pieces

Run = tuple[Param, int]  # a parameter, and how many equal ones stand side by side from it


def runs_of(params: Sequence[Param]) -> tuple[Run, ...]:
    """Return parameters as runs of equal neighbours (TE's grouped MLP has one per expert)."""
    return tuple((param, len(list(equal))) for param, equal in itertools.groupby(params))


@dataclass(frozen=True)
class Pieces:
    """The parameters of each piece a stage can hold, in megatron's parameter order, as runs
    (the pieces of world.pieces.Built)."""

    embedding: tuple[Run, ...]
    embedding_alone: tuple[Run, ...]
    layers: dict[bool | str, tuple[Run, ...]]  # by layer kind (stage_state.ChunkKinds)
    output_embedding: tuple[Run, ...]
    output: tuple[Run, ...]
    output_alone: tuple[Run, ...]
    grad_dtype: Any


def piece_key(job: Job) -> tuple[Any, ...]:
    """Return what a stage's parameter shapes depend on: model, tp, ep, expert-tp, SP, and what
    the world reads of the GPU (fp8 parameters keep no transpose on Blackwell)."""
    lay = job.layout
    return (job.model, lay.tp, lay.ep, lay.expert_tp, lay.sequence_parallel, job.training.fp32_grads,
            job.device.world)  # fmt: skip


_PIECES: dict[tuple[Any, ...], Pieces] = caches.table()
# piece_key less ep -> a build whose expert weights megatron names per local expert, and their count
_SCALABLE: dict[tuple[Any, ...], tuple[Built, int]] = caches.table()


def pieces_for(job: Job) -> Pieces:
    """Return the job's pieces, building the small models once per `piece_key` (or scaling)."""
    key = piece_key(job)
    if key not in _PIECES:
        experts, ep = job.model.num_experts, job.layout.ep
        local = None if experts is None else experts // ep  # megatron's num_local_experts
        family = key[:2] + key[3:]
        parallel = ep > 1 or (experts_flagged_without_ep() and job.layout.expert_tp != job.layout.tp)
        if local is not None and family in _SCALABLE:
            built, built_local = _SCALABLE[family]
            _PIECES[key] = as_pieces(built, (built_local, local, parallel))
        else:
            built = build_pieces(job)
            if local is not None and scalable(built, local, parallel):
                _SCALABLE[family] = (built, local)
            _PIECES[key] = as_pieces(built)
    return _PIECES[key]


def is_cached(job: Job) -> bool:
    """Return whether the job's pieces are at hand (built or scaled before)."""
    return piece_key(job) in _PIECES


def scalable_builds() -> int:
    """Return how many builds serve other expert-parallel sizes (for the tests)."""
    return len(_SCALABLE)


def as_pieces(built: Built, experts: tuple[int, int, bool] | None = None) -> Pieces:
    """Return the built pieces as runs; `experts` (local, to, parallel): with `to` local experts
    instead of the build's `local`, expert-parallel or not (`scalable` builds only)."""

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


def scalable(built: Built, local: int, parallel: bool) -> bool:
    """Return whether the build's expert weights can be scaled to another expert count.

    Every block of copies must name `local` alike experts (local > 1, where megatron's two
    orders differ); the expert-parallel flag (megatron's allreduce=False) must be on exactly the
    copies, and only where megatron sets it (`parallel`); and the build must come back at `local`.
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
        and as_pieces(built, (local, local, parallel)) == as_pieces(built)
    )


def chunk_runs(
    pieces: Pieces, layers: tuple[bool | str, ...], embedding: bool, output: bool, pp: int
) -> tuple[Run, ...]:
    """Return one chunk's parameters in megatron's order (embedding, layers, final norm/output), as runs.

    `layers`: each layer's kind, in order (True: an MoE MLP; a hybrid layer's pattern symbol).
    """
    head: tuple[Run, ...] = ()
    tail: tuple[Run, ...] = ()
    if embedding:
        head = pieces.embedding if pp > 1 else pieces.embedding_alone
    if output:
        tail = pieces.output if pp > 1 else pieces.output_alone
        if pp > 1:
            head = pieces.output_embedding
    return joined([head, *(pieces.layers[kind] for kind in layers), tail])


def joined(parts: Sequence[Sequence[Run]]) -> tuple[Run, ...]:
    """Return the runs one after another, equal parameters merged where they meet."""
    out: list[Run] = []
    for part in parts:
        for param, count in part:
            if out and out[-1][0] == param:
                out[-1] = (param, out[-1][1] + count)
            else:
                out.append((param, count))
    return tuple(out)
