"""Block-scaled fp8 parameters: TE's `Float8BlockwiseQTensor` as a weight (TE 2.11), for
`--fp8-recipe blockwise --fp8-param-gather`.

Under `quantized_model_init` with `Float8BlockScaling` TE's modules quantize each GEMM weight in
`reset_parameters` (module/base.py: usage row-wise, and column-wise when grad is enabled) with
the weight quantizer, whose blocks are 128 x 128 (`Float8BlockScaling.w_block_scaling_dim` 2).
`Float8BlockQuantizer.make_empty` (tensor/float8_blockwise_tensor.py 227-290, shapes from
`get_scale_shape` 125-184) allocates, for an [M, K] weight:
- `_rowwise_data`: uint8 [M, K], `_rowwise_scale_inv`: fp32 [ceil(M / 128), round_up(ceil(K /
  128), 4)];
- `_columnwise_data`: uint8 [K, M], `_columnwise_scale_inv`: fp32 [ceil(K / 128),
  round_up(ceil(M / 128), 4)].
kernels/quantize.py `quantize(..., "blockwise", weight=True)` makes exactly these.

megatron-core sees it as a QuantizedTensor (fp8_utils.is_float8tensor): its DDP gives it a uint8
param buffer of one byte an element and points `_rowwise_data` there through TE's
`replace_raw_data` (tensor/utils.py 42-47); the DistributedOptimizer casts each rank's fp32 shard
into those bytes with `cast_master_weights_to_fp8` (`_cast_master_weights_to_fp8_blockwise_scaling`
354-476) and `post_all_gather_processing` remakes the column-wise copy (`_create_columnwise`,
storage/float8_blockwise_tensor_storage.py 315-345). The rest stays the parameter's own.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.float8_tensor import scaled_weight
from inspector.world.te.kernels.quantize import Quantized, quantize
from inspector.world.te.state import ScaledWeight

RECIPE = "blockwise"  # state.recipe_name of Float8BlockScaling


class Float8BlockwiseQTensor(ScaledWeight):
    """A TE Float8BlockwiseQTensor parameter: nominally 16-bit, its bytes in row-wise and
    column-wise uint8 data with fp32 scales per 128 x 128 block."""

    def _get_quantizer(self) -> str:
        return RECIPE

    def _create_columnwise(self) -> None:
        """storage/float8_blockwise_tensor_storage.py 315-345: the column-wise data transposed
        from the row-wise data (into the kept tensor if any) and its scales."""
        rows, cols = self.shape
        made = quantize(rows, cols, RECIPE, rowwise=False, columnwise=True, weight=True)
        if self._columnwise_data is None:
            self._columnwise_data = made.columnwise[0]
        if self._columnwise_scale_inv is None:
            self._columnwise_scale_inv = made.columnwise[1]

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> None:  # fmt: skip
        """storage/float8_blockwise_tensor_storage.py `update_usage` (372-420): both asked for
        remake a missing column-wise copy (2-D scaled weights); one alone drops the other."""
        rowwise = self._rowwise_data is not None if rowwise_usage is None else rowwise_usage
        columnwise = self._columnwise_data is not None if columnwise_usage is None else columnwise_usage
        if rowwise and columnwise:
            self._create_columnwise()
        elif rowwise:
            self._columnwise_data = self._columnwise_scale_inv = None
        elif columnwise:
            self._rowwise_data = self._rowwise_scale_inv = None

    def operand(self, columnwise: bool) -> Quantized:
        """Return the weight as TE's GEMM reads it: itself, no workspace (linear.py)."""
        if columnwise:
            self.update_usage(rowwise_usage=True, columnwise_usage=True)
        rows, cols = self.shape
        rowwise = tuple(t for t in (self._rowwise_data, self._rowwise_scale_inv) if t is not None)
        colwise = (self._columnwise_data, self._columnwise_scale_inv) if columnwise else ()
        return Quantized(rows, cols, rowwise, tuple(t for t in colwise if t is not None))

    def kept_tensors(self) -> tuple[torch.Tensor, ...]:
        """Return what TE keeps beside the row-wise data megatron's buffer holds."""
        return tuple(t for t in (self._rowwise_scale_inv, self._columnwise_data,
                                 self._columnwise_scale_inv) if t is not None)  # fmt: skip

    def buffer_data(self) -> torch.Tensor | None:
        """Return the tensor megatron's DDP points into its param buffer: the row-wise data."""
        return self._rowwise_data


def quantize_weight(param: torch.Tensor, preserve: bool) -> Float8BlockwiseQTensor:
    """Return `param` as TE's block-scaled weight quantizer makes it under quantized_model_init
    (module/base.py, float8_blockwise_tensor.py `make_empty`), marked a parameter."""
    rows, cols = param.shape
    made = quantize(rows, cols, RECIPE, rowwise=True, columnwise=torch.is_grad_enabled(), weight=True)
    return scaled_weight(Float8BlockwiseQTensor, param, made, preserve)


def cast_master_weights(
    weights: list[Any], masters: list[Any], starts: list[Any], manual_post_all_gather_processing: bool
) -> list[torch.Tensor]:
    """tensor/utils.py 354-476 (`_cast_master_weights_to_fp8_blockwise_scaling`), given the
    shards already cast to 16 bits: an int overflow flag, fp32 amaxes packed for every block of
    every weight and one fp32 scale tensor per weight (returned: TE keeps them to the end of the
    call), each shard written in place into the row-wise bytes."""
    blocks = sum(w._rowwise_scale_inv.numel() for w in weights)
    work = [torch.zeros(1, dtype=torch.int, device="cuda"),
            torch.zeros(blocks, dtype=torch.float32, device="cuda")]  # fmt: skip
    work += [torch.empty(tuple(w._rowwise_scale_inv.shape), dtype=torch.float32, device="cuda")
             for w in weights]  # fmt: skip
    for weight, master, start in zip(weights, masters, starts, strict=True):
        if not manual_post_all_gather_processing:
            weight.update_usage(rowwise_usage=True, columnwise_usage=False)
        if master is not None:
            fragment = weight._rowwise_data.reshape(-1)[start : start + master.numel()]
            fragment.copy_(master.view(-1))  # fp8_block_scaling_partial_cast: in place
    return work
