"""Bash's `test` / `[ ]` / `[[ ]]` conditions, on values the script sets.

String and integer comparisons are evaluated on values as bash reads them (an unset variable is
empty). File tests of existence (`-e`, `-f`, `-d`, `-r`, `-s`, `-w`, `-x`) would look at the job's
machine: they are taken as the script hopes (the file is there), each with a note; the other file
tests (a link, a socket, a terminal, ...) are an error naming the test.
"""

from __future__ import annotations

import operator
import re

from inspector.inputs.bash.arith import evaluate_arith
from inspector.inputs.bash.context import Host
from inspector.inputs.bash.patterns import Glob, regex_risk
from inspector.inputs.bash.runtime import MAX_MATCHING

_UNARY_STRING = {"-z", "-n"}
_FILE_TESTS = {"-a", "-b", "-c", "-d", "-e", "-f", "-g", "-h", "-k", "-p", "-r", "-s", "-t", "-u",
               "-w", "-x", "-G", "-L", "-N", "-O", "-S"}  # fmt: skip
_EXISTS = {"-a": "exists", "-e": "exists", "-f": "is a file", "-d": "is a folder",
           "-r": "is readable", "-s": "is not empty", "-w": "is writable",
           "-x": "is executable"}  # what the script hopes of a file on the job's machine
_COMPARE = {"-eq": operator.eq, "-ne": operator.ne, "-lt": operator.lt, "-le": operator.le,
            "-gt": operator.gt, "-ge": operator.ge}  # fmt: skip
_INTEGER = set(_COMPARE)
_STRING = {"=", "==", "!=", "<", ">", "=~"}


class _Test:
    def __init__(self, operands: list[tuple[str, Glob | str | None]], double: bool, shell: Host):
        self.ops, self.double, self.shell, self.pos = operands, double, shell, 0
        self.shown = " ".join(shell.ctx.show(text) for text, _ in operands)

    def value(self, text: str) -> str:
        return self.shell.value(text, f"a value in the condition `{self.shown}`")

    def word(self, ahead: int = 0) -> str | None:
        index = self.pos + ahead
        return self.ops[index][0] if index < len(self.ops) else None

    def expression(self) -> bool:
        result = self.conjunction()
        while self.word() in (("||",) if self.double else ("-o",)):
            self.pos += 1
            right = self.conjunction()
            result = result or right
        return result

    def conjunction(self) -> bool:
        result = self.negation()
        while self.word() in (("&&",) if self.double else ("-a",)):
            self.pos += 1
            right = self.negation()
            result = result and right
        return result

    def negation(self) -> bool:
        if self.word() == "!" and self.pos + 1 < len(self.ops):
            self.pos += 1
            return not self.negation()
        return self.primary()

    def primary(self) -> bool:
        first = self.word()
        if first is None:
            return False
        if first == "(" and (self.double or self.pos + 2 < len(self.ops)):
            self.pos += 1
            result = self.expression()
            if self.word() != ")":
                raise self.shell.fail(f"the condition `{self.shown}` has an unclosed `(`")
            self.pos += 1
            return result
        second = self.word(1)
        if second is not None and (second in _STRING or second in _INTEGER) and (
            self.word(2) is not None
        ):
            return self.binary()
        if first in _UNARY_STRING and second is not None:
            self.pos += 2
            text = self.value(self.ops[self.pos - 1][0])
            return (text == "") == (first == "-z")
        if first == "-v" and second is not None:
            self.pos += 2
            return self.shell.lookup(second, None) is not None
        if first in _EXISTS and second is not None:
            self.pos += 2
            path = self.shell.ctx.show(second)
            self.shell.ctx.assumed += 1
            self.shell.ctx.note(f"{self.shell.where()}: took `{first} {path}` as true (the reader "
                                f"assumes {path} {_EXISTS[first]} on the job's machine)")
            return True
        if first in _FILE_TESTS and second is not None:
            raise self.shell.fail(
                f"the condition `{self.shown}` tests the file system ({first}), which the reader "
                "does not look at (the job's machine decides it)"
            )
        self.pos += 1
        return self.value(first) != ""

    def binary(self) -> bool:
        left = self.value(self.ops[self.pos][0])
        op = self.ops[self.pos + 1][0]
        right_text, right_regex = self.ops[self.pos + 2]
        self.pos += 3
        if op in _INTEGER:
            a, b = self.integer(left), self.integer(self.value(right_text))
            return bool(_COMPARE[op](a, b))
        if op == "=~":
            self.value(right_text)
            return self.regex_match(left, right_regex if isinstance(right_regex, str) else right_text)
        if op in ("<", ">"):
            right = self.value(right_text)
            return left < right if op == "<" else left > right
        if self.double and isinstance(right_regex, Glob):
            equal = right_regex.fullmatch(left, self.shell.ctx.matching)
        else:
            equal = left == self.value(right_text)
        return equal == (op != "!=")

    def regex_match(self, text: str, regex: str) -> bool:
        """`[[ text =~ regex ]]`, refused where Python's backtracking could run for long."""
        nested, repeats = regex_risk(regex)
        if nested:
            raise self.shell.fail(f"the regular expression `{regex}` repeats a group that itself "
                                  "repeats or alternates; the reader refuses it (its matching "
                                  "time can grow exponentially)")  # fmt: skip
        if (len(text) + 1) ** (repeats + 1) > MAX_MATCHING:
            raise self.shell.fail(f"the regular expression `{regex}` against a value of "
                                  f"{len(text)} characters could take more than {MAX_MATCHING} "
                                  "steps; the reader stops there")  # fmt: skip
        try:
            match = re.search(regex, text)
        except re.error:
            raise self.shell.fail(f"`{regex}` is not a regular expression") from None
        groups = [match.group(0), *match.groups()] if match else []
        self.shell.assign_array("BASH_REMATCH", {i: g or "" for i, g in enumerate(groups)})
        return match is not None

    def integer(self, text: str) -> int:
        if self.double:
            return evaluate_arith(text, self.shell)
        try:
            return int(text.strip())
        except ValueError:
            raise self.shell.fail(
                f"the condition `{self.shown}` compares {text!r} as an integer"
            ) from None


def evaluate_test(operands: list[tuple[str, Glob | str | None]], double: bool, shell: Host) -> int:
    """Return the exit status (0 true, 1 false) of `[ ... ]` or `[[ ... ]]` over expanded operands.

    Each operand is (its text, a regex when it may act as a `[[ == ]]` pattern).
    """
    test = _Test(operands, double, shell)
    if not operands:
        return 1
    result = test.expression()
    if test.pos != len(operands):
        raise shell.fail(f"the condition `{test.shown}` is not one bash can evaluate")
    return 0 if result else 1
