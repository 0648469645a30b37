"""inspector.world.fastimport: building and `memory` import neither DTensor, dynamo, sympy nor DCP.

Counts, not timings: each command runs in a fresh interpreter, which reports the heavy modules it
imported. The golden-file tests prove the shortcuts change no shape.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = [
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed.checkpoint",
    "sympy",
]

PROBE = f"""
import json, sys
HEAVY = {HEAVY!r}
from inspector.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stdout = sys.__stdout__
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps(dict(heavy=heavy, megatron="megatron.core" in sys.modules)))
"""

COMMANDS = [
    "params --model llama3-70b --tp 8 --pp 4 --bf16",
    "params --model gpt3-175b --tp 8 --pp 16",
    "params --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --tp 2 --pp 2 --num-virtual-stages-per-pipeline-rank 2",
    "memory --model llama3-70b --tp 8 --pp 4 --dp 8 --use-distributed-optimizer "
    "--micro-batch-size 1 --seq-length 8192",
    "tree --model mixtral-8x7b --ep 8 --dp 8 --pp 2",
    "params --model qwen1.5-moe-a2.7b --ep 4 --dp 4 --pp 2 --moe-grouped-gemm",
    "params --model llama3-70b --tp 8 --pp 4 --bf16 --transformer-impl transformer_engine "
    "--sequence-parallel",
]


def _heavy(command: str) -> list[str]:
    """Return the heavy modules `command` imports in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *command.split(), "--no-cache"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["megatron"], done.stderr
    return report["heavy"]


@pytest.mark.parametrize("command", COMMANDS)
def test_build_imports_no_heavy_module(command):
    heavy = _heavy(command)
    if command.startswith("memory"):
        # memory runs megatron's forward, backward and optimizer step on meta tensors (the
        # engine; TE jobs too since the TE stand-in runs): torch wraps the allocator model's
        # TorchDispatchMode in torch._disable_dynamo, whose first call imports dynamo, meta
        # references import sympy, and the optimizer step imports what torch.optim's step does
        # (inductor, DTensor, DCP). Only the build must stay light: the modules left are those.
        engine = ("sympy", "torch._dynamo", "torch._inductor", "torch.distributed.tensor",
                  "torch.distributed._tensor", "torch.distributed.checkpoint")  # fmt: skip
        heavy = [module for module in heavy if module not in engine]
    assert heavy == []


def test_multi_latent_attention_build_imports_no_dynamo():
    # MLA's YaRN rotary embedding takes 1 / tensor on meta (torch._refs.reciprocal, whose dynamo
    # wrapper only a closure holds). Its torch.arange on meta still imports sympy (torch._refs'
    # arange checks its layout through torch._check), which this test leaves aside.
    command = (
        "params --model deepseek-v3 --num-layers 4 --moe-layer-freq [0,1,1,1] --num-experts 16 "
        "--moe-router-topk 2 --tp 2 --ep 2 --dp 2 --pp 2 --sequence-parallel --bf16"
    )
    assert "torch._dynamo" not in _heavy(command)
