"""The commands that inspect one job's ranks (tree, topology, params, memory, workload): each
parses its flags, calls the core, and prints what a renderer returns (other_commands.py: the rest).

A command's signature is its typer option list, so these functions run past the usual ~40 lines;
their bodies stay a few calls (resolve the job, call the core, render).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from inspector.cli import cache
from inspector.cli.app import (
    OUTPUT_HELP,
    SOURCE_HELP,
    Choice,
    Progress,
    app,
    check_outputs,
    emit,
    expandable_segments,
    format_option,
    gpu_memory_option,
    gpu_option,
    gpu_tflops_option,
    job_on_gpu,
    kernels_gpu,
    kernels_option,
    mfu_option,
    model_options,
    output_option,
    rank_option,
    read_kernels,
    resolve_job,
    stage_option,
)
from inspector.cli.help import PanelCommand
from inspector.errors import ConfigError
from inspector.report.formats import (
    MemoryFormat,
    ParamsFormat,
    Partitioning,
    TopologyFormat,
    WorkloadFormat,
)


@app.command(cls=PanelCommand)
@model_options()
def tree(
    args: dict[str, Any],
    use_cache: bool,
    stage: int | None = stage_option("Print just this pipeline stage."),
    rank: int | None = rank_option(
        "Print the stage global rank R holds, under a summary: layers, parameters, bytes."
    ),
) -> None:
    """Print the module hierarchy of each pipeline stage."""

    def produce() -> str:
        from dataclasses import replace

        from inspector.render.tree import render_trees
        from inspector.report.params import chunk_comments
        from inspector.world.build import build, select_view, stage_trees

        job = resolve_job(args)
        view = select_view(job, stage, rank)
        with Progress() as progress:
            built = build(job, view, expert_ranks=(view.expert_rank,), progress=progress)
        trees = stage_trees(built)
        if rank is not None:  # a rank's view always starts with what the rank holds
            trees = [replace(t, headed=True) for t in trees]
        return render_trees(trees, chunk_comments(built))

    emit(cache.cached("tree", args, {"stage": stage, "rank": rank}, use_cache, produce))


@app.command(cls=PanelCommand)
@model_options()
def topology(
    args: dict[str, Any],
    use_cache: bool,
    fmt: Any = format_option(TopologyFormat.line, "line (ProcessCoord map) or table."),
) -> None:
    """Print the rank map: each global rank's pipeline, data and model coordinates."""

    def produce() -> str:
        from inspector.job.layout import rank_map_layout
        from inspector.render.topology import render_topology_line, render_topology_table
        from inspector.report.table import check_table_size
        from inspector.world.ranks import rank_coords, rank_positions

        layout = rank_map_layout(args)  # the coordinates come from megatron (world/ranks.py)
        if fmt is TopologyFormat.table:
            check_table_size(layout)
            return render_topology_table(rank_coords(layout), layout)
        return render_topology_line(rank_positions(layout), layout)

    emit(cache.cached("topology", args, {"format": fmt}, use_cache, produce))


@app.command(cls=PanelCommand)
@model_options()
def params(
    args: dict[str, Any],
    use_cache: bool,
    label: str | None,
    stage: int | None = stage_option("Keep just this pipeline stage."),
    rank: int | None = rank_option("Write the file global rank R writes."),
    partitioning: Any = typer.Option(
        None,
        "--partitioning",
        help="Optimizer ownership: layers (default), cost or distopt (the default with "
        "--use-distributed-optimizer or FSDP: the job's own shards).",
        click_type=Choice(Partitioning),
        metavar="POLICY",
    ),
    block_size: int = typer.Option(0, "--block-size", help="Shampoo block size (0 = off)."),
    fmt: Any = format_option(ParamsFormat.csv, "csv (semicolons), json or table."),
    output: str | None = output_option(),
    check: str | None = typer.Option(
        None,
        "--check",
        help="Compare with FILE; exit 1 if stale.",
        metavar="FILE",
        rich_help_panel=OUTPUT_HELP,
    ),
) -> None:
    """Print each stage's parameters: local shape, owners, preconditioners."""
    if partitioning is None:  # megatron's own shards when the job uses its distributed optimizer
        layers_or_distopt = args.get("use_distributed_optimizer") or args.get("use_torch_fsdp2")
        partitioning = Partitioning.distopt if layers_or_distopt else Partitioning.layers

    def produce() -> str:
        from inspector.render.params import render_params
        from inspector.report.params import params_result
        from inspector.world.build import build, select_view

        job = resolve_job(args)
        with Progress() as progress:
            built = build(job, select_view(job, stage, rank), progress=progress)
        result = params_result(built, partitioning, block_size)
        text = render_params(result, fmt)
        if fmt != ParamsFormat.table:  # csv and json keep their own first lines
            return text
        from inspector.render.job import job_lines, with_job
        from inspector.render.params import rank_summary

        line, *notes = job_lines(job, label)
        held = [] if rank is None else [rank_summary(rank, result)]
        return with_job([line, *held, *notes], text)

    if check is not None and output is not None:
        raise ConfigError(
            "--check compares the table with FILE and writes nothing, -o writes it; pass one of them"
        )
    options = dict(
        stage=stage, rank=rank, partitioning=partitioning, block_size=block_size, fmt=fmt,
        label=label,
    )
    text = cache.cached("params", args, options, use_cache, produce)
    if check is not None:
        from inspector.render.diff import render_check
        from inspector.report.diff import check_table

        result = check_table(text, check)
        sys.stdout.write(render_check(result, check))
        raise typer.Exit(0 if result is None else 1)
    emit(text, output)


@app.command(cls=PanelCommand)
@model_options("model", "layout", "training")
def memory(
    args: dict[str, Any],
    use_cache: bool,
    label: str | None,
    fmt: Any = format_option(MemoryFormat.text, "text (bar chart), table, json."),
    gpu: str | None = gpu_option(None, ": GiB, peak"),
    gpu_memory: float | None = gpu_memory_option(": say which stages fit"),
    gpu_tflops: float | None = gpu_tflops_option(": print the time"),
    mfu: float | None = mfu_option(),
    ulysses_degree: int | None = typer.Option(
        None, "--ulysses-degree", help="Add a Ulysses table to the walkthrough."
    ),
    walkthrough: bool = typer.Option(
        False,
        "--attention-walkthrough",
        help="Walk one attention layer step by step.",
    ),
    timeline: str | None = typer.Option(
        None, "--timeline", help="Draw each stage's iteration as SVG.", metavar="FILE",
        rich_help_panel=OUTPUT_HELP,
    ),
    snapshot: str | None = typer.Option(
        None, "--snapshot", help="Write PyTorch's memory snapshot (pickle).", metavar="FILE",
        rich_help_panel=OUTPUT_HELP,
    ),
    kernels: str | None = kernels_option(),
    output: str | None = output_option(),
) -> None:
    """Print each stage's weights, gradients, optimizer, activations and FLOPs."""
    table = read_kernels(kernels)
    files = {flag: path for flag, path in (("--timeline", timeline), ("--snapshot", snapshot))
             if path is not None}  # an empty name is refused (check_outputs), not dropped
    if walkthrough:
        from inspector.report.memory_outputs import check_walkthrough_flags

        check_walkthrough_flags(gpu=gpu, gpu_memory=gpu_memory, gpu_tflops=gpu_tflops, mfu=mfu,
                                **{flag.strip("-"): path for flag, path in files.items()})
    check_outputs(output, files)  # before the build: a bad path costs nothing
    written: list[tuple[str, str, str | bytes]] = []  # --timeline's and --snapshot's files
    expandable = expandable_segments()  # PYTORCH_CUDA_ALLOC_CONF: in the cache key

    def produce() -> str:
        from inspector.memory import measure as core
        from inspector.render import memory as render
        from inspector.report import memory_outputs as outputs

        job = job_on_gpu(resolve_job(args), gpu)  # its workspaces, its recipes (job/device.py)
        job.schedule()  # --micro-batch-size is required, and the batches must divide
        hardware = core.make_hardware(gpu_memory, gpu_tflops, mfu, gpu, job.model.dtype_name)
        if walkthrough:
            from inspector.formulas.walkthrough import job_walkthroughs
            from inspector.render.walkthrough import render_walkthroughs

            return render_walkthroughs(job, job_walkthroughs(job, ulysses_degree), fmt)
        outputs.check_ulysses(ulysses_degree)
        outputs.check_engine_outputs(job, tuple(files))
        from inspector.world.build import build, select_view

        with Progress() as progress:
            built = build(job, select_view(job), expert_ranks=(0,), progress=progress)
        report = core.measure(built, hardware, expandable)
        if files:
            written.extend(_engine_files(report, timeline, snapshot))
        text = render.render_memory(report, fmt)
        if table is not None:  # the step as plan prices it, from the user's measured kernels
            text = _with_step_time(text, fmt, job, args, kernels_gpu(gpu, table), table)
        if fmt == MemoryFormat.json:  # every number, the job's included, in its own fields
            return text
        from inspector.render.job import job_lines, with_job

        return with_job(job_lines(job, label, job.schedule()), text)

    options: dict[str, Any] = dict(
        fmt=fmt,
        gpu=gpu,
        gpu_memory=gpu_memory,
        gpu_tflops=gpu_tflops,
        mfu=mfu,
        ulysses_degree=ulysses_degree,
        walkthrough=walkthrough,
        label=label,
        expandable_segments=expandable,
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),  # job/device.py
    )
    if table is not None:
        options["kernels"] = table.digest
    # the files come from the run itself: a cached text would skip writing them
    emit(cache.cached("memory", args, options, use_cache and not files, produce), output, written)


def _with_step_time(text: str, fmt: Any, job: Any, args: dict[str, Any], gpu: str, table: Any) -> str:
    """Return memory's output with the step time plan's model gives the job on --kernels."""
    from inspector.plan.check import predicted_seconds
    from inspector.plan.request import PlanFlags
    from inspector.render.check import with_step_time

    batch = {"global_batch_size": job.schedule().global_batch_size}
    flags = PlanFlags(job.layout.world_size, gpu, kernels=table)
    seconds, note = predicted_seconds(job, {**args, **batch}, flags)
    return with_step_time(text, fmt == MemoryFormat.json, seconds, gpu, table.source, note)


def _engine_files(
    report: Any, timeline: str | None, snapshot: str | None
) -> list[tuple[str, str, str | bytes]]:
    """Return --timeline's SVG and --snapshot's pickle from the engine's run, for emit to write
    with -o's text, all or nothing."""
    from inspector.report.memory_outputs import engine_passes

    flags = ("--timeline",) * bool(timeline) + ("--snapshot",) * bool(snapshot)
    passes = engine_passes(report, flags)  # checked before either file is made
    made: list[tuple[str, str, str | bytes]] = []
    if timeline:
        from inspector.render.timeline import render_timeline

        made.append(("--timeline", timeline, render_timeline(report, passes)))
    if snapshot:
        from inspector.render.snapshot import render_snapshot

        made.append(("--snapshot", snapshot, render_snapshot(report, passes)))
    return made


def _workload_files_valid(text: str, stage: int | None) -> bool:
    """Whether a cached workload is what produce makes: JSON, file name -> text, plain names,
    the index and the asked stage's file among them."""
    import json

    from inspector.export import plain_name
    from inspector.report.workload_index import file_name

    try:
        files = json.loads(text)
    except ValueError:
        return False
    needed = ("index.csv", file_name(stage or 0))
    return isinstance(files, dict) and all(name in files for name in needed) and all(
        plain_name(name) and isinstance(body, str) for name, body in files.items())  # fmt: skip


@app.command(cls=PanelCommand)
@model_options("model", "layout", "training")
def workload(
    args: dict[str, Any],
    use_cache: bool,
    fmt: Any = format_option(WorkloadFormat.simai, "simai: SimAI workload files."),
    stage: int | None = stage_option("Print this stage's file instead."),
    gpu: str | None = gpu_option(None, ": its peak"),
    gpu_tflops: float | None = gpu_tflops_option(": compute times from FLOPs"),
    mfu: float | None = mfu_option(),
    compute_profile: str | None = typer.Option(
        None,
        "--compute-profile",
        help="Measured compute times (AICB/AIOB's profile file).",
        metavar="FILE",
        rich_help_panel=SOURCE_HELP,
    ),
    kernels: str | None = kernels_option(),
    output: str | None = output_option("Write the folder DIR atomically.", "DIR"),
) -> None:
    """Write SimAI network-simulator workloads: a file per stage and an index."""
    import json

    table = read_kernels(kernels)
    if table is not None and (gpu_tflops, mfu, compute_profile) != (None, None, None):
        raise ConfigError("--kernels gives the compute times; --gpu-tflops, --mfu and "
                          "--compute-profile give them another way: pass one")  # fmt: skip

    if (output is None) == (stage is None):
        raise ConfigError("workload writes every stage into -o DIR, or one stage with --stage S; pass one")

    if output is not None:
        from inspector.export import check_export_target

        check_export_target(output)  # before the build: a bad -o costs nothing
    profile = None
    if compute_profile is not None:
        from inspector.output import read_text

        profile = read_text(compute_profile)  # read once: the cache key and the times use it

    def produce() -> str:
        from inspector.render.workload import workload_files
        from inspector.report.workload_inputs import compute_for, context_for, stage_inputs
        from inspector.world.build import build, select_view

        job = resolve_job(args)
        if table is not None:
            from dataclasses import replace

            from inspector.job.hardware import get_gpu
            from inspector.report.workload_inputs import kernel_rate

            compute: Any = kernel_rate(job, replace(get_gpu(kernels_gpu(gpu, table)), kernels=table))
        else:
            compute = compute_for(
                gpu_tflops, mfu, profile, gpu, job.model.dtype_name, job.model.fp8_format is not None
            )
        with Progress() as progress:
            built = build(job, select_view(job, stage), expert_ranks=(0,), progress=progress)
        files = workload_files(context_for(built, compute), stage_inputs(built))
        return json.dumps(files, allow_nan=False)

    options = dict(stage=stage, gpu=gpu, gpu_tflops=gpu_tflops, mfu=mfu, profile=profile, fmt=fmt)
    if table is not None:
        options["kernels"] = table.digest
    text = cache.cached("workload", args, options, use_cache, produce,
                        lambda text: _workload_files_valid(text, stage))  # fmt: skip
    files: dict[str, str] = json.loads(text)
    from inspector.cli.streams import write_stderr
    from inspector.render.workload import workload_notes

    for note in workload_notes(args):
        write_stderr(note)
    if output is None:
        from inspector.report.workload_index import file_name

        emit(files[file_name(stage or 0)])
        return
    from inspector.export import write_export

    write_export(output, files)
