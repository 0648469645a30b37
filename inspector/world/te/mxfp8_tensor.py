"""MXFP8 parameters: TE's `MXFP8Tensor` as a weight (TE 2.11), for `--fp8-recipe mxfp8
--fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag`.

Under `quantized_model_init` TE's modules quantize each GEMM weight in `reset_parameters`
(module/base.py 1240-1290: `quantizer.set_usage(rowwise=True,
columnwise=torch.is_grad_enabled())`, then `quantizer(param)`). With the MXFP8 recipe the
quantizer is `MXFP8Quantizer` (pytorch/tensor/mxfp8_tensor.py), whose `make_empty` (98-159)
allocates what the parameter holds (storage/mxfp8_tensor_storage.py keeps the four tensors):
- `_rowwise_data`: uint8 [M, K], and `_rowwise_scale_inv`: uint8 (E8M0) [round_up(M, 128),
  round_up(K / 32, 4)], one scale per 32 elements of a row;
- `_columnwise_data`: uint8 [M, K] (the same layout, scaled down the columns: MXFP8 needs no
  transpose), and `_columnwise_scale_inv`: uint8 [round_up(M / 32, 4), round_up(K, 128)].
Its nominal dtype stays the 16-bit one, as for every QuantizedTensor.

megatron-core sees it through `fp8_utils.is_mxfp8tensor` (`isinstance(t, MXFP8Tensor)` from
`transformer_engine.pytorch.tensor.mxfp8_tensor`) and `is_float8tensor` (QuantizedTensor). Its
DDP then makes one grad-dtype buffer serve both the gradients and the parameter all-gather
(param_and_grad_buffer.py 774-793) and never points the weight into it: after each all-gather
`param.data.copy_(bf16 slice)` quantizes in place into the storage above (mxfp8_tensor.py
`__torch_dispatch__` 360-380: `aten.copy_` into an MXFP8Tensor is `quantize_`), so all four
tensors are the parameter's own, kept for the whole run. TE's `replace_raw_data` refuses an
MXFP8Tensor (tensor/utils.py 48-49), and `post_all_gather_processing` leaves it alone (627-629).

The stand-in is a plain tensor subclass on meta, like float8_tensor.Float8Tensor: megatron only
tests the class and reads `.data`, `.float()`, `.type()`; an in-place copy into `.data` on meta
allocates nothing, as TE's in-place quantize allocates nothing.
"""

from __future__ import annotations

import torch

from inspector.world.te.float8_tensor import scaled_weight
from inspector.world.te.kernels.quantize import Quantized, quantize
from inspector.world.te.state import ScaledWeight


class MXFP8Tensor(ScaledWeight):
    """A TE MXFP8Tensor parameter: nominally 16-bit, its bytes in row-wise and column-wise
    data and E8M0 scales (mxfp8_tensor_storage.py)."""

    def _get_quantizer(self) -> str:
        return "mxfp8"

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> None:  # fmt: skip
        """mxfp8_tensor_storage.py `update_usage` (213-260): only drops a direction (no kernel
        makes column-wise data from row-wise); asking for a missing one raises."""
        for usage, data, scale in (
            (rowwise_usage, "_rowwise_data", "_rowwise_scale_inv"),
            (columnwise_usage, "_columnwise_data", "_columnwise_scale_inv"),
        ):
            if usage is False:
                setattr(self, data, None)
                setattr(self, scale, None)
            elif usage and getattr(self, data) is None:
                raise RuntimeError(f"Requested usage, but MXFP8Tensor is missing {data}")

    def operand(self, columnwise: bool) -> Quantized:
        """Return the weight as TE's GEMM reads it: itself, no workspace (linear.py 252-278)."""
        rows, cols = self.shape
        rowwise = (self._rowwise_data, self._rowwise_scale_inv)
        colwise = (self._columnwise_data, self._columnwise_scale_inv)
        return Quantized(
            rows, cols,
            tuple(t for t in rowwise if t is not None),
            tuple(t for t in colwise if t is not None) if columnwise else (),
        )  # fmt: skip

    def kept_tensors(self) -> tuple[torch.Tensor, ...]:
        """Return every tensor the parameter holds: none lives in megatron's buffers."""
        return tuple(
            t for t in (self._rowwise_data, self._rowwise_scale_inv, self._columnwise_data,
                        self._columnwise_scale_inv) if t is not None
        )  # fmt: skip


def quantize_weight(param: torch.Tensor, preserve: bool) -> MXFP8Tensor:
    """Return `param` as TE's MXFP8 weight quantizer makes it under quantized_model_init
    (base.py 1240-1310, mxfp8_tensor.py `make_empty` 98-159), marked a parameter."""
    rows, cols = param.shape
    made = quantize(rows, cols, "mxfp8", rowwise=True, columnwise=torch.is_grad_enabled())
    return scaled_weight(MXFP8Tensor, param, made, preserve)
