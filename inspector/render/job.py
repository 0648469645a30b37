"""The job line every report starts with: the job as understood, and notes on surprising defaults.

One line says the model, precision, sequence, layout and batch the numbers below are for; a
`Note:` follows when a Megatron-LM default that usually surprises applies (fp32 because neither
--bf16 nor --fp16 is given; one micro-batch per iteration because --global-batch-size is absent),
naming the flag that changes it. Machine formats (csv, json) keep their own layout.
"""

from __future__ import annotations

from inspector.job.fp8_attention import fp8_attention, fp8_attention_note
from inspector.job.hardware import BOARD_GPUS
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
        if fp8_attention(model.fp8_format, model.fp8_recipe, model.fp8_dot_product_attention):
            precision += ", attention in fp8"
    if model.fp4_format is not None:
        precision += f" with fp4 {model.fp4_format} ({model.fp4_recipe} scaling)"
    if model.first_last_layers_bf16:
        precision += (f", first {model.num_layers_at_start_in_bf16} and last "
                      f"{model.num_layers_at_end_in_bf16} layers in bf16")  # fmt: skip
    return f"{label or DEFAULT_MODEL} ({sizes}), {precision}, sequence {model.seq_length}"


def _packed(document_length: int | None) -> str:
    """Say that sequences are packed (--sft), and the documents' length."""
    return "" if document_length is None else f" packed (--sft) in documents of {document_length}"


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
    unused = fp8_attention_note(model.fp8_format, model.fp8_recipe, model.fp8_dot_product_attention)
    if unused is not None:
        return ["Note: " + unused]
    if model.fp4_format is not None:
        return [
            "Note: --fp4-format runs on Blackwell GPUs only; its buffers are counted as "
            "Transformer Engine allocates them (NVFP4BlockScaling), but plan's kernel tables "
            "hold no NVFP4 GEMMs: plan prices Transformer Engine's GEMMs at bf16 speed."
        ]
    if model.fp8_format is not None and model.fp8_recipe == "mxfp8":
        attention = fp8_attention(model.fp8_format, "mxfp8", model.fp8_dot_product_attention)
        return [
            "Note: --fp8-recipe mxfp8 runs on Blackwell GPUs only (Megatron-LM: 'mxfp8' for "
            "Blackwell architecture only); its buffers are counted as Transformer Engine "
            "allocates them"
            + (", and its fp8 attention as Transformer Engine 2.15+ runs it (cuDNN 9.21+ "
               "on sm100+; no attention backend on Hopper)." if attention else ".")
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
    line = f"Job: {_model(label, job.model)}{_packed(job.training.packed_document_length)}; "
    line += _layout(job.layout)
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
        f"{request.memory / 2**30:g} GiB each{_placement(request.gpus_per_node)})"
    )
    line = (
        f"Job: {_model(label, request.model)}{_packed(request.training.packed_document_length)}; "
        f"{searched}"
        + (f" (fixed: {fixed})" if fixed else "")
        + f"; global batch {request.global_batch_size}."
    )
    return [line, *_precision_note(request.model, "parameters and activations are")]


def _placement(domain: int) -> str:
    """Return where the ranks run, where the NVLink domain is not an 8-GPU board's: megatron's
    RankGenerator numbers them in the order tp-cp-ep-dp-pp (Megatron-LM's and Megatron-Bridge's
    default; parallel_state.py `initialize_model_parallel(order=...)`) and a launcher fills each
    NVLink domain with consecutive ranks."""
    if domain == BOARD_GPUS:
        return ""
    return (f"; ranks in megatron's order tp-cp-ep-dp-pp, {domain} consecutive ranks per NVLink "
            "domain (--gpus-per-node)")


def with_job(lines: list[str], report: str) -> str:
    """Return the report with the job line and its notes above it, and a blank line between."""
    return "\n".join(lines) + "\n\n" + report
