"""The typer app and what every command shares: option panels, choices, model options, output.

Nothing heavy is imported at module level: `--help` and `models` never load torch or megatron.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

import click
import typer

from inspector.cli.help import OUTPUT_HELP, PANELS, SOURCE_HELP
from inspector.errors import ConfigError, InspectorError
from inspector.inputs.arguments import ARGUMENTS
from inspector.inputs.model_arguments import ArgSpec


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
    help="See what every rank holds in megatron-core's GPT and hybrid models, without a GPU.",
)

class Choice(click.Choice):
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


def finite_floats(command: Any) -> Any:
    """Give every float option of `command` and its subcommands the _FiniteFloat type."""
    for param in getattr(command, "params", []):
        if type(param.type) is click.types.FloatParamType:
            param.type = _FiniteFloat()
    for sub in getattr(command, "commands", {}).values():
        finite_floats(sub)
    return command


def _option_for(spec: ArgSpec) -> inspect.Parameter:
    names = [spec.flag, *spec.aliases]
    if spec.negatable:
        names = [f"{spec.flag}/--no-{spec.flag[2:]}", *spec.aliases]
    annotation: Any = spec.type | None
    extra: dict[str, Any] = {}
    if spec.choices:
        extra["click_type"] = Choice(spec.choices)
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
    # One typer option declaration per input flag: a list, longer than the usual ~40 lines.
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
            help_text="A preset (`inspect-model models`); default gpt2-small.",
            metavar="NAME",
        ),
        opt(
            "config_file",
            "--config",
            help_text="YAML or JSON file of Megatron-LM arguments.",
            metavar="FILE",
        ),
        opt(
            "hf_config",
            "--hf-config",
            help_text="An HF config.json, as Megatron-Bridge maps it.",
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
            help_text="A value the script reads from outside (repeatable).",
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


def model_options(
    *groups: str, accepted: tuple[str, ...] = (), searched: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the model-selection options and the argument `groups` it reads
    (`accepted`: refused values it models itself, resolve.merge_sources; `searched`: it searches
    the parallel sizes left unset, resolve.Sources).

    The command receives them merged (resolve.py) as `args`; what the user should know about
    the merge (e.g. what a launch script set that is not modelled) goes to stderr first. A
    command with a `label` parameter gets the model's name (script, config file, HF config or
    preset).
    """
    wanted = groups or ("model", "layout")
    specs = [spec for spec in ARGUMENTS if spec.group in wanted]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p
            for name, p in inspect.signature(func).parameters.items()
            if name not in ("args", "use_cache", "label")
        ]
        extra = _source_options() + [_option_for(spec) for spec in specs]

        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            from inspector.cli.streams import drop_notes, hold_notes, release_notes
            from inspector.inputs.resolve import Sources, merge_sources

            flags = {spec.name: kwargs.pop(spec.name) for spec in specs}
            sources = ("preset", "config_file", "hf_config", "script", "apex")
            named = {k: kwargs.pop(k) for k in sources}
            settings = tuple(kwargs.pop("settings") or ())
            use_cache = not kwargs.pop("no_cache")
            resolved = merge_sources(Sources(flags=flags, settings=settings, searched=searched, **named),
                                     wanted, accepted)  # fmt: skip
            # the merge's notes are printed once the job is accepted (emit, or the command's
            # end), never before the Error: of a job refused, by its checks or by megatron's build
            hold_notes(resolved.notes)
            if "label" in inspect.signature(func).parameters:  # the model's name for the job line
                kwargs["label"] = (
                    named["script"] or named["config_file"] or named["hf_config"] or named["preset"]
                )
            try:
                return func(args=resolved.args, use_cache=use_cache, **kwargs)
            except InspectorError:
                drop_notes()
                raise
            finally:
                release_notes()

        wrapper.__signature__ = inspect.Signature(own + extra)  # type: ignore[attr-defined]
        return wrapper

    return decorate


def format_option(default: Enum, help_text: str) -> Any:
    return typer.Option(
        default.value,
        "--format",
        help=help_text,
        click_type=Choice(type(default)),
        rich_help_panel=OUTPUT_HELP,
    )


def output_option(help_text: str = "Write to FILE atomically.", metavar: str = "FILE") -> Any:
    return typer.Option(
        None, "-o", "--output", help=help_text, metavar=metavar, rich_help_panel=OUTPUT_HELP
    )


def gpu_option(default: str | None, what: str = "") -> Any:
    """Return the --gpu option: a GPU type of job/hardware.py's table."""
    from inspector.job.hardware import GPUS

    names = ", ".join(GPUS)  # TYPE: the metavar says what they are
    given = f", default {default}" if default else ""
    return typer.Option(
        default, "--gpu", help=f"({names}){what}{given}.", metavar="TYPE", show_default=False
    )


def gpu_memory_option(use: str) -> Any:
    """Return --gpu-memory (GiB), declared here only; `use` says what the command does with it."""
    return typer.Option(None, "--gpu-memory", help=f"GPU memory in GiB{use}.")


def gpu_tflops_option(use: str) -> Any:
    """Return --gpu-tflops, declared here only; `use` says what the command does with it."""
    return typer.Option(None, "--gpu-tflops", help=f"Peak TFLOP/s per GPU{use}.")


def nvlink_domain_option() -> Any:
    """`--gpus-per-node`: the NVLink domain that consecutive ranks fill, megatron's placement."""
    return typer.Option(None, "--gpus-per-node", help="GPUs per NVLink domain (default: the type's).")


def mfu_option() -> Any:
    """Return --mfu, declared here only."""
    return typer.Option(None, "--mfu", help="Fraction of the peak reached (default 1).")


def kernels_option() -> Any:
    """Return the --kernels option: a kernel table measured by `inspect-model calibrate`."""
    return typer.Option(
        None, "--kernels", help="Kernel times measured by `calibrate` (default: built-in).",
        metavar="FILE", rich_help_panel=SOURCE_HELP,
    )


def read_kernels(path: str | None) -> Any:
    """Return the --kernels FILE's table, checked (None without the flag)."""
    if path is None:
        return None
    from inspector.errors import InputError
    from inspector.job.kernel_table import MAX_TABLE_BYTES, parse_table
    from inspector.output import read_head

    try:
        text, cut = read_head(path, MAX_TABLE_BYTES)
    except InputError as exc:
        raise InputError(f"--kernels {exc}") from None
    if cut:
        raise InputError(f"--kernels {path} is over {MAX_TABLE_BYTES:,} bytes; a kernel table "
                         "from calibrate is about 250,000")  # fmt: skip
    return parse_table(text, path)


def kernels_gpu(gpu: str | None, table: Any) -> str:
    """Return --gpu as given, else the --kernels table's GPU type, else the default type."""
    from inspector.job.hardware import DEFAULT_GPU
    from inspector.job.kernel_table import table_gpu

    if gpu is not None:
        return gpu
    return DEFAULT_GPU if table is None else table_gpu(table)


def stage_option(help_text: str) -> Any:
    return typer.Option(None, "--stage", help=help_text, rich_help_panel=OUTPUT_HELP)


def rank_option(help_text: str) -> Any:
    return typer.Option(None, "--rank", help=help_text, rich_help_panel=OUTPUT_HELP)


def emit(text: str, output: str | None = None, files: Sequence[tuple[str, str, str | bytes]] = ()) -> None:
    """Print text (or write it to -o FILE) with the command's other files (flag, path, data):
    every file written together, all or nothing (inspector.output.write_files), stdout last."""
    from inspector.cli.streams import release_notes
    from inspector.output import STDIO, write_files, write_output

    to_stdout = output is None or output == STDIO
    written = [*files, *([] if to_stdout else [("-o", str(output), text)])]
    if written:
        write_files(written)
    release_notes()  # the job was accepted: built, measured, its files written (or cached)
    if to_stdout:
        write_output(None, text)


def check_outputs(output: str | None, files: dict[str, str]) -> None:
    """Check -o FILE and the command's other files (flag -> path) before any work: each can be
    written, and no two name one file."""
    from inspector.output import STDIO, check_targets

    pairs = list(files.items()) + ([] if output is None or output == STDIO else [("-o", output)])
    check_targets(pairs)


class Progress:
    """A one-line progress indicator on stderr while stages are built.

    Only on a terminal, and only once the run has taken `delay` seconds: nothing in pipes, CI or
    captured streams. Use as a context manager; the line is erased at the end.
    """

    BUILDS = "building with megatron-core: {done} of {total} stage builds"

    def __init__(self, stream: Any = None, delay: float | None = None, what: str = BUILDS) -> None:
        import time

        if delay is None:  # INSPECT_MODEL_PROGRESS_DELAY: seconds before it shows (tests use 0)
            try:
                delay = float(os.environ.get("INSPECT_MODEL_PROGRESS_DELAY", "1"))
            except ValueError:
                delay = 1.0
        self.stream = sys.stderr if stream is None else stream
        self.what = what
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
        self._write("\r" + self.what.format(done=done, total=total) + "\x1b[K")

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


def resolve_job(args: dict[str, Any]) -> Any:
    from inspector.job.job import make_job

    return make_job(args)


def job_on_gpu(job: Any, gpu: str | None) -> Any:
    """Return `job` on the --gpu named, with the CUBLAS_WORKSPACE_CONFIG this process sees (torch
    reads the job's own environment, as for PYTORCH_CUDA_ALLOC_CONF): job/device.py."""
    from inspector.job.device import with_device

    return with_device(job, gpu, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def expandable_segments() -> bool:
    """Return whether PYTORCH_CUDA_ALLOC_CONF, as this process sees it, turns on the caching
    allocator's expandable segments: torch reads the job's own environment, so `memory` and
    `check` read it as the user sets it for the job (memory/segments.py)."""
    from inspector.memory.segments import expandable_segments as parse

    return parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
