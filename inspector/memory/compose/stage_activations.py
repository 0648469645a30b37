"""A stage's activation peak at the micro-batches megatron's schedule keeps in flight, fast.

The bytes are activations.py's (Korthikanti et al. 2022), as `memory` reports them; here each
layer kind's bytes are computed once and a stage's peak is found among the schedule's points
that no other covers (`live_points`), so a search can price thousands of stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from operator import mul
from typing import Any, cast

import inspector.caches as caches
from inspector.job.dims import ModelDims, live_microbatches
from inspector.job.hybrid_model import DSA_SYMBOL
from inspector.job.job import Recompute, Training
from inspector.job.layout import Layout
from inspector.memory.closed.activations import (
    embedding_activations,
    layer_activations,
    loss_logits,
    mtp_activations,
    mtp_recompute,
    output_activations,
    recompute_buffer,
    recompute_plan,
)
from inspector.memory.closed.dsa import dsa_rebuild_bytes


@caches.memo(maxsize=65536)
def live_points(stage: int, pp: int, m: int, v: int, extra: int = 0) -> tuple[tuple[int, ...], ...]:
    """Return the schedule's in-flight points that no other point covers chunk by chunk.

    With every chunk's bytes positive, the peak lies on one of them (a covered point holds less).
    Schedules of different stages and sizes often pass through the same points: the frontier
    is found once per distinct set of points (`_frontier`).
    """
    return _frontier(tuple(sorted(set(live_microbatches(stage, pp, m, v, extra=extra)))))


@caches.memo(maxsize=65536)
def _frontier(points: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Return the points (sorted, distinct) that no other point covers chunk by chunk."""
    frontier: list[tuple[int, ...]] = []
    for point in sorted(points, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(f, point, strict=True)) for f in frontier):
            frontier.append(point)
    return tuple(sorted(frontier))


@caches.memo(maxsize=65536)
def layer_bytes(
    dims: ModelDims, par: Layout, i: int, mbs: int, recompute: str, flash: bool,
    modules: tuple[str, ...] = ("core_attn",),
) -> float:
    return layer_activations(dims, par, i, mbs, recompute, flash, modules).total  # type: ignore[arg-type]


@caches.memo(maxsize=256)
def first_of_kind(dims: ModelDims) -> dict[bool | str, int]:
    """Return the first layer of each kind (True: MoE; a hybrid layer's symbol,
    `ModelDims.layer_kind`); layers of one kind cost the same."""
    return {dims.layer_kind(i): i for i in reversed(range(dims.num_layers))}


def _chunk_bytes(
    dims: ModelDims, par: Layout, groups: list[tuple[Sequence[int], Recompute]], mbs: int,
    flash: bool, modules: tuple[str, ...] = ("core_attn",),
) -> float:
    """Return one micro-batch's bytes of a chunk's layer groups (activations.recompute_plan):
    a checkpointed group keeps its first layer's input, any other layer its own activations;
    layers of one kind and mode cost the same."""
    counts: dict[tuple[Recompute, bool | str], int] = {}
    for group, mode in groups:
        for i in group[:1] if mode == "full" else group:
            key = (mode, dims.layer_kind(i))
            counts[key] = counts.get(key, 0) + 1
    first = first_of_kind(dims)
    return sum(
        n * layer_bytes(dims, par, first[kind], mbs, mode, flash, modules)
        for (mode, kind), n in counts.items()
    )


def stage_activation_bytes(
    dims: ModelDims, par: Layout, stage: int, chunks: Sequence[Sequence[int]], mbs: int, m: int,
    recompute: str, flash: bool, method: str = "uniform", num_layers: int = 1,
    modules: tuple[str, ...] = ("core_attn",), extra: int = 0,
) -> tuple[int, tuple[int, ...]]:
    """Return activations.stage_activations' peak (rounded up) and in-flight counts, fast.

    `method`, `num_layers`: --recompute-method and --recompute-num-layers with full recompute;
    `modules`: --recompute-modules with selective recomputation; `extra`: warm-up forwards the
    MoE all-to-all overlap adds (job/ep_overlap.py).
    """
    bytes_of = stage_chunk_bytes(dims, par, stage, chunks, mbs, (recompute, method, num_layers),
                                 flash, modules)
    return stage_peak(bytes_of, stage, par.pp, m, extra)


# one micro-batch's bytes per chunk; the most a pass adds for a moment (a rebuild, the loss's logits)
ChunkBytes = tuple[tuple[float, ...], float]


def stage_chunk_bytes(
    dims: ModelDims, par: Layout, stage: int, chunks: Sequence[Sequence[int]], mbs: int,
    recipe: tuple[str, str, int], flash: bool, modules: tuple[str, ...] = ("core_attn",),
    memo: dict[Any, Any] | None = None, keys: Sequence[Any] = (),
) -> ChunkBytes:
    """Return one micro-batch's bytes per chunk and the bytes backward rebuilds at once.

    `recipe`: --recompute-granularity, --recompute-method, --recompute-num-layers. The bytes
    depend on the stage's layers, not on its place in the schedule: stages of one shape share
    them (price.py). `memo`: each chunk's own bytes and rebuild by `keys` (one a chunk: what
    they depend on, its layers' kinds and the recomputation), shared by every stage.
    """
    mode, method, num_layers = cast(Recompute, recipe[0]), recipe[1], recipe[2]
    found: list[tuple[float, float] | None] = (
        [memo.get(key) for key in keys] if memo is not None and keys else [None] * len(chunks)
    )
    known = [each for each in found if each is not None]
    if len(known) < len(found):  # the plan raises megatron's error where uniform N does not divide
        plan = recompute_plan(stage, chunks, mode, method, num_layers)
        known = [each or _own_bytes(dims, par, groups, mbs, flash, modules)
                 for each, groups in zip(found, plan, strict=True)]
        if memo is not None and keys:
            memo.update(zip(keys, known, strict=True))
    per = [own for own, _ in known]
    logits = 0.0
    if stage == 0:
        per[0] += embedding_activations(dims, par, mbs).total
    if stage == par.pp - 1:  # the output layer and loss, and the MTP block beside them
        per[-1] += output_activations(dims, par, mbs).total
        per[-1] += mtp_activations(dims, par, mbs, mtp_recompute(mode, method), flash)
        logits = loss_logits(dims, par, mbs)
    # the most any chunk rebuilds is the most any group does (recompute.recompute_buffer); the
    # loss's 16-bit logits are never beside a rebuild (activation_records.StageActivations.total)
    return tuple(per), max(logits, max(rebuild for _, rebuild in known))


def _own_bytes(
    dims: ModelDims, par: Layout, groups: list[tuple[Sequence[int], Recompute]], mbs: int,
    flash: bool, modules: tuple[str, ...],
) -> tuple[float, float]:
    """Return a chunk's bytes (`_chunk_bytes`) and what backward rebuilds of it at once."""
    first = first_of_kind(dims)

    def rebuilt(i: int) -> float:  # a layer's bytes without recomputation (one per kind)
        return layer_bytes(dims, par, first[dims.layer_kind(i)], mbs, "none", flash)

    dsa = any(dims.layer_kind(i) == DSA_SYMBOL or dims.experimental_attention_variant == "dsa"
              and not dims.layer_symbols for group, _ in groups for i in group)  # fmt: skip
    rebuild = recompute_buffer([groups], rebuilt)
    if dsa:  # the DSA layer's backward, after any rebuild (closed/dsa.py)
        rebuild += dsa_rebuild_bytes(dims, par, mbs, groups[0][1], modules)
    return _chunk_bytes(dims, par, groups, mbs, flash, modules), rebuild


def stage_peak(
    bytes_of: ChunkBytes, stage: int, pp: int, m: int, extra: int = 0
) -> tuple[int, tuple[int, ...]]:
    """Return the stage's activation peak (rounded up) and the micro-batches in flight at it."""
    per, rebuild = bytes_of
    if len(per) == 1:  # 1F1B: the peak is min(p - s, m) micro-batches (formulas.microbatches_in_flight)
        best: tuple[int, ...] = (min(pp - stage + extra, m),)
    else:
        points = live_points(stage, pp, m, len(per), extra)  # each holds len(per) counts
        totals = [sum(map(mul, point, per)) for point in points]
        best = points[totals.index(max(totals))]  # the first of the most, as max(key=) picks
    total = sum(map(mul, best, per))
    total += rebuild
    return math.ceil(total), best


@caches.memo(maxsize=4096)
def activation_layout(pairs_of: Layout, pp: int) -> Layout:
    """Return the sizes activations.py reads (tp, cp, SP, expert tp, pp): dp and ep set to 1.

    Layouts that differ in dp or ep keep the same activations (tests check it), so they share
    one cache entry.
    """
    return replace(pairs_of, pp=pp, dp=1, ep=1, etp=pairs_of.expert_tp)


def recompute_recipe(training: Training, chunks: Sequence[Sequence[int]]) -> tuple[str, str, int]:
    """Return the stage's (granularity, method, N), one spelling per distinct behaviour.

    Method and N matter with full recomputation only; `block` with N past the stage's longest
    chunk checkpoints what N = that length does (every layer: as `uniform` 1 but for MTP, which
    megatron leaves alone under `block`, activations.mtp_recompute).
    """
    recompute, method, n = training.recompute, training.recompute_method, training.recompute_num_layers
    if recompute != "full":
        return recompute, "uniform", 1
    if method == "block":
        return recompute, method, min(n, max(1, max(map(len, chunks), default=0)))
    return recompute, method, n


