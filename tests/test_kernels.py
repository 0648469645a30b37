"""The per-kernel time model: formulas/kernels.py (the measured table) and formulas/ops.py (a layer's kernels)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from inspector.formulas import kernels
from inspector.formulas.flops import layer_flops, logit_flops
from inspector.formulas.kernels import Attention, Gemm, Memory, op_seconds, ops_seconds
from inspector.formulas.ops import Shard, layer_ops, layer_seconds, output_ops
from inspector.formulas.walkthrough import attention_walkthrough
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS

H200 = replace(GPUS["h200"], tflops_fp8=None)  # 989 TFLOP/s, 4.8 TB/s, its own table
A100 = GPUS["a100-80gb"]  # 312 TFLOP/s, 2.039 TB/s, scaled from the H200's table
LLAMA = ModelDims(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                  vocab_size=128256, ffn_hidden_size=14336, num_query_groups=8, swiglu=True,
                  rotary=True, flash_attention=True)
MOE = replace(LLAMA, num_experts=8, moe_router_topk=2)


def _rows(kind: str) -> list[dict]:
    with kernels.TABLE.open() as f:
        return [r for r in json.load(f) if r["kind"] == kind]


def test_the_table_ships_inside_the_package() -> None:
    assert kernels.TABLE.is_file() and kernels.TABLE.parent.name == "formulas"
    assert len(_rows("gemm")) == 576 and len(_rows("flash_attention")) == 32


def test_gemm_curve_is_the_mean_of_each_octave_of_measured_rows() -> None:
    # An independent recomputation of one bin: the fwd rows with log2(m n k) in [40, 41)
    rows = [r for r in _rows("gemm") if r["orient"] == "fwd"
            and 40 <= math.log2(r["m"] * r["n"] * r["k"]) < 41]
    xs, ys = kernels.gemm_curve("fwd")
    at = min(range(len(xs)), key=lambda i: abs(xs[i] - 40.5))
    assert ys[at] == pytest.approx(sum(r["tflops"] for r in rows) / 989.0 / len(rows))
    assert 0.6 < ys[at] < 0.75


def test_a_measured_gemm_is_priced_near_its_measurement_and_large_beats_small() -> None:
    for r in _rows("gemm")[:48]:
        op = Gemm("x", r["m"], r["n"], r["k"], r["orient"])
        assert op_seconds(op, H200) == pytest.approx(r["seconds"], rel=0.35)
    small, large = Gemm("s", 2048, 512, 4096, "fwd"), Gemm("l", 8192, 8192, 8192, "fwd")
    efficiency = [op.flops / op_seconds(op, H200) / 989e12 for op in (small, large)]
    assert efficiency[0] < 0.35 < 0.6 < efficiency[1] < 0.75


def test_curves_clamp_outside_the_table() -> None:
    # 1024^3 lies below the smallest measured volume (2^32) and is still compute-bound
    small, huge = Gemm("t", 1024, 1024, 1024, "fwd"), Gemm("h", 1 << 16, 1 << 16, 1 << 16, "fwd")
    xs, ys = kernels.gemm_curve("fwd")
    assert math.log2(1024**3) < xs[0] and math.log2(1 << 48) > xs[-1]
    assert small.flops / op_seconds(small, H200) == pytest.approx(ys[0] * 989e12)
    assert huge.flops / op_seconds(huge, H200) == pytest.approx(ys[-1] * 989e12)


def test_a_thin_gemm_is_memory_bound() -> None:
    # Q K^T of unfused attention: k = 128, the 16-bit s x s scores dominate the bytes
    op = Gemm("Q K^T", 4096, 4096, 128, "fwd", 32)
    written = 32 * 4096 * 4096 * 2
    assert op_seconds(op, H200) >= written / 4.8e12


def test_flash_attention_at_a_measured_point_is_the_measured_throughput() -> None:
    rows = [r for r in _rows("flash_attention") if (r["seq"], r["heads_per_rank"]) == (8192, 16)]
    measured = sum(r["fwd_tflops"] for r in rows) / len(rows)
    assert kernels.attention_tflops(8192, 16, False) == pytest.approx(measured)
    between = kernels.attention_tflops(8192, 24, False)
    assert min(measured, kernels.attention_tflops(8192, 32, False)) <= between
    assert kernels.attention_tflops(1 << 20, 1 << 10, True) == pytest.approx(
        kernels.attention_tflops(16384, 32, True))  # clamped to the grid


def test_memory_bound_ops_run_at_the_measured_bandwidth() -> None:
    row = next(r for r in _rows("memory_bound") if r["op"] == "rms_norm" and r["tokens"] == 8192)
    op = Memory("norm", "rms_norm", 8192 * 8192, 4)  # 2 tensors of 16-bit, as the table counts
    assert op_seconds(op, H200) == pytest.approx(row["seconds"])


def test_other_gpus_scale_by_peak_and_hbm() -> None:
    gemm, memory = Gemm("g", 8192, 8192, 8192, "fwd"), Memory("m", "copy", 1 << 28, 4)
    attention = Attention("a", 4096, 32, 1e12, False)
    for op in (gemm, attention):
        assert op_seconds(op, A100) == pytest.approx(op_seconds(op, H200) * 989 / 312)
    assert op_seconds(memory, A100) == pytest.approx(op_seconds(memory, H200) * 4.8 / 2.039)


def _gemm_flops(ops: tuple) -> float:
    return sum(op.flops for op in ops if isinstance(op, Gemm | Attention))


@pytest.mark.parametrize("tp, cp", [(1, 1), (4, 1), (8, 2)])
def test_layer_gemms_carry_megatrons_flops(tp: int, cp: int) -> None:
    # Megatron-LM's formula counts 3 GEMMs per linear (forward, 2 backward) and core attention
    # 3 x its forward; flash backward is 2.5 x the forward (the table's convention)
    z = Shard(tp=tp, cp=cp, sequence_parallel=tp > 1, micro_batch=2)
    f = layer_flops(LLAMA, 0, 2)
    ops = layer_ops(LLAMA, z, False)
    forward = _gemm_flops(ops.forward)
    assert forward == pytest.approx(f.total / 3 / (tp * cp))
    assert _gemm_flops(ops.core) == pytest.approx(f.core_attention / 3 / (tp * cp))
    linears = forward - _gemm_flops(ops.core)
    assert _gemm_flops(ops.backward) == pytest.approx(2 * linears + 2.5 * _gemm_flops(ops.core))


def test_qkv_gemm_is_the_walkthroughs() -> None:
    steps = attention_walkthrough(LLAMA, "tp", 4, 1)
    qkv = next(s for s in steps if s.name.startswith("Q, K, V"))
    ops = layer_ops(LLAMA, Shard(tp=4), False)
    assert next(op for op in ops.forward if op.name == "QKV").flops == qkv.flops_rank


def test_moe_layer_experts_carry_megatrons_flops_under_expert_parallelism() -> None:
    f = layer_flops(MOE, 0, 1)
    for ep in (1, 2, 8):
        ops = layer_ops(MOE, Shard(ep=ep), True)
        experts = sum(op.flops for op in ops.forward if isinstance(op, Gemm) and op.orient == "expert")
        assert experts == pytest.approx(f.mlp / 3)
        assert sum(isinstance(op, Memory) and op.name == "permute" for op in ops.forward) == 1


def test_unfused_attention_costs_more_than_flash_and_its_fused_softmax_less() -> None:
    z = Shard(micro_batch=1)
    flash = layer_seconds(layer_ops(LLAMA, z, False), H200, "none")
    fused = layer_seconds(layer_ops(replace(LLAMA, flash_attention=False), z, False), H200, "none")
    torch_softmax = layer_seconds(
        layer_ops(replace(LLAMA, flash_attention=False, fused_kernels=False), z, False), H200, "none")
    assert flash < fused < torch_softmax


def test_recomputation_repeats_the_forward_megatron_repeats() -> None:
    ops = layer_ops(LLAMA, Shard(), False)
    none, selective, full = (layer_seconds(ops, H200, r) for r in ("none", "selective", "full"))
    assert full - none == pytest.approx(ops_seconds(ops.forward, H200))
    assert selective - none == pytest.approx(ops_seconds(ops.core, H200))
    assert 0 < selective - none < full - none


def test_output_layer_carries_the_logit_flops_and_the_loss_costs_time() -> None:
    ops = output_ops(LLAMA, Shard(tp=2))
    assert _gemm_flops(ops.forward + ops.backward) == pytest.approx(logit_flops(LLAMA, 1) / 2)
    loss = [op for op in ops.forward if op.name == "cross entropy"]
    assert loss and op_seconds(loss[0], H200) > 0


def test_the_plan_prices_kernels_unless_given_an_efficiency() -> None:
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    flags = dict(num_layers=4, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                 max_position_embeddings=4096, bf16=True, global_batch_size=4, transformer_impl="local")
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    fixed = {"tp": 1, "pp": 1, "mbs": 1, "recompute": "none", "cp": 1}
    times = {}
    for efficiency in (None, 0.65, 0.325):
        req = make_request(args, PlanFlags(1, gpu="h200", efficiency=efficiency, top=1))
        times[efficiency] = search(replace(req, fixed=fixed)).plans[0].time.shares()["compute"]
    assert times[0.325] == pytest.approx(2 * times[0.65])  # the flat model: FLOPs / rate
    assert times[None] != pytest.approx(times[0.65])


def test_a_gpu_with_its_own_table_reads_it() -> None:
    """--gpu h100 reads the H100's measurements (bench/gpu_kernels.py), not the H200's scaled."""
    from inspector.job.hardware import GPUS

    h100 = GPUS["h100"]
    # a Blackwell type reads the H100 table sped up by published figures; the A100 the H200's
    assert (kernels.table_of(h100), kernels.table_of(GPUS["b200"])) == ("h100", "h100")
    assert kernels.table_of(GPUS["a100-80gb"]) == "h200"
    rows = json.loads(kernels.TABLES["h100"].read_text())
    assert rows[0]["name"] == "NVIDIA H100 80GB HBM3"
    cell = [r for r in rows if r["kind"] == "flash_attention" and (r["seq"], r["heads_per_rank"]) == (2048, 4)]
    op = Attention("a", 2048, 4, 1e12, False)
    assert op_seconds(op, h100) == pytest.approx(1 / (sum(r["fwd_tflops"] for r in cell) / len(cell)))
    norm = next(r for r in rows if r["kind"] == "memory_bound" and r["op"] == "add" and r["tokens"] == 8192)
    assert op_seconds(Memory("add", "add", 8192 * 8192, 6), h100) == pytest.approx(norm["seconds"])


def test_the_single_gpu_benchmark_prices_its_sdpa_jobs_with_flash_attention(capsys, monkeypatch) -> None:
    # bench/gpu_time.py's `sdpa` jobs swap torch's SDPA into the local spec, which Megatron-LM runs
    # unfused: its estimate must still price them as flash attention (the s x s scores' passes gone)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_time

    gpu_time.estimate(None, ["h1024-l2-a8-s2048-b1-m2-local", "h1024-l2-a8-s2048-b1-m2-sdpa"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    local, sdpa = (float(row[3].split()[0]) for row in rows)
    assert sdpa < 0.9 * local


def test_a_class_claiming_more_than_hbm_reads_the_copy_rows() -> None:
    # every memory-bound row moves its counted bytes within its GPU's HBM bandwidth, except the
    # H200's add rows (two above 4.8 TB/s): they are priced at the copy rows' rate, so an add
    # of the measured size takes 3/2 of a copy (three tensors against two), as on the H100
    from inspector.job.hardware import GPUS

    for table in kernels.TABLES:
        for row in kernels.table_rows(table):
            if row["kind"] == "memory_bound" and kernels.credible(row["op"], table):
                assert row["gbytes_per_s"] * 1e9 <= GPUS[table].hbm, (table, row)
    assert not kernels.credible("add", "h200")
    assert all(kernels.credible(cls, "h100") for cls in ("copy", "add", "rms_norm", "swiglu"))
    device = replace(GPUS["h200"], tflops_fp8=None)
    n = 16384 * 16384
    add = op_seconds(Memory("x", "add", n, 6), device)
    copy = op_seconds(Memory("x", "copy", n, 4), device)
    assert add == pytest.approx(1.5 * copy, rel=0.02)
