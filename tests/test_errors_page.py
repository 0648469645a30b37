"""docs/errors.md is the tool's real behaviour: every row of its table is run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
ROW = re.compile(r"^\| (.+?) \| `inspect-model (.+?)` \| `(Error: .+)` \|$", re.M)
ROWS = ROW.findall(PAGE)


def test_the_table_is_there():
    assert len(ROWS) >= 30


@pytest.mark.parametrize("what, command, message", ROWS, ids=[r[0] for r in ROWS])
def test_error_row(cli, what, command, message):
    result = cli(*shlex.split(command))
    assert (result.code, result.out) == (2, "")
    assert result.err == message.replace("\\|", "|") + "\n"
