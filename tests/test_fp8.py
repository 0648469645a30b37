"""FP8 through Transformer Engine: the flags, their refusals, what a TE linear holds and saves.

The byte counts are written by hand from TE 2.11's quantizers (float8_tensor.py `make_empty`,
mxfp8_tensor.py `make_empty`, float8_blockwise_tensor.py `get_scale_shape`) and the recipe state
(module/base.py `set_meta_tensor`), independently of inspector/world/te/kernels/quantize.py.
"""

from __future__ import annotations

import json

import pytest

M, K, N = 256, 128, 384  # GEMM rows (sequence x micro-batch), in and out features
SMALL = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size "
         "1000 --micro-batch-size 1 --bf16 --swiglu --normalization RMSNorm --disable-bias-linear "
         "--position-embedding-type rope").split()  # fmt: skip
TE = ["--transformer-impl", "transformer_engine"]


def _te():
    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from transformer_engine.common import recipe

    return te_pytorch, recipe


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _run_linear(recipe=None, first_microbatch=True):
    """Run a TE Linear (no tp) forward on an [M, 1, K] bf16 input; return (output, module)."""
    import torch

    te_pytorch, _ = _te()
    linear = te_pytorch.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="meta")
    x = torch.empty((M, 1, K), dtype=torch.bfloat16, device="meta", requires_grad=True)
    if recipe is None:
        return linear(x, is_first_microbatch=first_microbatch), linear
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe):
        return linear(x, is_first_microbatch=first_microbatch), linear


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def test_bf16_linear_saves_16_bit_input_and_weight():
    out, _ = _run_linear()
    # inputmat M x K bf16, weightmat and weight (the same N x K bf16 tensor, saved twice)
    assert _nbytes(out.grad_fn.saved_tensors) == 2 * M * K + 2 * (2 * N * K)


def test_delayed_fp8_linear_saves_one_byte_input_transpose_and_fp8_weight():
    _, recipe = _te()
    out, linear = _run_linear(recipe.DelayedScaling(amax_history_len=16))
    # input: column-wise fp8 transpose K x M (1 byte) + fp32 scale_inv [1]; weight workspace:
    # data N x K + transpose K x N (1 byte each) + scale_inv [1]; the bf16 weight itself
    fp8_input = M * K + 4
    fp8_weight = 2 * N * K + 4
    assert _nbytes(out.grad_fn.saved_tensors) == fp8_input + fp8_weight + 2 * N * K
    # against bf16 (2 M K for the input): the saved input halves, less its scale
    assert 2 * M * K - fp8_input == M * K - 4
    # recipe state, forward (3 tensors) and backward (2): scale [n] + amax_history [16, n] fp32
    state = linear.__dict__["fp8_recipe_state"]
    assert _nbytes(state) == 4 * (3 + 16 * 3) + 4 * (2 + 16 * 2)
    assert _nbytes(linear.__dict__["_fp8_workspaces"]["weight"].tensors()) == fp8_weight


def test_tensorwise_fp8_linear_keeps_a_scale_and_amax_per_quantizer():
    _, recipe = _te()
    out, linear = _run_linear(recipe.Float8CurrentScaling())
    assert _nbytes(out.grad_fn.saved_tensors) == (M * K + 4) + (2 * N * K + 4) + 2 * N * K
    assert _nbytes(linear.__dict__["fp8_recipe_state"]) == (3 + 2) * 2 * 4


def test_mxfp8_linear_saves_columnwise_data_and_e8m0_scales():
    _, recipe = _te()
    out, linear = _run_linear(recipe.MXFP8BlockScaling())
    # column-wise data M x K + one uint8 scale per 32 rows, padded to (4, 128)
    fp8_input = M * K + _round_up(M // 32, 4) * _round_up(K, 128)
    # weight row-wise and column-wise data + both scale tensors
    fp8_weight = 2 * N * K + _round_up(N, 128) * _round_up(K // 32, 4)
    fp8_weight += _round_up(N // 32, 4) * _round_up(K, 128)
    assert _nbytes(out.grad_fn.saved_tensors) == fp8_input + fp8_weight + 2 * N * K
    assert linear.__dict__["fp8_recipe_state"] == []


def test_blockwise_linear_scales_activations_per_1x128_and_weights_per_128x128():
    _, recipe = _te()
    out, _ = _run_linear(recipe.Float8BlockScaling())
    # input column-wise: K x M data, fp32 scales [ceil(M/128), roundup(K, 4)]
    fp8_input = M * K + 4 * -(-M // 128) * _round_up(K, 4)
    # weight 2-D blocks: row-wise [ceil(N/128), roundup(ceil(K/128), 4)], column-wise transposed
    fp8_weight = 2 * N * K + 4 * (-(-N // 128)) * _round_up(-(-K // 128), 4)
    fp8_weight += 4 * (-(-K // 128)) * _round_up(-(-N // 128), 4)
    assert _nbytes(out.grad_fn.saved_tensors) == fp8_input + fp8_weight + 2 * N * K


def test_fp8_weight_is_cached_across_microbatches_only_when_megatron_passes_the_flag():
    _, recipe = _te()
    out, linear = _run_linear(recipe.DelayedScaling())
    cached = linear.__dict__["_fp8_workspaces"]["weight"]
    out, linear = _run_linear(recipe.DelayedScaling(), first_microbatch=None)
    assert "weight" not in linear.__dict__.get("_fp8_workspaces", {})
    assert cached.rows == N and cached.cols == K


def test_fp8_backward_runs_and_returns_the_input_gradient():
    import torch

    _, recipe = _te()
    out, linear = _run_linear(recipe.DelayedScaling())
    out.backward(torch.empty_like(out))
    assert linear.weight.grad is not None and linear.weight.grad.shape == (N, K)


def _memory(cli, *flags):
    result = cli("memory", *SMALL, *TE, "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def test_fp8_memory_runs_end_to_end_and_holds_each_linears_fp8_weight(cli):
    """Each TE linear keeps its fp8 weight (data + transpose, N x K bytes each), its scale_inv
    and the delayed recipe's four state tensors, each rounded to the allocator's 512 bytes."""
    bf16, fp8 = _memory(cli), _memory(cli, "--fp8-format", "hybrid")
    h, f = 256, 640  # SwiGLU: int(4 x 256 x 2/3 / 64) x 64
    weights = [3 * h * h, h * h, 2 * f * h, h * f]  # qkv, proj, fc1, fc2 (8 heads, no GQA)
    per_module = [2 * n + 512 + 4 * 512 for n in weights]
    grew = sum(b for _, b in fp8["buffers"]["persistent"]) - sum(
        b for _, b in bf16["buffers"]["persistent"]
    )
    assert grew == 2 * sum(per_module)
    assert fp8["parameters"] == bf16["parameters"] and fp8["weights"] == bf16["weights"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--transformer-impl", "local", "--fp8-format", "hybrid"],
         "--fp8-format hybrid needs --transformer-impl transformer_engine: only Transformer "
         "Engine's layers compute in fp8"),
        ([*TE, "--fp8-recipe", "blockwise"],
         "--fp8-recipe blockwise has no effect without --fp8-format"),
        ([*TE, "--fp8-format", "e4m3", "--fp8-amax-history-len", "0"],
         "--fp8-amax-history-len"),
    ],
)  # fmt: skip
def test_fp8_flags_are_checked(cli, flags, message):
    result = cli("memory", *SMALL, *flags)
    assert result.code == 2 and result.err.startswith("Error: ") and message in result.err


@pytest.mark.parametrize("flag", ["--no-fp8-wgrad", "--fp8-multi-head-attention"])
def test_fp8_variants_not_modelled_are_refused_by_name(cli, tmp_path, flag):
    path = tmp_path / "train.sh"
    path.write_text(f"torchrun pretrain_gpt.py {' '.join(SMALL + TE)} --fp8-format hybrid {flag}\n")
    result = cli("memory", "--from-script", str(path))
    assert result.code == 2 and f"{flag} is not modelled" in result.err


def test_sequence_parallel_delayed_fp8_saves_row_wise_data_to_gather_again():
    """linear.py 390-396: Float8 quantizers all-gather row-wise data only, so a column-parallel
    linear under sequence parallelism saves its local input row-wise (M x K, not transposed)."""
    import torch

    te_pytorch, recipe = _te()
    linear = te_pytorch.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="meta",
                               parallel_mode="column", sequence_parallel=True, tp_size=2)  # fmt: skip
    x = torch.empty((M, 1, K), dtype=torch.bfloat16, device="meta", requires_grad=True)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        out = linear(x, is_first_microbatch=True)
    assert out.shape == (2 * M, 1, N // 2)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert (tuple(saved[0].shape), saved[0].dtype) == ((M, K), torch.uint8)
    assert _nbytes(saved) == (M * K + 4) + (2 * (N // 2) * K + 4) + 2 * (N // 2) * K


def test_fp8_gemms_are_priced_from_the_h100s_fp8_measurements():
    """fp8 GEMMs read the H100's measured fp8 rows (bench/gpu_kernels.py: cuBLASLt through
    torch._scaled_mm, per-tensor scales): near each measured row on the H100, at the same
    fraction of its own fp8 peak on another GPU (H100 SXM 1,979, HGX B200 4,500 dense FP8 TFLOP/s),
    and at the 16-bit rate on a GPU without fp8 tensor cores."""
    import json

    from inspector.formulas import kernels
    from inspector.formulas.kernels import Gemm, op_seconds
    from inspector.job.hardware import GPUS

    h100, b200 = GPUS["h100"], GPUS["b200"]
    rows = [r for r in json.loads(kernels.TABLES["h100"].read_text()) if r["kind"] == "gemm_fp8"]
    assert len(rows) == 576
    for r in rows[::12]:
        op = Gemm("x", r["m"], r["n"], r["k"], r["orient"], fp8=True)
        assert op_seconds(op, h100) == pytest.approx(r["seconds"], rel=0.35), r
    bf16 = Gemm("fc1", 8192, 8192, 8192, "fwd")
    fp8 = Gemm("fc1", 8192, 8192, 8192, "fwd", fp8=True)
    # measured: fp8 is not twice as fast as bf16 at this size on the H100
    assert 1.4 < op_seconds(bf16, h100) / op_seconds(fp8, h100) < 1.95
    # Blackwell's fp8 GEMMs: 2.0x the H100's, as NVIDIA's cuBLAS 12.9 measured (not 4500 / 1979)
    assert op_seconds(fp8, b200) == pytest.approx(op_seconds(fp8, h100) / 2.0)
    a100 = GPUS["a100-80gb"]  # no fp8 tensor cores: priced at the 16-bit peak
    assert op_seconds(fp8, a100) == pytest.approx(op_seconds(bf16, a100))


def test_fp8_layer_casts_each_gemm_input_and_output_gradient_once():
    from inspector.formulas.kernels import Gemm, Memory
    from inspector.formulas.ops import Shard, layer_ops
    from inspector.job.dims import ModelDims

    dims = ModelDims(2, 256, 8, 128, 1024, swiglu=True, flash_attention=True)
    plain = layer_ops(dims, Shard(micro_batch=2), False)
    fp8 = layer_ops(ModelDims(2, 256, 8, 128, 1024, swiglu=True, flash_attention=True,
                              fp8="hybrid"), Shard(micro_batch=2), False)  # fmt: skip
    gemms = [op for op in (*fp8.forward, *fp8.backward) if isinstance(op, Gemm)]
    assert all(op.fp8 for op in gemms if not op.name.startswith(("Q K", "dQ", "dK")))
    casts = [op for op in (*fp8.forward, *fp8.backward)
             if isinstance(op, Memory) and op.name.endswith("fp8 cast")]  # fmt: skip
    assert len(casts) == 2 * 4  # QKV, attention output, fc1, fc2; forward and backward
    assert len(fp8.forward) == len(plain.forward) + 4


def test_workload_prices_te_gemms_at_the_fp8_peak(cli, tmp_path):
    from inspector.report.workload_inputs import compute_for

    rate = compute_for(None, 0.5, None, "h100", "bfloat16", fp8=True)
    assert rate.ns(1979e9, fp8=True) == round(1979e9 / (1979 * 0.5 * 1e3))
    assert rate.ns(989e9) == round(989e9 / (989 * 0.5 * 1e3))
    assert compute_for(500.0, None, None, None, "bfloat16", fp8=True).fp8_tflops is None


def test_full_recompute_under_fp8_runs_through_tes_checkpoint(cli):
    """megatron's te_checkpoint calls TE's distributed.checkpoint under fp8; the fp8 weight
    caches are the same as without recomputation (made with their transposes, base.py 1376-1395)."""
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1"]  # fmt: skip
    plain, recomputed = _memory(cli, "--fp8-format", "hybrid"), _memory(cli, "--fp8-format", "hybrid", *full)
    assert sorted(recomputed["buffers"]["persistent"]) == sorted(plain["buffers"]["persistent"])


def test_grouped_linear_fp8_saves_each_gemms_columnwise_input_and_caches_fp8_weights():
    """grouped_linear.py 155-170, 229-256: per GEMM the column-wise fp8 input (K x m, 1 byte,
    + scale_inv) and the cached fp8 weight (N x K data + transpose + scale_inv)."""
    import torch

    te_pytorch, recipe = _te()
    splits = [64, 128, 64]
    grouped = te_pytorch.GroupedLinear(len(splits), K, N, bias=False, params_dtype=torch.bfloat16,
                                       device="meta")  # fmt: skip
    x = torch.empty((sum(splits), K), dtype=torch.bfloat16, device="meta", requires_grad=True)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        out = grouped(x, splits, is_first_microbatch=True)
    fp8_inputs = sum(m * K + 4 for m in splits)
    fp8_weights = len(splits) * (2 * N * K + 4)
    assert _nbytes(out.grad_fn.saved_tensors) == fp8_inputs + fp8_weights + len(splits) * 2 * N * K
    assert sorted(grouped.__dict__["_fp8_workspaces"]) == ["weight0", "weight1", "weight2"]
    # delayed state for 3 GEMMs, TE's default history of 1,024: scale [9] + history [1024, 9]
    # forward, [6] + [1024, 6] backward
    assert _nbytes(grouped.__dict__["fp8_recipe_state"]) == 4 * (9 + 1024 * 9 + 6 + 1024 * 6)
    out.backward(torch.empty_like(out))
    assert x.grad is not None and x.grad.shape == x.shape


def test_fp8_padding_pads_each_gemms_rows_to_16_or_32_for_mxfp8():
    import torch

    te_pytorch, recipe = _te()
    x = torch.empty((10 + 20, K), dtype=torch.bfloat16, device="meta", requires_grad=True)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        padded, splits = te_pytorch.Fp8Padding(2)(x, [10, 20])
        assert (tuple(padded.shape), splits) == ((16 + 32, K), [16, 32])
        back = te_pytorch.Fp8Unpadding(2)(padded, [10, 20])
        assert tuple(back.shape) == (30, K)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        assert te_pytorch.Fp8Padding(2)(x, [10, 20])[1] == [32, 32]


def test_fp8_moe_and_context_parallel_run_and_the_closed_forms_leave_fp8_out(cli, monkeypatch):
    from inspector.memory.engine import run as engine

    engine_line = "megatron's forward, backward and optimizer step run on meta tensors"
    moe = cli("memory", *SMALL, *TE, "--num-experts", "4", "--fp8-format", "hybrid")
    assert moe.code == 0, moe.err
    assert engine_line in moe.out
    cp_job = [*SMALL, *TE, "--cp", "2", "--dp", "1", "--use-flash-attn", "--fp8-format", "hybrid"]
    cp = cli("memory", *cp_job)
    assert cp.code == 0, cp.err
    assert engine_line in cp.out and "not counted" not in cp.out
    # where the engine cannot run an fp8 job, the closed-form line says what they leave out
    monkeypatch.setattr(engine, "engine_gap", lambda job: "Some layer is not run")
    cp = cli("memory", *cp_job)
    assert cp.code == 0, cp.err
    assert "fp8 weight copies and fp8 saved inputs not counted" in cp.out


def test_workload_mlp_times_scale_by_the_h100s_16_bit_over_fp8_peak(cli):
    def mlp_forward_ns(*flags):
        result = cli("workload", *SMALL, *TE, "--gpu", "h100", "--stage", "0", *flags)
        assert result.code == 0, result.err
        row = next(line for line in result.out.splitlines() if line.startswith("mlp_layer"))
        return int(row.split("\t")[2])

    bf16, fp8 = mlp_forward_ns(), mlp_forward_ns("--fp8-format", "hybrid")
    assert fp8 == round(bf16 * 989 / 1979) or abs(fp8 - bf16 * 989 / 1979) <= 1


def test_delayed_scaling_refuses_layernorm_recomputation_as_megatron_core_does(cli):
    result = cli("memory", *SMALL, *TE, "--fp8-format", "hybrid", "--recompute-granularity",
                 "selective", "--recompute-modules", "layernorm")  # fmt: skip
    assert result.code == 2
    assert result.err.startswith("Error: --recompute-modules layernorm does not work with "
                                 "--fp8-recipe delayed")  # fmt: skip


def test_plan_prints_the_peak_memory_confirms_for_an_fp8_job(cli):
    """plan's memory for an fp8 job is what `memory` measures on the plan's flags."""
    import shlex

    model = ["--model", "llama3-8b", "--num-layers", "2", "--seq-length", "1024", "--bf16",
             "--global-batch-size", "8", "--fp8-format", "hybrid"]  # fmt: skip
    result = cli("plan", "--format", "json", "--gpus", "2", "--tp", "1", "--cp", "1", *model,
                 "--top", "1")  # fmt: skip
    assert result.code == 0, result.err
    plan = json.loads(result.out)["plans"][0]
    flags = [word for flag in plan["flags"] for word in shlex.split(flag)]
    memory = cli("memory", "--format", "json", *model, *flags, "--dp", str(plan["layout"]["dp"]))
    assert memory.code == 0, memory.err
    built = json.loads(memory.out)["stages"]
    assert [s["total"] for s in plan["stages"]] == [s["total"] for s in built]
