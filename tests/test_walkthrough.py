"""The attention walkthrough for a 405B-sized layer at N = 60000 on 16 ranks, checked by hand."""

from __future__ import annotations

import pytest

from inspector.errors import ConfigError
from inspector.formulas.walkthrough import attention_walkthrough, mlp_walkthrough
from inspector.formulas.walkthrough_steps import WalkthroughStep, running_allocation
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout
from inspector.memory.closed.activations import layer_activations

# Llama-3.1 405B: H 16384, h 128 heads, g 8 KV groups, d 128; N = 60000 tokens, P = 16 ranks.
N, HID, HEADS, G, D, P = 60000, 16384, 128, 8, 128, 16
DIMS = ModelDims(126, HID, HEADS, N, 128256, ffn_hidden_size=53248, num_query_groups=G, swiglu=True)


def by_name(steps: list[WalkthroughStep]) -> dict[str, WalkthroughStep]:
    """Index steps by name."""
    return {step.name: step for step in steps}


def test_ulysses_shapes_and_bytes() -> None:
    steps = by_name(attention_walkthrough(DIMS, "ulysses", P))
    x = steps["x: layer input"]
    assert (x.layout, x.shape, x.bytes) == ("[N/P, b, H]", (3750, 1, 16384), 122_880_000)
    q = steps["Q: all-to-all, gather N, scatter heads"]
    assert (q.layout, q.shape, q.bytes) == ("[N, b, h/P, d]", (60000, 1, 8, 128), 122_880_000)
    # 8 KV heads on 16 ranks: one (replicated) head each, 60000 * 128 * 2 bytes.
    k = steps["K: all-to-all, gather N, scatter heads"]
    assert (k.layout, k.shape, k.bytes) == ("[N, b, 1, d]", (60000, 1, 1, 128), 15_360_000)
    assert "replicated on 2 ranks" in k.note
    # The naive score matrix: 8 heads x 60000 x 60000 = 28.8e9 elements, 57.6 GB in bf16.
    scores = steps["S = Q K^T: attention scores"]
    assert scores.layout == "[b, h/P, N, N]"
    assert (scores.shape, scores.elements) == ((1, 8, 60000, 60000), 28_800_000_000)
    assert (scores.bytes, scores.materialized) == (57_600_000_000, "naive")
    # Flash attention keeps 8 x 60000 fp32 statistics instead: 1.92 MB.
    assert steps["softmax statistics (log-sum-exp)"].bytes == 1_920_000
    # Q K^T: 2 * 128 heads * 60000^2 * 128 = 1.179648e14 FLOPs, a sixteenth per rank.
    assert scores.flops_global == 117_964_800_000_000
    assert scores.flops_rank == 7_372_800_000_000
    back = steps["O: all-to-all, scatter N, gather heads"]
    assert (back.shape, back.bytes) == ((3750, 1, 128, 128), 122_880_000)
    # Whole weights on every rank: W_qkv (128 + 16) * 128 x 16384.
    assert steps["W_qkv: QKV weight, whole"].shape == (18432, 16384)


def test_tensor_parallel_shapes_and_bytes() -> None:
    steps = by_name(attention_walkthrough(DIMS, "tp", P, sequence_parallel=True))
    assert steps["x: layer input"].shape == (3750, 1, 16384)
    gathered = steps["x: all-gather along N"]
    assert (gathered.shape, gathered.bytes) == ((60000, 1, 16384), 1_966_080_000)
    # Column shard: 8 query heads + 1 K + 1 V head (replicated), 10 * 128 = 1280 rows.
    assert steps["W_qkv: QKV weight, column shard"].shape == (1280, 16384)
    assert steps["S = Q K^T: attention scores"].bytes == 57_600_000_000
    assert steps["W_o: output weight, row shard"].shape == (16384, 1024)
    assert steps["Y: reduce-scatter along N"].shape == (3750, 1, 16384)
    # One QKV step: 8 query heads + 1 K + 1 V (replicated) head per rank, 10 heads of 128.
    qkv = steps["Q, K, V = x W_qkv"]
    assert (qkv.layout, qkv.shape) == ("[N, b, h/P + 2, d]", (60000, 1, 10, 128))
    assert qkv.flops_rank == 2 * 60000 * 16384 * 10 * 128
    assert "replicated on 2 ranks" in qkv.note


def test_context_parallel_shapes_and_bytes() -> None:
    steps = by_name(attention_walkthrough(DIMS, "cp", P))
    assert steps["Q, K, V = x W_qkv"].shape == (3750, 1, 128 + 2 * 8, 128)
    ring = steps["K, V: received from the previous rank"]
    assert (ring.shape, ring.bytes) == ((2, 3750, 1, 8, 128), 15_360_000)
    # One ring step's naive block: 128 heads x 3750 x 3750 = 1.8e9 elements, 3.6 GB.
    block = steps["S = Q K^T: attention scores"]
    assert (block.layout, block.shape) == ("[b, h, N/P, N/P]", (1, 128, 3750, 3750))
    assert block.bytes == 3_600_000_000
    assert block.flops_rank == 2 * 128 * 3750 * 60000 * 128  # all 16 steps of this rank


@pytest.mark.parametrize("mode", ["tp", "ulysses", "cp"])
def test_every_mode_does_the_same_model_flops(mode: str) -> None:
    steps = attention_walkthrough(DIMS, mode, P)  # type: ignore[arg-type]
    # Forward, dense: projections 2NH(h + 2g)d + 2NhdH, scores and context 2 * 2hN^2d.
    expected = 2 * N * HID * (HEADS + 2 * G) * D + 2 * N * HEADS * D * HID
    expected += 2 * 2 * HEADS * N * N * D
    assert sum(step.flops_global for step in steps) == expected
    if mode != "tp":  # no replicated work: each rank does exactly 1/P
        assert sum(step.flops_rank for step in steps) == expected / P


def test_softmax_bytes_agree_with_the_activation_formula() -> None:
    # The stored softmax output is 2 of the paper's 5as^2b/t bytes (t = P, no flash, one layer).
    dims = ModelDims(2, 4096, 32, 2048, 32000)
    softmax = by_name(attention_walkthrough(dims, "tp", 8))["P = softmax(S)"]
    core = layer_activations(dims, Layout(tp=8), 0, 1).core_attention
    assert softmax.bytes == core * 2 / 5


def test_heads_not_divisible() -> None:
    # 128 heads cannot be split over 12 ranks.
    with pytest.raises(ConfigError, match=r"--ulysses-degree 12 \(128 % 12 = 8\)"):
        attention_walkthrough(DIMS, "ulysses", 12)


def test_context_parallel_needs_2p_chunks() -> None:
    # Load balancing cuts the sequence in 2P = 64 chunks: 60000 % 64 = 32.
    with pytest.raises(ConfigError, match=r"60000 % 64 = 32"):
        attention_walkthrough(DIMS, "cp", 32)


def test_groups_and_degree_must_nest() -> None:
    # 6 KV groups over 4 ranks: neither a split nor a replication.
    dims = ModelDims(2, 3072, 24, 4096, 32000, num_query_groups=6)
    with pytest.raises(ConfigError, match="--num-query-groups 6"):
        attention_walkthrough(dims, "tp", 4)


def test_unknown_mode() -> None:
    # Only tensor, Ulysses and context parallelism have a walkthrough.
    with pytest.raises(ConfigError, match="tp, ulysses, cp"):
        attention_walkthrough(DIMS, "ring", 4)  # type: ignore[arg-type]


def test_qkv_is_one_step_with_the_three_projections_flops() -> None:
    # Q, K, V come from one GEMM (megatron's linear_qkv): 2 N H (h + 2g) d FLOPs together,
    # 2 * 60000 * 16384 * (128 + 16) * 128 = 36.2 TFLOP for the layer, a sixteenth per rank.
    qkv = by_name(attention_walkthrough(DIMS, "ulysses", P))["Q, K, V = x W_qkv"]
    assert (qkv.layout, qkv.shape) == ("[N/P, b, h + 2g, d]", (3750, 1, 144, 128))
    assert qkv.flops_global == 2 * N * HID * (HEADS + 2 * G) * D == 36_238_786_560_000
    assert qkv.flops_rank == qkv.flops_global / P


def test_running_allocation_keeps_every_tensor() -> None:
    # Kept tensors: each step adds its bytes; the peak is the running total (nothing is freed).
    steps = attention_walkthrough(DIMS, "ulysses", P)
    allocation = by_name_allocation(steps)
    # after the weight: x 122,880,000 + W_qkv 603,979,776 bytes
    assert allocation["W_qkv: QKV weight, whole"] == (726_859_776, 726_859_776)
    # once the score matrix exists: + QKV 138,240,000 + the gathered Q, K, V + 57.6 GB of scores
    before = 726_859_776 + 138_240_000 + 122_880_000 + 2 * 15_360_000
    assert allocation["S = Q K^T: attention scores"][0] == before + 57_600_000_000
    # flash-only statistics add nothing on the path without flash attention
    assert allocation["softmax statistics (log-sum-exp)"] == allocation["P = softmax(S)"]
    total = sum(s.bytes for s in steps if s.materialized != "flash")
    assert running_allocation(steps)[-1].current == running_allocation(steps)[-1].peak == total


def test_all_reduce_is_in_place() -> None:
    # Tensor parallel without sequence parallel all-reduces Y in its own buffer.
    steps = attention_walkthrough(DIMS, "tp", 8)
    allocation = by_name_allocation(steps)
    assert allocation["Y: all-reduce"] == allocation["Y = O W_o (partial sums)"]


def by_name_allocation(steps: list[WalkthroughStep]) -> dict[str, tuple[int, int]]:
    """Index (current, peak) by step name."""
    return {s.name: (a.current, a.peak) for s, a in zip(steps, running_allocation(steps))}


def test_mlp_under_data_and_tensor_parallel() -> None:
    # Llama-3.1 405B's MLP (H 16384, F 53248, SwiGLU: W1 has 2F columns) on DP 2 x TP 8, b 1,
    # s 60000, L = 126 layers: each rank has N/DP = 60000 of the 120000 tokens, F/TP = 6656.
    steps = mlp_walkthrough(DIMS, dp=2, tp=8, micro_batch_size=1, layers=126)
    named = by_name(steps)
    x, w1, w2 = named["input: this rank's tokens"], steps[1], steps[2]
    assert (x.layout, x.shape, x.bytes) == ("[N/DP, H]", (60000, 16384), 1_966_080_000)
    assert (w1.layout, w1.shape) == ("[L, H, 2F/TP]", (126, 16384, 2 * 6656))
    assert (w2.layout, w2.shape) == ("[L, F/TP, H]", (126, 6656, 16384))
    inter = named["inter = input W1"]
    assert (inter.layout, inter.shape, inter.bytes) == ("[N/DP, 2F/TP]", (60000, 13312), 1_597_440_000)
    # FLOPs: 2 N H 2F for fc1 over all 120000 tokens, 2 N F H for fc2; a sixteenth per rank.
    assert inter.flops_global == 2 * 120000 * 16384 * 2 * 53248
    y = named["Y = inter W2 (partial sums)"]
    assert y.flops_global == 2 * 120000 * 53248 * 16384 and y.flops_rank == y.flops_global / 16
    allocation = by_name_allocation(steps)
    held = x.bytes + w1.bytes + w2.bytes  # 1.97 GB + 55.0 GB + 27.5 GB
    assert allocation[inter.name] == (held + inter.bytes, held + inter.bytes)
    # Y is allocated while inter still exists (the peak), then inter is freed
    assert allocation[y.name] == (held + y.bytes, held + inter.bytes + y.bytes)
    # the all-reduce works in place: nothing more allocated
    assert allocation["Y: all-reduce over TP, in place"] == allocation[y.name]


def test_mlp_needs_the_ffn_to_split() -> None:
    # F = 100 over TP 8: 100 % 8 = 4
    dims = ModelDims(2, 64, 4, 32, 1000, ffn_hidden_size=100)
    with pytest.raises(ConfigError, match=r"--ffn-hidden-size 100 is not divisible by --tp 8"):
        mlp_walkthrough(dims, 1, 8)
