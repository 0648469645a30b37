"""NVFP4 parameters: TE's `NVFP4Tensor` as a weight (TE 2.14), for `--fp4-format e2m1
--fp4-param-gather`, and the two TE 2.14 helpers megatron-core 0.17+ call on it.

Under `quantized_model_init` with `NVFP4BlockScaling` (megatron's fp4_utils.get_fp4_context with
`is_init=True`) TE's modules quantize each GEMM weight in `reset_parameters` (module/base.py:
`quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())`, then `quantizer(param)`).
`NVFP4Quantizer.make_empty` (pytorch/tensor/nvfp4_tensor.py 292-372 at v2.14, shapes from
`get_scale_shape` 223-257 and `convert_shape_for_fp4` 286-290) allocates, for an [M, K] weight:
- `_rowwise_data`: uint8 [M, K / 2] (two E2M1 values a byte), `_rowwise_scale_inv`: uint8 (E4M3)
  [round_up(M, 128), round_up(K / 16, 4)], `_amax_rowwise`: fp32 [1];
- `_columnwise_data`: uint8 [K, M / 2] (of the transpose), `_columnwise_scale_inv`: uint8
  [round_up(K, 128), round_up(M / 16, 4)], `_amax_columnwise`: fp32 [1].
kernels/quantize.py `quantize(..., "nvfp4")` makes exactly these (tests/test_fp4_params.py).

megatron-core sees it through `fp4_utils.is_nvfp4tensor` (`isinstance(t, NVFP4Tensor)` from
`transformer_engine.pytorch.tensor.nvfp4_tensor`) and `fp8_utils.is_float8tensor`
(QuantizedTensor). Its DDP (0.18+: param_and_grad_buffer.py `_compute_nvfp4_packed_layout` and
`modify_nvfp4_rowwise_storage`; 0.17: TE's `replace_raw_data`) points `_rowwise_data` into a
uint8 param buffer laid out at half the elements, gathers those packed bytes, and after the step
casts each rank's fp32 main shard into them with TE's `quantize_master_weights` (tensor/utils.py
74-227, NVFP4 through `_cast_master_weights_to_nvfp4_2d` 626-840) and remakes the column-wise
copy in `post_all_gather_processing` (981-1016, `_nvfp4_2d_multi_tensor_transpose` 1019-1089).
Everything but `_rowwise_data` stays the parameter's own for the run.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.float8_tensor import scaled_weight
from inspector.world.te.kernels.quantize import NV_BLOCK, Quantized, quantize
from inspector.world.te.state import ScaledWeight

RECIPE = "nvfp4"  # state.recipe_name of NVFP4BlockScaling


class NVFP4Tensor(ScaledWeight):
    """A TE NVFP4Tensor parameter: nominally 16-bit, its bytes in packed row-wise and
    column-wise data, E4M3 scales and fp32 amaxes (nvfp4_tensor_storage.py)."""

    _amax_rowwise: torch.Tensor | None
    _amax_columnwise: torch.Tensor | None

    def _get_quantizer(self) -> str:
        return RECIPE

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> None:  # fmt: skip
        """nvfp4_tensor_storage.py `update_usage` (v2.14, 320-385): both directions asked for
        remake a missing column-wise copy from the row-wise data; otherwise it only drops a
        direction, and asking for a missing one raises."""
        if rowwise_usage and columnwise_usage and self._columnwise_data is None:
            make_columnwise([self])
            return
        for usage, names in ((rowwise_usage, _ROWWISE), (columnwise_usage, _COLUMNWISE)):
            if usage is False:
                for name in names:
                    setattr(self, name, None)
            elif usage and getattr(self, names[0]) is None:
                raise RuntimeError(f"Requested usage, but NVFP4Tensor is missing {names[0]}")

    def operand(self, columnwise: bool) -> Quantized:
        """Return the weight as TE's GEMM reads it: itself, no workspace (linear.py)."""
        rows, cols = self.shape
        return Quantized(rows, cols, self._tensors(_ROWWISE),
                         self._tensors(_COLUMNWISE) if columnwise else ())  # fmt: skip

    def kept_tensors(self) -> tuple[torch.Tensor, ...]:
        """Return what TE keeps beside the packed row-wise data megatron's buffer holds."""
        return self._tensors(_ROWWISE[1:] + _COLUMNWISE)

    def buffer_data(self) -> torch.Tensor | None:
        """Return the tensor megatron's DDP points into its param buffer: the packed bytes."""
        return self._rowwise_data

    def _tensors(self, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (getattr(self, name) for name in names) if t is not None)


_ROWWISE = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")
_COLUMNWISE = ("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise")


def quantize_weight(param: torch.Tensor, preserve: bool) -> NVFP4Tensor:
    """Return `param` as TE's NVFP4 weight quantizer makes it under quantized_model_init
    (module/base.py, nvfp4_tensor.py `make_empty`), marked a parameter."""
    rows, cols = param.shape
    if rows % NV_BLOCK or cols % NV_BLOCK:  # make_empty 306-316
        raise AssertionError(f"Incorrect shape {tuple(param.shape)} for NVFP4. Tensor dims must "
                             f"be divisible by {NV_BLOCK}")  # fmt: skip
    made = quantize(rows, cols, RECIPE, rowwise=True, columnwise=torch.is_grad_enabled())
    return scaled_weight(NVFP4Tensor, param, made, preserve, (_ROWWISE, _COLUMNWISE))


def helpers() -> bool:
    """Return whether the TE release mirrored has its NVFP4 parameter helpers (2.14+:
    `quantize_master_weights`, `replace_raw_data` of an NVFP4Tensor; te/__init__.py VERSION)."""
    from inspector.world.te import VERSION

    return tuple(int(p) for p in VERSION.split(".")[:2]) >= (2, 14)


def quantize_master_weights(
    model_weights: list[Any], master_weights: list[Any], start_offsets: list[Any], group: Any,
    fsdp_shard_model_weights: Any = None, manual_post_all_gather_processing: bool = False,
) -> None:  # fmt: skip
    """tensor/utils.py 74-227 (v2.14) for NVFP4 weights: cast each rank's fp32 main shard into
    its slice of the packed row-wise bytes.

    Allocated as TE allocates: the shards concatenated and cast to the weights' 16-bit dtype
    once (132-160; the fp32 concatenation freed after the cast), then `_cast_master_weights_to_
    nvfp4_2d` (626-840): packed fp32 amaxes and scales, one per 16 x 16 tile of every weight,
    and fp32 global amaxes and scales, one per weight; the cast written in place. Without
    `manual_post_all_gather_processing` the column-wise copies are dropped (usage row-wise only).
    """
    if fsdp_shard_model_weights is not None:
        raise NotImplementedError("NVFP4 parameters under FSDP are not simulated")
    if any(not isinstance(w, NVFP4Tensor) for w in model_weights):
        raise ValueError("quantize_master_weights is simulated for NVFP4 weights only")
    owned = [m.view(-1) for m in master_weights if m is not None]
    converted: list[torch.Tensor] = []
    if owned and owned[0].dtype != model_weights[0].dtype:
        concatenated = torch.cat(owned)
        converted = list(torch.split(concatenated.to(model_weights[0].dtype), [m.numel() for m in owned]))
        del concatenated
    tiles = sum(-(-w.shape[0] // NV_BLOCK) * -(-w.shape[1] // NV_BLOCK) for w in model_weights)
    f32 = torch.float32
    work = [torch.zeros(tiles, dtype=f32, device="cuda"), torch.zeros(tiles, dtype=f32, device="cuda"),
            torch.zeros(len(model_weights), dtype=f32, device="cuda")]  # fmt: skip
    work.append(torch.empty_like(work[-1]))  # global_scale_tensor (722)
    sources = iter(converted or owned)
    for weight, master, start in zip(model_weights, master_weights, start_offsets, strict=True):
        if not manual_post_all_gather_processing:
            weight.update_usage(rowwise_usage=True, columnwise_usage=False)
        if master is not None and master.numel() > 0:
            assert weight._rowwise_data is not None
            fragment = weight._rowwise_data.view(-1)[start // 2 : (start + master.numel() + 1) // 2]
            fragment.copy_(next(sources)[: fragment.numel()])  # nvfp4_multi_tensor_2d_partial_cast
    del converted, work


def make_columnwise(weights: list[NVFP4Tensor]) -> None:
    """tensor/utils.py `_nvfp4_2d_multi_tensor_transpose` (v2.14, 1019-1089): remake each
    weight's column-wise data, scales and amax where missing (kept otherwise)."""
    for weight in weights:
        rows, cols = weight.shape
        if weight._columnwise_data is None:
            data, scale, amax = quantize(rows, cols, RECIPE, rowwise=False, columnwise=True).columnwise
            weight._columnwise_data, weight._columnwise_scale_inv = data, scale
            weight._amax_columnwise = amax
