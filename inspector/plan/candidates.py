"""Candidates of one layout: its Job per setting, the least recomputation that fits, memory caps.

Each layout takes the least recomputation that fits: none, selective, full with
`--recompute-method block` and the fewest checkpointed layers per chunk, then full for every
layer (`first_fit`); memory is priced before time, and time only for the setting that fits.
`capped_split` gives split.balance a per-stage memory cap. Jobs are made once per setting
(`_JOBS`), and a layout megatron refuses is refused once (`_REFUSED`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import inspector.caches as caches
from inspector.errors import ConfigError
from inspector.job.device import Device
from inspector.job.flex import one_rank_refused
from inspector.job.job import Job, Training, check_layout
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.memory.compose.stage_activations import (
    activation_layout,
    first_of_kind,
    layer_bytes,
    live_points,
)
from inspector.memory.compose.stage_state import ChunkKinds
from inspector.plan.layouts import layout_for
from inspector.plan.price import (
    Placed,
    Plan,
    StagePlan,
    cached_stage_state,
    job_dims,
    model_token,
    pair_layout,
    price_memory,
    state_scope,
    state_scope_key,
)
from inspector.plan.request import Request
from inspector.plan.split import Split, balance, chunk_layers
from inspector.plan.timing import timed

# (--recompute-granularity, --recompute-method, --recompute-num-layers), least recomputation
# first; N 0: the fewest layers per chunk that fit (`_fewest_checkpointed`)
Recipe = tuple[str, str, int]
RECOMPUTES: tuple[Recipe, ...] = (("none", "uniform", 1), ("selective", "uniform", 1),
                                  ("full", "block", 0))


def recipes(req: Request) -> list[Recipe]:
    """Return the recomputation settings to try, least recomputation first, as the user fixed them.

    A fixed --recompute-method / --recompute-num-layers is used as given (block without N: the
    fewest layers that fit); --recompute-granularity full alone leaves block N and uniform open.
    """
    fixed = req.fixed
    if "recompute_method" in fixed or "recompute_num_layers" in fixed:
        method = fixed.get("recompute_method", "uniform")
        return [("full", method, fixed.get("recompute_num_layers", 0 if method == "block" else 1))]
    if "recompute" in fixed:
        granularity = fixed["recompute"]
        return [next(r for r in RECOMPUTES if r[0] == granularity)]
    if req.model.hybrid or req.training.cuda_graph_impl != "none":
        # no full recomputation of a hybrid stack (plan/hybrid.py), nor beside per-layer CUDA
        # graphs (megatron-core's TransformerConfig: "full recompute is only supported with full
        # iteration CUDA graph.")
        return [r for r in RECOMPUTES if r[0] != "full"]
    return list(RECOMPUTES)


Priced = tuple[Job, Placed, tuple[StagePlan, ...], int]


def first_fit(
    req: Request, lay: Layout, split: Split, mbs: int, distopt: bool | str, flash: bool,
    recomputes: list[Recipe],
) -> tuple[int, Plan | None, tuple[Job, int]] | None:
    """Return (candidates priced, the plan with the least recomputation that fits, the least
    memory seen); memory first, time only for the plan that fits. None: megatron refuses all."""
    tried = 0
    least: tuple[Job, int] | None = None

    def price(recipe: Recipe) -> Priced | None:
        nonlocal tried, least
        job = candidate_job(req, lay, mbs, recipe, distopt, flash)
        if job is None:
            return None
        try:
            placed, stages = price_memory(job, split)  # state shared by recipes (_state_scope)
        except ConfigError:
            return None
        tried += 1
        peak = max(st.total for st in stages)
        if least is None or peak < least[1]:
            least = (job, peak)
        return job, placed, stages, peak

    for recipe in recomputes:
        if recipe[1:] == ("block", 0):
            found = _fewest_checkpointed(req, lay, split, recipe, price)
        else:
            found = price(recipe)
        if found is not None and found[3] <= req.memory:
            job, placed, stages, peak = found
            return tried, timed(job, split, req, placed, stages), (job, peak)
    return None if least is None else (tried, None, least)


def _fewest_checkpointed(
    req: Request, lay: Layout, split: Split, recipe: Recipe,
    price: Callable[[Recipe], Priced | None],
) -> Priced | None:
    """Return block recomputation with the fewest layers per chunk N that fits, else the most.

    megatron-core `TransformerBlock._checkpointed_forward` with `block` checkpoints the first N
    layers of each chunk one by one and keeps all activations of the rest. Each step of N trades
    a layer's activations for its input, on every chunk that long and every micro-batch in
    flight, while the rebuild buffer holds one layer throughout (it can only grow where an MoE
    layer outweighs a dense one): memory falls as N grows, and a binary search over
    1 .. (longest chunk - 1) finds the least N, or at worst an N that fits. N = the longest chunk
    checkpoints every layer, which is `uniform` 1 (the fallback, priced first) unless the user
    fixed `block`.
    """
    most = max(len(c) for chunks in chunk_layers(split, lay.pp, lay.chunks) for c in chunks)
    fixed_block = req.fixed.get("recompute_method") == "block"
    top = price(("full", "block", most) if fixed_block else ("full", "uniform", 1))
    if top is None or top[3] > req.memory:
        return top
    best, lo, hi = top, 1, most  # invariant: hi fits (hi = most: `top`)
    while lo < hi:
        mid = (lo + hi) // 2
        found = price((recipe[0], "block", mid))
        if found is not None and found[3] <= req.memory:
            best, hi = found, mid
        else:
            lo = mid + 1
    return best


def more_recompute(req: Request, plan: Plan, recomputes: list[Recipe]) -> Plan | None:
    """Return the plan's setting with the next recomputation after its own that the closed forms
    fit (block N counted up one at a time), priced; None when none is left.

    `memory` may measure a plan above the closed forms (megatron's engine: confirm.py); the same
    layout with more recomputation is then the next candidate, as `first_fit` would have taken it.
    """
    job, split = plan.job, plan.split
    training, lay = job.training, job.layout
    most = max(len(c) for chunks in chunk_layers(split, lay.pp, lay.chunks) for c in chunks)
    order: list[Recipe] = []
    for recipe in recomputes:
        if recipe[1:] != ("block", 0):
            order.append(recipe)
            continue
        fixed_block = req.fixed.get("recompute_method") == "block"
        order += [("full", "block", n) for n in range(1, most)]
        order.append(("full", "block", most) if fixed_block else ("full", "uniform", 1))
    own = (training.recompute, training.recompute_method, training.recompute_num_layers)
    if training.recompute != "full":
        own = (training.recompute, "uniform", 1)
    later = order[order.index(own) + 1:] if own in order else []
    distopt = training.sharding_strategy if training.megatron_fsdp else training.use_distributed_optimizer
    for recipe in later:
        found = candidate_job(req, lay, job.schedule().micro_batch_size, recipe, distopt,
                              training.flash_attention)
        if found is None:
            continue
        try:
            placed, stages = price_memory(found, split)
        except ConfigError:
            continue
        if max(st.total for st in stages) <= req.memory:
            return timed(found, split, req, placed, stages)
    return None


def candidate_job(
    req: Request, lay: Layout, mbs: int, recipe: Recipe, distopt: bool | str, flash: bool
) -> Job | None:
    """Return the candidate's Job, or None where megatron's rules (job.py) refuse it; `recipe`:
    its recomputation (granularity, method, N)."""
    key = (model_token(req.model), lay)
    if key not in _REFUSED:
        _REFUSED[key] = _layout_refused(req.model, lay)
    if _REFUSED[key]:  # Job would raise the same, whatever the training
        return None
    flex = req.training.moe_token_dispatcher_type == "flex" and req.model.num_experts is not None
    if flex and lay.ep * lay.expert_tp <= 1 and one_rank_refused(req.training.moe_flex_backend):
        return None  # megatron's flex dispatcher asserts TPxEP > 1 (job/flex.py check_flex_group)
    if req.training.op_fuser and req.model.num_experts is not None and lay.expert_tp > 1:
        return None  # megatron's _is_fused_impl_supported: "Tensor parallelism is not supported"
    asked = (*key, req.training, req.global_batch_size, mbs, recipe, distopt, flash, req.gpu.name)
    if asked not in _JOBS:  # capped_split and _first_fit ask for some of the same
        _JOBS[asked] = _new_job(req, lay, mbs, recipe, distopt, flash)
    return _JOBS[asked]


_JOBS: dict[tuple[Any, ...], Job | None] = caches.table()


def _new_job(
    req: Request, lay: Layout, mbs: int, recipe: Recipe, distopt: bool | str, flash: bool
) -> Job | None:
    training = _training(req.training, req.global_batch_size, mbs, recipe, distopt, flash)
    try:
        job = Job(req.model, lay, training, Device(req.gpu.name))  # its workspaces (job/device.py)
        job.schedule()
    except ConfigError:
        return None
    return job


@caches.memo(maxsize=4096)
def _training(asked: Training, global_batch_size: int, mbs: int, recipe: Recipe, distopt: bool | str,
              flash: bool) -> Training:  # fmt: skip
    """Return the candidate's training settings, once for every layout that shares them."""
    recompute, method, num_layers = recipe
    return replace(
        asked,
        micro_batch_size=mbs,
        global_batch_size=global_batch_size,
        recompute=recompute,  # type: ignore[arg-type]
        recompute_method=method,
        recompute_num_layers=num_layers,
        flash_attention=flash,
        use_distributed_optimizer=bool(distopt),
        megatron_fsdp=isinstance(distopt, str),
        sharding_strategy=distopt if isinstance(distopt, str) else "no_shard",
        overlap_grad_reduce=True,
    )


_REFUSED: dict[tuple[int, Layout], bool] = caches.table()


def _layout_refused(model: ModelConfig, lay: Layout) -> bool:
    """Return whether topology.validate_layout, which every Job runs, refuses this layout.

    A search asks for each layout once per micro-batch size, recomputation and optimizer; a
    split megatron refuses (a layout string without the model's MTP) is refused once, one that
    passes is not checked again by its Jobs (job.py `check_layout`).
    """
    try:
        check_layout(model, lay)
    except ConfigError:
        return True
    return False


def capped_split(
    req: Request, base: Layout, v: int, splits: list[Split], mbs: int, distopt: bool | str,
    flash: bool, first: float, last: float,
) -> Split | None:
    """Return split.balance with each virtual stage capped at the layers that fit memory.

    Without recomputation, rank s holds each layer's state plus its activations times the
    micro-batches its chunk c keeps in flight (the schedule's replay, the most of any point):
    a rank's budget, less its embedding / output state, is shared evenly by its v chunks. The
    caps are an estimate for the DP only; the split it returns is priced exactly like any other.
    """
    if base.pp == 1 or not splits or {"split", "pin", "layers_per_chunk"} & req.fixed.keys():
        return None
    if req.model.hybrid:  # megatron's stack splits by its own rules (plan/hybrid.py)
        return None
    lay = layout_for(base, req.model, splits[0], v)
    job = candidate_job(req, lay, mbs, RECOMPUTES[0], distopt, flash) if lay else None
    if job is None:
        return None
    pp, m, dims = base.pp, job.schedule().num_microbatches, job_dims(job)
    pairs_of = pair_layout(job.layout)
    kinds = first_of_kind(dims)  # kind: its first layer, the last layer's kind first
    terms = state_scope_key(job, pairs_of)
    if terms not in _STATE_TERMS:
        _STATE_TERMS[terms] = _state_terms(job, pairs_of, tuple(kinds))
    one, ends, per_layer_state = _STATE_TERMS[terms]
    layer = max(layer_bytes(dims, activation_layout(pairs_of, pp), i, mbs, "none", flash)
                for i in kinds.values())
    flights = _flights(pp, m, v)
    if flights is None:  # megatron's interleaved schedule refuses this m
        return None
    caps = [0] * (pp * v)
    for s, flight in enumerate(flights):
        fixed = (ends - 2 * one) if s in (0, pp - 1) else 0
        budget = (req.memory - fixed) / v
        for c in range(v):
            caps[c * pp + s] = max(1, int(budget // (per_layer_state + layer * flight[c])))
    return balance(req.model.num_layers, pp * v, round(first, 2), round(last, 2), tuple(caps))


_STATE_TERMS: dict[tuple[Any, ...], tuple[int, int, int]] = caches.table()


def _state_terms(job: Job, pairs_of: Layout, kinds: tuple[bool | str, ...]) -> tuple[int, int, int]:
    """Return a rank's state with one layer, with one layer on each end stage (embedding,
    output), and the most one more layer of a kind adds: what capped_split's caps need."""
    scope = state_scope(job, pairs_of)

    def state(*shapes: ChunkKinds) -> int:
        return int(cached_stage_state(job, 1, shapes, pairs_of, scope).total)

    k = kinds[0]
    one = state(ChunkKinds((k,), False, False))
    ends = state(ChunkKinds((k,), True, False), ChunkKinds((k,), False, True))
    per_layer_state = max(  # the heavier kind where the model mixes MoE and dense layers
        state(ChunkKinds((kind, kind), False, False)) - state(ChunkKinds((kind,), False, False))
        for kind in kinds
    )
    return one, ends, per_layer_state


@caches.memo(maxsize=4096)
def _flights(pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...] | None:
    """Return per rank the most micro-batches each chunk keeps in flight at any point (None:
    megatron's interleaved schedule refuses m)."""
    flights = []
    for s in range(pp):
        try:
            points = live_points(s, pp, m, v) if v > 1 else ((min(pp - s, m),),)
        except ConfigError:
            return None
        flights.append(tuple(max(p[c] for p in points) for c in range(v)))
    return tuple(flights)
