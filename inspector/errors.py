"""Errors the CLI reports to the user; everything else is a bug and keeps its traceback."""

import re


class InspectorError(Exception):
    """Bad user input: the CLI prints `Error: <message>` on stderr and exits 2."""

    exit_code = 2


class ConfigError(InspectorError):
    """A model or layout that cannot be built as asked (names the flag and the arithmetic)."""


class InputError(InspectorError):
    """A file given to the tool that is missing, unreadable or malformed."""


class FidelityError(Exception):
    """The built tables contradict megatron-core itself: a bug in this tool, exit 3."""

    exit_code = 3


class OutputError(InspectorError):
    """A file or stream the tool writes to that cannot be written (`-o FILE`, stdout)."""


def one_line(message: str) -> str:
    """Return an error message as one line, without a sentence that repeats the one before it.

    click's "No such command" message already ends in "Did you mean ...?", and typer appends
    the same suggestion again; multi-line messages from libraries are joined with "; ".
    """
    parts = [part.strip() for part in message.strip().splitlines() if part.strip()]
    text = "; ".join(parts)
    sentences = [s for s in re.split(r"(?<=[.?!])\s+", text) if s]
    kept = [s for i, s in enumerate(sentences) if i == 0 or s != sentences[i - 1]]
    return " ".join(kept)
