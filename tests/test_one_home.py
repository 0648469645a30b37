"""One name, one home: each record, constant and CLI option the code base knows is defined once.

A second `ChunkShape`, another `ADAM_MOMENTS = 8` or a second `typer.Option(..., "--gpu-tflops")`
fails here; add the concept to the list below when you give it its home.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "inspector"

# Records with one home each (memory/measure.py, memory/engine, memory/compose, job/...).
RECORDS = (
    "StateBytes", "StageBytes", "StageMemory", "StagePlan", "MemoryReport", "RunMemory",
    "ChunkShape", "ChunkKinds", "Pieces", "PhaseCut", "FsdpState", "StageActivations",
    "Gpu", "Hardware", "OptimizerBytes", "OptimizerPrecision", "OptimizerStep",
)  # fmt: skip
# Class names that two unrelated modules still share (each mirrors a different upstream name).
# RMSNorm: the TE stand-in's and mamba_ssm's gated one, each named as upstream names it;
# GroupedLinear: TE's module (transformer_engine.pytorch.GroupedLinear, world/te/grouped_linear.py)
# and its fused operation (transformer_engine.pytorch.ops.GroupedLinear, world/te/ops.py), which
# megatron-core reaches by those names
KNOWN_SHARED_CLASSES = {"Context", "Param", "FusedAdam", "RMSNorm", "GroupedLinear"}
CONSTANTS = ("ADAM_MOMENTS", "MASTER_COPY", "REMAINDER", "GIB", "DEFAULT_GPU", "GPUS", "DEFAULT_ADAM")
# A GPU's figures: only the --gpu record (job/hardware.py Gpu) holds them.
GPU_FIGURES = {"hbm", "tflops_16bit", "tflops_fp8", "memory_gib"}


@cache
def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def _package() -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in _sources().items()}


def _trees(sources: dict[str, str] | None = None) -> dict[str, ast.Module]:
    if sources is None:
        return _package()
    return {**_package(), **{name: ast.parse(text) for name, text in sources.items()}}


def classes(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Return each class name defined anywhere in the package and the files defining it."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(name)
    return found


def constants(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Return each module-level UPPER_CASE name assigned in the package and its files."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, tree in trees.items():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name) and target.id.isupper():
                    found[target.id].append(name)
    return found


def option_declarations(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Return each flag (a "--x" string) passed to typer.Option / typer.Argument, and where."""
    found: dict[str, list[str]] = defaultdict(list)
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("Option", "Argument")):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                    found[arg.value].append(f"{name}:{node.lineno}")
    return found


def gpu_figure_holders(trees: dict[str, ast.Module]) -> set[str]:
    """Return the classes that declare a GPU's figures (HBM, peaks, memory) as fields."""
    holders = set()
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                fields = {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
                if fields & GPU_FIGURES:
                    holders.add(f"{name}:{node.name}")
    return holders


def test_each_record_has_one_home() -> None:
    found = classes(_trees())
    assert {name: found[name] for name in RECORDS if len(found[name]) != 1} == {}


def test_no_new_class_name_is_shared() -> None:
    shared = {name for name, files in classes(_trees()).items() if len(files) > 1}
    assert shared <= KNOWN_SHARED_CLASSES, sorted(shared - KNOWN_SHARED_CLASSES)


def test_each_constant_has_one_home() -> None:
    found = constants(_trees())
    assert {name: found[name] for name in CONSTANTS if len(found[name]) != 1} == {}
    assert found["ADAM_MOMENTS"] == found["MASTER_COPY"] == ["job/optimizer_precision.py"]


def test_one_hardware_record() -> None:
    assert gpu_figure_holders(_trees()) == {"job/hardware.py:Gpu"}


def test_each_cli_option_is_declared_once() -> None:
    twice = {flag: where for flag, where in option_declarations(_trees()).items() if len(where) > 1}
    assert twice == {}
    assert "--gpu-tflops" in option_declarations(_trees())  # the scan sees cli/app.py's factory


SECOND = {
    "a.py": "class ChunkShape:\n    layers: tuple\n",
    "b.py": "ADAM_MOMENTS = 8\nclass Device:\n    hbm: float\n",
    "c.py": "import typer\ndef f(x=typer.Option(None, '--gpu-tflops', help='h')): ...\n",
}


@pytest.mark.parametrize(
    "added, check",
    [
        ("a.py", lambda t: len(classes(t)["ChunkShape"]) > 1),
        ("b.py", lambda t: len(constants(t)["ADAM_MOMENTS"]) > 1),
        ("b.py", lambda t: "b.py:Device" in gpu_figure_holders(t)),
        ("c.py", lambda t: len(option_declarations(t)["--gpu-tflops"]) > 1),
    ],
)
def test_a_second_definition_is_caught(added: str, check) -> None:
    """Each scan finds a copy added beside the package's own definitions."""
    assert not check(_trees())
    assert check(_trees({added: SECOND[added]}))
