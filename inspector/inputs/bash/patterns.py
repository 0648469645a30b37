"""Bash's patterns without backtracking: globs (`case`, `[[ == ]]`, `${v#pat}`, `${v//pat/x}`) are
matched by following every position of the pattern at once (time: text length x pattern length,
never exponential), and `[[ =~ ]]` regular expressions are checked for nested repetition and for
their worst case against the text before Python's `re` runs them. POSIX classes (`[[:digit:]]`)
mean what they mean in bash's C locale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inspector.inputs.bash.runtime import Budget

_CLASSES = {
    "alnum": "a-zA-Z0-9", "alpha": "a-zA-Z", "digit": "0-9", "lower": "a-z", "upper": "A-Z",
    "xdigit": "0-9A-Fa-f", "space": " \\t\\n\\r\\f\\v", "blank": " \\t", "word": "a-zA-Z0-9_",
    "punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"), "cntrl": "\\x00-\\x1f\\x7f",
    "print": "\\x20-\\x7e", "graph": "\\x21-\\x7e",
}  # fmt: skip
_INTERVAL = re.compile(r"\{\d*,?\d*\}")
STAR = "<*>"  # a glob item: any text (other items: ANY, one literal character, or a class)
ANY = "<?>"  # any one character


def bracket(text: str, start: int, backslash_escapes: bool) -> tuple[str, int] | None:
    """Translate the bracket expression at text[start] (`[a-z]`, `[!0-9]`, `[[:digit:]]`) to a
    Python character class; return it with the index after its `]`, or None when unclosed."""
    i = start + 1
    negate = i < len(text) and text[i] in "!^"
    i += negate
    body: list[str] = []
    first = True
    while i < len(text):
        char = text[i]
        if char == "]" and not first:
            return "[" + ("^" if negate else "") + "".join(body) + "]", i + 1
        first = False
        if char == "[" and text.startswith(":", i + 1):
            end = text.find(":]", i + 2)
            if end > 0 and text[i + 2 : end] in _CLASSES:
                body.append(_CLASSES[text[i + 2 : end]])
                i = end + 2
                continue
        if char == "\\" and backslash_escapes and i + 1 < len(text):
            i += 1
            char = text[i]
        ranged = char == "-" and body and i + 1 < len(text) and text[i + 1] != "]"
        body.append("-" if ranged else re.escape(char))
        i += 1
    return None


@dataclass(frozen=True)
class Glob:
    """A compiled glob pattern: STAR, ANY, one-character literals and compiled classes."""

    items: tuple[str | re.Pattern[str], ...]

    @property
    def size(self) -> int:
        return len(self.items)

    @staticmethod
    def compile(pieces: list[tuple[str, bool]]) -> Glob:
        """Compile a pattern's pieces (text, quoted): quoted text is literal."""
        items: list[str | re.Pattern[str]] = []
        for text, quoted in pieces:
            i = 0
            while i < len(text):
                char = text[i]
                found = bracket(text, i, True) if char == "[" and not quoted else None
                if found:
                    items.append(re.compile(found[0], re.S))
                    i = found[1]
                    continue
                if char == "\\" and not quoted and i + 1 < len(text):
                    i += 1
                    items.append(text[i])
                elif char == "*" and not quoted:
                    if not items or items[-1] != STAR:
                        items.append(STAR)
                else:
                    items.append(ANY if char == "?" and not quoted else char)
                i += 1
        return Glob(tuple(items))

    def reversed(self) -> Glob:
        return Glob(self.items[::-1])

    def _enter(self, states: set[int], state: int) -> None:
        """Add `state` and the states after the stars that follow it (a star may match nothing)."""
        states.add(state)
        while state < len(self.items) and self.items[state] == STAR:
            state += 1
            states.add(state)

    def _step(self, states: set[int], char: str) -> set[int]:
        following: set[int] = set()
        for state in states:
            if state == len(self.items):
                continue
            item = self.items[state]
            if item == STAR:
                self._enter(following, state)
            elif item == ANY or item == char or (not isinstance(item, str) and item.fullmatch(char)):
                self._enter(following, state + 1)
        return following

    def ends(self, text: str, start: int, budget: Budget, first_only: bool = False) -> list[int]:
        """Return each end such that text[start:end] matches (ascending)."""
        states: set[int] = set()
        self._enter(states, 0)
        found = [start] if len(self.items) in states else []
        for position in range(start, len(text)):
            if not states or (first_only and found):
                break
            budget.spend(len(states) + 1)
            states = self._step(states, text[position])
            if len(self.items) in states:
                found.append(position + 1)
        return found

    def fullmatch(self, text: str, budget: Budget) -> bool:
        ends = self.ends(text, 0, budget)
        return bool(ends) and ends[-1] == len(text)

    def replace(self, text: str, replacement: str, every: bool, budget: Budget) -> str:
        """`${v/pat/x}` (every: `${v//pat/x}`): the longest match at the leftmost position."""
        if not text:  # bash replaces an empty match in an empty value
            return replacement if self.ends(text, 0, budget) else text
        out: list[str] = []
        position = 0
        while position < len(text):
            ends = self.ends(text, position, budget)
            if ends and ends[-1] > position:
                out.append(replacement)
                position = ends[-1]
                if not every:
                    break
            else:
                out.append(text[position])
                position += 1
        return "".join(out) + text[position:]


def ere(pattern: str) -> str:
    """Translate a POSIX extended regular expression (bash's `=~`) to Python's syntax."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        found = bracket(pattern, i, False) if char == "[" else None
        if found:
            out.append(found[0])
            i = found[1]
            continue
        if char == "\\" and i + 1 < len(pattern):
            following = pattern[i + 1]
            gnu = {"<": "\\b", ">": "\\b"}.get(following, "\\" + following)
            out.append(gnu if following in "wWsSbB<>" else re.escape(following))
            i += 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


def regex_risk(regex: str) -> tuple[bool, int]:
    """Return (whether a repeated group holds a repetition or `|`, how many repetitions there are)
    for a translated regex: the first makes Python's backtracking exponential, the second bounds
    the work at (text length + 1) ** (repetitions + 1)."""
    groups: list[bool] = []  # per open group: holds a repetition or an alternation
    nested, repeats, i, last_group = False, 0, 0, False
    while i < len(regex):
        char = regex[i]
        repeated = char in "*+" or (char == "{" and _INTERVAL.match(regex, i) is not None)
        if char == "\\":
            i += 2
            last_group = False
            continue
        if char == "[":
            end = regex.find("]", i + 2)
            i = end + 1 if end > 0 else len(regex)
            last_group = False
            continue
        if repeated:
            repeats += 1
            nested = nested or last_group
            if groups:
                groups[-1] = True
        last_group = False
        if char == "(":
            groups.append(False)
        elif char == ")" and groups:
            inner = groups.pop()
            last_group = inner
            if inner and groups:
                groups[-1] = True
        elif char == "|" and groups:
            groups[-1] = True
        i += 1
    return nested, repeats
