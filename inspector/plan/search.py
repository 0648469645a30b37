"""`plan`: search the layouts Megatron-LM accepts for a job and rank them by estimated step time.

Every candidate is a real `Job` (job.py validates it with megatron's rules), priced with exact
state memory (memory.py, composed from megatron builds), activations from activations.py at the
schedule's micro-batches in flight, and the time model of cost.py. Per pipeline size the layer
split comes from even / accounted splits and split.balance (layouts.py), once on time alone and
once with memory caps (candidates.capped_split). Each distinct stage is priced once (its state,
activations and time depend on its own shape only), memory before time, and micro-batch sizes
stop growing once a smaller one fits nowhere. Each layout takes the least recomputation that
fits (candidates.first_fit). Settings are priced least floor first (timing.time_floors: what no
recomputation of theirs beats), and once the `KEPT` fastest plans all beat the next floor the
rest are passed over. The plans shown are those `memory` confirms (confirm.py: where megatron's
engine runs the job, its peak replaces the closed forms). Nothing here prints.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from inspector.errors import ConfigError
from inspector.formulas.kernels import published, scaled_from
from inspector.formulas.published_kernels import unmeasured
from inspector.job.job import Job, checks_once
from inspector.job.layout import Layout
from inspector.plan.candidates import (
    Recipe,
    candidate_job,
    capped_split,
    first_fit,
    more_recompute,
    recipes,
)
from inspector.plan.confirm import confirmed, engine_runs, measured
from inspector.plan.hybrid import hybrid_vpp, pinned_by_pattern
from inspector.plan.layouts import distopts, layout_for, layouts, splits, vpp_choices
from inspector.plan.price import Plan, price_memory
from inspector.plan.request import Request
from inspector.plan.split import Split
from inspector.plan.timing import time_floors, timed


@dataclass
class SearchResult:
    """The ranked feasible plans, and what the search saw."""

    plans: list[Plan]
    evaluated: int
    seconds: float
    smallest_peak: int | None  # the least memory any candidate needed (when none fits)
    smallest: Plan | None
    # a GPU priced from published kernel figures with a range (formulas/published_kernels.py):
    # the kinds of kernel not measured, and each plan's step seconds at the fast end
    unmeasured: tuple[str, ...] = ()
    fast_seconds: tuple[float, ...] = ()
    scaled_from: str = ""  # every kernel read from this GPU type's table, scaled by the peaks
    # settings not priced (capped splits not counted): the `kept` fastest plans all beat their
    # floor (timing.time_floors)
    passed_over: int = 0
    kept: int = 0


def extras(job: Job) -> tuple[float, float]:
    """Return the embedding and output-layer costs in units of one layer (time model)."""
    dims = job.dims()
    from inspector.formulas.flops import layer_flops, logit_flops, mtp_flops

    layer = layer_flops(dims, 0, 1).total
    # The embedding has no FLOPs, but the first stage holds the most micro-batches in flight;
    # megatron's --account-for-embedding-in-pipeline-split counts it as a layer: so do we
    # for memory, not time (0 in time). The last stage adds the output layer and the MTP block.
    return 0.0, (logit_flops(dims, 1) + mtp_flops(dims, 1)) / layer


Setting = tuple[tuple[Any, ...], Layout, Split, int, bool | str]  # key, layout, split, mbs, distopt or FSDP
KEPT = 50  # the fastest plans found exactly before a setting is passed over by its floor


@dataclass(frozen=True)
class Capped:
    """A group's memory-capped split (candidates.capped_split), found only when the search
    reaches its floor: settings share everything with the group's other splits but the split."""

    base: Layout
    v: int
    tried: tuple[Split, ...]
    mbs: int
    distopt: bool | str
    ends: tuple[float, float]  # extras(): the first and last stages' costs in layers
    pin: tuple[tuple[str, Any], ...]  # the split flags the user pinned (layouts.layout_for)

    def setting(self, req: Request) -> Setting | None:
        """Return the capped split's setting, None where it is none or one of the group's."""
        capped = capped_split(req, self.base, self.v, list(self.tried), self.mbs, self.distopt,
                              req.flash, *self.ends)  # fmt: skip
        if not capped or capped in self.tried:
            return None
        lay = layout_for(self.base, req.model, capped, self.v, self.pin)
        return None if lay is None else ((self.base, self.v, capped, self.distopt), lay, capped,
                                         self.mbs, self.distopt)  # fmt: skip


def settings(req: Request) -> Iterator[Setting | Capped]:
    """Yield every (layout, split, micro-batch size, distributed optimizer) to price, in order,
    each group's memory-capped split as a `Capped` after its other splits.

    The key (base layout, vpp, split, distopt) names what no recomputation may fit.
    """
    mbs_choices = [req.fixed["mbs"]] if "mbs" in req.fixed else [1, 2, 4, 8]
    pin = tuple(sorted(req.fixed.get("pin", {}).items()))
    for base in layouts(req):
        # a pattern's `|` segments need their own pp and virtual stages (megatron-core 0.17+)
        pp = base.pp if pinned_by_pattern(req.model) else 1
        ends = extras(Job(req.model, Layout(tp=base.tp, pp=pp, vpp=hybrid_vpp(req.model, pp))))
        for mbs in mbs_choices:  # ascending: what does not fit at b does not fit at 2b
            if req.global_batch_size % (mbs * base.dp):
                continue
            m = req.global_batch_size // (mbs * base.dp)
            for v in vpp_choices(req, base.pp, m):
                tried = splits(req, base, v, *ends)
                for distopt in distopts(req, base):
                    for split in tried:
                        lay = layout_for(base, req.model, split, v, pin)
                        if lay is not None:
                            yield (base, v, split, distopt), lay, split, mbs, distopt
                    if base.pp > 1 and tried:
                        yield Capped(base, v, tuple(tried), mbs, distopt, ends, pin)


Queued = tuple[float, int, Setting | Capped]  # floor, place in `settings` order, setting


@dataclass
class _Tally:
    """What a search has seen so far: candidates priced, the plans that fit (with their settings'
    places in `settings` order), the least peak, the settings passed over unpriced."""

    req: Request
    progress: Callable[[int, int], None] | None
    evaluated: int = 0
    feasible: list[tuple[int, Plan]] = field(default_factory=list)
    smallest: Plan | None = None
    any_layout: bool = False
    unfit: dict[tuple[Any, ...], int] = field(default_factory=dict)  # key -> least mbs none fits
    kept: int = 0  # how many fastest plans to find before passing settings over (0: none passed)
    fastest: list[float] = field(default_factory=list)  # the kept fastest steps, negated (a heap)
    passed_over: list[Queued] = field(default_factory=list)

    def add(self, index: int, setting: Setting, outcome: Any, last: Recipe) -> None:
        """Count one setting's outcome (candidates.first_fit's)."""
        key, _, split, mbs, _ = setting
        self.any_layout = True
        tried, plan, least = outcome
        self.evaluated += tried
        if plan is not None:
            self.feasible.append((index, plan))
            heapq.heappush(self.fastest, -plan.time.seconds)
            if len(self.fastest) > self.kept:
                heapq.heappop(self.fastest)
        elif self.smallest is None or least[1] < self.smallest.peak:
            self.smallest = timed(least[0], split, self.req, *price_memory(least[0], split))
        if plan is None and last[0] == "full":
            self.unfit[key] = min(mbs, self.unfit.get(key, mbs))
        if self.progress is not None and self.evaluated // 500 != (self.evaluated - tried) // 500:
            self.progress(self.evaluated, len(self.feasible))

    def beaten(self, floor: float) -> bool:
        """Return whether the kept fastest plans all take less than `floor` seconds."""
        return bool(self.kept) and len(self.fastest) == self.kept and floor > -self.fastest[0]

    def ranked(self) -> list[Plan]:
        """Return the plans that fit in `settings` order (the ranking's order among equals)."""
        return [plan for _, plan in sorted(self.feasible, key=lambda each: each[0])]


def _kept(req: Request) -> int:
    """Return how many of the fastest plans are found exactly before settings are passed over by
    their floor (`KEPT`, or 10 x --top); 0 (none passed over) when every plan is asked for."""
    return max(KEPT, 10 * req.top) if req.top else 0


def _shown(
    feasible: list[Plan], smallest: Plan | None, req: Request, limit: float = math.inf
) -> tuple[list[Plan], Plan | None] | None:
    """Return the plans to print, fastest first, and the least-memory candidate, each as `memory`
    measures it where megatron's engine runs the job (confirm.py); None where that needs a plan
    slower than `limit` seconds (the search passed such settings over)."""
    feasible.sort(key=lambda p: (p.time.seconds, p.peak))
    recomputes = recipes(req)
    found = confirmed(feasible, req.memory, req.top,
                      lambda plan: more_recompute(req, plan, recomputes), limit)
    if found is None:
        return None
    shown, least = found
    if feasible and not shown:  # memory's own peaks: every plan the closed forms fit is over
        smallest = least
    elif not feasible and smallest is not None and engine_runs(smallest):
        # the closed forms fit nothing; megatron's engine may measure less than they estimate
        # (an fp8-parameter job, say): the least-memory candidate is shown if `memory` fits it,
        # and otherwise the message quotes `memory`'s peak, not the closed forms'
        smallest = measured(smallest)
        if smallest.peak <= req.memory:
            shown = [smallest]
    return shown, smallest


def search(req: Request, progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Return the feasible plans, fastest first (at most `req.top`).

    Args:
        req: the model, cluster and fixed dimensions.
        progress: called with (candidates evaluated, plans feasible) now and then.
    """
    with checks_once(req.model):  # one model, tens of thousands of jobs
        return _search(req, progress)


def _search(req: Request, progress: Callable[[int, int], None] | None) -> SearchResult:
    start = time.perf_counter()
    tally = _Tally(req, progress, kept=_kept(req))
    recomputes = recipes(req)
    _price(tally, _by_floor(req, recomputes), recomputes)
    if not tally.any_layout:
        raise ConfigError(
            f"--gpus {req.gpus} admits no layout Megatron-LM accepts for this model and "
            f"--global-batch-size {req.global_batch_size}{req.pinned_text()} (tp x cp x pp x dp "
            "must equal the GPUs, dp must divide the global batch, tp must divide the heads and "
            "query groups)"
        )
    limit = -tally.fastest[0] if tally.passed_over else math.inf
    found = _shown(tally.ranked(), tally.smallest, req, limit)
    if found is None:  # `memory` turned down plans down to the settings passed over: price them
        rest, tally.passed_over, tally.kept = tally.passed_over, [], 0
        _price(tally, rest, recomputes)
        found = _shown(tally.ranked(), tally.smallest, req)
    assert found is not None  # no limit: every plan is there
    shown, smallest = found
    unknown = unmeasured(req.gpu.name) if published(req.gpu) and req.efficiency is None else ()
    return SearchResult(
        shown,
        tally.evaluated,
        time.perf_counter() - start,
        None if shown else (smallest.peak if smallest else None),
        smallest,
        unknown,
        tuple(fast_end(plan, req) for plan in shown) if unknown else (),
        scaled_from(req.gpu) if req.efficiency is None else "",
        sum(not isinstance(item, Capped) for _, _, item in tally.passed_over),
        tally.kept,
    )


def _by_floor(req: Request, recomputes: list[Recipe]) -> list[Queued]:
    """Return every setting with its floor (timing.time_floors at the least recomputation asked;
    0 where megatron refuses that job) and its place in `settings` order, least floor first; a
    `Capped` split with the floor no split of its group's layout beats."""
    out: list[Queued] = []
    floors: dict[tuple[Any, ...], tuple[float, float]] = {}  # they read no optimizer setting
    for index, item in enumerate(settings(req)):
        if isinstance(item, Capped):  # its group's first split stands for every one
            split, mbs, distopt = item.tried[0], item.mbs, item.distopt
            lay = layout_for(item.base, req.model, split, item.v, item.pin)
        else:
            _, lay, split, mbs, distopt = item
        if (lay, split, mbs) not in floors:
            floors[lay, split, mbs] = _floors(req, recomputes, lay, split, mbs, distopt)
        out.append((floors[lay, split, mbs][isinstance(item, Capped)], index, item))
    out.sort(key=lambda each: each[:2])
    return out


def _floors(req: Request, recomputes: list[Recipe], lay: Layout | None, split: Split, mbs: int,
            distopt: bool | str) -> tuple[float, float]:  # fmt: skip
    """Return timing.time_floors of the setting's job at the least recomputation asked (block
    recomputation of the fewest layers that fit: of one), 0.0 where megatron refuses that job."""
    least = recomputes[0] if recomputes[0][1:] != ("block", 0) else ("full", "block", 1)
    try:
        job = candidate_job(req, lay, mbs, least, distopt, req.flash) if lay else None
        return time_floors(job, split, req) if job is not None else (0.0, 0.0)
    except ConfigError:
        return 0.0, 0.0


def _price(tally: _Tally, queue: list[Queued], recomputes: list[Recipe]) -> None:
    """Price the settings in `queue` (a heap, least floor first) until the kept fastest plans all
    beat the next one's floor; those left are `tally.passed_over`. A `Capped` split is found
    when reached, and queued again at its own floor (no less than its group's)."""
    req = tally.req
    while queue:
        floor, index, item = heapq.heappop(queue)
        if tally.beaten(floor):
            heapq.heappush(queue, (floor, index, item))
            tally.passed_over = queue
            return
        if isinstance(item, Capped):
            found = item.setting(req)
            if found is not None:
                _, lay, split, mbs, distopt = found
                heapq.heappush(queue, (_floors(req, recomputes, lay, split, mbs, distopt)[0], index, found))
            continue
        key, lay, split, mbs, distopt = item
        if tally.unfit.get(key, mbs + 1) <= mbs:  # no recomputation fit a smaller micro-batch
            continue
        outcome = first_fit(req, lay, split, mbs, distopt, req.flash, recomputes)
        if outcome is not None:
            tally.add(index, item, outcome, recomputes[-1])


def fast_end(plan: Plan, req: Request) -> float:
    """Return a plan's step seconds at the fast end of its GPU's published kernel ranges (the
    plans rank by the slow end)."""
    fast = replace(req, gpu=replace(req.gpu, published_end="fast"))
    return timed(plan.job, plan.split, fast, price_memory(plan.job, plan.split)[0], plan.stages).time.seconds


def progress_line(stream: Any = None) -> Callable[[int, int], None] | None:
    """Return a progress callback writing to stderr, or None when stderr is not a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(evaluated: int, feasible: int) -> None:
        stream.write(f"\rplan: {evaluated} candidates evaluated, {feasible} fit")
        stream.flush()

    return show
