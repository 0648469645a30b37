"""The commands: each parses its flags, calls the core, and prints what a renderer returns."""

from __future__ import annotations

import sys
from typing import Any

import typer

from inspector.cli import cache
from inspector.cli.app import (
    OUTPUT_HELP,
    SOURCE_HELP,
    Progress,
    _Choice,
    _emit,
    _format_option,
    _gpu_option,
    _job,
    _output_option,
    _PanelCommand,
    _rank_option,
    _stage_option,
    app,
    model_options,
)
from inspector.errors import ConfigError
from inspector.job.hardware import DEFAULT_GPU
from inspector.report.formats import (
    DiffFormat,
    MemoryFormat,
    ParamsFormat,
    Partitioning,
    PlanFormat,
    TopologyFormat,
    WorkloadFormat,
)


@app.command(cls=_PanelCommand)
@model_options()
def tree(
    args: dict[str, Any],
    use_cache: bool,
    stage: int | None = _stage_option("Print just this pipeline stage."),
    rank: int | None = _rank_option("Print the stage global rank R holds."),
) -> None:
    """Print the module hierarchy of each pipeline stage."""

    def produce() -> str:
        from inspector.render.tree import render_trees
        from inspector.world.build import build, select_view, stage_trees

        job = _job(args)
        view = select_view(job, stage, rank)
        with Progress() as progress:
            built = build(job, view, expert_ranks=(view.expert_rank,), progress=progress)
        return render_trees(stage_trees(built))

    _emit(cache.cached("tree", args, {"stage": stage, "rank": rank}, use_cache, produce))


@app.command(cls=_PanelCommand)
@model_options()
def topology(
    args: dict[str, Any],
    use_cache: bool,
    fmt: Any = _format_option(TopologyFormat.line, "line (ProcessCoord map) or table."),
) -> None:
    """Print the rank map: each rank's pipeline, data and model coordinates."""

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

    _emit(cache.cached("topology", args, {"format": fmt}, use_cache, produce))


@app.command(cls=_PanelCommand)
@model_options()
def params(
    args: dict[str, Any],
    use_cache: bool,
    stage: int | None = _stage_option("Keep just this pipeline stage."),
    rank: int | None = _rank_option("Write the file global rank R writes."),
    partitioning: Any = typer.Option(
        Partitioning.layers.value,
        "--partitioning",
        help="Optimizer ownership: layers, cost or distopt.",
        click_type=_Choice(Partitioning),
    ),
    block_size: int = typer.Option(0, "--block-size", help="Shampoo block size (0 = off)."),
    fmt: Any = _format_option(ParamsFormat.csv, "csv (semicolons), json or table."),
    output: str | None = _output_option(),
    check: str | None = typer.Option(
        None,
        "--check",
        help="Compare with FILE; exit 1 if stale.",
        metavar="FILE",
        rich_help_panel=OUTPUT_HELP,
    ),
) -> None:
    """Print the per-stage parameter / partition table."""

    def produce() -> str:
        from inspector.render.params import render_params
        from inspector.report.params import params_result
        from inspector.world.build import build, select_view

        job = _job(args)
        with Progress() as progress:
            built = build(job, select_view(job, stage, rank), progress=progress)
        return render_params(params_result(built, partitioning, block_size), fmt)

    if check is not None and output is not None:
        raise ConfigError(
            "--check compares the table with FILE and writes nothing, -o writes it; pass one of them"
        )
    options = dict(
        stage=stage, rank=rank, partitioning=partitioning, block_size=block_size, fmt=fmt
    )
    text = cache.cached("params", args, options, use_cache, produce)
    if check is not None:
        from inspector.render.diff import render_check
        from inspector.report.diff import check_table

        result = check_table(text, check)
        sys.stdout.write(render_check(result, check))
        raise typer.Exit(0 if result is None else 1)
    _emit(text, output)


@app.command(cls=_PanelCommand)
@model_options("model", "layout", "training")
def memory(
    args: dict[str, Any],
    use_cache: bool,
    fmt: Any = _format_option(MemoryFormat.text, "text (with a bar chart), table or json."),
    gpu: str | None = _gpu_option(None, ": its memory and peak, unless given below"),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="GPU memory in GiB: say which stages fit."
    ),
    gpu_tflops: float | None = typer.Option(
        None, "--gpu-tflops", help="Peak TFLOP/s per GPU: print the time per iteration."
    ),
    mfu: float | None = typer.Option(
        None, "--mfu", help="Model FLOPs utilisation for that time, in (0, 1] (default 1)."
    ),
    ulysses_degree: int | None = typer.Option(
        None, "--ulysses-degree", help="Add a Ulysses all-to-all table to the walkthrough."
    ),
    walkthrough: bool = typer.Option(
        False,
        "--attention-walkthrough",
        help="Print one attention layer on one rank, step by step, instead of the report.",
    ),
    output: str | None = _output_option(),
) -> None:
    """Print what each rank needs to train: weights, grads, optimizer, activations, FLOPs."""
    if walkthrough:
        from inspector.report.memory import check_walkthrough_flags

        check_walkthrough_flags(gpu=gpu, gpu_memory=gpu_memory, gpu_tflops=gpu_tflops, mfu=mfu)

    def produce() -> str:
        from inspector.render import memory as render
        from inspector.report import memory as core

        job = _job(args)
        job.schedule()  # --micro-batch-size is required, and the batches must divide
        hardware = core.make_hardware(gpu_memory, gpu_tflops, mfu, gpu, job.model.dtype_name)
        if walkthrough:
            from inspector.formulas.walkthrough import job_walkthroughs

            return render.render_walkthroughs(job, job_walkthroughs(job, ulysses_degree), fmt)
        core.check_ulysses(ulysses_degree)
        from inspector.world.build import build, select_view

        with Progress() as progress:
            built = build(job, select_view(job), expert_ranks=(0,), progress=progress)
        return render.render_memory(core.measure(built, hardware), fmt)

    options: dict[str, Any] = dict(
        fmt=fmt,
        gpu=gpu,
        gpu_memory=gpu_memory,
        gpu_tflops=gpu_tflops,
        mfu=mfu,
        ulysses_degree=ulysses_degree,
        walkthrough=walkthrough,
    )
    _emit(cache.cached("memory", args, options, use_cache, produce), output)


@app.command(cls=_PanelCommand)
@model_options("model", "layout", "training")
def workload(
    args: dict[str, Any],
    use_cache: bool,
    fmt: Any = _format_option(WorkloadFormat.simai, "simai: SimAI workload files."),
    stage: int | None = _stage_option("Print this stage's file instead."),
    gpu: str | None = _gpu_option(None, ": its peak, unless --gpu-tflops"),
    gpu_tflops: float | None = typer.Option(
        None, "--gpu-tflops", help="Peak TFLOP/s per GPU: compute times from FLOPs."
    ),
    mfu: float | None = typer.Option(None, "--mfu", help="Fraction of the peak reached (default 1)."),
    compute_profile: str | None = typer.Option(
        None,
        "--compute-profile",
        help="Measured compute times (AICB/AIOB's profile file).",
        metavar="FILE",
        rich_help_panel=SOURCE_HELP,
    ),
    output: str | None = _output_option("Write the folder DIR atomically.", "DIR"),
) -> None:
    """Write SimAI network-simulator workloads: one file per pipeline stage, and an index."""
    import json

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

        job = _job(args)
        compute = compute_for(gpu_tflops, mfu, profile, gpu, job.model.dtype_name)
        with Progress() as progress:
            built = build(job, select_view(job, stage), expert_ranks=(0,), progress=progress)
        files = workload_files(context_for(built, compute), stage_inputs(built))
        return json.dumps(files, allow_nan=False)

    options = dict(stage=stage, gpu=gpu, gpu_tflops=gpu_tflops, mfu=mfu, profile=profile, fmt=fmt)
    files: dict[str, str] = json.loads(cache.cached("workload", args, options, use_cache, produce))
    if output is None:
        from inspector.report.workload_index import file_name

        _emit(files[file_name(stage or 0)])
        return
    from inspector.export import write_export

    write_export(output, files)


@app.command(cls=_PanelCommand)
def diff(
    old: str = typer.Argument(
        ..., help="The old params table (semicolon or json), or - for stdin.", metavar="OLD"
    ),
    new: str = typer.Argument(
        ..., help="The new params table (semicolon or json), or - for stdin.", metavar="NEW"
    ),
    fmt: Any = _format_option(DiffFormat.text, "text, markdown (a PR comment) or json."),
) -> None:
    """Compare two params tables: exit 0 when equal, 1 when they differ."""
    from inspector.render.diff import render_diff
    from inspector.report.diff import diff_files

    result = diff_files(old, new)
    sys.stdout.write(render_diff(result, fmt, old, new))
    raise typer.Exit(0 if result.equal else 1)


@app.command(cls=_PanelCommand)
def models() -> None:
    """List the model presets with their key sizes."""
    from inspector.render.models import render_presets

    sys.stdout.write(render_presets())


@app.command(cls=_PanelCommand)
@model_options("model", "layout", "training")
def plan(
    args: dict[str, Any],
    use_cache: bool,
    gpus: int = typer.Option(..., "--gpus", help="GPUs in the cluster."),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="GPU memory in GiB (default: the --gpu type's)."
    ),
    gpu: str = _gpu_option(DEFAULT_GPU),
    gpus_per_node: int | None = typer.Option(
        None, "--gpus-per-node", help="GPUs per node, the NVLink domain (default: the --gpu type's)."
    ),
    gpu_tflops: float | None = typer.Option(
        None, "--gpu-tflops", help="Override the --gpu type's dense 16-bit peak TFLOP/s."
    ),
    intra_bandwidth: float | None = typer.Option(
        None, "--intra-node-bandwidth", help="Override NVLink GB/s per GPU, one direction."
    ),
    inter_bandwidth: float | None = typer.Option(
        None, "--inter-node-bandwidth", help="Override InfiniBand GB/s per GPU, one direction."
    ),
    efficiency: float | None = typer.Option(
        None, "--efficiency",
        help="Price every GEMM FLOP at this fraction of peak, in (0, 1], instead of the measured "
        "per-kernel tables.",
    ),
    top: int = typer.Option(5, "--top", help="How many plans to list."),
    explain: bool = typer.Option(False, "--explain", help="Say why plan 1 wins."),
    svg: str | None = typer.Option(None, "--svg", help="Write plan 1's schedule as SVG to FILE."),
    fmt: Any = _format_option(PlanFormat.text, "text (table, flags, timeline) or json."),
    output: str | None = _output_option(),
) -> None:
    """Rank the parallel layouts of a model on N GPUs by estimated step time."""
    from inspector.plan import search as core
    from inspector.plan.request import PlanFlags, make_request
    from inspector.render import plan as render

    flags = PlanFlags(gpus, gpu, gpu_memory, gpus_per_node, gpu_tflops, intra_bandwidth,
                      inter_bandwidth, efficiency, top)
    request = make_request(args, flags)
    if svg is not None:
        from inspector.output import check_target

        check_target(svg, "--svg")  # before the search: a bad --svg costs nothing
    progress = core.progress_line()
    result = core.search(request, progress)
    if progress is not None:  # the search's speed, on the terminal only (stdout stays identical)
        rate = result.evaluated / max(result.seconds, 1e-9)
        sys.stderr.write(f"\rplan: {result.evaluated} candidates in {result.seconds:.2f} s "
                         f"({rate:.0f} per second)\n")
    text = render.render_plan(result, request.memory, fmt.value if hasattr(fmt, "value") else fmt, explain)
    if svg is not None and result.plans:
        from inspector.output import write_atomic

        write_atomic(svg, render.render_svg(result.plans[0]), "--svg")
    _emit(text, output)
