"""Render a plan search: the ranked table, the winner's flags, --explain, JSON, the timeline."""

from __future__ import annotations

import json
from typing import Any

from tabulate import tabulate

from inspector.formulas.kernels import not_measured
from inspector.job.hardware import GIB
from inspector.plan.hybrid import estimate_notes
from inspector.plan.price import Plan
from inspector.plan.search import SearchResult
from inspector.render.held_elsewhere import outside_line


def _layout(plan: Plan) -> str:
    lay, tr = plan.job.layout, plan.job.training
    parts = [f"tp{lay.tp}", f"pp{lay.pp}", f"dp{lay.dp}"]
    if lay.cp > 1:
        parts.append(f"cp{lay.cp}")
    if lay.ep > 1:
        parts.append(f"ep{lay.ep}")
    if plan.job.model.num_experts and lay.expert_tp != lay.tp:  # megatron's default: etp = tp
        parts.append(f"etp{lay.expert_tp}")
    if lay.chunks > 1:
        parts.append(f"vpp{lay.chunks}")
    parts.append(f"mbs{tr.micro_batch_size}")
    return " ".join(parts)


def recompute_label(plan: Plan) -> str:
    """Return the plan's recomputation in a word or two: none, selective, full, block N, uniform N."""
    tr = plan.job.training
    if tr.recompute != "full":
        return tr.recompute
    if tr.recompute_method == "block":
        return f"block {tr.recompute_num_layers}"
    return "full" if tr.recompute_num_layers == 1 else f"uniform {tr.recompute_num_layers}"


def _row(rank: int, plan: Plan, memory: int) -> list[Any]:
    tr = plan.job.training
    return [
        rank,
        _layout(plan),
        _stage_cell(plan),
        recompute_label(plan),
        _optimizer(tr),
        f"{plan.peak / GIB:.1f} / {memory / GIB:.0f}",
        f"{plan.time.seconds:.2f}",
        f"{plan.mfu * 100:.1f}%",
        f"{plan.time.bubble * 100:.1f}%",
        plan.bound(),
    ]


def _optimizer(tr: Any) -> str:
    """Return the distopt column: yes, no, or the Megatron-FSDP strategy."""
    if tr.megatron_fsdp:
        return f"fsdp {tr.sharding_strategy}"
    return "yes" if tr.use_distributed_optimizer else "no"


def _stage_counts(plan: Plan) -> list[int]:
    return [sum(len(c) for c in s.layers) for s in plan.stages]


def _stage_cell(plan: Plan) -> str:
    """Return the layers-per-stage column: each stage's layers ("8/8"), or where a stage's
    virtual-pipeline chunks hold different numbers of layers (a --pipeline-model-parallel-layout),
    each chunk's ("1+1+3+3/1+2+3+2"): plans that differ only there must not print alike."""
    chunks = [[len(c) for c in s.layers] for s in plan.stages]
    if all(len(set(counts)) <= 1 for counts in chunks):
        return "/".join(str(n) for n in _stage_counts(plan))
    return "/".join("+".join(map(str, counts)) for counts in chunks)


def render_plan(result: SearchResult, memory: int, fmt: str, explain: bool = False) -> str:
    """Return the search result as text or JSON."""
    if fmt == "json":
        return json.dumps(_json(result, memory), indent=2, allow_nan=False) + "\n"
    if not result.plans:
        return _none_fits(result, memory)
    headers = ["#", "layout", "layers per stage", "recompute", "distopt", "peak GiB / GPU",
               "step s", "MFU", "bubble", "bound by"]
    rows = [_row(i + 1, p, memory) for i, p in enumerate(result.plans)]
    best = result.plans[0]
    lines = [
        tabulate(rows, headers=headers, disable_numparse=True),
        *_outside(best),
        *_range(result),
        *_host_note(best),
        *(f"Note: {note}." for note in estimate_notes(best.job.model)),
        "",
        "Megatron-LM flags of plan 1:",
        "  " + " \\\n  ".join(best.flags()),
        "",
        render_timeline(best),
        _searched(result),
    ]
    if explain:
        lines += ["", explain_plan(result, memory)]
    return "\n".join(lines) + "\n"


def _outside(plan: Plan) -> list[str]:
    """Return the line naming what plan 1's fullest stage holds outside PyTorch's allocator
    (DeepEP's buffers, in its activations and the peak), as `memory` prints it; none where it holds
    nothing there."""
    worst = max(plan.stages, key=lambda s: s.total)
    if not worst.outside:
        return []
    label = f"Plan 1, stage {worst.stage} (its peak)"
    return [outside_line(label, worst.outside, lambda v: f"{v / GIB:,.2f} GiB",
                         "the activations and the peak", worst.total)]  # fmt: skip


def _host_note(plan: Plan) -> list[str]:
    """Return the note saying plan 1 is host-bound: on its busiest stage the host's launches take
    longer than the GPU's work (plan/host.py), so the step is the host's pace; none otherwise."""
    bound = plan.time.host_bound()
    if bound is None:
        return []
    stage, host, gpu = bound
    return [f"Note: plan 1 is host-bound: on stage {stage} the host takes {host * 1e3:.1f} ms per "
            f"micro-batch to launch its kernels, the GPU {gpu * 1e3:.1f} ms; the GPU waits for it "
            "(docs/how-time-is-computed.md, \"The host's pace\")."]


def _range(result: SearchResult) -> list[str]:
    """Return the line saying which kernels no published measurement fixes on the GPU and the
    step times at the fast end of the range they imply, or that every kernel is another GPU's
    measured table scaled by the peaks; none where every kind is measured."""
    if result.scaled_from and result.plans:
        return [not_measured(result.plans[0].gpu)]
    if not result.unmeasured:
        return []
    gpu = result.plans[0].gpu.name
    fast = ", ".join(f"{s:.2f}" for s in result.fast_seconds)
    return [f"Not measured on {gpu} ({', '.join(result.unmeasured)}; docs/how-time-is-computed.md): "
            f"step s is the slow end of the range the published figures imply; at the fast end: {fast} s."]


def _none_fits(result: SearchResult, memory: int) -> str:
    need = result.smallest_peak or 0
    text = (
        f"No layout fits in {memory / GIB:.2f} GiB per GPU: the smallest any layout needs is "
        f"{need / GIB:.2f} GiB"
    )
    if result.smallest is not None:
        text += f" ({_layout(result.smallest)}, recompute {recompute_label(result.smallest)})"
    return text + ".\n"


def explain_plan(result: SearchResult, memory: int) -> str:
    """Return why plan 1 won: its binding constraint and what the runner-up loses."""
    best = result.plans[0]
    worst = max(best.stages, key=lambda s: s.total)
    held = worst.state
    shares = best.time.shares()
    lines = [
        f"Why plan 1: {best.time.seconds:.2f} s per step at {best.tflops_per_gpu:.0f} TFLOP/s per GPU.",
        f"  memory: stage {worst.stage} is the fullest, {worst.total / GIB:.2f} of "
        f"{memory / GIB:.2f} GiB (weights {held.weights / GIB:.2f}, grads {held.gradients / GIB:.2f}, "
        f"optimizer {held.optimizer / GIB:.2f}, activations {worst.activations / GIB:.2f} with "
        f"{sum(worst.in_flight)} micro-batch passes in flight)",
        "  time: " + ", ".join(f"{k} {v:.2f} s" for k, v in shares.items() if v > 0),
    ]
    if len(result.plans) > 1:
        second = result.plans[1]
        lost = second.time.seconds / best.time.seconds - 1
        lines.append(
            f"  runner-up ({_layout(second)}, recompute {recompute_label(second)}) is "
            f"{lost * 100:.1f}% slower; it is bound by {second.bound()}"
        )
    return "\n".join(lines)


MAX_TIMELINE_PASSES = 100_000  # forward and backward passes drawn (docs/limits.md)


def _passes(plan: Plan) -> int:
    """Return the forward and backward passes of one step over all ranks: what a timeline draws."""
    lay = plan.job.layout
    return 2 * plan.job.schedule().num_microbatches * lay.chunks * lay.pp


def _too_long(plan: Plan) -> str | None:
    """Return why the schedule is not drawn, or None when it is."""
    passes = _passes(plan)
    if passes <= MAX_TIMELINE_PASSES:
        return None
    return (f"Schedule of plan 1: not drawn ({passes:,} passes, more than the "
            f"{MAX_TIMELINE_PASSES:,} drawn; docs/limits.md)")


def render_timeline(plan: Plan, width: int = 72) -> str:
    """Return the 1F1B / interleaved schedule as stages x time: F forward, B backward, . idle."""
    skipped = _too_long(plan)
    if skipped is not None:
        return skipped + "\n"
    rows = timeline(plan)
    end = max((t for row in rows for _, t, _ in row), default=1.0)
    lines = ["Schedule of plan 1 (F forward, B backward, . idle; one micro-batch pass per letter run):"]
    for stage, row in enumerate(rows):
        cells = ["."] * width
        for start, stop, kind in row:
            a, b = int(start / end * width), max(int(start / end * width) + 1, int(stop / end * width))
            for x in range(a, min(b, width)):
                cells[x] = kind
        lines.append(f"  stage {stage:<3} " + "".join(cells))
    return "\n".join(lines) + "\n"


def timeline(plan: Plan) -> list[list[tuple[float, float, str]]]:
    """Return per stage the (start, end, F|B) intervals of megatron's schedule, replayed.

    The order of each rank's passes is megatron-core's: `get_schedule_table` (micro-batches in
    groups of p through chunk 0, then chunk 1, ...; 1F1B is the one-chunk case), the warm-up of
    `get_pp_rank_microbatches` (job.dims.warmup_steps), then one forward and one backward per
    step, the backward of step k running chunk v - 1 - chunk(k). A pass starts when its input
    is ready (the previous virtual stage's forward, the next one's backward) and its rank is
    free. A chunk's forward takes a third and its backward two thirds of its share (by layers)
    of the rank's per-micro-batch time.
    """
    lay = plan.job.layout
    pp, v = lay.pp, lay.chunks
    m = plan.job.schedule().num_microbatches
    per = [s.per_microbatch for s in plan.time.stages]
    share = [[len(c) / max(sum(len(x) for x in st.layers), 1) for c in st.layers]
             for st in plan.stages]
    order = [_rank_order(s, pp, m, v) for s in range(pp)]
    done: dict[tuple[str, int, int, int], float] = {}
    rows: list[list[tuple[float, float, str]]] = [[] for _ in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for s in range(pp):
            while pos[s] < len(order[s]):
                kind, i, c = order[s][pos[s]]
                dep = _dependency(kind, s, i, c, pp, v)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep else 0.0)
                length = per[s] * share[s][c] * (1 / 3 if kind == "F" else 2 / 3)
                done[(kind, s, i, c)] = free[s] = start + length
                rows[s].append((start, start + length, kind))
                pos[s] += 1
                progress = True
    return rows


def _rank_order(stage: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    """Return one rank's passes (F|B, micro-batch, chunk) in megatron-core's order."""
    from inspector.job.dims import warmup_steps

    table = []  # megatron's get_schedule_table: (micro-batch, chunk) per forward step
    for start in range(0, m, pp):
        width = min(pp, m - start)
        table += [(start + i, c) for c in range(v) for i in range(width)]
    warmup = warmup_steps(stage, pp, m, v, pp) if pp > 1 else 0
    ops = [("F", *table[k]) for k in range(warmup)]
    for k in range(warmup, len(table)):
        ops.append(("F", *table[k]))
        i, c = table[k - warmup]
        ops.append(("B", i, v - 1 - c))
    for k in range(len(table) - warmup, len(table)):
        i, c = table[k]
        ops.append(("B", i, v - 1 - c))
    return ops


def render_svg(plan: Plan) -> str:
    """Return the schedule timeline as an SVG picture."""
    skipped = _too_long(plan)
    if skipped is not None:
        return ('<svg xmlns="http://www.w3.org/2000/svg" width="900" height="40" '
                f'font-family="sans-serif" font-size="12"><text x="4" y="24">{skipped}</text>'
                "</svg>\n")
    rows = timeline(plan)
    end = max((t for row in rows for _, t, _ in row), default=1.0)
    width, height, pad = 900, 24, 80
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + pad + 10}" '
        f'height="{height * len(rows) + 40}" font-family="sans-serif" font-size="12">'
    ]
    colours = {"F": "#4c78a8", "B": "#f58518"}
    for s, row in enumerate(rows):
        y = 10 + s * height
        out.append(f'<text x="4" y="{y + 16}">stage {s}</text>')
        for start, stop, kind in row:
            x = pad + start / end * width
            w = max((stop - start) / end * width, 0.5)
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{height - 4}" '
                f'fill="{colours[kind]}" stroke="white" stroke-width="0.3"/>'
            )
    out.append(
        f'<text x="{pad}" y="{height * len(rows) + 30}">forward (blue), backward (orange), '
        f"idle (white); step {plan.time.seconds:.2f} s</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _searched(result: SearchResult) -> str:
    """Return the line saying how many candidates were priced, and how many settings were passed
    over unpriced (search.py `_kept`: slower, without recomputation, than the kept fastest plans)."""
    if not result.passed_over:
        return f"Searched {result.evaluated} candidates."
    return (f"Searched {result.evaluated} candidates and passed over {result.passed_over} more: even "
            f"without recomputation, their GPU work alone takes longer than each of the "
            f"{result.kept} fastest plans.")


def _json(result: SearchResult, memory: int) -> dict[str, Any]:
    return {
        "gpu_memory_bytes": memory,
        "evaluated": result.evaluated,
        "passed_over": result.passed_over,
        "smallest_peak_bytes": result.smallest_peak,
        "plans": [_plan_json(p) for p in result.plans],
        **({"unmeasured_kernels": list(result.unmeasured),
            "step_seconds_fast_end": list(result.fast_seconds)} if result.unmeasured else {}),
        **({"kernels_scaled_from": result.scaled_from} if result.scaled_from else {}),
    }


def _plan_json(p: Plan) -> dict[str, Any]:
    lay, tr = p.job.layout, p.job.training
    full = tr.recompute == "full"
    return {
        "layout": {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
            "etp": lay.expert_tp, "vpp": lay.chunks, "sequence_parallel": lay.sequence_parallel,
        },
        "micro_batch_size": tr.micro_batch_size,
        "recompute": tr.recompute,
        "recompute_method": tr.recompute_method if full else None,
        "recompute_num_layers": tr.recompute_num_layers if full else None,
        "distributed_optimizer": tr.use_distributed_optimizer,
        "megatron_fsdp": tr.sharding_strategy if tr.megatron_fsdp else None,
        "split": list(p.split),
        "stages": [
            {
                "stage": s.stage, "layers": [list(c) for c in s.layers],
                "weights": s.state.weights, "gradients": s.state.gradients,
                "optimizer": s.state.optimizer, "activations": s.activations,
                "total": s.total, "in_flight": list(s.in_flight),
                **({"outside_allocator": [[what, size] for what, size in s.outside]}
                   if s.outside else {}),  # fmt: skip
            }
            for s in p.stages
        ],
        "peak_bytes": p.peak,
        "step_seconds": p.time.seconds,
        "mfu": p.mfu,
        "tflops_per_gpu": p.tflops_per_gpu,
        "bubble": p.time.bubble,
        "bound": p.bound(),
        "time_shares": p.time.shares(),
        "flags": p.flags(),
        **({"notes": estimate_notes(p.job.model)} if estimate_notes(p.job.model) else {}),
    }


def _dependency(
    kind: str, stage: int, index: int, chunk: int, pp: int, v: int
) -> tuple[str, int, int, int] | None:
    """Return the pass a pass waits for: the previous virtual stage's forward, the next one's
    backward (virtual stage c x p + s; the last one's backward follows its own forward)."""
    if kind == "F":
        if stage > 0:
            return ("F", stage - 1, index, chunk)
        return ("F", pp - 1, index, chunk - 1) if chunk > 0 else None
    if stage < pp - 1:
        return ("B", stage + 1, index, chunk)
    return ("B", 0, index, chunk + 1) if chunk < v - 1 else ("F", stage, index, chunk)
