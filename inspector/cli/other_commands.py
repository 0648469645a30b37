"""The commands that inspect no single job's ranks: diff (two params tables), models (the
presets) and plan (the layout search). Registered after commands.py's, so `--help` lists them last.

A command's signature is its typer option list, so these functions run past the usual ~40 lines;
their bodies stay a few calls (resolve the job, call the core, render).
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from inspector.cli.app import (
    app,
    emit,
    format_option,
    gpu_memory_option,
    gpu_option,
    gpu_tflops_option,
    kernels_gpu,
    kernels_option,
    model_options,
    nvlink_domain_option,
    output_option,
    read_kernels,
)
from inspector.cli.help import PanelCommand
from inspector.job.hardware import DEFAULT_GPU
from inspector.report.formats import DiffFormat, PlanFormat


@app.command(cls=PanelCommand)
def diff(
    old: str = typer.Argument(
        ..., help="The old params table (semicolon or json), or - for stdin.", metavar="OLD"
    ),
    new: str = typer.Argument(
        ..., help="The new params table (semicolon or json), or - for stdin.", metavar="NEW"
    ),
    fmt: Any = format_option(DiffFormat.text, "text, markdown (a PR comment) or json."),
) -> None:
    """Compare two params tables: exit 0 when they are equal, 1 when they differ."""
    from inspector.render.diff import render_diff
    from inspector.report.diff import diff_files

    result = diff_files(old, new)
    sys.stdout.write(render_diff(result, fmt, old, new))
    raise typer.Exit(0 if result.equal else 1)


@app.command(cls=PanelCommand)
def models() -> None:
    """List the model presets with their sizes and sources."""
    from inspector.render.models import render_presets

    sys.stdout.write(render_presets())


@app.command(cls=PanelCommand)
@model_options("model", "layout", "training", searched=True)
def plan(
    args: dict[str, Any],
    use_cache: bool,
    label: str | None,
    gpus: int = typer.Option(..., "--gpus", help="GPUs in the cluster."),
    gpu_memory: float | None = gpu_memory_option(" (default: the --gpu type's)"),
    gpu: str | None = gpu_option(None, f"; default: --kernels' GPU, else {DEFAULT_GPU}"),
    gpus_per_node: int | None = nvlink_domain_option(),
    gpu_tflops: float | None = gpu_tflops_option(", 16-bit (default: --gpu)"),
    intra_bandwidth: float | None = typer.Option(
        None, "--intra-node-bandwidth", help="NVLink GB/s per GPU, each way."
    ),
    inter_bandwidth: float | None = typer.Option(
        None, "--inter-node-bandwidth", help="InfiniBand GB/s per GPU, each way."
    ),
    efficiency: float | None = typer.Option(
        None, "--efficiency",
        help="Use this fraction of peak, not kernel tables.",
    ),
    kernels: str | None = kernels_option(),
    top: int = typer.Option(5, "--top", help="How many plans to list."),
    explain: bool = typer.Option(False, "--explain", help="Say why plan 1 wins."),
    svg: str | None = typer.Option(None, "--svg", help="Draw plan 1's schedule.", metavar="FILE"),
    fmt: Any = format_option(PlanFormat.text, "text (tables, flags) or json."),
    output: str | None = output_option(),
) -> None:
    """Rank a model's parallel layouts on N GPUs by step time, with their flags."""
    from inspector.plan import search as core
    from inspector.plan.request import PlanFlags, make_request
    from inspector.render import plan as render

    table = read_kernels(kernels)
    flags = PlanFlags(gpus, kernels_gpu(gpu, table), gpu_memory, gpus_per_node, gpu_tflops,
                      intra_bandwidth, inter_bandwidth, efficiency, top, table)
    request = make_request(args, flags)
    from inspector.cli.app import check_outputs
    from inspector.cli.streams import release_notes

    check_outputs(output, {"--svg": svg} if svg is not None else {})  # before the search
    release_notes()  # the job is accepted: the merge's notes, held until now, before the search
    progress = core.progress_line()
    result = core.search(request, progress)
    if progress is not None:  # the search's speed, on the terminal only (stdout stays identical)
        rate = result.evaluated / max(result.seconds, 1e-9)
        sys.stderr.write(f"\rplan: {result.evaluated} candidates in {result.seconds:.2f} s "
                         f"({rate:.0f} per second)\n")
    text = render.render_plan(result, request.memory, fmt.value if hasattr(fmt, "value") else fmt, explain)
    if fmt == PlanFormat.text:
        from inspector.render.job import plan_lines, with_job

        text = with_job(plan_lines(request, label), text)
    files = [("--svg", svg, render.render_svg(result.plans[0]))] if svg and result.plans else []
    if svg and not result.plans:  # said, so that an old file of that name is not taken for this plan
        sys.stderr.write(f"Note: --svg {svg} is not written: no layout fits, so there is no plan 1 "
                         "to draw\n")  # fmt: skip
    emit(text, output, files)
