"""Errors the CLI reports to the user; everything else is a bug and keeps its traceback."""


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
