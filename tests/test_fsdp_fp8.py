"""Megatron-FSDP with fp8 weights (--fp8-param-gather) and with the precision-aware optimizer.

Each rank's bytes by hand from megatron-core's Megatron-FSDP (megatron_fsdp/param_and_grad_buffer.py,
0.16.1 and 0.19.2) on SMALL (tests/test_fp8_params.py), at --dp 1 where no bucket is padded
(`build_data_parallel_buffer_index` pads a bucket to its longest row only):
- `_init_each_parameter_group_buffers`: a group of TE's quantized weights (`dtype="float8"`)
  gets a torch.uint8 model weight buffer, and with MXFP8 a second uint8 buffer for the
  column-wise data (`transpose_weight_buffer`, `fp8_need_transpose_data`); the other
  parameters a bf16 one; the fp32 main weights (`megatron_fsdp_main_params_dtype`) for all;
- `fp8_set_raw_data` points only the data into those buffers: a Float8Tensor's scale_inv
  (an fp32 [1], 512 bytes in the caching allocator) and an MXFP8Tensor's two E8M0 scale
  tensors stay whole on every rank; the Float8Tensor's transpose is dropped
  (`fp8_discard_transpose_cache`, keep_fp8_transpose_cache False);
- the precision-aware optimizer (0.19.2 optimizer/__init__.py, Megatron-FSDP branch): FusedAdam
  keeps no master weights (`master_weights` False), so the optimizer state is the fp32 main
  weights and the two moments in --exp-avg-dtype / --exp-avg-sq-dtype.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from inspector.inputs.versions import megatron_core_version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fp8_params import SMALL, TE_WEIGHT_SHAPES, F  # noqa: E402

MFSDP = ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy "
         "optim_grads_params").split()  # fmt: skip
TENSORWISE = ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]
MXFP8 = ["--fp8-recipe", "mxfp8", "--fp8-param-gather"]
AWARE = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
P = 1_770_752  # SMALL's parameters (tests/test_fp8_params.py)
N = sum(rows * cols for rows, cols in TE_WEIGHT_SHAPES)  # its TE GEMM weights
BLOCK = 512  # the caching allocator's smallest block


def _padded_fp8() -> int:
    # a layer's fp8 weights are one bucket (an FSDP unit's group of one dtype), padded to a
    # multiple of dp x its longest row (fc2's F elements): build_data_parallel_buffer_index
    return 2 * _up(N // 2, F)


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mxfp8_scales(rows: int, cols: int) -> int:
    # TE tensor/mxfp8_tensor.py make_empty: row-wise [M, K/32] padded to (128, 4), column-wise
    # [M/32, K] padded to (4, 128), one byte each, each its own allocation
    row = _up(rows, 128) * _up(cols // 32, 4)
    col = _up(rows // 32, 4) * _up(cols, 128)
    return _up(row, BLOCK) + _up(col, BLOCK)


def _stage(cli: Any, *flags: str) -> dict[str, Any]:
    result = cli("memory", *SMALL, *MFSDP, "--dp", "1", "--format", "json", *flags)
    assert result.code == 0, result.err
    stage: dict[str, Any] = json.loads(result.out)["stages"][0]
    return stage


skip_old = pytest.mark.skipif(megatron_core_version() < (0, 16),
                              reason="megatron-core before 0.16 has custom_fsdp, refused")  # fmt: skip


@skip_old
def test_float8_weights_live_in_a_uint8_buffer_with_their_scales_beside_it(cli):
    got = _stage(cli, *TENSORWISE)
    assert got["parameters"] == P
    assert got["weights"] == 2 * (P - N) + _padded_fp8() + BLOCK * len(TE_WEIGHT_SHAPES)
    # fp32 main grads (Megatron-LM's default for bf16) and main weights over the padded buckets,
    # Adam's two fp32 moments over the parameters
    assert got["gradients"] == 4 * (P - N + _padded_fp8())
    assert got["optimizer"] == 4 * (P - N + _padded_fp8()) + 8 * P


@skip_old
def test_mxfp8_weights_have_a_row_wise_and_a_column_wise_buffer(cli):
    got = _stage(cli, *MXFP8)
    scales = sum(_mxfp8_scales(rows, cols) for rows, cols in TE_WEIGHT_SHAPES)
    assert got["weights"] == 2 * (P - N) + 2 * _padded_fp8() + scales


@skip_old
def test_gathered_float8_weights_are_one_byte_and_the_backward_adds_a_transpose(cli):
    # the layers are gathered one FSDP unit at a time, the next prefetched: the pair's fp8
    # weights at one byte beside their bf16 norms (a bucket of 2 x 256), and the transpose of
    # the unit in use in its backward (a Float8Tensor's, on Hopper)
    fp8 = _stage(cli, *TENSORWISE)["buffers"]["fsdp_in_flight"]
    mx = _stage(cli, *MXFP8)["buffers"]["fsdp_in_flight"]
    layer = _padded_fp8() // 2 + 2 * 512
    assert fp8 == 2 * layer + _padded_fp8() // 2
    assert mx == 2 * layer  # MXFP8: the backward gathers the column-wise buffer instead
    # on Blackwell TE's post_all_gather_processing makes no transpose (tensor/utils.py: "if not
    # is_non_tn_fp8_gemm_supported(): model_weight._create_transpose()"): the pair alone
    assert _stage(cli, *TENSORWISE, "--gpu", "gb200")["buffers"]["fsdp_in_flight"] == 2 * layer


@pytest.mark.skipif(megatron_core_version() < (0, 19),
                    reason="before 0.19 FusedAdam keeps its own master weights: refused")  # fmt: skip
def test_precision_aware_optimizer_keeps_main_weights_and_reduced_moments(cli):
    got = _stage(cli, *AWARE)
    # the fp32 main weights fill the same padded buckets as the fp32 main grads; the moments
    # (bf16, 2 bytes each) cover the parameters; no FusedAdam master copy
    assert got["optimizer"] == got["gradients"] + (2 + 2) * P
    assert got["optimizer"] < _stage(cli)["optimizer"] - 3 * P


@pytest.mark.skipif(megatron_core_version() >= (0, 19), reason="0.19 is modelled")
def test_precision_aware_optimizer_with_megatron_fsdp_is_refused_before_0_19(cli):
    result = cli("memory", *SMALL, *MFSDP, "--dp", "1", *AWARE)
    assert result.code == 2
    assert "--use-precision-aware-optimizer with --use-megatron-fsdp is not modelled before " \
        "megatron-core 0.19" in result.err


@pytest.mark.parametrize(("flags", "said"), [
    (["--fp8-recipe", "blockwise", "--fp8-param-gather"], "--fp8-recipe blockwise is not modelled"),
    (["--fp8-recipe", "tensorwise", "--fp8-param-gather", "--data-parallel-sharding-strategy",
      "no_shard"], "no_shard is not modelled"),
])  # fmt: skip
@skip_old
def test_what_is_not_modelled_is_refused_by_name(cli, flags, said):
    result = cli("memory", *SMALL, *MFSDP, "--dp", "1", *flags)
    assert result.code == 2
    assert said in result.err
