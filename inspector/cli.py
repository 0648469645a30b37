"""The command line: parse flags, call the core, print what a renderer returns, map errors.

Nothing heavy is imported at module level: `--help` and `models` never load torch or megatron.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import Any

import typer

from inspector import __version__
from inspector.arguments import ARGUMENTS, BY_NAME, ArgSpec
from inspector.errors import FidelityError, InspectorError


def _click_errors() -> Any:
    """Return click's exception module (typer >= 0.22 vendors click; the pinned releases do not)."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:
        return importlib.import_module("click.exceptions")


click_errors: Any = _click_errors()

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="See what every rank holds in megatron-core's GPTModel, without a GPU.",
)

SOURCE_HELP = "Model selection"
PANELS = {
    "model": "Megatron-LM model arguments",
    "layout": "Parallel layout",
    "training": "Megatron-LM training arguments",
}


def _option_for(spec: ArgSpec) -> inspect.Parameter:
    names = [spec.flag, *spec.aliases]
    help_text = spec.help + (f" One of: {', '.join(spec.choices)}." if spec.choices else "")
    annotation: Any = spec.type | None
    option = typer.Option(
        None, *names, help=help_text, rich_help_panel=PANELS[spec.group], show_default=False
    )
    return inspect.Parameter(
        spec.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
    )


def _source_options() -> list[inspect.Parameter]:
    def opt(
        name: str, *decls: str, help_text: str, annotation: Any = str | None
    ) -> inspect.Parameter:
        option = typer.Option(None, *decls, help=help_text, rich_help_panel=SOURCE_HELP)
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation
        )

    return [
        opt(
            "preset",
            "--model",
            help_text="Preset name (see `inspect-model models`); default gpt2-small.",
        ),
        opt("config_file", "--config", help_text="YAML or JSON file of Megatron-LM arguments."),
        opt("script", "--from-script", help_text="Training launch script to read arguments from."),
        opt(
            "no_cache",
            "--no-cache",
            help_text="Recompute instead of reusing a cached result.",
            annotation=bool | None,
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

    The command receives them merged as `args` (preset, then file, script, flags); arguments of
    other groups that a file or script sets are dropped, so they cannot change a cache key.
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
            flags = {spec.name: kwargs.pop(spec.name) for spec in specs}
            sources = {
                name: kwargs.pop(name) for name in ("preset", "config_file", "script", "apex")
            }
            use_cache = not kwargs.pop("no_cache")
            merged = _gather_args(flags, **sources)
            args = {
                k: v for k, v in merged.items() if k not in BY_NAME or BY_NAME[k].group in wanted
            }
            return func(args=args, use_cache=use_cache, **kwargs)

        wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _gather_args(
    flags: dict[str, Any],
    preset: str | None,
    config_file: str | None,
    script: str | None,
    apex: bool | None,
) -> dict[str, Any]:
    """Merge preset, config file, launch script and flags, later ones winning."""
    layers: list[dict[str, Any]] = []
    if preset is not None:
        from inspector.presets import get_preset

        layers.append(dict(get_preset(preset).args))
    if config_file is not None:
        from inspector.sources import load_config_file

        layers.append(load_config_file(config_file))
    if script is not None:
        from inspector.sources import read_launch_script

        parsed = read_launch_script(script)
        if parsed.ignored:
            typer.echo(f"Ignored from {script}: {' '.join(parsed.ignored)}", err=True)
        layers.append(parsed.args)
    layers.append({name: value for name, value in flags.items() if value is not None})
    if apex is not None:
        layers.append({"apex": apex})
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    return merged


def _emit(text: str, output: str | None = None) -> None:
    from inspector.output import write_output

    write_output(output, text)


@app.command()
@model_options()
def tree(
    args: dict[str, Any],
    use_cache: bool,
    stage: int | None = typer.Option(None, "--stage", help="Print just this pipeline stage."),
    rank: int | None = typer.Option(None, "--rank", help="Print the stage global rank R holds."),
) -> None:
    """Print the module hierarchy of each pipeline stage."""
    from inspector.commands import cached, tree_text

    options = {"stage": stage, "rank": rank}
    _emit(cached("tree", args, options, use_cache, lambda: tree_text(args, stage=stage, rank=rank)))


@app.command()
@model_options()
def topology(
    args: dict[str, Any],
    use_cache: bool,
    fmt: str = typer.Option("line", "--format", help="line (ProcessCoord map) or table."),
) -> None:
    """Print the rank map: each rank's pipeline, data and model coordinates."""
    from inspector.commands import cached, topology_text

    _emit(cached("topology", args, {"format": fmt}, use_cache, lambda: topology_text(args, fmt)))


@app.command()
@model_options()
def params(
    args: dict[str, Any],
    use_cache: bool,
    stage: int | None = typer.Option(None, "--stage", help="Keep just this pipeline stage."),
    rank: int | None = typer.Option(None, "--rank", help="Write the file global rank R writes."),
    partitioning: str = typer.Option(
        "layers", "--partitioning", help="Optimizer ownership: layers, cost or distopt."
    ),
    block_size: int = typer.Option(0, "--block-size", help="Shampoo block size (0 = off)."),
    fmt: str = typer.Option("csv", "--format", help="csv (semicolons), json or table."),
    output: str | None = typer.Option(None, "-o", "--output", help="Write to FILE atomically."),
    check: str | None = typer.Option(None, "--check", help="Compare with FILE; exit 1 if stale."),
) -> None:
    """Print the per-stage parameter / partition table."""
    from inspector.commands import cached, params_text

    options: dict[str, Any] = dict(
        stage=stage, rank=rank, partitioning=partitioning, block_size=block_size, fmt=fmt
    )
    text = cached("params", args, options, use_cache, lambda: params_text(args, **options))
    if check is not None:
        from inspector.commands import check_text

        report, equal = check_text(text, check)
        sys.stdout.write(report)
        raise typer.Exit(0 if equal else 1)
    _emit(text, output)


@app.command()
@model_options("model", "layout", "training")
def memory(
    args: dict[str, Any],
    use_cache: bool,
    fmt: str = typer.Option("text", "--format", help="text (with a bar chart), table or json."),
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
    output: str | None = typer.Option(None, "-o", "--output", help="Write to FILE atomically."),
) -> None:
    """Print what each rank needs to train: weights, grads, optimizer, activations, FLOPs."""
    from inspector.commands import cached, memory_text

    options: dict[str, Any] = dict(
        fmt=fmt,
        gpu_memory=gpu_memory,
        gpu_tflops=gpu_tflops,
        mfu=mfu,
        ulysses_degree=ulysses_degree,
        walkthrough=walkthrough,
    )
    _emit(cached("memory", args, options, use_cache, lambda: memory_text(args, **options)), output)


@app.command()
def diff(
    old: str = typer.Argument(
        ..., help="The old params table (semicolon or json), or - for stdin."
    ),
    new: str = typer.Argument(
        ..., help="The new params table (semicolon or json), or - for stdin."
    ),
    fmt: str = typer.Option("text", "--format", help="text, markdown (a PR comment) or json."),
) -> None:
    """Compare two params tables: exit 0 when equal, 1 when they differ."""
    from inspector.commands import diff_text

    report, equal = diff_text(old, new, fmt)
    sys.stdout.write(report)
    raise typer.Exit(0 if equal else 1)


@app.command()
def models() -> None:
    """List the model presets with their key sizes."""
    from inspector.commands import models_text

    sys.stdout.write(models_text())


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
    _STATE["debug"] = debug


_STATE: dict[str, bool] = {"debug": False}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; `Error:` + one sentence on stderr and exit 2 for any bad input."""
    from inspector.output import guard_streams

    guard_streams()  # UTF-8 stdout; a failed write is an Error:, a closed pipe a quiet exit 141
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="inspect-model", standalone_mode=False)
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


def _fail(message: str, code: int = 2) -> int:
    from inspector.errors import one_line
    from inspector.output import write_error

    write_error(one_line(message))
    return code


if __name__ == "__main__":
    sys.exit(main())
