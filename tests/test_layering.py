"""The code's layers: each folder imports only the folders below it, with no cycles.

The table below is the architecture (inspector/README.md draws it). A folder may import itself and
the folders it lists; every other import of an `inspector` module fails here, whether it sits at
the top of a file, inside a function, or under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests import invariants

PACKAGE = Path(__file__).resolve().parent.parent / "inspector"

# folder -> the folders it may import (besides itself). "" is the package's own top-level modules.
LAYERS: dict[str, set[str]] = {
    "": set(),  # inspector/__init__.py: the version
    "errors": set(),
    "records": set(),
    "guard": set(),  # signals held and stale temporaries removed around a write
    "output": {"errors", "guard"},
    "export": {"errors", "output", "guard"},  # -o DIR: a folder of files written whole, beside output's -o FILE
    "inputs.bash": {"errors", "output"},  # output: files read within bounds (`source`)
    "inputs": {"errors", "output", "inputs.bash"},
    "job": {"errors", "inputs"},
    "formulas": {"errors", "job"},
    "world.te": set(),
    "world": {"errors", "records", "job", "world.te"},
    "caches": set(),  # the planner's caches, one owner: caches.clear() empties them all
    # memory: every way a rank's bytes are found (inspector/memory/README.md)
    "memory.closed": {"errors", "job"},  # the closed forms, kept as cross-checks
    # memory.engine: runs megatron's forward, backward and optimizer step on the world's stages
    "memory.engine": {"errors", "records", "job", "formulas", "world", "world.te"},
    "memory": {"errors", "records", "job", "formulas", "world", "memory.closed", "memory.engine"},
    "memory.compose": {"errors", "caches", "job", "world", "memory", "memory.closed"},
    "report": {"errors", "records", "output", "job", "formulas", "world", "memory",
               "memory.engine"},
    "plan": {"errors", "inputs", "caches", "job", "formulas", "world", "memory", "memory.closed",
             "memory.compose", "memory.engine"},
    # measure: kernel micro-benchmarks on this machine's GPU (calibrate), torch's own kernels
    "measure": {"errors", "job", "formulas"},
    "render": {"records", "inputs", "job", "formulas", "report", "plan", "memory", "memory.closed",
               "memory.engine"},
    "cli": {"", "errors", "records", "output", "export", "inputs", "job", "formulas", "world",
            "report", "plan", "render", "memory", "memory.engine", "measure"},
    "__main__": {"cli"},
}
# Only these folders may import torch or megatron (the simulated world runs megatron-core's code).
TORCH_FOLDERS = {"world", "world.te", "memory.engine", "measure"}

# Import cycles between modules of one folder that are still to be broken; each is listed so that
# no new one can appear unnoticed.
KNOWN_CYCLES: set[frozenset[str]] = set()


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


@cache
def parsed_modules() -> dict[str, frozenset[str]]:
    return {
        str(path.relative_to(PACKAGE.parent)).removesuffix(".py").replace("/", "."): frozenset(
            imported_modules(path)
        )
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def modules() -> dict[str, set[str]]:
    """Each module of the package and the modules it imports (a fresh copy each call)."""
    return {name: set(imports) for name, imports in parsed_modules().items()}


@cache
def module_names() -> frozenset[str]:
    return frozenset(name.removesuffix(".__init__") for name in parsed_modules())


def inspector_imports(imports: set[str]) -> set[str]:
    """The inspector modules among `imports` (a `from pkg import name` counts the module it names)."""
    known = module_names()
    return {name for name in imports if name in known}


def folder(module: str) -> str:
    """The layer a module belongs to: its folder under inspector, or its name if top-level."""
    parts = module.removeprefix("inspector").removeprefix(".").removesuffix(".__init__").split(".")
    if ".".join(parts[:2]) in LAYERS:
        return ".".join(parts[:2])
    return parts[0] if parts[0] in LAYERS else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Return one line per import that the LAYERS table does not allow."""
    bad = []
    for name, imports in graph.items():
        here = folder(name)
        allowed = LAYERS.get(here, set()) | {here}
        for target in sorted(inspector_imports(imports)):
            there = folder(target)
            if there not in allowed:
                bad.append(f"{name} ({here or 'top level'}) imports {target} ({there or 'top level'})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Return the strongly connected groups of more than one module (Tarjan).

    A module's import of its own package (`inspector.cli.commands` reading `inspector.cli`) is no
    edge: Python imports a package before any module in it.
    """

    def ancestors(name: str) -> set[str]:
        parts = name.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}

    edges = {
        name.removesuffix(".__init__"): {
            t.removesuffix(".__init__") for t in inspector_imports(imports)
        } - ancestors(name.removesuffix(".__init__"))
        for name, imports in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.add(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(frozenset(m.removeprefix("inspector.") for m in group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_every_folder_imports_only_the_folders_below_it() -> None:
    assert layering_violations(modules()) == []


def test_every_module_belongs_to_a_layer() -> None:
    unplaced = sorted(n for n in modules() if n != "inspector.__init__" and folder(n) == "")
    assert unplaced == []


def test_the_table_has_no_cycle() -> None:
    """A layer may import only layers that do not import it back, directly or through others."""
    graph = {layer: set(allowed) - {layer} for layer, allowed in LAYERS.items()}
    order: list[str] = []
    while graph:
        ready = sorted(layer for layer, deps in graph.items() if not deps - set(order))
        assert ready, f"cycle among {sorted(graph)}"
        order.extend(ready)
        for layer in ready:
            del graph[layer]


def test_no_module_import_cycles_beyond_the_known_ones() -> None:
    assert set(cycles(modules())) <= KNOWN_CYCLES


def test_only_the_world_imports_torch_or_megatron() -> None:
    for name, imports in modules().items():
        heavy = {i for i in imports if i.split(".")[0] in ("torch", "megatron")}
        if heavy:
            assert folder(name) in TORCH_FOLDERS, f"{name} imports {sorted(heavy)}"


def test_a_forbidden_import_is_caught() -> None:
    """The check fails on an upward import, inside a function or under TYPE_CHECKING alike."""
    graph = modules()
    for added in ("inspector.plan.search", "inspector.memory.measure", "inspector.cli.app"):
        broken = dict(graph)
        broken["inspector.job.layout"] = graph["inspector.job.layout"] | {added}
        assert layering_violations(broken), added
    code = "if TYPE_CHECKING:\n    from inspector.world.build import BuiltJob\n"
    assert "inspector.world.build" in inspector_imports(
        {n for node in ast.walk(ast.parse(code)) if isinstance(node, ast.ImportFrom)
         for n in (node.module or "",)}
    )


def test_a_new_cycle_is_caught() -> None:
    graph = modules()
    broken = dict(graph)
    broken["inspector.job.model"] = graph["inspector.job.model"] | {"inspector.job.job"}
    assert set(cycles(broken)) - KNOWN_CYCLES


def test_only_the_cli_imports_typer_and_click() -> None:
    users = {name for name, imports in modules().items() if imports & {"typer", "click"}}
    assert users == {
        "inspector.cli.app", "inspector.cli.commands", "inspector.cli.entry", "inspector.cli.help",
        "inspector.cli.other_commands", "inspector.cli.measure_commands",
    }  # fmt: skip


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
        "inspector.report.table",
        "inspector.report.table_reader",
        "inspector.report.diff",
        "inspector.render.diff",
        "inspector.job.job",
    ],
)
def test_reading_and_diffing_tables_loads_no_torch_or_megatron(module: str) -> None:
    code = (
        f"import sys, {module}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}), "
        "'inspector.world.stage' in sys.modules)"
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
        ("memory_small.txt", "102.03       10.1", "103.03       10.1"),
        ("memory_small.txt", "x dp 2 = 8 GPUs", "x dp 2 = 16 GPUs"),
        ("memory_small.txt", "micro-batch 2 x 4", "micro-batch 2 x 2"),
        ("memory_small.txt", ", bf16,", ", fp16,"),
        ("params_example_table.txt", ", fp32,", ", bf16,"),
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
