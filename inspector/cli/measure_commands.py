"""The commands that meet a real GPU: calibrate (kernel micro-benchmarks on this machine) and
check (a Megatron-LM training log beside the prediction). Registered after the others.

A command's signature is its typer option list, so these functions run past the usual ~40 lines;
their bodies stay a few calls (read, call the core, render).
"""

from __future__ import annotations

from typing import Any

import typer

from inspector.cli.app import (
    Choice,
    Progress,
    app,
    emit,
    expandable_segments,
    format_option,
    gpu_option,
    job_on_gpu,
    kernels_gpu,
    kernels_option,
    model_options,
    output_option,
    read_kernels,
    resolve_job,
)
from inspector.cli.help import PanelCommand
from inspector.errors import ConfigError
from inspector.job.hardware import DEFAULT_GPU
from inspector.report.formats import CheckFormat

LOG_LIMIT = 256 * 2**20  # bytes of a training log read at most (a FIFO or growing file stops here)
DEVICES = ("cuda", "cpu")

MAX_CALLS = 1000  # --warmup and --iters: calls per kernel (docs/limits.md)


@app.command(cls=PanelCommand)
def calibrate(
    output: str | None = output_option(),
    gpu: str | None = gpu_option(None, ": datasheet peaks the table is relative to (default: "
                                       "from the CUDA device's name)"),
    device: str = typer.Option(
        "cuda", "--device", help="cuda, or cpu to test the same code on the CPU.",
        click_type=Choice(DEVICES),
    ),
    shrink: int = typer.Option(1, "--shrink", help="Divide every shape by N (quick runs)."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed calls before timing each kernel."),
    iters: int = typer.Option(10, "--iters", help="Timed calls per kernel (the median is kept)."),
    like: str | None = typer.Option(
        None, "--like", help="Measure the shapes of this table (default: the built-in H200's).",
        metavar="FILE",
    ),
) -> None:
    """Measure kernel throughput on this machine's GPU: a table for --kernels."""
    from inspector.job.hardware import get_gpu
    from inspector.job.kernel_table import gpu_type_of, table_rows

    for flag, value, least in (("--shrink", shrink, 1), ("--warmup", warmup, 0), ("--iters", iters, 1)):
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
        if flag != "--shrink" and value > MAX_CALLS:  # a billion calls per kernel would never end
            raise ConfigError(f"{flag} {value} is more than the {MAX_CALLS:,} calls per kernel "
                              "calibrate makes (docs/limits.md)")  # fmt: skip
    template = table_rows(read_kernels(like) if like else "h200")
    if output is not None:
        from inspector.output import check_target

        check_target(output)  # before measuring: a bad -o costs nothing
    from inspector.measure import kernels as core

    if device == "cuda" and not core.cuda_available():
        raise ConfigError("calibrate measures this machine's CUDA GPU and torch sees none "
                          "(torch.cuda.is_available() is False); --device cpu runs the same "
                          "measurements on the CPU, for testing")  # fmt: skip
    if gpu is None:
        gpu = gpu_type_of(core.cuda_name()) if device == "cuda" else None
        if gpu is None:
            raise ConfigError("calibrate needs --gpu TYPE: the GPU type whose datasheet peaks "
                              "the measured throughput is relative to")  # fmt: skip
    get_gpu(gpu)  # a known type, or the Error naming the choices
    with Progress(delay=0, what="calibrate: {done} of {total} kernel shapes measured") as progress:
        table = core.calibrate(template, device, gpu, shrink=shrink, warmup=warmup, iters=iters,
                               progress=progress)  # fmt: skip
    from inspector.render.check import render_table

    emit(render_table(table), output)


@app.command(cls=PanelCommand)
@model_options("model", "layout", "training")
def check(
    args: dict[str, Any],
    use_cache: bool,
    label: str | None,
    log: str = typer.Argument(..., help="Megatron-LM's training log (- for stdin).", metavar="LOG"),
    gpu: str | None = gpu_option(None, f", default the --kernels table's, else {DEFAULT_GPU}"),
    kernels: str | None = kernels_option(),
    warmup: int = typer.Option(
        3, "--skip-iterations", help="Leave out iterations 1..N of the times (warm-up)."
    ),
    fmt: Any = format_option(CheckFormat.text, "text or json."),
    output: str | None = output_option(),
) -> None:
    """Put a Megatron-LM training log beside the prediction for the same job."""
    from inspector.inputs.training_log import parse_training_log
    from inspector.output import read_head
    from inspector.plan import check as core
    from inspector.plan.request import PlanFlags
    from inspector.render import check as render

    if warmup < 0:
        raise ConfigError(f"--skip-iterations must be at least 0, got {warmup}")
    table = read_kernels(kernels)
    named = gpu is not None or table is not None  # the GPU the log ran on, where it is known
    gpu = kernels_gpu(gpu, table)
    text, cut = read_head(log, LOG_LIMIT)
    parsed = parse_training_log(text, log, cut)  # a log without either line costs nothing
    job = job_on_gpu(resolve_job(args), gpu if named else None)  # job/device.py
    schedule = job.schedule()  # --micro-batch-size is required, and the batches must divide
    memory: tuple[Any, ...] = ()
    if parsed.memory:
        from inspector.memory.measure import make_hardware, measure
        from inspector.world.build import build, select_view

        with Progress() as progress:
            built = build(job, select_view(job), expert_ranks=(0,), progress=progress)
        report = measure(built, make_hardware(None, None, None), expandable_segments())
        memory = core.compare_memory(parsed, report)
    predicted, note = None, ""
    if parsed.times_after(warmup):
        batch = {"global_batch_size": args.get("global_batch_size") or schedule.global_batch_size}
        flags = PlanFlags(job.layout.world_size, gpu, kernels=table)
        predicted, note = core.predicted_seconds(job, {**args, **batch}, flags)
    timed, used = core.compare_time(parsed, predicted, warmup)
    result = core.CheckResult(memory, timed, used, warmup, parsed, note)
    where = gpu if table is None else f"{gpu} (--kernels {kernels})"
    if fmt == CheckFormat.json:
        emit(render.render_check_json(result, where), output)
        return
    from inspector.render.job import job_lines, with_job

    emit(with_job(job_lines(job, label, schedule), render.render_check(result, where, log)), output)
