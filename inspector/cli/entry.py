"""The entry point: run the app, and turn every bad input into `Error:` and one sentence."""

from __future__ import annotations

import gc
import sys
from functools import cache
from typing import Any

import typer

from inspector import __version__
from inspector.cli.app import app, click_errors, finite_floats
from inspector.errors import FidelityError, InspectorError


def _version(value: bool) -> None:
    if value:
        typer.echo(f"inspect-model {__version__}")
        raise typer.Exit()


def _help_all(ctx: typer.Context, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from inspector.cli.help import every_page

        typer.echo(every_page(ctx), nl=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    help_all: bool = typer.Option(
        False, "--help-all", callback=_help_all, is_eager=True,
        help="Show every command's whole help page and exit.",
    ),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks behind errors."),
) -> None:
    """See what every rank holds in megatron-core's GPT and hybrid models, without a GPU."""
    _STATE["debug"] = _STATE["debug"] or debug


_STATE: dict[str, bool] = {"debug": False}


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; `Error:` + one sentence on stderr and exit 2 for any bad input."""
    code = _run(argv)
    if argv is None:  # the program itself, which exits next
        # Python's exit collects garbage over every object still alive: torch's, megatron's and
        # a plan search's caches (~0.8 s after a large search). None of it is garbage to find.
        gc.freeze()
    return code


def _refused(flag: str) -> str | None:
    """Return why a Megatron-LM flag this tool refuses or ignores in a launch script is not taken
    here (inputs/unmodelled.py, inputs/ignored.py), or None for a flag it does not know."""
    from inspector.inputs.ignored import IGNORED
    from inspector.inputs.refusals import refused_argument
    from inspector.inputs.tokenizers import TOKENIZER_FLAGS
    from inspector.inputs.versions import null_tokenizer_adds_eod

    if flag in TOKENIZER_FLAGS:  # they set the vocabulary where a script or config file gives them
        eod = " + 1" if null_tokenizer_adds_eod() else ""
        return (f"{flag} is read from a launch script or config file (--from-script, --config), "
                "where it sets the vocabulary; on the command line give --vocab-size as Megatron-LM's "
                f"tokenizer reports it (NullTokenizer: its --vocab-size{eod})")  # fmt: skip
    if flag in IGNORED:  # a script's "Ignored from" line; the command line takes modelled flags only
        return (f"{flag} is a Megatron-LM argument that changes nothing this tool reports: "
                f"{IGNORED[flag]}; drop it here (a launch script or config file may keep it)")
    refusal = refused_argument(flag, None, "")
    return None if refusal is None else f"{refusal.argument} is {refusal.verb}: {refusal.reason}"


def _run(argv: list[str] | None) -> int:
    from inspector.cli.streams import guard_streams
    from inspector.output import forget_reads

    forget_reads()  # an output may not replace a file this command reads (output.check_targets)
    guard_streams()  # UTF-8 stdout; a failed write is an Error:, a closed pipe a quiet exit 141
    args, _STATE["debug"] = _take_debug(sys.argv[1:] if argv is None else argv)
    args = _join_many(args)
    command = _command()
    try:
        result = command.main(args=args, prog_name="inspect-model", standalone_mode=False)
    except click_errors.NoSuchOption as exc:
        refused = _refused(exc.option_name)
        if refused is not None:
            return _fail(refused)
        close = sorted(exc.possibilities or [])
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        return _fail(f"no such option: {exc.option_name}{hint}")
    except click_errors.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:
            typer.echo(exc.ctx.get_help())
            return 0
        return _fail(_extra_word(exc.format_message(), args))
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


def _extra_word(message: str, args: list[str]) -> str:
    """Name an empty word click found where an option should be ("Got unexpected extra argument
    ()"): its position and the word before it, as for a launch script's."""
    if not message.startswith("Got unexpected extra argument") or "" not in args:
        return message
    index = args.index("")
    place = f"after {args[index - 1]}" if index else "first"
    return (f"argument {index + 1} of the command line ({place}) is an empty word, '', where an "
            "option should be; drop it")  # fmt: skip


@cache
def _command() -> Any:
    """Return the app as click's command, built once per process: typer builds it anew from the
    options' annotations on every call (~17 ms, most of a small `params` run in this process)."""
    return finite_floats(typer.main.get_command(app))


def _take_debug(argv: list[str]) -> tuple[list[str], bool]:
    """Remove `--debug` wherever it stands before `--` (after the command too); say if it did."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [arg for arg in argv[:end] if arg != "--debug"] + argv[end:]
    return kept, len(kept) != len(argv)


def _join_many(argv: list[str]) -> list[str]:
    """Join the words after a flag Megatron-LM declares nargs='*' (`--recompute-modules
    mla_up_proj mlp`) into its one value, as Megatron-LM's argparse reads them (up to the next
    word starting with `-`, before any `--`)."""
    from inspector.inputs.arguments import ARGUMENTS

    many = {spec.flag for spec in ARGUMENTS if spec.many}
    end = argv.index("--") if "--" in argv else len(argv)
    out: list[str] = []
    index = 0
    while index < end:
        out.append(argv[index])
        index += 1
        if out[-1] in many:
            words = []
            while index < end and not argv[index].startswith("-"):
                words.append(argv[index])
                index += 1
            if words:
                out.append(" ".join(words))
    return out + argv[end:]


def _fail(message: str, code: int = 2) -> int:
    from inspector.cli.streams import write_error
    from inspector.errors import one_line

    write_error(one_line(message))
    return code


if __name__ == "__main__":
    sys.exit(main())
