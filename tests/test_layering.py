"""The code's layers: data flows one way, and the table reader never loads torch or megatron."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests import invariants

PACKAGE = Path(__file__).resolve().parent.parent / "inspector"


def imported_modules(path: Path) -> set[str]:
    """Return every module a file imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules() -> dict[str, set[str]]:
    return {
        str(path.relative_to(PACKAGE.parent)).removesuffix(".py").replace("/", "."): imported_modules(path)
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_only_the_cli_imports_typer_and_click() -> None:
    users = {name for name, imports in modules().items() if imports & {"typer", "click"}}
    assert users == {"inspector.cli.app", "inspector.cli.commands", "inspector.cli.entry"}


def test_the_core_never_imports_renderers_or_the_cli() -> None:
    """Core modules return records; only the cli turns them into text via inspector.render."""
    for name, imports in modules().items():
        if name == "inspector.__main__" or name.startswith("inspector.cli"):
            continue
        assert not {i for i in imports if i.startswith("inspector.cli")}, name
        if not name.startswith("inspector.render"):
            upward = {i for i in imports if i.startswith("inspector.render")}
            assert not upward, f"{name} imports {upward}"


@pytest.mark.parametrize(
    "module",
    [
        "inspector.table",
        "inspector.table_reader",
        "inspector.diff",
        "inspector.render.diff",
        "inspector.job",
    ],
)
def test_reading_and_diffing_tables_loads_no_torch_or_megatron(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}), "
        "'inspector.world' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "False"]


@pytest.mark.parametrize(
    "name, find, replace",
    [
        ("params_example.csv", ", 52074496 params", ", 52074497 params"),
        ("params_example.json", '"numel": 25821184', '"numel": 25821185'),
        ("tree_default.txt", "Module: LanguageModelEmbedding", "Module: Embedding"),
        ("topology_pp2_dp2_tp2.txt", "model=1): 1", "model=1): 2"),
        ("params_example_table.txt", "total", "totals"),
        ("memory_small.txt", "36.12        10.1", "37.12        10.1"),
        ("diff_tp2_to_tp4.md", "8 patterns", "9 patterns"),
    ],
)
def test_golden_invariants_catch_a_broken_file(name: str, find: str, replace: str) -> None:
    """Each invariant holds on the golden file and fails when one number in it is wrong."""
    text = (PACKAGE.parent / "fixtures" / "golden" / name).read_text()
    invariants.check(name, text)
    assert find in text
    with pytest.raises((AssertionError, ValueError)):
        invariants.check(name, text.replace(find, replace, 1))
