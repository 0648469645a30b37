"""The planner as one unit: its caches have one owner, its modules share no private names."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli

PACKAGE = Path(__file__).resolve().parent.parent / "inspector"
PLAN_FILES = sorted((PACKAGE / "plan").glob("*.py"))
COMPOSE_FILES = sorted((PACKAGE / "memory" / "compose").glob("*.py"))  # the planner's memory
CHECKED = [*PLAN_FILES, *COMPOSE_FILES, PACKAGE / "render" / "plan.py", PACKAGE / "world" / "pieces.py",
           PACKAGE / "job" / "hardware.py"]


def _plan_modules() -> list[object]:
    return [importlib.import_module(f"inspector.{folder}.{path.stem}")
            for folder, files in (("plan", PLAN_FILES), ("memory.compose", COMPOSE_FILES))
            for path in files if path.stem != "__init__"]


def test_every_planner_cache_is_registered() -> None:
    # A module-level dictionary or memoised function that caches.clear() cannot reach would
    # keep one search's state into the next.
    import inspector.caches as caches

    modules = _plan_modules()
    tables, functions = caches.registered()
    seen = 0
    for module in modules:
        for name, value in vars(module).items():
            if name.startswith("__") or getattr(value, "__module__", module.__name__) != module.__name__:
                continue  # Python's, or imported from elsewhere
            if hasattr(value, "cache_clear"):
                assert any(value is f for f in functions), f"{module.__name__}.{name}"
                seen += 1
            elif isinstance(value, (dict, set, list)) and name.startswith("_"):
                assert any(value is t for t in tables), f"{module.__name__}.{name}"
                seen += 1
    assert seen == len(tables) + len(functions)
    assert seen >= 30  # the price, activation, memory, layout, candidate and cost caches


SEARCHES = [
    # MoE with a dense first layer, MTP, expert scaling and layout strings
    ("--model", "deepseek-v3", "--num-layers", "4", "--moe-layer-freq", "[0,1,1,1]",
     "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8", "--global-batch-size", "16",
     "--seq-length", "1024", "--bf16", "--gpu-memory", "40", "--pp", "2", "--top", "5",
     "--no-rope-fusion"),  # megatron-core 0.13 runs MLA's fused RoPE only as experimental
    # block recomputation, capped splits, every pipeline size
    ("--num-layers", "8", "--seq-length", "4096", "--max-position-embeddings", "4096", "--bf16",
     "--gpus", "4", "--global-batch-size", "8", "--gpu-memory", "2.1", "--top", "5"),
]


@pytest.mark.slow
def test_a_search_priced_again_from_empty_caches_is_byte_identical() -> None:
    import inspector.caches as caches

    def plan(args: tuple[str, ...]) -> str:
        result = run_cli("plan", *args, "--format", "json")
        assert result.code == 0, result.err
        return result.out

    first = [plan(args) for args in SEARCHES]
    caches.clear()
    tables, functions = caches.registered()
    assert not any(tables) and all(f.cache_info().currsize == 0 for f in functions)
    assert [plan(args) for args in reversed(SEARCHES)] == list(reversed(first))
    assert any(tables)  # the second round filled them again


def _imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    return [(node.module or "", alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) for alias in node.names]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_private_name_is_imported_across_modules(path: Path) -> None:
    private = [f"{module}.{name}" for module, name in _imports(path)
               if module.startswith("inspector") and name.startswith("_")]
    assert not private, private


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [(node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_planner_modules_and_functions_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400
    long = [(name, n) for name, n in _function_lengths(path) if n > 40]
    assert not long, long


def test_a_search_checks_its_model_once_and_each_layout_once(monkeypatch) -> None:
    # plan/search.py makes tens of thousands of Jobs of one model: job.py's `checks_once` checks
    # the model on entry and each layout the first time it passes, and a refusal stays one
    import inspector.job.job as job_module
    from inspector.errors import ConfigError
    from inspector.job.job import Job, checks_once
    from inspector.job.layout import Layout
    from inspector.job.model import ModelConfig

    calls: list[object] = []
    check_model, check_layout = job_module.validate_model, job_module.validate_layout
    monkeypatch.setattr(job_module, "validate_model",
                        lambda model: calls.append("model") or check_model(model))
    monkeypatch.setattr(job_module, "validate_layout",
                        lambda model, lay: calls.append(lay.tp) or check_layout(model, lay))
    model = ModelConfig(num_layers=2)  # 12 heads
    with checks_once(model):
        Job(model, Layout(tp=2))
        Job(model, Layout(tp=2))
        Job(ModelConfig(num_layers=4), Layout(tp=2))  # another model: checked in full
        for _ in range(2):
            with pytest.raises(ConfigError):
                Job(model, Layout(tp=5))  # 12 heads over 5: refused each time
    Job(model, Layout(tp=2))  # after the block, checked in full again
    assert calls == ["model", 2, "model", 2, 5, 5, "model", 2]


def test_a_record_hashed_once_hashes_as_its_fields_and_is_forgotten_with_it() -> None:
    # job/hash_once.py: ModelDims and Training keep their hash beside them while they live
    import dataclasses
    import gc

    from inspector.job import hash_once
    from inspector.job.job import Job
    from inspector.job.model import ModelConfig

    job = Job(ModelConfig(num_layers=2))
    for record in (job.dims(), job.training):
        fields = [f for f in dataclasses.fields(record) if f.compare and f.hash is not False]
        assert hash(record) == hash(tuple(getattr(record, f.name) for f in fields))
        assert id(record) in hash_once._HASHES
    dims = job.dims()  # a new object, equal to the one above
    assert {job.dims(): 1}[dims] == 1
    key = id(dims)
    hash(dims)
    del dims, job
    gc.collect()
    assert key not in hash_once._HASHES


def test_a_stage_split_unevenly_over_its_chunks_prints_each_chunk() -> None:
    """Two plans of one layout whose stages hold 8 layers each, one split evenly over its 4
    virtual-pipeline chunks and one not (its flags carry a --pipeline-model-parallel-layout),
    printed alike as "8/8" (three such rows for Megatron-LM's MoE memory_speed functional test):
    the uneven one now names each chunk's layers."""
    from types import SimpleNamespace

    from inspector.render.plan import _stage_cell

    def plan(*stages: tuple[int, ...]) -> Any:
        layers = []
        start = 0
        for counts in stages:
            chunks = []
            for n in counts:
                chunks.append(tuple(range(start, start + n)))
                start += n
            layers.append(SimpleNamespace(layers=tuple(chunks)))
        return SimpleNamespace(stages=tuple(layers))

    assert _stage_cell(plan((2, 2, 2, 2), (2, 2, 2, 2))) == "8/8"
    assert _stage_cell(plan((1, 1, 3, 3), (1, 2, 3, 2))) == "1+1+3+3/1+2+3+2"
    assert _stage_cell(plan((26,), (22,))) == "26/22"
