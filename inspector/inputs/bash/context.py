"""What one reading of a launch script shares: unknown values (marked in text) and the commands met."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inspector.errors import InputError
from inspector.inputs.bash.runtime import MAX_COPIED, MAX_MATCHING, Budget

_MATCHING = f"pattern matching takes more than {MAX_MATCHING} steps in all"
_COPIED = f"the script assigns more than {MAX_COPIED} characters in all"
MARK = re.compile("\x00(\\d+)\x00")


# Commands that run the rest of their words as a command (`env A=1 torchrun ...`, `nohup`, ...).
PASS_THROUGH = {"env", "nohup", "exec", "command", "stdbuf", "numactl", "nice", "time"}


def program_name(word: str) -> str:
    """The program a command word names: its last path component."""
    return os.path.basename(word)

@dataclass(frozen=True)
class Unknown:
    """A value the script does not determine: shown as `text`, given with `--set hint=VALUE`."""

    text: str  # `$HIDDEN`, `$1`, `$(cat layers.txt)`
    reason: str  # "which the script never sets"
    hint: str | None  # the name for --set, or None when only a flag can give it
    # What bash reads on a fresh login shell of the job's machine: "" for an unset variable, a
    # placeholder for `$RANDOM` or `$PWD`; None where only running a command would tell.
    value: str | None = None


@dataclass(frozen=True)
class Command:
    """One command the script runs (after expansion), with where it is and the variables it sees."""

    argv: tuple[str, ...]
    origin: str
    line: int
    env: Mapping[str, str]  # exported variables and the command's own NAME=value prefixes
    outer: tuple[tuple[str, ...], ...] = ()  # `srun ... bash -c "..."` around it, outermost first
    batch: tuple[str, ...] = ()  # the #SBATCH options of the batch job it runs in

    @property
    def observed(self) -> tuple[str, ...]:
        """The command as bash starts it (the outermost launcher's argv)."""
        return self.outer[0] if self.outer else self.argv


@dataclass
class Context:
    """What the whole reading shares: unknown markers, the commands met, the main script."""

    script: str
    settings: Mapping[str, str]
    # Which commands are the launches to record (the reader of launch scripts supplies it); every
    # other external command is skipped as if it succeeded.
    is_launch: Callable[[Sequence[str]], bool] = lambda argv: False
    # A command as the launch reader spells it (a module program as its file), before is_launch.
    program_of: Callable[[Sequence[str]], Sequence[str]] = lambda argv: argv
    unknowns: list[Unknown] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    matching: Budget = field(default_factory=lambda: Budget(MAX_MATCHING, _MATCHING))
    copied: Budget = field(default_factory=lambda: Budget(MAX_COPIED, _COPIED))
    ended: str = ""  # where and why the script stopped early (`exit`, `set -e`), if it did
    notes: list[str] = field(default_factory=list)  # assumptions made, for stderr
    unset_read: dict[str, str] = field(default_factory=dict)  # --set name -> where read as empty
    # the unset names read by the test being run (an `if` condition, the left of `&&`/`||`), and
    # those of the test whose branch is running: where that branch exits, what decided it
    reading: list[str] | None = None
    guard: tuple[str, ...] = ()
    taint: list[Unknown] | None = None  # unknowns read while an `$(( ))` is evaluated
    assumed: int = 0  # file tests taken as true so far (conditions.py)
    # The launches of branches that a file test taken as true skipped: what the script runs
    # where the file is missing (a conversion before training, say). Shell.skipped fills it.
    skipped: list[Command] = field(default_factory=list)
    dry: bool = False  # a skipped branch is being read for its launches
    steps: int = 0  # simple commands run
    depth: int = 0  # compound commands, functions and sourced texts running inside one another
    kept_mark: str = ""  # marks a word of only unset variables that a quoted part keeps (`kept`)

    def mark(self, unknown: Unknown) -> str:
        self.unknowns.append(unknown)
        return f"\x00{len(self.unknowns) - 1}\x00"

    def unknown_in(self, text: str) -> Unknown | None:
        match = MARK.search(text)
        return self.unknowns[int(match.group(1))] if match else None

    def show(self, text: str) -> str:
        return MARK.sub(lambda m: self.unknowns[int(m.group(1))].text, text)

    def held(self, text: str) -> list[Unknown]:
        """The unknowns a text holds, in order."""
        return [self.unknowns[int(m.group(1))] for m in MARK.finditer(text)]

    def bash_value(self, text: str) -> str | None:
        """The text as bash reads it (each unknown replaced by its value), or None where an
        unknown has no value bash could know without running a command."""
        if any(unknown.value is None for unknown in self.held(text)):
            return None
        return MARK.sub(lambda m: self.unknowns[int(m.group(1))].value or "", text)

    def unset_in(self, text: str) -> bool:
        """Whether a text holds an unset variable."""
        return any(unknown.value == "" for unknown in self.held(text))

    def is_unset(self, text: str) -> bool:
        """Whether a text is only unset variables (bash drops it as an unquoted word)."""
        kept = bool(self.kept_mark) and self.kept_mark in text
        return bool(text) and not kept and not MARK.sub("", text) and self.bash_value(text) == ""

    def kept(self, text: str) -> str:
        """A word of only unset variables with a quoted part (`"$X"`, `""$X`, `$X''`), which
        bash keeps as one empty word: marked so that `is_unset` holds no more."""
        if not self.kept_mark:
            self.kept_mark = self.mark(Unknown("", "which bash keeps as an empty word", None, ""))
        return text + self.kept_mark

    def unkept(self, text: str) -> str:
        """The word without the mark `kept` gave it."""
        return text.replace(self.kept_mark, "") if self.kept_mark else text

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)


class Host(Protocol):
    """What arithmetic and conditions need of the shell that evaluates them."""

    ctx: Context

    def fail(self, message: str) -> InputError: ...
    def require(self, text: str, what: str) -> str: ...
    def value(self, text: str, what: str) -> str: ...
    def read_unset_name(self, name: str) -> None: ...
    def where(self) -> str: ...
    def lookup(self, name: str, index: str | None) -> list[str] | None: ...
    def assign(self, name: str, value: str) -> None: ...
    def assign_array(self, name: str, elements: dict[int, str]) -> None: ...


def describe_unknown(unknown: Unknown, what: str, shown: str | None = None) -> str:
    """One sentence: where an unknown value is used, why it is unknown, how to give it."""
    if unknown.hint is None:
        how = "give the value with its own flag instead"
    elif unknown.hint.isdigit():
        how = f"give it with --set {unknown.hint}=VALUE (positional parameters are --set 1=..., 2=...)"
    else:
        how = f"give it with --set {unknown.hint}=VALUE"
    if shown is not None and shown != unknown.text:
        return f"{what} is {shown}, where {unknown.text} is a value {unknown.reason}; {how}"
    return f"{what} is {unknown.text}, {unknown.reason}; {how}"


def script_dir(ctx: Context) -> str:
    return os.path.dirname(os.path.abspath(ctx.script))
