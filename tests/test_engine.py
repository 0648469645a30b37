"""The engine: megatron's forward and backward on meta tensors, counted as the CUDA allocator does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / "shared" / "gpu"


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=2, tensor_model_parallel_size=2, data_parallel_size=2,
        micro_batch_size=2, global_batch_size=8, bf16=True, use_distributed_optimizer=True,
        transformer_impl="local",
    )  # fmt: skip
    return make_job({**args, **flags})


def test_caching_allocator_rounds_to_512_bytes():
    from inspector.engine.allocator import rounded

    assert [rounded(n) for n in (0, 1, 511, 512, 513, 4096)] == [0, 512, 512, 512, 1024, 4096]


def test_tracker_counts_new_storages_only_and_frees_them():
    import torch

    from inspector.engine.allocator import Tracker

    before = torch.empty(100, device="meta")  # exists before recording: never counted
    tracker = Tracker()
    with tracker:
        x = torch.empty(1000, device="meta")  # 4000 bytes -> 4096
        x.view(10, 100)  # a view allocates nothing
        before.add_(1)  # in place on an old storage allocates nothing
        y = x * 2
        del y
    assert [e.bytes for e in tracker.events] == [4096, 4096, -4096]
    assert tracker.peak == 8192 and tracker.allocated == 4096
    del x
    assert tracker.allocated == 0


def test_dropout_keeps_a_bool_mask_as_on_cuda():
    import torch

    from inspector.engine.allocator import Tracker
    from inspector.engine.cuda import cuda_on_meta

    x = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tracker = Tracker()
    with cuda_on_meta(), tracker:
        out = torch.nn.functional.dropout(x, 0.1)
    # output (bf16, 2 MiB) and mask (bool, 1 MiB): not a bf16 mask as the CPU path keeps
    assert sorted(e.bytes for e in tracker.events) == [1 << 20, 2 << 20]
    assert out.grad_fn.name() == "NativeDropoutBackward0"


def test_rms_norm_keeps_no_fp32_copy_as_the_fused_cuda_kernel():
    import torch

    from inspector.engine.allocator import Tracker
    from inspector.engine.cuda import cuda_on_meta

    x = torch.empty(256, 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    tracker = Tracker()
    with cuda_on_meta(), tracker:
        out = torch.nn.functional.rms_norm(x, (1024,), weight, 1e-5)
    assert sorted(e.bytes for e in tracker.events) == [1024, 512 << 10]  # rstd, bf16 output
    assert out.dtype == torch.bfloat16


def test_schedule_passes_replay_1f1b():
    from inspector.job.dims import live_microbatches, schedule_passes

    passes = schedule_passes(0, 2, 3)
    assert passes == [(True, 0), (True, 0), (False, 0), (True, 0), (False, 0), (False, 0)]
    # the same replay as live_microbatches: micro-batches in flight after each forward
    alive, points = 0, []
    for forward, _ in passes:
        alive += 1 if forward else -1
        if forward:
            points.append((alive,))
    assert points == live_microbatches(0, 2, 3)


def test_run_memory_finds_megatrons_global_buffer_and_is_deterministic():
    from inspector.engine.memory import run_memory

    job = _job()
    first, second = run_memory(job, 0), run_memory(job, 0)
    assert first == second
    # DotProductAttention's baddbmm input from megatron's global memory buffer:
    # [b * heads / tp, s, s] in bf16 = 2 * 2 * 32 * 32 * 2 bytes
    assert ("decoder.layers.0.self_attention.core_attention", 2 * 2 * 32 * 32 * 2) in first.persistent
    assert first.peak.bytes > 0 and first.peak.moment.startswith(("forward", "backward"))


def test_full_recomputation_lowers_the_peak():
    from inspector.engine.memory import run_memory

    plain = run_memory(_job(num_layers=4), 0).peak.bytes
    full = run_memory(
        _job(num_layers=4, recompute_granularity="full", recompute_method="uniform",
             recompute_num_layers=1), 0
    ).peak.bytes  # fmt: skip
    assert full < plain


@pytest.mark.skipif(not (GPU / "memory-h200.json").exists(), reason="shared/gpu not present")
def test_engine_matches_every_probed_gpu_rank():
    """The issue's targets: peak within 3% and never more than 2% under; static within 1%."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from gpu_memory import rows

    runs = json.loads((GPU / "memory-h200.json").read_text())["runs"]
    table = rows(GPU)
    assert len(table) == len(runs)
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        static_ratio, peak_ratio = float(cells[5]), float(cells[8])
        assert abs(static_ratio - 1) <= 0.01, row
        assert 0.98 <= peak_ratio <= 1.03, row
