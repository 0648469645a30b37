"""`memory --timeline FILE.svg`: each stage's memory over one iteration, drawn by hand in SVG.

One file, one panel per pipeline stage (the rank the report shows for it), stacked from the
bottom: weights, gradients, optimizer state, buffers (persistent buffers and cuBLAS workspaces)
as flat bands; the activations other micro-batches in flight hold beneath the running pass; and
the running pass itself (its micro-batch's activations and temporaries). The x axis is the
iteration's passes in megatron's schedule order (memory/engine/timeline.py), each the same width, the
pass's events drawn as their highest total per pixel. The peak is marked with the report's
moment. Only the standard library; every number printed with fixed decimals, so the file is
byte-identical run to run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from xml.sax.saxutils import escape

from inspector.job.hardware import GIB
from inspector.memory.measure import MemoryReport, StageMemory
from inspector.records import MemoryPass

WIDTH, LEFT, RIGHT = 960, 70, 20
PLOT_HEIGHT, PANEL_TOP, PANEL_BOTTOM = 200, 48, 46
LEGEND_HEIGHT = 30
# (category, colour, legend text): bottom to top.
BANDS = (
    ("weights", "#4e79a7", "weights"),
    ("gradients", "#f28e2b", "gradients"),
    ("optimizer", "#e15759", "optimizer state"),
    ("buffers", "#76b7b2", "buffers and workspaces"),
    ("activations", "#59a14f", "activations of micro-batches in flight"),
    ("transient", "#edc948", "the running pass"),
)
# drawn above the buffers, in a job with CUDA graphs only (memory/engine/cuda_graphs.py): their memory
# pool and static buffers, which the passes above cannot use
GRAPH_BAND = ("graphs", "#b07aa1", "CUDA graphs' pool and static buffers")
STEPS = (1, 2, 5)
YScale = Callable[[float], str]  # bytes -> the y coordinate, printed


def render_timeline(report: MemoryReport, passes: dict[int, tuple[MemoryPass, ...]]) -> str:
    """Return the SVG of every stage's iteration, given each stage's passes
    (report.memory_outputs.engine_passes; a stage without passes is left out)."""
    stages = [s for s in report.stages if s.run is not None and passes.get(s.stage)]
    panel = PANEL_TOP + PLOT_HEIGHT + PANEL_BOTTOM
    height = LEGEND_HEIGHT + panel * len(stages)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        "<title>inspect-model memory --timeline: each stage's memory over one iteration</title>",
        '<rect width="100%" height="100%" fill="white"/>',
        *_legend(any(s.run is not None and s.run.graph_buffers for s in stages)),
    ]
    for index, stage in enumerate(stages):
        out.extend(_panel(stage, passes[stage.stage], LEGEND_HEIGHT + index * panel))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend(graphs: bool) -> list[str]:
    out, x = [], LEFT
    for _, colour, text in (*BANDS[:4], GRAPH_BAND, *BANDS[4:]) if graphs else BANDS:
        out.append(f'<rect x="{x}" y="10" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="20">{escape(text)}</text>')
        x += 28 + 6 * len(text)
    return out


def _panel(stage: StageMemory, passes: Sequence[MemoryPass], top: int) -> list[str]:
    state = stage.state
    graphs = stage.run.graph_buffers if stage.run is not None else 0
    static = (state.weights, state.gradients, state.optimizer, stage.buffers - graphs, graphs)
    base = sum(static)
    peak_pass, peak_step, peak_bytes = _highest(passes)
    scale = _scale(max(base + peak_bytes, stage.total))
    plot_top = top + PANEL_TOP
    y = _y(plot_top, scale)
    width = (WIDTH - LEFT - RIGHT) / len(passes)
    out = [f'<g data-stage="{stage.stage}" data-rank="{stage.rank}">']
    out.append(
        f'<text x="{LEFT}" y="{top + 16}" font-size="13" font-weight="bold">'
        f"stage {stage.stage} (rank {stage.rank}): {_gib(base + peak_bytes)} GiB at the peak, "
        f"{_gib(base)} GiB static</text>"
    )
    out.extend(_axis(plot_top, scale, y))
    low = 0
    for (name, colour, text), size in zip((*BANDS[:4], GRAPH_BAND), static, strict=True):
        if name == GRAPH_BAND[0] and not size:
            continue
        out.append(_band(name, colour, text, f"M{LEFT},{y(low)}H{WIDTH - RIGHT}V{y(low + size)}H{LEFT}Z"))
        low += size
    out.append(_band(*BANDS[4], _held_path(passes, base, width, y)))
    out.append(_band(*BANDS[5], _running_path(passes, base, width, y)))
    out.extend(_peak_mark(stage, passes, (peak_pass, peak_step), base + peak_bytes, width, y, top))
    out.extend(_pass_labels(passes, width, plot_top + PLOT_HEIGHT))
    out.append("</g>")
    return out


def _highest(passes: Sequence[MemoryPass]) -> tuple[int, int, int]:
    """Return the first (pass, step) at the highest total above static memory, and that total."""
    best = (0, -1, -1)
    for index, one in enumerate(passes):
        for step, (_, allocated, _) in enumerate(one.steps):
            if one.held + allocated > best[2]:
                best = (index, step, one.held + allocated)
    return best[0], best[1], max(best[2], 0)


def _scale(total: int) -> float:
    """Return the y axis's top in GiB: a round number above the total."""
    value = max(total / GIB * 1.08, 1e-3)
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude


def _y(plot_top: int, scale: float) -> YScale:
    def y(value: float) -> str:
        return f"{plot_top + PLOT_HEIGHT - value / GIB / scale * PLOT_HEIGHT:.1f}"

    return y


def _gib(value: float) -> str:
    """Return bytes in GiB: two decimals, three below 1 GiB."""
    return f"{value / GIB:,.2f}" if value >= GIB else f"{value / GIB:.3f}"


def _axis(plot_top: int, scale: float, y: YScale) -> list[str]:
    step = next(s * 10**e for e in range(-4, 6) for s in STEPS if scale / (s * 10**e) <= 5)
    out = []
    for n in range(int(scale / step + 1e-9) + 1):
        value = n * step * GIB
        out.append(
            f'<line x1="{LEFT - 4}" x2="{WIDTH - RIGHT}" y1="{y(value)}" y2="{y(value)}" '
            f'stroke="#ddd"/>'
        )
        out.append(f'<text x="{LEFT - 6}" y="{y(value)}" dy="4" text-anchor="end">{n * step:g}</text>')
    middle = plot_top + PLOT_HEIGHT / 2
    out.append(
        f'<text x="16" y="{middle:.1f}" transform="rotate(-90 16 {middle:.1f})" '
        'text-anchor="middle">GiB</text>'
    )
    return out


def _band(name: str, colour: str, text: str, path: str) -> str:
    return f'<path data-band="{name}" fill="{colour}" d="{path}"><title>{escape(text)}</title></path>'


def _held_path(passes: Sequence[MemoryPass], base: int, width: float, y: YScale) -> str:
    top = [f"M{LEFT},{y(base)}"]
    for index, one in enumerate(passes):
        top.append(f"V{y(base + one.held)}H{LEFT + (index + 1) * width:.1f}")
    return "".join(top) + f"V{y(base)}Z"


def _running_path(passes: Sequence[MemoryPass], base: int, width: float, y: YScale) -> str:
    """Return the running pass's band: its highest total per pixel above the held activations."""
    top, bottom = [f"M{LEFT},{y(base + passes[0].held)}"], []
    for index, one in enumerate(passes):
        x0 = LEFT + index * width
        buckets = _buckets(one, width)
        for b, value in enumerate(buckets):
            x1 = x0 + (b + 1) * width / len(buckets)
            top.append(f"V{y(base + one.held + value)}H{x1:.1f}")
        bottom.append(f"V{y(base + one.held)}H{x0:.1f}")
    return "".join(top) + "".join(reversed(bottom)) + "Z"


def _buckets(one: MemoryPass, width: float) -> list[int]:
    """Return a pass's highest total per pixel (its start included), at least one value."""
    steps = one.steps
    if not steps:
        return [0]
    start = steps[0][1] - steps[0][0]
    count = max(1, min(len(steps), int(width)))
    out = []
    for b in range(count):
        chunk = steps[b * len(steps) // count : (b + 1) * len(steps) // count]
        out.append(max((allocated for _, allocated, _ in chunk), default=0))
    out[0] = max(out[0], start)
    return out


def _peak_mark(
    stage: StageMemory,
    passes: Sequence[MemoryPass],
    at: tuple[int, int],
    total: int,
    width: float,
    y: YScale,
    top: int,
) -> list[str]:
    index, step = at
    count = len(_buckets(passes[index], width))
    bucket = max(step, 0) * count // max(len(passes[index].steps), 1)
    x = LEFT + index * width + (bucket + 0.5) * width / count
    assert stage.run is not None
    label = f"peak {_gib(total)} GiB: {stage.run.peak.moment}"
    return [
        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + 36}" y2="{y(total)}" stroke="black" '
        'stroke-dasharray="3,2"/>',
        f'<circle cx="{x:.1f}" cy="{y(total)}" r="3" fill="black" '
        f'data-pass="{escape(passes[index].label)}"/>',
        f'<text class="peak" x="{LEFT}" y="{top + 32}">{escape(label)}</text>',
    ]


def _pass_labels(passes: Sequence[MemoryPass], width: float, bottom: int) -> list[str]:
    every = max(1, math.ceil(len(passes) / 24))
    out = []
    for index in range(0, len(passes), every):
        x = LEFT + (index + 0.5) * width
        out.append(f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{_short(passes[index])}</text>')
    out.append(
        f'<text x="{LEFT + (WIDTH - LEFT - RIGHT) / 2:.1f}" y="{bottom + 32}" text-anchor="middle">'
        "passes in megatron's schedule order (F: forward, B: backward of micro-batch n; "
        "c: chunk)</text>"
    )
    return out


def _short(one: MemoryPass) -> str:
    chunk, mb = one.owner
    if chunk < 0:
        return escape(one.label)
    kind = "F" if one.label.startswith("forward") else "B"
    return f"{kind}{mb}" + (f"c{chunk}" if "(chunk" in one.label else "")
