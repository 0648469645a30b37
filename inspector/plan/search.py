"""`plan`: search the layouts Megatron-LM accepts for a job and rank them by estimated step time.

Every candidate is a real `Job` (job.py validates it with megatron's rules), priced with exact
state memory (memory.py, composed from megatron builds), activations from activations.py at the
schedule's micro-batches in flight, and the time model of cost.py. Per pipeline size the layer
split comes from even / accounted splits and split.balance (layouts.py), once on time alone and
once with memory caps (candidates.capped_split). Each distinct stage is priced once (its state,
activations and time depend on its own shape only), memory before time, and micro-batch sizes
stop growing once a smaller one fits nowhere. Each layout takes the least recomputation that
fits (candidates.first_fit). The plans shown are those `memory` confirms (confirm.py: where
megatron's engine runs the job, its peak replaces the closed forms). Nothing here prints.
"""

from __future__ import annotations

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
from inspector.plan.candidates import Recipe, capped_split, first_fit, more_recompute, recipes
from inspector.plan.confirm import confirmed, engine_runs, measured
from inspector.plan.hybrid import hybrid_vpp, pinned_by_pattern
from inspector.plan.layouts import distopts, layout_for, layouts, splits, vpp_choices
from inspector.plan.price import Plan, price_memory, timed
from inspector.plan.request import Request
from inspector.plan.split import Split


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


def settings(req: Request) -> Iterator[Setting]:
    """Yield every (layout, split, micro-batch size, distributed optimizer) to price, in order.

    The key (base layout, vpp, split, distopt) names what no recomputation may fit.
    """
    mbs_choices = [req.fixed["mbs"]] if "mbs" in req.fixed else [1, 2, 4, 8]
    pin = tuple(sorted(req.fixed.get("pin", {}).items()))
    for base in layouts(req):
        # a pattern's `|` segments need their own pp and virtual stages (megatron-core 0.17+)
        pp = base.pp if pinned_by_pattern(req.model) else 1
        first, last = extras(Job(req.model, Layout(tp=base.tp, pp=pp, vpp=hybrid_vpp(req.model, pp))))
        for mbs in mbs_choices:  # ascending: what does not fit at b does not fit at 2b
            if req.global_batch_size % (mbs * base.dp):
                continue
            m = req.global_batch_size // (mbs * base.dp)
            for v in vpp_choices(req, base.pp, m):
                tried = splits(req, base, v, first, last)
                for distopt in distopts(req, base):
                    capped = capped_split(req, base, v, tried, mbs, distopt, req.flash, first, last)
                    for split in tried + ([capped] if capped and capped not in tried else []):
                        lay = layout_for(base, req.model, split, v, pin)
                        if lay is not None:
                            yield (base, v, split, distopt), lay, split, mbs, distopt


@dataclass
class _Tally:
    """What a search has seen so far: candidates priced, the plans that fit, the least peak."""

    req: Request
    progress: Callable[[int, int], None] | None
    evaluated: int = 0
    feasible: list[Plan] = field(default_factory=list)
    smallest: Plan | None = None
    any_layout: bool = False
    unfit: set[tuple[Any, ...]] = field(default_factory=set)  # keys no recompute fits

    def add(self, key: tuple[Any, ...], split: Split, outcome: Any, last: Recipe) -> None:
        """Count one setting's outcome (candidates.first_fit's)."""
        self.any_layout = True
        tried, plan, least = outcome
        self.evaluated += tried
        if plan is not None:
            self.feasible.append(plan)
        elif self.smallest is None or least[1] < self.smallest.peak:
            self.smallest = timed(least[0], split, self.req, *price_memory(least[0], split))
        if plan is None and last[0] == "full":
            self.unfit.add(key)
        if self.progress is not None and self.evaluated // 500 != (self.evaluated - tried) // 500:
            self.progress(self.evaluated, len(self.feasible))


def _shown(feasible: list[Plan], smallest: Plan | None, req: Request) -> tuple[list[Plan], Plan | None]:
    """Return the plans to print, fastest first, and the least-memory candidate, each as `memory`
    measures it where megatron's engine runs the job (confirm.py)."""
    feasible.sort(key=lambda p: (p.time.seconds, p.peak))
    recomputes = recipes(req)
    shown, least = confirmed(feasible, req.memory, req.top,
                             lambda plan: more_recompute(req, plan, recomputes))
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
    tally = _Tally(req, progress)
    recomputes = recipes(req)
    for key, lay, split, mbs, distopt in settings(req):
        if key in tally.unfit:
            continue
        outcome = first_fit(req, lay, split, mbs, distopt, req.flash, recomputes)
        if outcome is not None:
            tally.add(key, split, outcome, recomputes[-1])
    if not tally.any_layout:
        raise ConfigError(
            f"--gpus {req.gpus} admits no layout Megatron-LM accepts for this model and "
            f"--global-batch-size {req.global_batch_size}{req.pinned_text()} (tp x cp x pp x dp "
            "must equal the GPUs, dp must divide the global batch, tp must divide the heads and "
            "query groups)"
        )
    shown, smallest = _shown(tally.feasible, tally.smallest, req)
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
    )


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
