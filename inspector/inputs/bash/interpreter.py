"""Read a launch script as bash would on a fresh login shell: the one entry point of inputs/bash."""

from __future__ import annotations

from inspector.inputs.bash.batch import sbatch_options, start_job
from inspector.inputs.bash.commands import Builtins
from inspector.inputs.bash.context import Context
from inspector.inputs.bash.runtime import Break, Exit, Return, Value
from inspector.inputs.bash.shell import Shell


def new_shell(ctx: Context, origin: str) -> Shell:
    """Return the main script's shell: --set values are its environment (exported)."""
    positional_keys = sorted(int(k) for k in ctx.settings if k.isdigit())
    positional: list[str] = []
    if positional_keys:
        positional = [ctx.settings.get(str(n), "") for n in range(1, max(positional_keys) + 1)]
    variables: dict[str, Value] = {k: v for k, v in ctx.settings.items() if not k.isdigit()}
    return Shell(ctx, Builtins(), origin, positional, variables, set(variables))


def interpret(ctx: Context, text: str) -> None:
    """Run the script `text` (the file ctx.script) without running anything; fill ctx."""
    shell = new_shell(ctx, ctx.script)
    start_job(shell, sbatch_options(text))
    try:
        shell.run_text(text, ctx.script)
    except Exit as stop:
        ctx.ended = stop.reason
    except (Return, Break):
        pass
    except RecursionError:  # the caps (runtime.py) keep to Python's stack; this is the backstop
        raise shell.fail("the script nests too deeply for the reader") from None
