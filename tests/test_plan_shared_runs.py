"""The engine runs of one plan search share what does not change between them (plan/confirm.py):
the small chunks' traces across --recompute-num-layers, the optimizer steps across recomputation
and micro-batch size; the plans printed are those of runs that share nothing."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import inspector.caches as caches
from inspector.job.job import Job, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.plan import confirm
from tests.conftest import run_cli
from tests.test_versions import VERSION

# an MoE job whose plans need recomputation to fit: the search measures a layout, finds it over,
# and measures it again with more layers recomputed
MOE = ("plan", "--model", "qwen3-30b-a3b", "--num-layers", "4", "--gpus", "8", "--global-batch-size",
       "16", "--seq-length", "2048", "--bf16", "--gpu-memory", "14", "--top", "3", "--format", "json")


def test_runs_share_traces_across_recompute_layers_and_steps_across_batch_and_recompute() -> None:
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=128,
                        max_position_embeddings=128, vocab_size=1024)  # fmt: skip
    job = Job(model, Layout(tp=2, dp=4), Training(micro_batch_size=1, recompute="full",
                                                  recompute_method="block", recompute_num_layers=1))
    more = replace(job, training=replace(job.training, recompute_num_layers=3))
    other_batch = replace(job, training=replace(job.training, micro_batch_size=2, recompute="none"))
    other_layout = replace(job, layout=Layout(tp=4, dp=2))
    traces, steps = confirm._shared(job)
    assert confirm._shared(more)[0] is traces and confirm._shared(more)[1] is steps
    assert confirm._shared(other_batch)[0] is not traces and confirm._shared(other_batch)[1] is steps
    assert confirm._shared(other_layout)[1] is not steps


@pytest.mark.slow
def test_sharing_runs_prints_the_plans_of_unshared_runs(monkeypatch) -> None:
    caches.clear()
    shared = run_cli(*MOE)
    assert shared.code == 0, shared.err
    caches.clear()
    monkeypatch.setattr(confirm, "_shared", lambda job: ({}, {}))
    alone = run_cli(*MOE)
    assert json.loads(shared.out) == json.loads(alone.out)
    if VERSION >= (0, 16):  # on 0.13.1 this job's printed plans need no recomputation
        assert any(p["recompute"] != "none" for p in json.loads(shared.out)["plans"])
