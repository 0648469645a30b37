"""Bash brace expansion (`{a,b}`, `{1..8}`, `{01..10..3}`, `{a..e}`), done first, on unquoted
text only, as bash does before any other expansion."""

from __future__ import annotations

import re

from inspector.inputs.bash.runtime import MAX_BRACE_WORDS, MAX_VALUE, WorkExceeded
from inspector.inputs.bash.syntax import Lit, Part, Word

Atom = str | Part  # one unquoted character, or a part that braces cannot split
_RANGE = re.compile(r"(-?\d+|[A-Za-z])\.\.(-?\d+|[A-Za-z])(?:\.\.(-?\d+))?")
_TOO_MANY = (f"a brace expansion makes more than {MAX_BRACE_WORDS} words or "
             f"{4 * MAX_VALUE} characters")


def expand_braces(word: Word) -> list[Word]:
    """Return the words a word's brace expressions make (the word itself when it has none)."""
    if not any(isinstance(p, Lit) and not p.quoted and "{" in p.text for p in word.parts):
        return [word]
    atoms: list[Atom] = []
    for part in word.parts:
        if isinstance(part, Lit) and not part.quoted:
            atoms.extend(part.text)
        else:
            atoms.append(part)
    return [Word(_rebuild(variant), word.raw, word.line) for variant in _expand(atoms)]


def _expand(atoms: list[Atom]) -> list[list[Atom]]:
    """Expand brace groups left to right, first alternative first, as bash orders the words."""
    done: list[list[Atom]] = []
    pending = [(atoms, 0)]
    work = 0
    while pending:
        current, start = pending.pop()
        work += len(current)
        if work > 4 * MAX_VALUE or len(done) + len(pending) > MAX_BRACE_WORDS:
            raise WorkExceeded(_TOO_MANY)
        group = _find_group(current, start)
        if group is None:
            done.append(current)
            continue
        begin, end, alternatives = group
        if alternatives is None:  # `{x}`: no comma and no range, so plain text
            pending.append((current, begin + 1))
            continue
        for alternative in reversed(alternatives):
            pending.append((current[:begin] + alternative + current[end + 1 :], begin))
    return done


def _find_group(atoms: list[Atom], start: int) -> tuple[int, int, list[list[Atom]] | None] | None:
    """Find the first `{` at or after start with its matching `}`; say what it expands to."""
    pairs: dict[int, int] = {}
    commas: dict[int, list[int]] = {}
    open_braces: list[int] = []
    for index in range(start, len(atoms)):  # one pass: an unclosed `{` is a plain character
        atom = atoms[index]
        if atom == "{" and not (index and atoms[index - 1] == "$"):
            open_braces.append(index)
        elif atom == "}" and open_braces:
            pairs[open_braces.pop()] = index
        elif atom == "," and open_braces:
            commas.setdefault(open_braces[-1], []).append(index)
    for begin in sorted(pairs):
        end = pairs[begin]
        if commas.get(begin):
            cuts = [begin, *commas[begin], end]
            return begin, end, [atoms[a + 1 : b] for a, b in zip(cuts, cuts[1:])]
        return begin, end, _range(atoms[begin + 1 : end])
    return None


def _range(inner: list[Atom]) -> list[list[Atom]] | None:
    if not all(isinstance(a, str) for a in inner):
        return None
    match = _RANGE.fullmatch("".join(str(a) for a in inner))
    if not match:
        return None
    first, last, step_text = match.groups()
    step = abs(int(step_text)) if step_text and int(step_text) else 1
    if first.lstrip("-").isdigit() != last.lstrip("-").isdigit():
        return None
    if first.lstrip("-").isdigit():
        low, high = int(first), int(last)
        padded = any(re.match(r"-?0\d", end) for end in (first, last))
        width = max(len(first), len(last)) if padded else 0
        numbers = range(low, high + 1, step) if low <= high else range(low, high - 1, -step)
        if len(numbers) > MAX_BRACE_WORDS:
            raise WorkExceeded(_TOO_MANY)
        return [list(f"{n:0{width}d}" if width else str(n)) for n in numbers]
    letters = range(ord(first), ord(last) + 1, step) if first <= last else range(
        ord(first), ord(last) - 1, -step)  # fmt: skip
    # a `\\` made is then removed as a quote, leaving an empty word
    return [[chr(c)] if c != ord("\\") else [Lit("", True)] for c in letters]


def _rebuild(atoms: list[Atom]) -> tuple[Part, ...]:
    parts: list[Part] = []
    for atom in atoms:
        if isinstance(atom, str):
            if parts and isinstance(parts[-1], Lit) and not parts[-1].quoted:
                parts[-1] = Lit(parts[-1].text + atom, False)
            else:
                parts.append(Lit(atom, False))
        else:
            parts.append(atom)
    return tuple(parts)
