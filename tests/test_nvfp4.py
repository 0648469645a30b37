"""NVFP4 (--fp4-format e2m1 --fp4-recipe nvfp4) and the 16-bit first and last layers, counted by
hand from the sources.

Transformer Engine 2.11's NVFP4Quantizer.make_empty (tensor/nvfp4_tensor.py 284-365) allocates,
per direction: packed data uint8 [M, K / 2] (row-wise) or [K, M / 2] (column-wise, the
transpose), E4M3 scales uint8 from `get_scale_shape` (215-250: [round_up(M, 128),
round_up(K / 16, 4)], column-wise [round_up(K, 128), round_up(M / 16, 4)]) and an fp32 amax [1].
megatron-core's fp4_utils.get_fp4_context (118-160) enters TE's fp8_autocast with
NVFP4BlockScaling around each transformer layer but the first `num_layers_at_start_in_bf16` and
last `num_layers_at_end_in_bf16` ones under --first-last-layers-bf16.
"""

from __future__ import annotations

import json

import pytest

from inspector.job.versions import FP4_SINCE, megatron_version

# megatron-core 0.13's TransformerConfig has no fp4: the tests that build it need 0.16+
NEEDS_FP4 = pytest.mark.skipif(megatron_version() < FP4_SINCE, reason="megatron-core lacks fp4")
SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size "
         "1000 --micro-batch-size 1 --bf16 --swiglu --normalization RMSNorm --disable-bias-linear "
         "--position-embedding-type rope --transformer-impl transformer_engine "
         "--use-distributed-optimizer --dp 2").split()  # fmt: skip
H, F = 256, 640  # hidden; SwiGLU ffn
LAYER_WEIGHTS = [(3 * H, H), (H, H), (2 * F, H), (H, F)]  # qkv, proj, fc1, fc2 (out, in)
BLOCK = 512  # the caching allocator's smallest block


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _direction(rows: int, cols: int) -> list[int]:
    """One direction's tensors in bytes: packed data, E4M3 scales per 16, the fp32 amax."""
    return [rows * cols // 2, _up(rows, 128) * _up(-(-cols // 16), 4), 4]


def _nvfp4_weight(rows: int, cols: int) -> int:
    """A weight quantized both ways (row-wise for fprop, column-wise for dgrad), as the
    allocator rounds each tensor."""
    return sum(_up(b, BLOCK) for b in _direction(rows, cols) + _direction(cols, rows))


def test_the_quantizer_allocates_what_nvfp4_tensor_make_empty_allocates():
    import torch

    from inspector.world.te.kernels.quantize import quantize

    made = quantize(384, 160, "nvfp4", rowwise=True, columnwise=True)
    shapes = [(t.dtype, tuple(t.shape)) for t in made.tensors()]
    u8, f32 = torch.uint8, torch.float32
    # row-wise: 160 / 2 bytes a row; 160 / 16 = 10 scales padded to 12, 384 rows (x128);
    # column-wise: [160, 192] data; 384 / 16 = 24 scales, 160 rows padded to 256
    assert shapes == [(u8, (384, 80)), (u8, (384, 12)), (f32, (1,)),
                      (u8, (160, 192)), (u8, (256, 24)), (f32, (1,))]  # fmt: skip


def _static(cli, *flags):
    result = cli("memory", *SMALL, "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]["static"]


@NEEDS_FP4
def test_each_fp4_layer_keeps_its_nvfp4_weights_and_the_first_and_last_keep_none(cli):
    """TE keeps each GEMM's quantized weight for the run (`_fp8_workspaces`, base.py 1376-1395):
    every layer under fp4, only the middle two with --first-last-layers-bf16 (megatron's
    get_fp4_context decides per layer); the weights themselves stay bf16 in megatron's buffers."""
    plain = _static(cli)
    fp4 = _static(cli, "--fp4-format", "e2m1")
    middle = _static(cli, "--fp4-format", "e2m1", "--first-last-layers-bf16")
    one_layer = sum(_nvfp4_weight(r, c) for r, c in LAYER_WEIGHTS)
    assert fp4 - middle == 2 * one_layer
    # fp4 against bf16: the four layers' NVFP4 weights, less what bf16 keeps and fp4 does not
    assert 0 <= 4 * one_layer - (fp4 - plain) < 4 * 2 * BLOCK
    only_first = _static(cli, "--fp4-format", "e2m1", "--first-last-layers-bf16",
                         "--num-layers-at-end-in-bf16", "0")  # fmt: skip
    assert fp4 - only_first == one_layer


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp4-format", "e2m1", "--fp8-format", "hybrid"],
         "Error: --fp4-format e2m1 with --fp8-format hybrid: megatron-core's TransformerConfig: "
         "'fp4 and fp8 cannot be used simultaneously. Please choose one.'"),
        (["--fp4-format", "e2m1", "--fp4-recipe", "custom"],
         "Error: --fp4-recipe 'custom' is not modelled"),
        (["--fp4-recipe", "custom"], "Error: --fp4-recipe custom has no effect without --fp4-format"),
        (["--fp4-format", "e2m1", "--first-last-layers-bf16", "--fp8-format", "hybrid"],
         "Error: --fp4-format e2m1 with --fp8-format hybrid"),
    ],
)  # fmt: skip
@NEEDS_FP4
def test_fp4_settings_megatron_refuses_are_refused(cli, flags, message):
    result = cli("memory", *SMALL, *flags)
    assert result.code == 2 and result.err.startswith(message), result.err


@NEEDS_FP4
def test_fp4_needs_transformer_engine(cli):
    flags = [f for f in SMALL if f not in ("--transformer-impl", "transformer_engine")]
    result = cli("memory", *flags, "--transformer-impl", "local", "--fp4-format", "e2m1")
    assert result.code == 2
    assert result.err == ("Error: --fp4-format e2m1 needs --transformer-impl transformer_engine: "
                          "only Transformer Engine's layers compute in fp4\n")  # fmt: skip


@pytest.mark.skipif(megatron_version() >= (0, 18), reason="modelled on 0.18+ (test_fp4_params.py)")
def test_fp4_parameters_are_refused_by_name_with_megatrons_reason(cli, tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(f"torchrun pretrain_gpt.py {' '.join(SMALL)} --fp4-format e2m1 "
                    "--fp4-param-gather\n")  # fmt: skip
    result = cli("memory", "--from-script", str(path))
    assert result.code == 2
    assert "--fp4-param-gather is not modelled: megatron-core 0.13-0.16's DDP" in result.err
    assert "replace_raw_data" in result.err


def plan_and_memory(cli, *extra: str) -> tuple[dict, list[dict]]:
    """Return `plan`'s best 2-GPU layout of a 4-layer Llama 3 8B in NVFP4 (with `extra`), and
    `memory`'s stages for the flags it prints."""
    import shlex

    model = ["--model", "llama3-8b", "--num-layers", "4", "--seq-length", "1024", "--bf16",
             "--global-batch-size", "8", "--fp4-format", "e2m1", *extra]  # fmt: skip
    result = cli("plan", "--format", "json", "--gpus", "2", "--tp", "1", "--cp", "1", *model,
                 "--top", "1", "--gpu", "b200")  # fmt: skip
    assert result.code == 0, result.err
    plan = json.loads(result.out)["plans"][0]
    assert {"--fp4-format e2m1", *extra} <= set(plan["flags"])
    flags = [word for flag in plan["flags"] for word in shlex.split(flag)]
    memory = cli("memory", "--format", "json", "--model", "llama3-8b", "--num-layers", "4",
                 "--seq-length", "1024", *flags, "--dp", str(plan["layout"]["dp"]))  # fmt: skip
    assert memory.code == 0, memory.err
    return plan, json.loads(memory.out)["stages"]


@NEEDS_FP4
def test_plan_prices_fp4_memory_as_memory_does_and_says_its_gemms_are_bf16(cli):
    plan, measured = plan_and_memory(cli, "--first-last-layers-bf16")
    assert [s["total"] for s in plan["stages"]] == [s["total"] for s in measured]
    model = ["--model", "llama3-8b", "--num-layers", "4", "--seq-length", "1024", "--bf16",
             "--global-batch-size", "8", "--fp4-format", "e2m1", "--first-last-layers-bf16"]  # fmt: skip
    text = cli("plan", "--gpus", "2", "--tp", "1", "--cp", "1", *model, "--top", "1", "--gpu", "b200")
    assert "hold no NVFP4 GEMMs: plan prices Transformer Engine's GEMMs at bf16 speed" in text.out


@pytest.mark.skipif(megatron_version() >= FP4_SINCE, reason="this megatron-core has fp4")
def test_fp4_is_refused_before_megatron_core_has_it(cli):
    result = cli("memory", *SMALL, "--fp4-format", "e2m1")
    assert result.code == 2 and result.err.startswith("Error: --fp4-format e2m1 needs megatron-core 0.16")


def test_fp4_since_is_what_the_installed_megatron_core_has():
    """job/versions.py FP4_SINCE against megatron itself: TransformerConfig has `fp4` exactly
    from it on (0.13.1 no, 0.16.1 and 0.19.2 yes)."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert ("fp4" in names) == (megatron_version() >= FP4_SINCE)
