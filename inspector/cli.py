"""The command line: parse flags, call the core, print what a renderer returns, map errors.

Nothing heavy is imported at module level: `--help` and `models` never load torch or megatron.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from enum import Enum
from typing import Any

import click
import typer

from inspector import __version__, cache
from inspector.arguments import ARGUMENTS, ArgSpec
from inspector.errors import ConfigError, FidelityError, InspectorError
from inspector.formats import (
    DiffFormat,
    MemoryFormat,
    ParamsFormat,
    Partitioning,
    PlanFormat,
    TopologyFormat,
    WorkloadFormat,
)


def _click_errors() -> Any:
    """Return click's exception module (typer >= 0.22 vendors click; the pinned releases do not)."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:
        return importlib.import_module("click.exceptions")


click_errors: Any = _click_errors()

app = typer.Typer(
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="See what every rank holds in megatron-core's GPTModel, without a GPU.",
)

SOURCE_HELP = "Input: the model and where its arguments come from"
OUTPUT_HELP = "Output"
PANELS = {
    "model": "Model: Megatron-LM model arguments",
    "layout": "Parallel layout",
    "training": "Training: Megatron-LM training arguments",
}
# Options a command needs although a --config file or --from-script may give them: click must not
# require them (our own `Error:` says what is missing), but help marks them.
REQUIRED_IN_HELP = {"memory": ("--micro-batch-size",)}


class _PanelCommand(typer.core.TyperCommand):
    """Help grouped in panels (each option's rich_help_panel), in plain text: rich stays unloaded."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        arguments = []
        required = REQUIRED_IN_HELP.get(self.name or "", ())
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                arguments.append(record)
                continue
            if any(opt in required for opt in param.opts):
                record = (record[0], f"{record[1]}  [required]".lstrip())
            panel = getattr(param, "rich_help_panel", None) or "Options"
            panels.setdefault(panel, []).append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        order = ["Options", SOURCE_HELP, *PANELS.values(), OUTPUT_HELP]
        for panel, records in sorted(panels.items(), key=lambda item: order.index(item[0])):
            with formatter.section(panel):
                formatter.write_dl(records)


class _Choice(click.Choice):
    """A choice option whose bad value is our one-sentence error, naming the flag."""

    def __init__(self, choices: type[Enum] | tuple[str, ...]) -> None:
        names = choices if isinstance(choices, tuple) else [member.value for member in choices]
        super().__init__(names)
        self.enum = None if isinstance(choices, tuple) else choices

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if self.enum is not None and isinstance(value, self.enum):
            return value
        if value in self.choices:
            return value if self.enum is None else self.enum(value)
        flag = max(param.opts, key=len) if param is not None else "option"
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(self.choices)}")


class _FiniteFloat(click.types.FloatParamType):
    """A float option that refuses nan and infinities (1e400 reads as inf), naming the flag."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            flag = max(param.opts, key=len) if param is not None else "option"
            raise ConfigError(f"{flag} must be a finite number, got {value}")
        return number


def _finite_floats(command: Any) -> Any:
    """Give every float option of `command` and its subcommands the _FiniteFloat type."""
    for param in getattr(command, "params", []):
        if type(param.type) is click.types.FloatParamType:
            param.type = _FiniteFloat()
    for sub in getattr(command, "commands", {}).values():
        _finite_floats(sub)
    return command


def _option_for(spec: ArgSpec) -> inspect.Parameter:
    names = [spec.flag, *spec.aliases]
    annotation: Any = spec.type | None
    extra: dict[str, Any] = {}
    if spec.choices:
        extra["click_type"] = _Choice(spec.choices)
    option = typer.Option(
        None,
        *names,
        help=spec.help,
        rich_help_panel=PANELS[spec.group],
        show_default=False,
        **extra,
    )
    return inspect.Parameter(
        spec.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
    )


def _source_options() -> list[inspect.Parameter]:
    def opt(
        name: str,
        *decls: str,
        help_text: str,
        annotation: Any = str | None,
        metavar: str | None = None,
    ) -> inspect.Parameter:
        option = typer.Option(
            None, *decls, help=help_text, rich_help_panel=SOURCE_HELP, metavar=metavar
        )
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
        )

    return [
        opt(
            "preset",
            "--model",
            help_text="Preset name (see `inspect-model models`); default gpt2-small.",
            metavar="NAME",
        ),
        opt(
            "config_file",
            "--config",
            help_text="YAML or JSON file of Megatron-LM arguments.",
            metavar="FILE",
        ),
        opt(
            "script",
            "--from-script",
            help_text="Training launch script to read arguments from.",
            metavar="FILE",
        ),
        opt(
            "no_cache",
            "--no-cache",
            help_text="Recompute instead of reusing a cached result.",
            annotation=bool | None,
        ),
        opt(
            "settings",
            "--set",
            help_text="NAME=VALUE the launch script reads from its environment (repeatable).",
            annotation=list[str] | None,
            metavar="NAME=VALUE",
        ),
        opt(
            "apex",
            "--apex/--no-apex",
            help_text="Simulate apex's FusedLayerNorm (default: on for LayerNorm models).",
            annotation=bool | None,
        ),
    ]


def model_options(*groups: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the model-selection options and the argument `groups` it reads.

    The command receives them merged (resolve.py) as `args`; what the user should know about
    the merge (e.g. what a launch script set that is not modelled) goes to stderr first.
    """
    wanted = groups or ("model", "layout")
    specs = [spec for spec in ARGUMENTS if spec.group in wanted]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p
            for name, p in inspect.signature(func).parameters.items()
            if name not in ("args", "use_cache")
        ]
        extra = _source_options() + [_option_for(spec) for spec in specs]

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            from inspector.resolve import Sources, merge_sources

            flags = {spec.name: kwargs.pop(spec.name) for spec in specs}
            named = {k: kwargs.pop(k) for k in ("preset", "config_file", "script", "apex")}
            settings = tuple(kwargs.pop("settings") or ())
            use_cache = not kwargs.pop("no_cache")
            resolved = merge_sources(Sources(flags=flags, settings=settings, **named), wanted)
            for note in resolved.notes:
                typer.echo(note, err=True)
            return func(args=resolved.args, use_cache=use_cache, **kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _format_option(default: Enum, help_text: str) -> Any:
    return typer.Option(
        default.value,
        "--format",
        help=help_text,
        click_type=_Choice(type(default)),
        rich_help_panel=OUTPUT_HELP,
    )


def _output_option(help_text: str = "Write to FILE atomically.", metavar: str = "FILE") -> Any:
    return typer.Option(
        None, "-o", "--output", help=help_text, metavar=metavar, rich_help_panel=OUTPUT_HELP
    )


def _stage_option(help_text: str) -> Any:
    return typer.Option(None, "--stage", help=help_text, rich_help_panel=OUTPUT_HELP)


def _rank_option(help_text: str) -> Any:
    return typer.Option(None, "--rank", help=help_text, rich_help_panel=OUTPUT_HELP)


def _emit(text: str, output: str | None = None) -> None:
    from inspector.output import write_output

    write_output(output, text)


class Progress:
    """A one-line progress indicator on stderr while stages are built.

    Only on a terminal, and only once the run has taken `delay` seconds: nothing in pipes, CI or
    captured streams. Use as a context manager; the line is erased at the end.
    """

    def __init__(self, stream: Any = None, delay: float = 1.0) -> None:
        import time

        self.stream = sys.stderr if stream is None else stream
        self.clock = time.monotonic
        self.start, self.delay, self.shown = self.clock(), delay, False
        try:
            self.enabled = bool(self.stream.isatty())
        except (AttributeError, OSError, ValueError):
            self.enabled = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or (not self.shown and self.clock() - self.start < self.delay):
            return
        self.shown = True
        self._write(f"\rbuilding with megatron-core: {done} of {total} stage builds\x1b[K")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown and self.enabled:
            self._write("\r\x1b[K")


def _job(args: dict[str, Any]) -> Any:
    from inspector.job import make_job

    return make_job(args)


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
        from inspector.build import build, select_view
        from inspector.render.tree import render_trees
        from inspector.walk import stage_trees

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
        from inspector.render.topology import render_topology
        from inspector.topology import rank_map_layout

        return render_topology(rank_map_layout(args), fmt)

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
        from inspector.build import build, select_view
        from inspector.params import params_result
        from inspector.render.params import render_params

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
        from inspector.diff import check_table
        from inspector.render.diff import render_check

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
        from inspector.memory import check_walkthrough_flags

        check_walkthrough_flags(gpu_memory=gpu_memory, gpu_tflops=gpu_tflops, mfu=mfu)

    def produce() -> str:
        from inspector import memory as core
        from inspector.render import memory as render

        job = _job(args)
        job.schedule()  # --micro-batch-size is required, and the batches must divide
        hardware = core.make_hardware(gpu_memory, gpu_tflops, mfu)
        if walkthrough:
            from inspector.walkthrough import job_walkthroughs

            return render.render_walkthroughs(job, job_walkthroughs(job, ulysses_degree), fmt)
        core.check_ulysses(ulysses_degree)
        from inspector.build import build, select_view

        with Progress() as progress:
            built = build(job, select_view(job), expert_ranks=(0,), progress=progress)
        return render.render_memory(core.measure(built, hardware), fmt)

    options: dict[str, Any] = dict(
        fmt=fmt,
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

    def produce() -> str:
        from inspector.build import build, select_view
        from inspector.render.workload import workload_files
        from inspector.workload_inputs import compute_for, context_for, stage_inputs

        job = _job(args)
        compute = compute_for(gpu_tflops, mfu, compute_profile)
        with Progress() as progress:
            built = build(job, select_view(job, stage), expert_ranks=(0,), progress=progress)
        files = workload_files(context_for(built, compute), stage_inputs(built))
        return json.dumps(files, allow_nan=False)

    options = dict(stage=stage, gpu_tflops=gpu_tflops, mfu=mfu, profile=compute_profile, fmt=fmt)
    if compute_profile is not None:
        from inspector.output import read_text

        options["profile_text"] = read_text(compute_profile)
    files: dict[str, str] = json.loads(cache.cached("workload", args, options, use_cache, produce))
    if output is None:
        from inspector.workload import file_name

        _emit(files[file_name(stage or 0)])
        return
    from inspector.output import write_directory_atomic

    write_directory_atomic(output, files)


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
    from inspector.diff import diff_files
    from inspector.render.diff import render_diff

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
        None, "--gpu-memory", help="GPU memory in GiB (default: the --gpu profile's)."
    ),
    gpu: str = typer.Option("h100", "--gpu", help="GPU profile: h100, h200 or a100-80gb."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node (NVLink domain)."),
    gpu_tflops: float | None = typer.Option(
        None, "--gpu-tflops", help="Override the profile's dense 16-bit peak TFLOP/s."
    ),
    intra_bandwidth: float | None = typer.Option(
        None, "--intra-node-bandwidth", help="Override NVLink GB/s per GPU, one direction."
    ),
    inter_bandwidth: float | None = typer.Option(
        None, "--inter-node-bandwidth", help="Override InfiniBand GB/s per GPU, one direction."
    ),
    efficiency: float = typer.Option(
        0.65, "--efficiency", help="Fraction of peak the layers' GEMMs reach, in (0, 1]."
    ),
    top: int = typer.Option(5, "--top", help="How many plans to list."),
    explain: bool = typer.Option(False, "--explain", help="Say why plan 1 wins."),
    svg: str | None = typer.Option(None, "--svg", help="Write plan 1's schedule as SVG to FILE."),
    fmt: Any = _format_option(PlanFormat.text, "text (table, flags, timeline) or json."),
    output: str | None = _output_option(),
) -> None:
    """Rank the parallel layouts of a model on N GPUs by estimated step time."""
    from inspector import plan as core
    from inspector.render import plan as render

    request = core.make_request(
        args, gpus, gpu, gpu_memory, gpus_per_node, gpu_tflops, intra_bandwidth,
        inter_bandwidth, efficiency, top,
    )
    result = core.search(request, core.progress_line())
    text = render.render_plan(result, request.memory, fmt.value if hasattr(fmt, "value") else fmt, explain)
    if svg is not None and result.plans:
        from inspector.output import write_atomic

        write_atomic(svg, render.render_svg(result.plans[0]))
    _emit(text, output)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"inspect-model {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks behind errors."),
) -> None:
    """See what every rank holds in megatron-core's GPTModel, without a GPU."""
    _STATE["debug"] = _STATE["debug"] or debug


_STATE: dict[str, bool] = {"debug": False}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; `Error:` + one sentence on stderr and exit 2 for any bad input."""
    from inspector.output import guard_streams

    guard_streams()  # UTF-8 stdout; a failed write is an Error:, a closed pipe a quiet exit 141
    args, _STATE["debug"] = _take_debug(sys.argv[1:] if argv is None else argv)
    command = _finite_floats(typer.main.get_command(app))
    try:
        result = command.main(args=args, prog_name="inspect-model", standalone_mode=False)
    except click_errors.NoSuchOption as exc:
        close = sorted(exc.possibilities or [])
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return _fail(f"no such option: {exc.option_name}{hint}")
    except click_errors.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:
            typer.echo(exc.ctx.get_help())
            return 0
        return _fail(exc.format_message())
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        return _fail("aborted")
    except InspectorError as exc:
        if _STATE["debug"]:
            import traceback

            traceback.print_exc()
        return _fail(str(exc), exc.exit_code)
    except FidelityError as exc:
        return _fail(f"internal check failed, this is a bug in inspect-model: {exc}", exc.exit_code)
    return result if isinstance(result, int) else 0


def _take_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove `--debug` wherever it stands before `--` (after the command too); say if it did."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [arg for arg in argv[:end] if arg != "--debug"] + argv[end:]
    return kept, len(kept) != len(argv)


def _fail(message: str, code: int = 2) -> int:
    from inspector.errors import one_line
    from inspector.output import write_error

    write_error(one_line(message))
    return code


if __name__ == "__main__":
    sys.exit(main())
