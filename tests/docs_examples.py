"""The `$` examples of README.md and docs/*.md: found, run as a shell would, compared with the page.

An example is a `$ COMMAND` line in a code block (indented or fenced), continued by trailing
backslashes, followed by the output the page shows, up to the next `$` line or the block's end.
A shown line `...` stands for any number of lines; `...` inside a line for any text. The command
runs in a folder of its own per page (fixtures/ linked in), so one example can write a file the next
one reads. `inspect-model` runs in this process; `cat`, `head`, `tail`, `sed -n A,Bp` and `grep`
are read here; `> FILE` writes stdout to FILE, and then the page shows stderr.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_PROMPT = re.compile(r"^(\s*)\$ (.*)$")


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    command: str
    shown: tuple[str, ...]


def pages() -> list[Path]:
    """Return README.md and every docs page that is written by hand."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples(path: Path) -> list[Example]:
    """Return the page's examples in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        match = _PROMPT.match(lines[index])
        if match is None:
            index += 1
            continue
        indent, command, start = match.group(1), match.group(2), index
        while command.endswith("\\"):
            index += 1
            command = command[:-1].rstrip() + " " + lines[index].strip()
        index += 1
        shown = []
        while index < len(lines) and not _PROMPT.match(lines[index]):
            line = lines[index]
            if line.strip().startswith("```") or (line.strip() and not line.startswith(indent)):
                break
            if not indent and not line.strip() and not lines[index - 1].strip():
                break
            shown.append(line[len(indent) :].rstrip())
            index += 1
        while shown and not shown[-1]:
            shown.pop()
        found.append(Example(path.name, start + 1, command, tuple(shown)))
    return found


def _segments(command: str) -> list[list[str]]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|>")
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token == "|":
            segments.append([])
        else:
            segments[-1].append(token)
    return segments


def _filter(words: list[str], text: str, folder: Path) -> str:
    """Run one of the few text tools the pages use, on `text` or on the file it names last."""
    tool, *rest = words
    takes = {"cat": 0, "head": 1, "tail": 1, "sed": 2, "grep": 1, "cut": 2}[tool]  # arguments before FILE
    if len(rest) > takes or tool == "cat":
        text = (folder / rest.pop()).read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    if tool in ("head", "tail"):
        count = int(rest[0].lstrip("-n")) if rest else 10
        return "".join(lines[:count] if tool == "head" else lines[-count:])
    if tool == "sed":
        assert rest[0] == "-n", words
        first, last = rest[1].rstrip("p").split(",")
        return "".join(lines[int(first) - 1 : int(last)])
    if tool == "grep":
        return "".join(line for line in lines if re.search(rest[0], line))
    if tool == "cut":  # cut -f LIST on tab-separated fields
        assert rest[0] == "-f", words
        fields = [int(field) - 1 for field in rest[1].split(",")]
        cells = [line.rstrip("\n").split("\t") for line in lines]
        return "".join("\t".join(row[f] for f in fields if f < len(row)) + "\n" for row in cells)
    return text


def run(example: Example, folder: Path, cli) -> tuple[int, str]:
    """Run the example in `folder`; return its exit status and what a terminal would show."""
    code, text, err = 0, "", ""
    for position, words in enumerate(_segments(example.command)):
        target = None
        if ">" in words:
            at = words.index(">")
            words, target = words[:at], words[at + 1]
        if words[0] == "inspect-model":
            assert position == 0, example.command
            result = cli(*words[1:])
            code, text, err = result.code, result.out, result.err
        else:
            text = _filter(words, text, folder)
        if target is not None:
            (folder / target).write_text(text, encoding="utf-8")
            text = ""
    return code, err + text


def _pattern(line: str) -> re.Pattern[str]:
    """Return a shown line as a pattern: `...` stands for anything, and a table's padding (a run
    of two or more spaces or dashes) for any such run, since a column is as wide as its widest
    row, which the page may leave out (another megatron-core's plan 2 or 3, say)."""
    def literal(part: str) -> str:
        return "".join(r" {2,}" if run.startswith("  ") else r"-{2,}" if run.startswith("--")
                       else re.escape(run) for run in re.split(r"( {2,}|-{2,})", part))  # fmt: skip

    return re.compile(".*".join(literal(part) for part in line.split("...")))


def _matches(shown: tuple[str, ...], actual: tuple[str, ...]) -> bool:
    patterns = tuple(None if line.strip() == "..." else _pattern(line) for line in shown)

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(patterns):
            return j == len(actual)
        pattern = patterns[i]
        if pattern is None:
            return any(match(i + 1, k) for k in range(j, len(actual) + 1))
        return j < len(actual) and bool(pattern.fullmatch(actual[j])) and match(i + 1, j + 1)

    return match(0, 0)


def check(example: Example, code: int, output: str) -> None:
    """Fail unless the output is what the page shows, and the exit status what it implies."""
    from tests.test_versions import as_printed_by_0_16

    # the pages show megatron-core 0.16's linear reprs (tests/test_versions.py)
    output = as_printed_by_0_16(output)
    actual = tuple(line.rstrip() for line in output.rstrip("\n").splitlines())
    where = f"{example.page} line {example.line}: $ {example.command}"
    if example.shown and example.shown[0].startswith("Error: "):
        assert code == 2, where
    else:
        words = example.command.split()
        allowed = {0, 1} if "diff" in words[:2] or "--check" in words else {0}
        assert code in allowed, f"{where}\nexit {code}\n{output}"
    assert _matches(example.shown, actual), f"{where}\nshows:\n" + "\n".join(
        example.shown
    ) + "\nbut prints:\n" + "\n".join(actual)
