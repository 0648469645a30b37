"""What Transformer Engine's fp8 quantizers allocate: data, transposes, scales (TE 2.11).

A quantized tensor is a few plain tensors (TE's `prepare_for_saving` saves exactly these):
- delayed / tensorwise (`Float8Tensor`, pytorch/tensor/float8_tensor.py `make_empty` 111-150):
  row-wise `_data` uint8 [M, K], column-wise `_transpose` uint8 [K, M] (the copy Hopper's TN-only
  fp8 GEMMs read for dgrad and wgrad), one fp32 `_scale_inv` [1]. On a GPU whose fp8 GEMMs take
  any layout (compute capability 10.x: te/cuda.py `is_non_tn_fp8_gemm_supported`) there is no
  transpose: the row-wise data serves both usages (csrc/quantizer.cpp `Float8Quantizer::
  create_tensor`, v2.11 126 and 137, v2.17 290 and 302: "with_data = rowwise_usage ||
  nvte_is_non_tn_fp8_gemm_supported()", "with_transpose = columnwise_usage &&
  !nvte_is_non_tn_fp8_gemm_supported()"; `Float8CurrentScalingQuantizer` alike, v2.11 331/340);
- blockwise (`Float8BlockwiseQTensor`, float8_blockwise_tensor.py `get_scale_shape` 125-184):
  row-wise data [M, K] and column-wise data [K, M], each with fp32 scales per 1x128 block
  (activations, gradients) or 128x128 block (weights, `Float8BlockScaling.w_block_scaling_dim`);
- mxfp8 (`MXFP8Tensor`, mxfp8_tensor.py `make_empty` 105-150): row-wise and column-wise data
  [M, K], with one uint8 (E8M0) scale per 32 elements along each direction, padded to 128 x 4;
- nvfp4 (`NVFP4Tensor`, nvfp4_tensor.py `make_empty` 284-365, `get_scale_shape` 215-250):
  row-wise data uint8 [M, K / 2] (two E2M1 values a byte), one uint8 (E4M3) scale per 16
  elements [round_up(M, 128), round_up(K / 16, 4)] and an fp32 amax [1]; column-wise the same of
  the transpose: [K, M / 2], scales [round_up(K, 128), round_up(M / 16, 4)], amax [1]. The
  random Hadamard transform (inputs' and gradients' column-wise use, recipe `fp4_quant_fwd_inp`)
  is fused into the cast; its 16 x 16 bf16 matrix is made once per device (lru_cache,
  nvfp4_tensor.py 92-102), 512 bytes, not counted.
Recipe state (module/base.py `set_meta_tensor` 706-741, quantization.py
`DelayedScalingRecipeState` 1049-1090): delayed keeps, per module and direction, fp32 `scale`
[n] and `amax_history` [history, n] for n = 3 (forward: input, weight, output) or 2 (backward:
grad output, grad input) tensors per GEMM; tensorwise keeps an fp32 scale and amax [1] per
quantizer (float8_tensor.py `Float8CurrentScalingQuantizer.__init__` 260-270); block recipes
keep none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inspector.world.te.cuda import is_non_tn_fp8_gemm_supported

BLOCK = 128  # Float8BlockScaling block_len
MX_BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE
NV_BLOCK = 16  # NVFP4_BLOCK_SCALING_SIZE


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass
class Quantized:
    """A quantized 2-D tensor as its plain tensors: row-wise and column-wise parts."""

    rows: int
    cols: int
    rowwise: tuple[torch.Tensor, ...]
    columnwise: tuple[torch.Tensor, ...]
    shared: tuple[torch.Tensor, ...] = ()  # Float8Tensor's one scale_inv serves both
    # a Float8 tensor on a GPU with non-TN fp8 GEMMs: its row-wise data serves both usages
    serves_both: bool = False

    def keep(self, rowwise: bool, columnwise: bool) -> Quantized:
        """Drop the unused direction, as TE's `update_usage` frees it (quantized_tensor.py); a
        Float8 tensor on Blackwell keeps its data for either usage (float8_tensor_storage.py
        `update_usage`, v2.11 202-207: "if columnwise_usage: needs_data = True")."""
        keep_rows = rowwise or (columnwise and self.serves_both)
        return Quantized(
            self.rows,
            self.cols,
            self.rowwise if keep_rows else (),
            self.columnwise if columnwise else (),
            self.shared,
            self.serves_both,
        )

    @property
    def has_columnwise(self) -> bool:
        """Return whether a GEMM can read it column-wise (TE's `get_usages()["columnwise"]`)."""
        return bool(self.columnwise) or (self.serves_both and bool(self.rowwise))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Return the tensors TE's `prepare_for_saving` would save."""
        return (*self.rowwise, *self.columnwise, *self.shared)


def _block_scales(rows: int, cols: int, two_d: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Return (row-wise, column-wise) fp32 scale shapes of Float8BlockQuantizer.get_scale_shape."""
    if two_d:
        row = (math.ceil(rows / BLOCK), _round_up(math.ceil(cols / BLOCK), 4))
        col = (math.ceil(cols / BLOCK), _round_up(math.ceil(rows / BLOCK), 4))
        return row, col
    return (math.ceil(cols / BLOCK), _round_up(rows, 4)), (math.ceil(rows / BLOCK), _round_up(cols, 4))


def quantize(
    rows: int, cols: int, recipe: str, rowwise: bool, columnwise: bool, weight: bool = False
) -> Quantized:
    """Allocate what TE's quantizer for `recipe` makes of an [rows, cols] tensor."""
    u8, f32 = torch.uint8, torch.float32
    if recipe in ("delayed", "tensorwise"):
        if is_non_tn_fp8_gemm_supported():  # no transpose: the data serves both (see above)
            data = (_empty((rows, cols), u8),) if rowwise or columnwise else ()
            return Quantized(rows, cols, data, (), (_empty((1,), f32),), serves_both=True)
        return Quantized(
            rows,
            cols,
            (_empty((rows, cols), u8),) if rowwise else (),
            (_empty((cols, rows), u8),) if columnwise else (),
            (_empty((1,), f32),),
        )
    if recipe == "blockwise":
        row_scale, col_scale = _block_scales(rows, cols, two_d=weight)
        return Quantized(
            rows,
            cols,
            (_empty((rows, cols), u8), _empty(row_scale, f32)) if rowwise else (),
            (_empty((cols, rows), u8), _empty(col_scale, f32)) if columnwise else (),
        )
    if recipe == "mxfp8":
        row_scale = (_round_up(rows, 128), _round_up(cols // MX_BLOCK, 4))
        col_scale = (_round_up(rows // MX_BLOCK, 4), _round_up(cols, 128))
        return Quantized(
            rows,
            cols,
            (_empty((rows, cols), u8), _empty(row_scale, u8)) if rowwise else (),
            (_empty((rows, cols), u8), _empty(col_scale, u8)) if columnwise else (),
        )
    if recipe == "nvfp4":
        return Quantized(
            rows,
            cols,
            _nvfp4(rows, cols) if rowwise else (),
            _nvfp4(cols, rows) if columnwise else (),
        )
    raise NotImplementedError(f"fp8 recipe {recipe!r} is not simulated")


def _nvfp4(rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """One direction of an NVFP4 tensor: packed data, E4M3 scales per 16, the fp32 amax."""
    scale = (_round_up(rows, 128), _round_up(math.ceil(cols / NV_BLOCK), 4))
    u8 = torch.uint8
    return _empty((rows, cols // 2), u8), _empty(scale, u8), _empty((1,), torch.float32)


def only_rowwise_all_gather(recipe: str) -> bool:
    """Return TE's `supports_only_rowwise_all_gather`: Float8 quantizers gather row-wise data
    only (float8_tensor.py), block and MX quantizers gather either direction."""
    return recipe in ("delayed", "tensorwise")


def gather(q: Quantized, tp_size: int, recipe: str) -> Quantized:
    """TE distributed.py `gather_along_first_dim` of a quantized tensor: a new quantized tensor
    tp times as long, in the directions the gathered input had (row-wise for Float8)."""
    return quantize(
        q.rows * tp_size, q.cols, recipe, rowwise=bool(q.rowwise) or only_rowwise_all_gather(recipe),
        columnwise=bool(q.columnwise) and not only_rowwise_all_gather(recipe),
    )  # fmt: skip


def recipe_state(recipe: str, num_gemms: int, history: int) -> list[torch.Tensor]:
    """Allocate a module's fp8 recipe state for both directions (module/base.py 706-741)."""
    f32 = torch.float32
    state: list[torch.Tensor] = []
    for n in (3 * num_gemms, 2 * num_gemms):  # forward, backward
        if recipe == "delayed":
            state += [_empty((n,), f32), _empty((history, n), f32)]
        elif recipe == "tensorwise":
            state += [_empty((1,), f32) for _ in range(2 * n)]
    return state
