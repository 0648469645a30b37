"""The host's constants (inspector/plan/host.py COSTS), fitted on the H100 functional tests of
Megatron-LM, with their held-out errors (issue #45 item 2).

    .venv/bin/python bench/host_fit.py --megatron-lm CHECKOUT [--jobs 2] [--only REGEX] [--json FILE]
    .venv/bin/python bench/host_fit.py --from-json FILE [--model NAME]

For every GPT-family training case with an H100 `iteration-time` (bench/ci_goldens.py reads them),
`plan --gpu h100`'s plan of the job's own layout and split (ci_goldens.matching_plan) gives, per
stage and micro-batch, its GPU seconds and its host counts (plan/host.py UNITS: the kernels it
prices, the GEMMs among them, the layer passes megatron's Python runs, the MoE layers' passes),
in segments the host cannot run ahead across. The step is then priced again for any costs
exactly as cost.step_time does (each stage's GPU time plus the GPU's wait for a slower host, per
segment; the 1F1B critical path; the data-parallel and optimizer tail), so the fit is of the
model plan runs, max(GPU, host) included. Each candidate model (MODELS: which units get a cost)
is fitted by the least sum of squared relative step-time errors over every timed case (a
GPU-bound case does not move the costs: its host is under its GPU time), on a grid refined
around its best point. Reported: each model's fit, its leave-one-out error (each case predicted
by the costs fitted without it) and split-half error (fitted on the even cases, scored on the
odd, and the reverse); then the chosen model's errors for the cases it finds host-bound and
GPU-bound apart, before (no host term) and after, and per case. Nothing here changes the tool:
the chosen costs are copied into plan/host.py by hand, with this run's provenance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ci_goldens  # noqa: E402

SPAN = 2e-3  # the first grid's upper bound of each constant (seconds per unit)
MODELS = {  # name: the plan/host.py UNITS whose costs are fitted (the others held at 0)
    "kernels": ("kernels",),
    "kernels + passes": ("kernels", "passes"),
    "kernels + GEMMs": ("kernels", "gemms"),
    "kernels + MoE passes": ("kernels", "moe_passes"),
    "kernels + GEMMs + MoE passes": ("kernels", "gemms", "moe_passes"),
    "kernels (TE, local apart) + MoE passes": ("kernels", "moe_passes", "local_kernels"),
}
SAME_KERNELS = ("kernels", "local_kernels")  # one cost for both unless a model fits them apart


def case_row(case: Any) -> dict[str, Any]:
    """Return the case's plan as numbers: per stage its GPU seconds and host segments."""
    from inspector.errors import InspectorError
    from inspector.inputs.resolve import Sources, merge_sources

    name = f"{case.model}/{case.name}"
    measured = ci_goldens.read_golden(case.folder / ci_goldens.GOLDEN).step
    dp = ci_goldens.data_parallel(case)
    flags = {"data_parallel_size": dp} if dp is not None else {}
    sources = Sources(config_file=str(case.folder / "model_config.yaml"), flags=flags)
    try:
        args = merge_sources(sources, ("model", "layout", "training")).args
        plan, note = ci_goldens.matching_plan(args, case.world, ci_goldens.nccl_algo(case.folder))
    except InspectorError as error:
        return {"case": name, "refusal": str(error).splitlines()[0]}
    if plan is None:
        return {"case": name, "refusal": note}
    stages = [{"gpu": s.per_microbatch - s.wait, "tail": s.data + s.optimizer,
               "segments": [[g.gpu, *g.units] for g in s.host.segments for _ in range(g.count)],
               "layers": sum(map(len, st.layers))}
              for s, st in zip(plan.time.stages, plan.stages, strict=True)]  # fmt: skip
    return {"case": name, "measured": measured, "m": plan.job.schedule().num_microbatches,
            "chunks": plan.job.layout.chunks, "moe": plan.job.model.num_experts is not None,
            "plan_step": plan.time.seconds, "stages": stages}  # fmt: skip


def _per_stage(row: dict[str, Any], costs: Any) -> list[Any]:
    """Return each stage's seconds per micro-batch at `costs` (floats or broadcast arrays)."""
    per = []
    for s in row["stages"]:
        wait = 0.0
        for g, *units in s["segments"]:
            wait = wait + _max0(sum(c * n for c, n in zip(costs, units, strict=True)) - g)
        per.append(s["gpu"] + wait)
    return per


def _max0(value: Any) -> Any:
    import numpy as np

    return np.maximum(0.0, value)


def step(row: dict[str, Any], costs: Any) -> Any:
    """Return the case's step at these costs (cost.step_time with plan/host.py's wait)."""
    import numpy as np

    per = _per_stage(row, costs)
    slowest = np.maximum.reduce(per) if len(per) > 1 else per[0]
    pipeline = row["m"] * slowest + (sum(per) - slowest) / row["chunks"]
    return pipeline + max(s["tail"] for s in row["stages"])


def host_bound(row: dict[str, Any], costs: tuple[float, ...]) -> bool:
    """Return whether the plan's host time exceeds its GPU time on the busiest stage."""
    per = _per_stage(row, costs)
    s = row["stages"][per.index(max(per))]
    return sum(sum(c * n for c, n in zip(costs, u, strict=True)) for _, *u in s["segments"]) > s["gpu"]


def errors(rows: list[dict[str, Any]], costs: tuple[float, ...]) -> list[float]:
    return [float(step(r, costs)) / r["measured"] - 1 for r in rows]


def fit(rows: list[dict[str, Any]], names: tuple[str, ...]) -> tuple[float, ...]:
    """Return the costs (plan/host.py UNITS order; those not in `names` 0) with the least sum of
    squared relative errors: a grid over [0, SPAN] per fitted cost, refined 8 times around the best."""
    import numpy as np

    from inspector.plan.host import UNITS

    which = [UNITS.index(n) for n in names]
    low, high = np.zeros(len(which)), np.full(len(which), SPAN)
    best = np.zeros(len(which))
    for _ in range(8):
        axes = [np.linspace(lo, hi, 21) for lo, hi in zip(low, high, strict=True)]
        grid = np.meshgrid(*axes, indexing="ij")
        costs: list[Any] = [0.0] * len(UNITS)
        for k, index in enumerate(which):
            costs[index] = grid[k]
        _tie(costs, names)
        total = sum((step(r, costs) / r["measured"] - 1) ** 2 for r in rows)
        at = np.unravel_index(int(np.argmin(total)), total.shape)
        best = np.array([axis[i] for axis, i in zip(axes, at, strict=True)])
        width = (high - low) / 4
        low, high = np.maximum(0.0, best - width), best + width
    out = [0.0] * len(UNITS)
    for k, index in enumerate(which):
        out[index] = float(best[k])
    _tie(out, names)
    return tuple(out)


def _tie(costs: list[Any], names: tuple[str, ...]) -> None:
    """Give local-spec kernels the kernels' cost where the model does not fit them apart."""
    from inspector.plan.host import UNITS

    kernels, local = (UNITS.index(n) for n in SAME_KERNELS)
    if "kernels" in names and "local_kernels" not in names:
        costs[local] = costs[kernels]


def _mae(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(map(abs, values)) * 100:.1f}% (n {len(values)}, worst {max(values, key=abs) * 100:+.0f}%)"


def _costs(costs: tuple[float, ...]) -> str:
    from inspector.plan.host import UNITS

    return ", ".join(f"{n} {c * 1e6:.1f} us" for n, c in zip(UNITS, costs, strict=True) if c)


def render(rows: list[dict[str, Any]], chosen: str = "kernels (TE, local apart) + MoE passes") -> str:
    """Return every model's fit and held-out errors, then the chosen one's errors by kind,
    before and after, and per case."""
    timed = [r for r in rows if not r.get("refusal") and r.get("measured")]
    zero = (0.0,) * len(timed[0]["stages"][0]["segments"][0][1:])
    lines = [f"{len(timed)} timed cases. Fits (least squares of the relative step-time error), "
             "held out: leave-one-out, and split-half (fit on the even cases, scored on the odd, and "
             "the reverse):", ""]
    for name, names in MODELS.items():
        costs = fit(timed, names)
        loo = [errors([r], fit(timed[:i] + timed[i + 1:], names))[0] for i, r in enumerate(timed)]
        even, odd = timed[::2], timed[1::2]
        half = errors(odd, fit(even, names)) + errors(even, fit(odd, names))
        lines.append(f"- {name}: {_costs(costs)}; mean |error| {_mae(errors(timed, costs))}; "
                     f"leave-one-out {_mae(loo)}; split-half {_mae(half)}")
    costs = fit(timed, MODELS[chosen])
    bound = [r for r in timed if host_bound(r, costs)]
    gpu = [r for r in timed if not host_bound(r, costs)]
    lines += ["", f"Chosen: {chosen} ({_costs(costs)}).", "",
              "| cases | before (no host term) | after |", "|---|---|---|"]
    for title, subset in (("host-bound (after)", bound), ("GPU-bound (after)", gpu),
                          ("host-bound dense", [r for r in bound if not r["moe"]]),
                          ("host-bound MoE", [r for r in bound if r["moe"]]), ("all", timed)):  # fmt: skip
        lines.append(f"| {title} | {_mae(errors(subset, zero))} | {_mae(errors(subset, costs))} |")
    lines += ["", "| case | m | measured s | before | after | host-bound |", "|---|---|---|---|---|---|"]
    for r in timed:
        lines.append(f"| {r['case']} | {r['m']} | {r['measured']:.3f} | {errors([r], zero)[0] * 100:+.1f}% "
                     f"| {errors([r], costs)[0] * 100:+.1f}% | {'yes' if r in bound else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only")
    parser.add_argument("--json", type=Path, help="write the rows here as each case ends")
    parser.add_argument("--from-json", type=Path, help="render the rows a run wrote")
    parser.add_argument("--model", default="kernels (TE, local apart) + MoE passes", choices=list(MODELS))
    ns = parser.parse_args(argv)
    if ns.from_json:
        sys.stdout.write(render(json.loads(ns.from_json.read_text()), ns.model))
        return
    rows = ci_goldens.each_training_case(ns.megatron_lm, ns.only, case_row, ns.jobs, ns.json)
    sys.stdout.write(render(rows, ns.model))


if __name__ == "__main__":
    main()
