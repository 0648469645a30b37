"""`pip install .` (the README's route on a user's own machine) gives a working inspect-model.

The wheel is built offline from a copy of the checkout with this environment's pip and setuptools
(`pip wheel --no-deps --no-build-isolation --no-index`), as pip builds it for `pip install .`; the
test then reads what the wheel holds and runs the command from the unpacked wheel alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and unpacks the wheel: ~4 s of CPU, and pip

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "inspector"
NOT_SHIPPED = {"README.md"}  # notes for readers of the code; nothing opens them at run time


def _tracked(pattern: str) -> set[str]:
    """Return the package folder's files matching pattern (READMEs aside), as wheel paths."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob(pattern)
        if "__pycache__" not in path.parts and path.name not in NOT_SHIPPED
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel offline from a copy of the checkout (the build writes beside its sources)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "inspector", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "-w", str(tmp / "dist"), str(source)],  # fmt: skip
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (found,) = (tmp / "dist").glob("inspect_model-*.whl")
    return found


def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = _tracked("*.py")
    data = _tracked("*") - modules - {p for p in _tracked("*") if (ROOT / p).is_dir()}
    assert {"inspector/formulas/kernels-h200.json", "inspector/formulas/kernels-h100.json"} <= data  # kernels.py
    assert modules and not modules - names, sorted(modules - names)
    assert not data - names, f"files the code may open, missing from the wheel: {sorted(data - names)}"


def test_wheel_declares_the_command_and_its_requirements(wheel):
    archive = zipfile.ZipFile(wheel)
    info = next(n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt"))
    entry_points = archive.read(info).decode()
    assert "[console_scripts]" in entry_points
    assert "inspect-model = inspector.cli:main" in entry_points
    metadata = archive.read(info.replace("entry_points.txt", "METADATA")).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    for package in ("torch", "megatron-core", "typer", "tabulate", "pyyaml"):
        assert any(line.split()[1].lower().startswith(package) for line in requires), package


def test_unpacked_wheel_runs_alone(wheel, tmp_path):
    """The unpacked wheel, first on the path, answers a command and reads its kernel table."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = (
        "import sys, inspector\n"
        "from inspector.formulas import kernels\n"
        "print(inspector.__file__)\n"
        "print(kernels.TABLE.stat().st_size > 0)\n"
        "from inspector.cli import main\n"
        "sys.argv = ['inspect-model', 'tree', '--num-layers', '1', '--no-cache']\n"
        "sys.exit(main())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
        timeout=300,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    where, table, *tree = ran.stdout.splitlines()
    assert Path(where).is_relative_to(site), where  # not the checkout's editable install
    assert table == "True"
    assert tree[0] == "Module: GPTModel"
