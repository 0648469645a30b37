"""What running a script needs below the interpreter: values, control flow, and the reader's caps.

The caps keep any script, however written, to seconds and megabytes (docs/launch-scripts.md lists
them): bash itself has no such limits, but no launch script comes near them.
"""

from __future__ import annotations

Value = str | dict[int, str]  # a scalar, or an indexed array (index -> element)

MAX_DEPTH = 32  # functions, sourced files and `bash -c` shells inside one another
MAX_NESTING = 60  # compound commands as written, and `(`/unary operators in one `$(( ))`
MAX_RUN_DEPTH = 100  # compound commands, functions, sourced files and `eval`s running inside one another
MAX_LOOPS = 10_000  # turns of one `while`/`until` loop
MAX_STEPS = 1_000_000  # commands run in all
MAX_MATCHING = 5_000_000  # steps of pattern matching in all (text position x pattern position)
MAX_COPIED = 256 << 20  # characters assigned to variables in all
MAX_VALUE = 1 << 20  # characters in one variable or array
MAX_ELEMENTS = 1 << 14  # elements in one array
MAX_BRACE_WORDS = 10_000  # words one brace expansion makes
MAX_SCRIPT = 16 << 20  # characters in one script file or `eval`/`bash -c` text


class Exit(Exception):
    """`exit`, or a failing command under `set -e`: the shell stops; its status is on the shell."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason  # "s.sh line 4: `false` fails under `set -e`"


class Return(Exception):
    """`return`: the function or sourced file stops."""


class Break(Exception):
    """`break N` / `continue N`."""

    def __init__(self, levels: int, cont: bool):
        super().__init__(levels, cont)
        self.levels, self.cont = levels, cont


class WorkExceeded(Exception):
    """A Budget ran out; the shell names the line and the cap."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class Budget:
    """A count of work left (pattern-matching steps, characters copied) that raises when spent."""

    def __init__(self, left: int, what: str):
        self.left, self.what = left, what

    def spend(self, amount: int) -> None:
        self.left -= amount
        if self.left < 0:
            raise WorkExceeded(self.what)


def as_array(value: Value | None) -> dict[int, str]:
    """A variable as an indexed array (a scalar is element 0)."""
    if isinstance(value, dict):
        return value
    return {0: value} if value is not None else {}
