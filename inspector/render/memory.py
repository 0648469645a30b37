"""The memory report: records in, text, table or json out (the walkthrough: walkthrough.py)."""

from __future__ import annotations

import json
from typing import Any

from tabulate import tabulate

from inspector.job.flex import runs_hybridep
from inspector.job.hardware import GIB
from inspector.job.optimizer_precision import REMAINDER
from inspector.job.rollout import HELD
from inspector.memory.measure import MemoryReport, StageMemory
from inspector.render.allocated import allocated_json, allocated_line, graph_pool_line
from inspector.render.by_rank import MUON_SAID, by_rank_json, by_rank_line
from inspector.render.held_elsewhere import held_lines, host_json, outside_line
from inspector.render.job import counted
from inspector.report.formats import MemoryFormat

BAR_WIDTH = 48
# One shade per component, darkest for what lasts longest; the legend prints under the chart.
SHADES = (
    ("weights", "█"),
    ("gradients", "▓"),
    ("optimizer", "▒"),
    ("buffers", "▪"),
    ("activations", "░"),
)
MODE_TITLES = {
    "tp": "tensor parallel",
    "ulysses": "Ulysses all-to-all sequence parallel",
    "cp": "context parallel (ring attention)",
}


def gib(value: float) -> str:
    """Return bytes as GiB with two decimals."""
    return f"{value / GIB:,.2f}"


def _unit(report: MemoryReport) -> tuple[str, int]:
    """Return the unit the text report counts in: GiB, or MiB when every stage is below 1 GiB."""
    return ("GiB", GIB) if report.worst.total >= GIB else ("MiB", 1 << 20)


def _size(report: MemoryReport, value: float) -> str:
    """Return bytes in the report's unit, with the unit's name."""
    name, unit = _unit(report)
    return f"{value / unit:,.2f} {name}"


def _seconds(value: float) -> str:
    return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"


def flops(value: float) -> str:
    """Return FLOPs with an SI prefix and three significant digits ("6.54 PFLOP")."""
    for prefix, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}FLOP"
    return f"{value:.3g} FLOP"


def _layers(stage: StageMemory) -> str:
    """Return the stage's layers as ranges, chunk by chunk ("0-4 | 20-24")."""
    parts = [f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) if c else "-" for c in stage.layers]
    return " | ".join(parts)


def _parts(stage: StageMemory) -> tuple[int, int, int, int, int]:
    state = stage.state
    return state.weights, state.gradients, state.optimizer, stage.buffers, stage.activation_bytes


def _in_flight(stage: StageMemory) -> list[int]:
    """Return the micro-batches in flight at the peak: in all (the run), or per chunk (formulas)."""
    if stage.run is not None:
        return [stage.run.peak.micro_batches]
    return list(stage.activations.in_flight)


def _bar(stage: StageMemory, scale: int) -> str:
    """Return the stage's stacked bar: each component's cells, rounded on the running sum."""
    cells, running, drawn = [], 0, 0
    for (_, shade), value in zip(SHADES, _parts(stage), strict=True):
        running += value
        end = round(BAR_WIDTH * running / scale) if scale else 0
        cells.append(shade * (end - drawn))
        drawn = end
    return "".join(cells).ljust(BAR_WIDTH)


def _verdict(report: MemoryReport, stage: StageMemory) -> str:
    spare = report.spare(stage)
    if spare is None:
        return ""
    if spare >= 0:
        return f"fits, {_size(report, spare)} spare"
    return f"DOES NOT FIT, {_size(report, -spare)} over"


def _summary(report: MemoryReport) -> list[str]:
    """Return the lines under the chart: the worst stage, the verdict, FLOPs and time."""
    worst = report.worst
    lines = [
        f"Worst: stage {worst.stage} (rank {worst.rank}) needs {_size(report, worst.total)} per GPU."
    ]
    memory = report.hardware.memory
    if memory is not None:
        over = [s.stage for s in report.stages if not report.fits(s)]
        if over:
            listed = ", ".join(map(str, over))
            lines.append(f"Does not fit in --gpu-memory {gib(memory)} GiB: stage(s) {listed}.")
        else:
            lines.append(f"Every stage fits in --gpu-memory {gib(memory)} GiB.")
    lines.append(
        f"FLOPs per iteration: {flops(report.iteration_flops)} "
        f"({counted(report.schedule.global_batch_size, 'sequence', 'sequences')} of "
        f"{report.model.seq_length} tokens, "
        "Megatron-LM's throughput formula)."
    )
    seconds = report.seconds
    if seconds is not None:
        mfu = report.hardware.mfu
        lines.append(
            f"Time per iteration: {_seconds(seconds)} on "
            f"{counted(report.layout.world_size, 'GPU', 'GPUs')} at "
            f"{report.hardware.tflops:g} TFLOP/s and MFU {mfu:g}"
            + (": every FLOP at the GPU's peak, a bound no job reaches (--mfu sets the fraction "
               "reached; `plan` prices each kernel from measured tables)." if mfu == 1 else ".")
        )
    return lines


def _precision_aware(report: MemoryReport) -> str:
    """Return what --use-precision-aware-optimizer keeps, in words ("" without it)."""
    precision, model = report.training.optimizer_precision, report.model
    if not precision.precision_aware:
        return ""
    each = precision.for_model(model.bf16, model.fp8_format, model.fp8_recipe)
    if not each.te_master:
        master = "megatron's fp32 master weights"
    elif model.bf16 and each.master(2) == REMAINDER:
        master = "fp32 master weights kept as 16-bit remainders of the bf16 weights"
    else:
        master = f"{precision.main_params_dtype} master weights"
    fp32_grads = report.training.fp32_grads
    grads = "bf16" if model.bf16 and fp32_grads is False else "fp32"
    if model.fp16 and not fp32_grads:
        grads = "fp16"
    return (
        f" with the precision-aware optimizer (Transformer Engine's FusedAdam: exp_avg "
        f"{precision.exp_avg_dtype}, exp_avg_sq {precision.exp_avg_sq_dtype}, {master}, "
        f"{grads} main gradients)"
    )


def _context(report: MemoryReport) -> list[str]:
    """Return the lines that say what was assumed: precision, batch, schedule."""
    t, b, layout, model = report.training, report.schedule, report.layout, report.model
    optimizer = "distributed optimizer" if t.use_distributed_optimizer else "Adam"
    optimizer = MUON_SAID.get((t.optimizer, t.layer_wise_param_layout), optimizer)
    if t.megatron_fsdp:
        optimizer = f"Megatron-FSDP {t.sharding_strategy}"
    elif t.torch_fsdp2:
        optimizer = "PyTorch FSDP2, Adam"
    optimizer += _precision_aware(report)
    recompute: str = t.recompute
    if recompute == "selective" and t.recompute_modules != ("core_attn",):
        recompute += f" ({', '.join(t.recompute_modules)})"  # megatron's default goes unsaid
    params = f"{model.dtype_name} parameters"
    if model.fp8_param_gather:  # Transformer Engine's linear weights (report: fp8 parameters)
        params += " (Transformer Engine's linear weights in fp8)"
    lines = [f"Precision: {params}, {optimizer}; recompute {recompute}, flash attention "
             f"{'on' if t.flash_attention else 'off'}."]  # the batch: the job line (render/job.py)
    gathered = max(s.fsdp_in_flight for s in report.stages)
    if t.megatron_fsdp or t.torch_fsdp2:
        from inspector.memory.fsdp_buffers import buckets_each_backward

        # with megatron's run, the buckets each backward makes are in it (engine/fsdp_grads.py)
        in_run = report.not_run is None and t.megatron_fsdp
        grads = ("; the unsharded gradient buckets are made in the backward, as its gradients "
                 "arrive" if in_run and buckets_each_backward(t.sharding_strategy) else
                 " and the unsharded gradient buckets megatron's reduce-scatter queue holds at once")
        lines.append(f"FSDP: buffers include {_size(report, gathered)} in flight: gathered "
                     f"parameters (two neighbouring layers){grads}.")  # fmt: skip
    if t.rollout is not None:
        lines.append(f"GRPO: buffers include {_size(report, max(s.rollout for s in report.stages))} {HELD}")
    lines.append(_source(report))
    if report.not_run is None and model.num_experts is not None:
        lines.append(_routing(report))
    # Without --global-batch-size the job line's note says so, and what shows the steady state.
    given = t.global_batch_size is not None
    if given and layout.pp > 1 and b.num_microbatches < layout.pp:
        steady = layout.pp * b.micro_batch_size * layout.dp
        lines.append(
            f"Note: {b.num_microbatches} micro-batch per iteration is fewer than --pp {layout.pp}, "
            f"so stages hold fewer in flight than in steady state; --global-batch-size {steady} "
            "or more shows the steady-state peak."
        )
    return lines


def _source(report: MemoryReport) -> str:
    """Return the line that says where the activations come from."""
    if report.not_run is None:
        return (
            "Activations and buffers: megatron's forward, backward and optimizer step run on "
            "meta tensors, replayed in the pipeline schedule (peak above weights, grads, "
            "optimizer, buffers)."
        )
    return (
        f"Activations: closed forms (Korthikanti et al. 2022), not megatron running: "
        f"{report.not_run}."
    )


def _routing(report: MemoryReport) -> str:
    """Return the note that says which routing the engine ran an MoE job with."""
    t, model = report.training, report.model
    capacity = t.moe_expert_capacity_factor
    dropping = "dropless" if capacity is None else f"capacity factor {capacity:g}" + (
        ", padded to capacity" if t.moe_pad_expert_input_to_capacity else ""
    )
    dispatcher = f"{t.moe_token_dispatcher_type} dispatcher"
    if t.moe_token_dispatcher_type == "flex":
        dispatcher += " (HybridEP)" if runs_hybridep(t) else " (DeepEP)"
    return (
        f"Note: MoE routing is balanced: every expert gets tokens x {model.moe_router_topk} / "
        f"{model.num_experts} of each rank's tokens (what Megatron-LM's "
        f"--moe-router-force-load-balancing gives on average); {dispatcher}, {dropping}."
    )


def _moments(report: MemoryReport) -> list[str]:
    """Return one line per stage naming the moment of its peak (runs only), and one for what
    it holds outside PyTorch's allocator or in CUDA graphs' pools, where it holds any."""
    lines = []
    for s in report.stages:
        if s.run is None:
            continue
        lines.append(
            f"Stage {s.stage}: static {_size(report, s.static)} (state and buffers), peak "
            f"{_size(report, s.total)} at the {s.run.peak.moment}."
        )
        lines.append(allocated_line(report, s, lambda v: _size(report, v)))
        if s.optimizer_by_rank:
            lines.append(by_rank_line(s, lambda v: _size(report, v)))
        if s.run.outside:
            lines.append(outside_line(f"Stage {s.stage}", s.run.outside, lambda v: _size(report, v),
                                      "buffers and the total", s.total))  # fmt: skip
        lines += held_lines(f"Stage {s.stage}", s.run, lambda v: _size(report, v))  # host, stash
        if s.run.graph_pool:  # engine/cuda_graphs.py allocated_peak
            lines.append(graph_pool_line(s, lambda v: _size(report, v)))
    return lines


NOT_COUNTED = "not counted"  # the buffers where the engine did not run (json: null)


def _stage_rows(report: MemoryReport, exact: bool) -> list[list[str]]:
    unit = _unit(report)[1]
    fmt = (lambda v: f"{v:,}") if exact else (lambda v: f"{v / unit:,.2f}")
    rows = []
    for s in report.stages:
        cells = [fmt(v) for v in _parts(s)]
        if not s.buffers_counted:
            cells[3] = NOT_COUNTED
        rows.append(
            [
                str(s.stage),
                str(s.rank),
                _layers(s),
                f"{s.parameters:,}",
                *cells,
                ",".join(map(str, _in_flight(s))),
                fmt(s.total),
                flops(report.flops_per_rank(s)),
            ]
        )
    return rows


def _headers(unit: str) -> list[str]:
    return [
        "stage", "rank", "layers", "params", f"weights {unit}", f"grads {unit}",
        f"optimizer {unit}", f"buffers {unit}", f"activations {unit}", "in flight", f"total {unit}",
        "FLOPs per rank",
    ]  # fmt: skip


def render_text(report: MemoryReport) -> str:
    """Return the per-stage table, a bar chart per stage and the summary."""
    name = _unit(report)[0]
    table = tabulate(
        _stage_rows(report, exact=False), headers=_headers(name), disable_numparse=True
    )
    scale = max([s.total for s in report.stages] + [report.hardware.memory or 0])
    chart = []
    for s in report.stages:
        mark = "  <- worst" if s is report.worst and len(report.stages) > 1 else ""
        verdict = _verdict(report, s)
        tail = f"{_size(report, s.total):>13}" + (f"  {verdict}" if verdict else "") + mark
        chart.append(f"stage {s.stage:<3} {_bar(s, scale)}{tail}")
    legend = "          " + "  ".join(f"{shade} {part}" for part, shade in SHADES)
    lines = [
        "Memory per GPU: the most loaded rank of each pipeline stage.",
        *_context(report),
        "",
        table,
        "",
        *chart,
        legend,
        "",
        *_moments(report),
        *_summary(report),
    ]
    return "\n".join(lines) + "\n"


def render_table(report: MemoryReport) -> str:
    """Return the per-stage table with exact byte counts."""
    rows, headers = _stage_rows(report, exact=True), _headers("B")
    if report.hardware.memory is not None:  # the verdict of the text report's chart, exact
        headers += ["fits", "spare B"]
        for row, stage in zip(rows, report.stages, strict=True):
            spare = report.spare(stage) or 0
            row += ["yes" if spare >= 0 else "NO", f"{spare:,}"]
    return tabulate(rows, headers=headers, disable_numparse=True) + "\n"


def _number(value: float) -> int | float:
    """Return an exact byte count as an int when it is whole."""
    return int(value) if float(value).is_integer() else value


def _activations_json(s: StageMemory) -> dict[str, Any]:
    run, a = s.run, s.activations
    if run is not None:
        return {
            "source": "engine",
            "total": s.activation_bytes,
            "held": run.peak.held,
            "in_flight": [run.peak.micro_batches],
            "moment": run.peak.moment,
        }
    return {
        "source": "formulas",
        "layers": _number(a.layers),
        "embedding": _number(a.embedding),
        "output": _number(a.output),
        "recompute_buffer": _number(a.recompute_buffer),
        "loss_logits": _number(a.loss_logits),
        "total": s.activation_bytes,
        "in_flight": list(a.in_flight),
    }


def _buffers_json(s: StageMemory) -> dict[str, Any] | None:
    if s.run is None:
        return {"fsdp_in_flight": s.fsdp_in_flight, "total": s.buffers} if s.fsdp_in_flight else None
    fsdp = {"fsdp_in_flight": s.fsdp_in_flight} if s.fsdp_in_flight else {}
    outside = {"outside_allocator": [[what, size] for what, size in s.run.outside]} \
        if s.run.outside else {}  # fmt: skip
    return {
        "persistent": [[where, size] for where, size in s.run.persistent],
        "workspaces": s.run.workspaces,
        **outside,
        **fsdp, **({"rollout": s.rollout} if s.rollout else {}),
        "total": s.buffers,
    }


def _stage_json(report: MemoryReport, s: StageMemory) -> dict[str, Any]:
    return {
        "stage": s.stage,
        "rank": s.rank,
        "layers": [list(chunk) for chunk in s.layers],
        "parameters": s.parameters,
        "weights": s.state.weights,
        "gradients": s.state.gradients,
        "optimizer": s.state.optimizer,
        "buffers": _buffers_json(s),
        **host_json(s.run.host if s.run is not None else (0, 0)),
        "static": s.static,
        "activations": _activations_json(s),
        "total": s.total,
        "fits": report.fits(s),
        "flops": s.flops,
        "flops_per_rank": report.flops_per_rank(s),
        **by_rank_json(s),
        **allocated_json(report, s),
    }


def _fsdp_json(t: Any) -> dict[str, Any]:
    if t.megatron_fsdp:
        return {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": t.sharding_strategy}
    return {"use_torch_fsdp2": True} if t.torch_fsdp2 else {}


def _precision_json(t: Any) -> dict[str, Any]:
    """Return --use-precision-aware-optimizer and its dtypes, as Megatron-LM names them."""
    precision = t.optimizer_precision
    if not precision.precision_aware:
        return {}
    names = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    return {"use_precision_aware_optimizer": True,
            **{name: getattr(precision, name) for name in names}}  # fmt: skip


def report_json(report: MemoryReport) -> dict[str, Any]:
    """Return every number of the report, bytes and FLOPs, as a json-ready dict."""
    t, b, hw = report.training, report.schedule, report.hardware
    return {
        "config": report.model.to_args(),
        "training": {
            "micro_batch_size": b.micro_batch_size,
            "global_batch_size": b.global_batch_size,
            "num_microbatches": b.num_microbatches,
            "recompute_granularity": t.recompute,
            "use_flash_attn": t.flash_attention,
            "use_distributed_optimizer": t.use_distributed_optimizer,
            "accumulate_allreduce_grads_in_fp32": t.fp32_grads,
            **_fsdp_json(t),
            **_precision_json(t),
        },
        "hardware": {"gpu_memory": hw.memory, "gpu_tflops": hw.tflops, "mfu": hw.mfu},
        "world_size": report.layout.world_size,
        "stages": [_stage_json(report, s) for s in report.stages],
        "worst_stage": report.worst.stage,
        "iteration_flops": report.iteration_flops,
        "seconds_per_iteration": report.seconds,
    }


def render_json(report: MemoryReport) -> str:
    """Return the report as indented json."""
    return json.dumps(report_json(report), indent=1, allow_nan=False) + "\n"


def render_memory(report: MemoryReport, fmt: MemoryFormat) -> str:
    """Return the memory report in the asked format."""
    if fmt is MemoryFormat.json:
        return render_json(report)
    if fmt is MemoryFormat.table:
        return render_table(report)
    return render_text(report)
