"""The command line: parse flags, call the core, print what a renderer returns, map errors.

app.py holds the typer app and the options commands share, commands.py, other_commands.py and
measure_commands.py the commands, entry.py `main` (the console script). Only this package
imports typer and click.
"""

from inspector.cli import commands, other_commands  # noqa: F401  (register the commands, in order)

from inspector.cli import measure_commands  # noqa: F401  # isort: skip  (calibrate, check: last)
from inspector.cli.app import Progress, app
from inspector.cli.entry import main

__all__ = ["Progress", "app", "main"]
