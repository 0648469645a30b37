"""Faults and bad inputs of issue #46: Hugging Face values of the wrong type, inputs that never
end, outputs of one command written together, signals while other threads run, a cache entry
that names files outside the folder. Each case answers one `Error:` line (exit 2) and leaves
nothing damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "fixtures" / "hf"
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "1000", "--transformer-impl", "local"]  # fmt: skip


def run(*argv: str, cwd: Path, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, "INSPECT_MODEL_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "inspector", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)  # fmt: skip


def error_line(result: subprocess.CompletedProcess) -> str:
    """Return the one Error: line of a refused run (exit 2, nothing on stdout, no traceback)."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("Note")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def hf_config(folder: Path, **changes: Any) -> Path:
    data = json.loads((HF / "llama3.1-8b.json").read_text())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


HF_CASES = {
    "string-for-int": ({"num_hidden_layers": "32"}, '"num_hidden_layers" must be a whole number'),
    "bool-for-int": ({"num_hidden_layers": True}, '"num_hidden_layers" must be a whole number'),
    "float-for-int": ({"hidden_size": 4096.5}, '"hidden_size" must be a whole number'),
    "negative": ({"num_key_value_heads": -8}, '"num_key_value_heads" must be a whole number'),
    "list-for-int": ({"vocab_size": [1]}, '"vocab_size" must be a whole number'),
    "nan-dropout": ({"attention_dropout": float("nan")}, '"attention_dropout" must be a finite'),
    "string-bool": ({"tie_word_embeddings": "false"}, '"tie_word_embeddings" must be true or false'),
    "string-rope": ({"rope_scaling": "yarn"}, '"rope_scaling" must be a mapping'),
    "string-architectures": ({"architectures": "LlamaForCausalLM"}, '"architectures" must be a list'),
    "missing-layers": ({"num_hidden_layers": ...}, '"num_hidden_layers" is missing'),
    "null-hidden": ({"hidden_size": None}, '"hidden_size" is missing'),
    "missing-ffn": ({"intermediate_size": ...}, "--ffn-hidden-size"),
}


@pytest.mark.parametrize("name", HF_CASES)
def test_hf_value_of_the_wrong_type_or_missing_is_an_error_naming_the_key(
    name: str, tmp_path: Path
) -> None:
    changes, words = HF_CASES[name]
    path = hf_config(tmp_path, **changes)
    line = error_line(run("params", "--hf-config", str(path), cwd=tmp_path))
    assert str(path) in line and words in line
