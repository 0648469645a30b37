"""The README's examples are the tool's real behaviour: every error-table row is run here."""

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
