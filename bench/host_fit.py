"""The host's two constants (inspector/plan/host.py LAUNCH_SECONDS, PASS_SECONDS), fitted on the H100
functional tests of Megatron-LM, with their held-out errors (issue #45 item 2).

    .venv/bin/python bench/host_fit.py --megatron-lm CHECKOUT [--jobs 2] [--only REGEX] [--json FILE]
    .venv/bin/python bench/host_fit.py --from-json FILE

For every GPT-family training case with an H100 `iteration-time` (bench/ci_goldens.py reads them),
`plan --gpu h100`'s plan of the job's own layout (ci_goldens.matching_plan) gives, per stage and
micro-batch, its GPU seconds and its host work: the kernels it launches and the layer passes
megatron's Python runs, in segments the host cannot run ahead across (plan/host.py). The step is
then priced again for any pair of constants exactly as cost.step_time does (each stage's GPU
time plus the GPU's wait for a slower host, the 1F1B critical path, the data-parallel and
optimizer tail), so the fit is of the model plan runs, max(GPU, host) included. The constants
minimise the sum of squared relative step-time errors over every timed case (a GPU-bound case
does not move them: its host is under its GPU time). Reported: the fit; its errors for the cases
the fitted plan finds host-bound and GPU-bound apart, before (no host term) and after; and the
held-out errors (each case predicted by the constants fitted without it, and split-half: fitted
on the even cases, scored on the odd, and the reverse). Nothing here changes the tool.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ci_goldens  # noqa: E402

LAUNCH_GRID = [i * 0.5e-6 for i in range(0, 161)]  # 0-80 us per kernel
PASS_GRID = [i * 20e-6 for i in range(0, 151)]  # 0-3 ms per layer pass


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
               "segments": [[g.gpu, g.launches, g.passes] for g in s.host.segments],
               "layers": sum(map(len, st.layers))}
              for s, st in zip(plan.time.stages, plan.stages, strict=True)]  # fmt: skip
    return {"case": name, "measured": measured, "m": plan.job.schedule().num_microbatches,
            "chunks": plan.job.layout.chunks, "moe": plan.job.model.num_experts is not None,
            "plan_step": plan.time.seconds, "stages": stages}  # fmt: skip


def step(row: dict[str, Any], launch: float, per_pass: float) -> float:
    """Return the case's step at these constants (cost.step_time with plan/host.py's wait)."""
    per = []
    for s in row["stages"]:
        wait = sum(max(0.0, launch * n + per_pass * p - g) for g, n, p in s["segments"])
        per.append(s["gpu"] + wait)
    slowest = max(per)
    pipeline = row["m"] * slowest + (sum(per) - slowest) / row["chunks"]
    return pipeline + max(s["tail"] for s in row["stages"])


def host_bound(row: dict[str, Any], launch: float, per_pass: float) -> bool:
    """Return whether the plan's host time exceeds its GPU time on the busiest stage."""
    def busy(s: dict[str, Any]) -> float:
        return s["gpu"] + sum(max(0.0, launch * n + per_pass * p - g) for g, n, p in s["segments"])

    s = max(row["stages"], key=busy)
    return sum(launch * n + per_pass * p for _, n, p in s["segments"]) > s["gpu"]


def errors(rows: list[dict[str, Any]], launch: float, per_pass: float) -> list[float]:
    return [step(r, launch, per_pass) / r["measured"] - 1 for r in rows]


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Return the (launch, pass) pair of the grid with the least sum of squared relative errors."""
    best = (float("inf"), 0.0, 0.0)
    for launch in LAUNCH_GRID:
        for per_pass in PASS_GRID:
            cost = sum(e * e for e in errors(rows, launch, per_pass))
            if cost < best[0]:
                best = (cost, launch, per_pass)
    return best[1], best[2]


def _mae(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.mean(map(abs, values)) * 100:.1f}% (n {len(values)}, worst {max(values, key=abs) * 100:+.0f}%)"


def render(rows: list[dict[str, Any]]) -> str:
    """Return the fit, the errors before and after by kind, and the held-out errors."""
    timed = [r for r in rows if not r.get("refusal") and r.get("measured")]
    launch, per_pass = fit(timed)
    bound = [r for r in timed if host_bound(r, launch, per_pass)]
    gpu = [r for r in timed if not host_bound(r, launch, per_pass)]
    lines = [f"Fit over {len(timed)} timed cases: {launch * 1e6:.1f} us per kernel launched, "
             f"{per_pass * 1e6:.0f} us per layer pass.", "",
             "| cases | before (no host term) | after |", "|---|---|---|"]
    for title, subset in (("host-bound (after)", bound), ("GPU-bound (after)", gpu),
                          ("host-bound dense", [r for r in bound if not r["moe"]]),
                          ("host-bound MoE", [r for r in bound if r["moe"]]), ("all", timed)):  # fmt: skip
        lines.append(f"| {title} | {_mae(errors(subset, 0.0, 0.0))} | {_mae(errors(subset, launch, per_pass))} |")
    held = []
    for i, r in enumerate(timed):
        c = fit(timed[:i] + timed[i + 1:])
        held.append((r, errors([r], *c)[0]))
    lines.append(f"\nLeave-one-out: all {_mae([e for _, e in held])}; host-bound "
                 f"{_mae([e for r, e in held if r in bound])}")
    even, odd = timed[::2], timed[1::2]
    half = errors(odd, *fit(even)) + errors(even, *fit(odd))
    lines.append(f"Split-half (fit on even, score odd, and the reverse): all {_mae(half)}; constants "
                 f"{[round(x * 1e6, 1) for x in fit(even)]} and {[round(x * 1e6, 1) for x in fit(odd)]} us")
    lines += ["", "| case | m | measured s | before | after | host-bound |", "|---|---|---|---|---|---|"]
    for r in timed:
        lines.append(f"| {r['case']} | {r['m']} | {r['measured']:.3f} | {errors([r], 0, 0)[0] * 100:+.1f}% "
                     f"| {errors([r], launch, per_pass)[0] * 100:+.1f}% | {'yes' if r in bound else ''} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only")
    parser.add_argument("--json", type=Path, help="write the rows here as each case ends")
    parser.add_argument("--from-json", type=Path, help="render the rows a run wrote")
    ns = parser.parse_args(argv)
    if ns.from_json:
        sys.stdout.write(render(json.loads(ns.from_json.read_text())))
        return
    cases = [c for c in ci_goldens.discover(ns.megatron_lm) if c.gpt_family and not c.world_unknown]
    cases = [c for c in cases if not ns.only or re.search(ns.only, f"{c.model}/{c.name}")]
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(ns.jobs) as pool:
        for row in pool.map(case_row, cases):
            rows.append(row)
            if ns.json:
                ns.json.write_text(json.dumps(rows, indent=1))
    sys.stdout.write(render(rows))


if __name__ == "__main__":
    main()
