"""The README's examples are the tool's real behaviour: every error row and memory example is run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
ROW = re.compile(r"^\| (.+?) \| `inspect-model (.+?)` \| `(Error: .+)` \|$", re.M)
ROWS = ROW.findall(README)


def test_the_table_is_there():
    assert len(ROWS) >= 30


@pytest.mark.parametrize("what, command, message", ROWS, ids=[r[0] for r in ROWS])
def test_error_row(cli, what, command, message):
    result = cli(*shlex.split(command))
    assert (result.code, result.out) == (2, "")
    assert result.err == message.replace("\\|", "|") + "\n"


def _memory_examples() -> list[tuple[str, str]]:
    """Return each `$ inspect-model memory ...` example of the README with the output it shows."""
    lines = README.splitlines()
    examples = []
    for index, line in enumerate(lines):
        if not line.startswith("    $ inspect-model memory "):
            continue
        shown = []
        for following in lines[index + 1 :]:
            if following and not following.startswith("    "):
                break
            shown.append(following[4:])
        examples.append((line[len("    $ inspect-model ") :], "\n".join(shown).strip("\n") + "\n"))
    return examples


@pytest.mark.parametrize("command, shown", _memory_examples())
def test_memory_example_is_the_real_output(cli, command, shown):
    # The walkthrough example shows its last tables (Ulysses, then the MLP): the output ends with them.
    result = cli(*shlex.split(command))
    assert result.code == 0, result.err
    assert result.out.endswith(shown)
