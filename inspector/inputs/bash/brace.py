"""Bash brace expansion (`{a,b}`, `{1..8}`, `{01..10..3}`, `{a..e}`), done first, on unquoted
text only, as bash does before any other expansion."""

from __future__ import annotations

import re

from inspector.inputs.bash.syntax import Lit, Part, Word

Atom = str | Part  # one unquoted character, or a part that braces cannot split
_RANGE = re.compile(r"(-?\d+|[A-Za-z])\.\.(-?\d+|[A-Za-z])(?:\.\.(-?\d+))?")
_MAX_WORDS = 10_000


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
    start = 0
    while True:
        group = _find_group(atoms, start)
        if group is None:
            return [atoms]
        begin, end, alternatives = group
        if alternatives is not None:
            out: list[list[Atom]] = []
            for alternative in alternatives:
                out.extend(_expand(atoms[:begin] + alternative + atoms[end + 1 :]))
                if len(out) > _MAX_WORDS:
                    return out[:_MAX_WORDS]
            return out
        start = begin + 1


def _find_group(atoms: list[Atom], start: int) -> tuple[int, int, list[list[Atom]] | None] | None:
    """Find the first `{` at or after start with its matching `}`; say what it expands to."""
    for begin in range(start, len(atoms)):
        if atoms[begin] != "{" or (begin and atoms[begin - 1] == "$"):
            continue
        depth, commas = 0, list[int]()
        for end in range(begin, len(atoms)):
            atom = atoms[end]
            if atom == "{":
                depth += 1
            elif atom == "}":
                depth -= 1
                if depth == 0:
                    inner = atoms[begin + 1 : end]
                    if commas:
                        cuts = [begin, *commas, end]
                        return begin, end, [atoms[a + 1 : b] for a, b in zip(cuts, cuts[1:])]
                    return begin, end, _range(inner)
            elif atom == "," and depth == 1:
                commas.append(end)
        return None
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
        if len(numbers) > _MAX_WORDS:
            return None
        return [list(f"{n:0{width}d}" if width else str(n)) for n in numbers]
    letters = range(ord(first), ord(last) + 1, step) if first <= last else range(
        ord(first), ord(last) - 1, -step)  # fmt: skip
    return [[chr(c)] for c in letters]


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
