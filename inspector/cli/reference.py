"""The CLI reference (docs/reference.md), generated from the typer app so it cannot drift.

`python -m inspector.cli.reference > docs/reference.md` writes it; `make golden` does too, and
tests/test_docs.py fails while the committed page differs from what this returns.
"""

from __future__ import annotations

import sys
from typing import Any

from typer.main import get_command

from inspector.cli.help import command_help

WIDTH = 100  # help is wrapped at this width, whatever the terminal


def render_reference() -> str:
    """Return the reference page: the main help, then every command's whole help page."""
    from inspector.cli import entry  # noqa: F401  (registers the top-level options)
    from inspector.cli.app import app

    group = get_command(app)
    settings: dict[str, Any] = dict(
        resilient_parsing=True, terminal_width=WIDTH, max_content_width=WIDTH
    )
    with group.make_context("inspect-model", [], **settings) as ctx:
        parts = [
            "# Command reference",
            "",
            "Generated from the command line itself (`python -m inspector.cli.reference`); "
            "`inspect-model COMMAND -h` shows the short page, `--help-all` this one.",
            "",
            "```",
            group.get_help(ctx),
            "```",
        ]
        for name in group.commands:  # type: ignore[attr-defined]
            parts += ["", f"## `inspect-model {name}`", "", "```", command_help(ctx, name), "```"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_reference())
