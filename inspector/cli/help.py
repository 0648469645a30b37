"""Help pages: short by default (`-h`), every Megatron-LM flag with `--help-all`.

A command's `-h` (at most 40 lines) shows its own and output options, the input options, the
Megatron-LM flags most jobs set (a switch by its on-form only), two examples and a line pointing
at `--help-all`; `--help-all` adds every model, layout and
training flag in its panel. `inspect-model --help` lists each command with its whole first sentence.
"""

from __future__ import annotations

from typing import Any

import click
import typer

SOURCE_HELP = "Input: the model and where its arguments come from"
OUTPUT_HELP = "Output"
PANELS = {
    "model": "Model: Megatron-LM model arguments",
    "layout": "Parallel layout",
    "training": "Training: Megatron-LM training arguments",
}
COMMON_HELP = "Most used Megatron-LM flags"
HELP_ALL = "help_all"
# Options a command needs although a --config file or --from-script may give them: click must not
# require them (our own `Error:` says what is missing), but help marks them.
REQUIRED_IN_HELP = {"memory": ("--micro-batch-size",)}
# The Megatron-LM flags `-h` shows, by command (the rest: COMMON); `--help-all` shows them all.
COMMON = (
    "--bf16", "--seq-length", "--num-layers", "--hidden-size",
    "--tp", "--pp", "--dp", "--sequence-parallel", "--use-distributed-optimizer",
)  # fmt: skip
TRAINING_COMMON = (
    "--bf16", "--seq-length", "--tp", "--pp", "--dp", "--use-distributed-optimizer",
    "--micro-batch-size", "--global-batch-size",
)  # fmt: skip
COMMON_BY_COMMAND = {
    "memory": TRAINING_COMMON,
    "workload": TRAINING_COMMON,
    "plan": ("--bf16", "--seq-length", "--global-batch-size", "--micro-batch-size"),
    "check": TRAINING_COMMON,
}
# Input options `-h` leaves to `--help-all`.
RARE_INPUTS = ("--no-cache", "--apex", "--kernels", "--set")  # --set: with --from-script only
EXAMPLES = {
    "tree": (
        "inspect-model tree --model llama3-8b --pp 4 --stage 3",
        "inspect-model tree --tp 2 --pp 2 --rank 3",
    ),
    "topology": (
        "inspect-model topology --tp 2 --pp 2 --dp 2",
        "inspect-model topology --tp 8 --pp 4 --dp 8 --format table",
    ),
    "params": (
        "inspect-model params --model llama3-8b --tp 2 --pp 2 -o table.csv",
        "inspect-model params --model llama3-8b --tp 2 --pp 2 --check table.csv",
    ),
    "memory": (
        "inspect-model memory --model llama3-8b --bf16 --micro-batch-size 1 --gpu-memory 80",
        "inspect-model memory --model llama3-70b --tp 8 --pp 4 --dp 8 --bf16 --micro-batch-size 1 "
        "--global-batch-size 512 --sequence-parallel --use-distributed-optimizer",
    ),
    "plan": (
        "inspect-model plan --model llama3-70b --gpus 512 --global-batch-size 512 --bf16",
        "inspect-model plan --model llama3-8b --gpus 64 --global-batch-size 256 --bf16 --explain",
    ),
    "workload": (
        "inspect-model workload --model llama3-8b --tp 2 --pp 2 --dp 2 --bf16 "
        "--micro-batch-size 1 --gpu-tflops 989 --mfu 0.4 -o wl",
        "inspect-model workload --model llama3-8b --pp 2 --bf16 --micro-batch-size 1 "
        "--gpu-tflops 989 --stage 1",
    ),
    "diff": (
        "inspect-model diff old.csv new.csv",
        "inspect-model diff old.csv new.csv --format markdown > comment.md",
    ),
    "models": ("inspect-model models", "inspect-model params --model llama3-8b --format table"),
    "calibrate": (
        "inspect-model calibrate -o kernels-mygpu.json",
        "inspect-model plan --model llama3-8b --gpus 64 --global-batch-size 256 --bf16 "
        "--kernels kernels-mygpu.json",
    ),
    "check": (
        "inspect-model check train.log --from-script train.sh --gpu h100",
        "inspect-model check train.log --from-script train.sh --kernels kernels-mygpu.json",
    ),
}


def _show_all(ctx: Any, param: Any, value: bool) -> None:
    """Print the whole help page, every Megatron-LM flag included, and exit."""
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[HELP_ALL] = True
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


def _takes_megatron_flags(command: click.Command) -> bool:
    return any(getattr(p, "rich_help_panel", None) in PANELS.values() for p in command.params)


class PanelCommand(typer.core.TyperCommand):
    """Help grouped in panels (each option's rich_help_panel), in plain text: rich stays unloaded."""

    _help_all: click.Option | None = None

    def get_short_help_str(self, limit: int = 45) -> str:
        """Return the help's first sentence whole (click would cut it at `limit` characters)."""
        first = (self.help or "").strip().split("\n\n")[0]
        return " ".join(first.split())

    def get_params(self, ctx: Any) -> list[Any]:
        """Return the command's parameters, with `--help-all` before `-h` where it has more."""
        params = super().get_params(ctx)
        if self._help_all is None:  # every command: the same page as -h where it has no more
            self._help_all = click.Option(
                ["--help-all"], is_flag=True, expose_value=False, is_eager=True,
                callback=_show_all, help="Show every option too.",
            )  # fmt: skip
        return [*params[:-1], self._help_all, params[-1]]

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Write the options panel by panel; without --help-all, only the most used flags."""
        panels = self._panels(ctx, every=bool(ctx.meta.get(HELP_ALL)))
        order = ["Arguments", "Options", SOURCE_HELP, COMMON_HELP, *PANELS.values(), OUTPUT_HELP]
        for panel, records in sorted(panels.items(), key=lambda item: order.index(item[0])):
            with formatter.section(panel):
                formatter.write_dl(records)

    def _panels(self, ctx: Any, every: bool) -> dict[str, list[tuple[str, str]]]:
        panels: dict[str, list[tuple[str, str]]] = {}
        required = REQUIRED_IN_HELP.get(self.name or "", ())
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if any(opt in required for opt in param.opts):
                record = (record[0], f"{record[1]}  [required]".lstrip())
            panel = getattr(param, "rich_help_panel", None) or "Options"
            if param.param_type_name == "argument":
                panel = "Arguments"
            elif not every and panel in PANELS.values():
                common = COMMON_BY_COMMAND.get(self.name or "", COMMON)
                if not any(opt in common for opt in param.opts):
                    continue
                panel, record = COMMON_HELP, (record[0].split(", ")[-1], record[1])
            elif not every and panel == SOURCE_HELP and any(o in RARE_INPUTS for o in param.opts):
                continue
            if not every:  # the short page: output options with the command's own, flags' on-form
                panel = "Options" if panel == OUTPUT_HELP else panel
                record = (record[0].split(" / ")[0], record[1])
            panels.setdefault(panel, []).append(record)
        return panels

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        """Write two examples and, on the short page, where the other flags are."""
        examples = EXAMPLES.get(self.name or "", ())
        if examples:
            with formatter.section("Examples"):
                for example in examples:  # whole lines, to copy
                    formatter.write(f"{'':>{formatter.current_indent}}{example}\n")
        if _takes_megatron_flags(self) and not ctx.meta.get(HELP_ALL):
            formatter.write_paragraph()
            formatter.write_text(
                f"`inspect-model {self.name} --help-all` lists every Megatron-LM flag it takes."
            )


def command_help(group_ctx: Any, name: str) -> str:
    """Return a command's whole help page (`--help-all`'s), under the group's context."""
    command = group_ctx.command.commands[name]
    with command.make_context(name, [], parent=group_ctx, resilient_parsing=True) as ctx:
        ctx.meta[HELP_ALL] = True
        return str(command.get_help(ctx))


def every_page(group_ctx: Any) -> str:
    """Return `inspect-model --help-all`: the main help, then every command's whole page."""
    parts = [group_ctx.command.get_help(group_ctx)]
    for name in group_ctx.command.commands:
        parts += ["", f"inspect-model {name}", "", command_help(group_ctx, name)]
    return "\n".join(parts) + "\n"

