"""The job line every report starts with: the job as understood, and notes on surprising defaults.

One line says the model, precision, sequence, layout and batch the numbers below are for; a
`Note:` follows when a Megatron-LM default that usually surprises applies (fp32 because neither
--bf16 nor --fp16 is given; one micro-batch per iteration because --global-batch-size is absent),
naming the flag that changes it. Machine formats (csv, json) keep their own layout.
"""

from __future__ import annotations

from inspector.job.job import Job, Schedule
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.plan.request import Request

DEFAULT_MODEL = "gpt2-small"
PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _model(label: str | None, model: ModelConfig) -> str:
    sizes = f"{model.num_layers} layers, hidden {model.hidden_size}"
    if model.num_experts:
        sizes += f", {model.num_experts} experts"
    if model.hybrid:
        sizes += f", {_hybrid(model)}"
    precision = PRECISION[model.dtype_name]
    if model.fp8_format is not None:
        precision += f" with fp8 {model.fp8_format} ({model.fp8_recipe} scaling)"
        if model.fp8_param_gather:
            precision += " and fp8 parameters"
    return f"{label or DEFAULT_MODEL} ({sizes}), {precision}, sequence {model.seq_length}"


def _hybrid(model: ModelConfig) -> str:
    """Say what a hybrid stack holds: its pattern's layer counts, or the ratios megatron spreads."""
    pattern = model.hybrid_override_pattern
    if pattern is not None:
        names = (("M", "Mamba"), ("*", "attention"), ("D", "DSA"), ("-", "MLP"), ("E", "MoE"))
        return "hybrid: " + ", ".join(f"{pattern.count(s)} {name}" for s, name in names
                                      if s in pattern)  # fmt: skip
    attention, mlp = model.hybrid_attention_ratio or 0.0, model.hybrid_mlp_ratio or 0.0
    if attention or mlp:
        return f"hybrid: attention ratio {attention:g}, MLP ratio {mlp:g}"
    return "hybrid: all Mamba"


def _layout(layout: Layout) -> str:
    sizes = [("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp), ("cp", layout.cp)]
    words = " x ".join(f"{name} {size}" for name, size in sizes if size > 1 or name != "cp")
    words += f" = {counted(layout.world_size, 'GPU', 'GPUs')}"
    if layout.ep > 1:
        words += f", ep {layout.ep}"
    if layout.vpp:
        words += f", {layout.vpp} virtual stages per pipeline rank"
    if layout.sequence_parallel:
        words += ", sequence parallel"
    if layout.use_tp_pp_dp_mapping:
        words += ", ranks in tp-pp-dp order"
    return words


def counted(number: int, one: str, many: str) -> str:
    """Return `number` with the noun in its singular or plural ("1 GPU", "8 GPUs")."""
    return f"{number} {one if number == 1 else many}"


def _batch(schedule: Schedule, dp: int) -> str:
    return (
        f"global batch {schedule.global_batch_size} = micro-batch {schedule.micro_batch_size} x "
        f"{counted(schedule.num_microbatches, 'micro-batch', 'micro-batches')} x dp {dp}"
    )


def _precision_note(model: ModelConfig, what: str) -> list[str]:
    if model.fp8_format is not None and model.fp8_recipe == "mxfp8":
        return [
            "Note: --fp8-recipe mxfp8 runs on Blackwell GPUs only (Megatron-LM: 'mxfp8' for "
            "Blackwell architecture only); its buffers are counted as Transformer Engine 2.11 "
            "allocates them."
        ]
    if model.dtype_name != "float32":
        return []
    return [
        f"Note: neither --bf16 nor --fp16 is given, so {what} fp32 (Megatron-LM's default); "
        "pass --bf16 for mixed-precision training."
    ]


def _batch_note(job: Job, schedule: Schedule) -> list[str]:
    if job.training.global_batch_size is not None:
        return []
    layout = job.layout
    note = (
        "Note: no --global-batch-size, so an iteration is one micro-batch per data-parallel rank "
        "(Megatron-LM's default, --micro-batch-size x --dp)"
    )
    if layout.pp > 1:
        steady = layout.pp * schedule.micro_batch_size * layout.dp
        note += f"; with --pp {layout.pp}, --global-batch-size {steady} or more shows the steady state"
    return [note + "."]


def job_lines(job: Job, label: str | None, schedule: Schedule | None = None) -> list[str]:
    """Return the job line (with the batch when the report has one) and its notes."""
    line = f"Job: {_model(label, job.model)}; {_layout(job.layout)}"
    if schedule is None:
        return [line + ".", *_precision_note(job.model, "parameters are")]
    line += f"; {_batch(schedule, job.layout.dp)}."
    notes = _precision_note(job.model, "parameters and activations are")
    return [line, *notes, *_batch_note(job, schedule)]


def plan_lines(request: Request, label: str | None) -> list[str]:
    """Return the job line of a layout search: what is given, and what is searched."""
    gpu = request.gpu
    fixed = ", ".join(name if value is True else f"{name} {value}" for name, value in request.fixed.items())
    searched = (
        f"layout searched on {counted(request.gpus, 'GPU', 'GPUs')} (--gpu {gpu.name}, "
        f"{request.memory / 2**30:g} GiB each)"
    )
    line = (
        f"Job: {_model(label, request.model)}; {searched}"
        + (f" (fixed: {fixed})" if fixed else "")
        + f"; global batch {request.global_batch_size}."
    )
    return [line, *_precision_note(request.model, "parameters and activations are")]


def with_job(lines: list[str], report: str) -> str:
    """Return the report with the job line and its notes above it, and a blank line between."""
    return "\n".join(lines) + "\n\n" + report
