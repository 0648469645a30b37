"""bench/host_ops.py: the host's operations counted in megatron's own forward and backward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # megatron's forward and backward twice: ~17 s (tests/README.md)
BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import ci_goldens  # noqa: E402
import host_ops  # noqa: E402

CONFIG = """\
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 256
  --num-attention-heads: 4
  --seq-length: 256
  --max-position-embeddings: 256
  --micro-batch-size: 1
  --global-batch-size: 1
  --transformer-impl: transformer_engine
  --tokenizer-type: NullTokenizer
  --vocab-size: 1024
  --bf16: true
"""


def _counts(tmp_path: Path, name: str, extra: str = "") -> dict[str, float]:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model_config.yaml").write_text(CONFIG + extra)
    host_ops.install()
    row = host_ops.count_case(ci_goldens.Case("gpt", name, folder, 1, 1), plan=False)
    assert not row["refusal"], row["refusal"]
    return host_ops.per_layer(row)


def test_full_recomputation_repeats_the_layers_forward_in_backward(tmp_path: Path) -> None:
    """Megatron's CheckpointFunction (tensor_parallel/random.py) reruns the layer's forward inside
    its backward: the same module calls, and the forward's aten ops added to the backward's."""
    plain = _counts(tmp_path, "plain")
    full = _counts(tmp_path, "full", "  --recompute-granularity: full\n  --recompute-method: uniform\n"
                   "  --recompute-num-layers: 1\n")  # fmt: skip
    assert plain["forward_modules"] > 0 and plain.get("backward_modules", 0) == 0
    assert full["backward_modules"] == full["forward_modules"] == plain["forward_modules"]
    assert full["backward_aten"] >= plain["backward_aten"] + plain["forward_aten"]
    assert plain["backward_nodes"] > 0  # the autograd graph walked from the loss
