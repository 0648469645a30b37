"""`plan`'s floors (plan/timing.py `time_floors`) and the settings the search passes over by them.

A search prices settings least floor first and stops once its kept fastest plans all beat the
next floor (plan/search.py). That is only right if no plan is faster than its floor: checked
here against every plan a search prices when nothing is passed over, for a dense model with
interleaving, an MoE model with expert parallelism and its all-to-all overlap, full recomputation
(block N searched).
And the plans printed must be those of the search that prices everything.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from inspector.inputs.resolve import Sources, merge_sources
from inspector.plan import search as search_module
from inspector.plan.candidates import candidate_job, recipes
from inspector.plan.request import PlanFlags, make_request
from inspector.plan.search import search
from inspector.plan.timing import time_floors

JOBS = {
    "dense": ("llama2-7b", 32, dict(bf16=True, global_batch_size=64)),
    "moe": ("qwen3-30b-a3b", 8, dict(bf16=True, global_batch_size=32)),
    "moe overlap": ("qwen3-30b-a3b", 8, dict(
        bf16=True, global_batch_size=32, moe_token_dispatcher_type="alltoall",
        overlap_moe_expert_parallel_comm=True)),
    "dense full": ("llama2-7b", 32, dict(bf16=True, global_batch_size=64, recompute_granularity="full")),
}


def _request(name: str, **flags: Any) -> Any:
    preset, gpus, given = JOBS[name]
    args = merge_sources(Sources(preset=preset, flags={**given, **flags}, searched=True),
                         ("model", "layout", "training")).args
    return make_request(args, PlanFlags(gpus))


def _priced(req: Any, kept: int = 0) -> tuple[list[Any], int]:
    """Return the plans a search prices, in its ranking's order (fastest first, then by peak
    and `settings` order), and how many settings it passed over keeping `kept` (no `memory`)."""
    tally = search_module._Tally(req, None, kept=kept)
    recomputes = recipes(req)
    search_module._price(tally, search_module._by_floor(req, recomputes), recomputes)
    ranked = tally.ranked()
    ranked.sort(key=lambda p: (p.time.seconds, p.peak))
    return ranked, len(tally.passed_over)


def _signature(plans: list[Any]) -> list[tuple[Any, ...]]:
    return [(p.job.layout, p.split, p.job.training.recompute, p.job.training.recompute_num_layers,
             p.time.seconds, p.peak) for p in plans]  # fmt: skip


@pytest.mark.parametrize("name", list(JOBS))
def test_no_plan_is_faster_than_its_floors(name: str) -> None:
    req = _request(name)
    priced, passed_over = _priced(req)
    assert passed_over == 0
    assert len(priced) > 3
    least = recipes(req)[0]
    if least[1:] == ("block", 0):  # block recomputation of the fewest layers that fit: of one
        least = ("full", "block", 1)
    groups: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for plan in priced:
        job, lay = plan.job, plan.job.layout
        mbs = job.schedule().micro_batch_size
        floor_job = candidate_job(req, lay, mbs, least, job.training.use_distributed_optimizer,
                                  req.flash)  # fmt: skip
        exact, any_split = time_floors(floor_job, plan.split, req)
        assert 0 < exact <= plan.time.seconds * (1 + 1e-12), (lay, plan.split)
        group = (lay.tp, lay.pp, lay.dp, lay.cp, lay.ep, lay.expert_tp, lay.chunks, mbs)
        groups.setdefault(group, []).append((any_split, plan.time.seconds))
    # a split's `any_split` floor bounds every split of its layout and micro-batch size
    for group, pairs in groups.items():
        assert max(f for f, _ in pairs) <= min(t for _, t in pairs) * (1 + 1e-12), group
    if name == "moe overlap":  # merged passes depend on the split: no floor across splits
        assert {f for pairs in groups.values() for f, _ in pairs} == {0.0}


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_passing_settings_over_keeps_the_fastest_plans(name: str) -> None:
    req = _request(name)
    fast, passed_over = _priced(req, kept=50)
    full, _ = _priced(req)
    assert passed_over > 0 and len(full) > len(fast) >= 50
    assert _signature(fast[:50]) == _signature(full[:50])


def test_passing_settings_over_prints_the_same_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    req = _request("dense")
    fast = search(req)
    assert fast.passed_over > 0 and fast.kept == 50
    monkeypatch.setattr(search_module, "_kept", lambda req: 0)
    full = search(req)
    assert full.passed_over == 0 and full.evaluated > fast.evaluated
    assert _signature(fast.plans) == _signature(full.plans) and len(fast.plans) == 5


def test_memory_turning_plans_down_past_the_kept_ones_prices_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # keep one plan: the other four printed lie past it, so the search must price the settings
    # it passed over before confirming them, and print what the full search prints
    req = replace(_request("dense"), top=5)
    calls: list[int] = []
    real = search_module._price

    def counted(tally: Any, queue: Any, recomputes: Any) -> None:
        calls.append(len(queue))
        real(tally, queue, recomputes)

    monkeypatch.setattr(search_module, "_price", counted)
    monkeypatch.setattr(search_module, "_kept", lambda req: 1)
    kept_one = search(req)
    assert len(calls) == 2 and kept_one.passed_over == 0
    monkeypatch.setattr(search_module, "_kept", lambda req: 0)
    assert _signature(kept_one.plans) == _signature(search(req).plans)
