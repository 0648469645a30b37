"""The first stage's word embedding in `plan` (formulas/embedding_ops.py, plan/cost.py
`stage_work(has_embedding=True)`): megatron-core's VocabParallelEmbedding and
LanguageModelEmbedding, counted by hand at the 7B functional test's sizes (tp 4, micro-batch 2,
sequence 8192, h 4096, 131,584 padded vocabulary rows: 32,896 a rank)."""

from __future__ import annotations

import pytest

import inspector.caches as caches
from inspector.formulas.embedding_ops import embedding_kernels
from inspector.formulas.kernels import ops_seconds
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS
from inspector.job.layout import Layout
from inspector.plan import cost
from inspector.plan.network import Network

T, H, ROWS = 16384, 4096, 32896


def test_embedding_bytes_by_hand() -> None:
    """Forward: the lookup reads and writes T h (2 + 2 bytes), the other ranks' 3/4 of the rows
    zeroed (2), the [b, s, h] -> [s, b, h] copy (2 + 2), dropout (2 + 2 + a 1-byte mask);
    backward: the same, the zeroed [v / t, h] gradient with T h read and written into it, and
    main_grad.add_ (fp32 read and write, 16-bit read: 10 bytes an element)."""
    forward, backward = embedding_kernels(T, T, ROWS, H, 4, 2, 2, True)
    th = T * H
    assert sum(op.bytes for op in forward) == th * 4 + th * 3 // 4 * 2 + th * 4 + th * 5
    assert sum(op.bytes for op in backward) == (
        th * 3 // 4 * 2 + th * 4 + th * 5 + (ROWS * H + 2 * th) * 2 + ROWS * H * 10)
    # micro-batch 1: the transpose is a view; tp 1: no rows of other ranks; sequence parallel
    # tp 4: dropout on a quarter of the rows
    one = embedding_kernels(T // 2, T // 8, ROWS, H, 4, 1, 2, True)[0]
    assert "embedding transpose" not in {op.name for op in one}
    assert {op.name: op.elements for op in one}["embedding dropout"] == T // 8 * H
    assert "embedding other ranks' rows" not in {op.name for op in embedding_kernels(
        T, T, ROWS * 4, H, 1, 2, 2, True)[0]}  # fmt: skip


def test_the_first_stage_prices_the_embedding_and_its_all_reduce() -> None:
    """Stage 0 of the 7B tp 4 job: the kernels above, and the sum of the lookups over the 4
    tensor-parallel ranks, an all-reduce of T h (2 ring halves) at NCCL's ring bandwidth."""
    dims = ModelDims(2, H, 32, 8192, ROWS * 4, num_query_groups=8, flash_attention=True,
                     rotary=True, te_attention=True)  # fmt: skip
    lay, net = Layout(tp=4, dp=2), Network(GPUS["h100"], 8, nvls=False)
    caches.clear()
    args = (dims, lay, net, None, 2, "none", [[0, 1]], False)
    without, with_ = cost.stage_work(*args), cost.stage_work(*args, has_embedding=True)
    forward, backward = embedding_kernels(T, T, ROWS, H, 4, 2, 2, True)
    gpu = GPUS["h100"]
    assert with_.compute - without.compute == pytest.approx(
        ops_seconds(forward, gpu) + ops_seconds(backward, gpu))
    alpha, bandwidth = net.link(4)
    assert with_.tensor - without.tensor == pytest.approx(2 * (alpha + T * H * 2 * 3 / 4 / bandwidth))
