"""fp8 parameters: TE's `Float8Tensor` as a weight, and the helpers megatron calls on it (TE 2.11).

Under `quantized_model_init` (`fp8_model_init`, quantization.py 672-720) TE's modules quantize
each GEMM weight in `reset_parameters` (module/base.py 1210-1300): the weight quantizer, with
usage row-wise and column-wise (`torch.is_grad_enabled()` at build), turns the bf16 weight into a
`Float8Tensor` parameter (pytorch/tensor/float8_tensor.py, `Float8Quantizer.make_empty` 111-150
for delayed scaling, `Float8CurrentScalingQuantizer` for tensorwise), which holds:
- `_data`: uint8 [out, in], the row-wise fp8 values (megatron's DDP later points it into its
  uint8 param buffer, `replace_raw_data`);
- `_transpose`: uint8 [in, out], the column-wise copy Hopper's TN-only fp8 GEMMs read
  (`is_non_tn_fp8_gemm_supported()` is False before Blackwell), kept beside the parameter; none
  on compute capability 10.x (te/cuda.py), where `_data` serves both GEMM layouts: the C++
  quantizer makes none (csrc/quantizer.cpp v2.11 137, "with_transpose = columnwise_usage &&
  !nvte_is_non_tn_fp8_gemm_supported()"), `update_usage` drops it (tensor/storage/
  float8_tensor_storage.py v2.11 202-207) and `post_all_gather_processing` makes none (tensor/
  utils.py v2.11 615, v2.14 1000, v2.17 955);
- `_scale_inv`: fp32 [1].
Its nominal dtype stays the 16-bit one (TE's "fake dtype"), so megatron's DistributedOptimizer
sees a bf16 parameter whose fp32 main copy it makes. With `preserve_high_precision_init_val` the
bf16 initial values are kept on the host until the optimizer has made its main copy.

The stand-in is a plain tensor subclass on meta (subclass propagation off): megatron only tests
`isinstance(param, QuantizedTensor)` and calls the helpers below. `pytorch/tensor/utils.py`
(replace_raw_data 25-50, cast_master_weights_to_fp8 54-155 with the delayed 158-240 and current
scaling 243-350 paths, post_all_gather_processing 602-624) allocate what TE allocates.
MXFP8 parameters are mxfp8_tensor.py's; block-scaled ones (`Float8BlockwiseQTensor`) are not
simulated.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from inspector.world.te.cuda import is_non_tn_fp8_gemm_supported
from inspector.world.te.state import QuantizedTensor

PARAM_RECIPES = ("delayed", "tensorwise")  # the recipes whose weights are Float8Tensors


class Float8Tensor(QuantizedTensor):
    """A TE Float8Tensor parameter: nominally 16-bit, its bytes in `_data`, `_transpose`,
    `_scale_inv` (float8_tensor.py)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain results

    _data: torch.Tensor
    _transpose: torch.Tensor | None
    _scale_inv: torch.Tensor
    _recipe: str
    _high_precision_init_val: torch.Tensor | None
    _is_param: bool

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return the values in `dtype` (default the nominal one): a new tensor."""
        return torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)

    def _get_quantizer(self) -> str:
        return self._recipe

    def _create_transpose(self) -> None:
        """float8_tensor.py `_create_transpose`: `tex.fp8_transpose(data, out=self._transpose)`,
        into the kept transpose when there is one."""
        if self._transpose is None:
            self._transpose = torch.empty(
                (self.shape[1], self.shape[0]), dtype=torch.uint8, device=self._data.device
            )

    def _reset_caches(self) -> None:
        """float8_tensor.py `_reset_caches`: forget the transpose."""
        self._transpose = None

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> None:  # fmt: skip
        """float8_tensor_storage.py `update_usage` (v2.11 189-225): make the transpose where
        column-wise use needs it; on Blackwell keep the data alone (`needs_data_transpose = False`)."""
        if is_non_tn_fp8_gemm_supported():
            self._transpose = None
        elif columnwise_usage:
            self._create_transpose()

    def kept_tensors(self) -> tuple[torch.Tensor, ...]:
        """Return what TE keeps beside the parameter's data: the transpose and the scale."""
        return tuple(t for t in (self._transpose, self._scale_inv) if t is not None)


ALLOCATOR_BLOCK = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize: each request rounded up


def kept_bytes(param: object) -> int:
    """Return the GPU bytes TE keeps outside megatron's param buffer for a quantized parameter
    (a Float8Tensor's transpose and scale_inv; all of an MXFP8Tensor; all but an NVFP4Tensor's
    packed row-wise data), each tensor its own
    allocation; 0 for any other parameter."""
    kept = getattr(param, "kept_tensors", None) if isinstance(param, QuantizedTensor) else None
    if kept is None:
        return 0
    block = ALLOCATOR_BLOCK
    return sum(-(-t.numel() * t.element_size() // block) * block for t in kept())


def stored_bytes(param: object) -> int | None:
    """Return the bytes of the tensors a quantized parameter stores (its data and what
    `kept_bytes` counts, unrounded), None for any other parameter."""
    if not isinstance(param, QuantizedTensor):
        return None
    quantized: Any = param
    # what megatron's buffer holds: a Float8Tensor's data, an NVFP4Tensor's packed row-wise
    # bytes (nvfp4_tensor.py `buffer_data`); an MXFP8Tensor keeps all
    buffer_data = getattr(quantized, "buffer_data", None)
    own = buffer_data() if buffer_data is not None else getattr(quantized, "_data", None)
    tensors = (*((own,) if own is not None else ()), *quantized.kept_tensors())
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_weight(param: torch.Tensor, recipe: str, preserve: bool) -> Float8Tensor:
    """Return `param` as TE's weight quantizer makes it under quantized_model_init (base.py
    1250-1275): a Float8Tensor parameter with data, transpose (column-wise usage, Hopper only)
    and scale_inv. It is marked a parameter as torch marks a custom tensor (`_is_param`)."""
    if recipe not in PARAM_RECIPES:
        raise NotImplementedError(f"fp8 parameters with the {recipe} recipe are not simulated")
    nominal = torch.empty(param.shape, dtype=param.dtype, device="meta")
    tensor = torch.Tensor._make_subclass(Float8Tensor, nominal, True)
    rows, cols = param.shape
    tensor._data = torch.empty((rows, cols), dtype=torch.uint8, device="meta")
    tensor._transpose = None
    tensor._scale_inv = torch.empty((1,), dtype=torch.float32, device="meta")
    tensor._recipe = recipe
    keep_init_val(tensor, preserve)
    # quantizer.set_usage(columnwise=torch.is_grad_enabled()); no transpose on Blackwell
    if torch.is_grad_enabled() and not is_non_tn_fp8_gemm_supported():
        tensor._create_transpose()
    tensor._is_param = True  # torch.nn.Parameter of a custom tensor: isinstance holds
    return tensor


ROWWISE = ("_rowwise_data", "_rowwise_scale_inv")  # a scaled weight's tensors (state.ScaledWeight)
COLUMNWISE = ("_columnwise_data", "_columnwise_scale_inv")


def scaled_weight(cls: type[Any], param: torch.Tensor, made: Any, preserve: bool,
                  names: tuple[tuple[str, ...], ...] = (ROWWISE, COLUMNWISE)) -> Any:  # fmt: skip
    """Return a `cls` parameter (a state.ScaledWeight) of `param`'s nominal shape and dtype
    holding the quantizer's tensors (`made`: kernels/quantize.py Quantized) under `names`, a
    direction not made None; marked a parameter as torch marks a custom tensor (`_is_param`)."""
    nominal = torch.empty(param.shape, dtype=param.dtype, device="meta")
    tensor = torch.Tensor._make_subclass(cls, nominal, True)
    for attributes, tensors in zip(names, (made.rowwise, made.columnwise), strict=True):
        for name, value in zip(attributes, tensors or (None,) * len(attributes), strict=True):
            setattr(tensor, name, value)
    keep_init_val(tensor, preserve)
    tensor._is_param = True  # torch.nn.Parameter of a custom tensor: isinstance holds
    return tensor


def keep_init_val(tensor: Any, preserve: bool) -> None:
    """base.py 1283-1310: with `preserve`, keep the 16-bit initial values on the host and
    attach the two methods megatron's DistributedOptimizer calls; else none."""
    tensor._high_precision_init_val = None
    if preserve:
        tensor._high_precision_init_val = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="meta"
        )
        for name, method in (("get_high_precision_init_val", _get_init_val),
                             ("clear_high_precision_init_val", _clear_init_val)):  # fmt: skip
            setattr(tensor, name, types.MethodType(method, tensor))


def _get_init_val(self: Any) -> torch.Tensor | None:
    return self._high_precision_init_val


def _clear_init_val(self: Any) -> None:
    self._high_precision_init_val = None


def replace_raw_data(tensor: Any, new_raw_data: torch.Tensor) -> None:
    """utils.py 25-50: point a Float8Tensor's `_data` at `new_raw_data` (after copying)."""
    if not isinstance(tensor, Float8Tensor):
        raise ValueError(f"replace_raw_data for {type(tensor)} is not supported yet")
    if tensor._data.dtype != new_raw_data.dtype:
        raise AssertionError("The data types of raw data don't match")
    new_raw_data.detach().copy_(tensor._data)
    tensor._data = new_raw_data


def cast_master_weights_to_fp8(
    model_weights: list[Any], master_weights: list[Any], start_offsets: list[Any], group: Any,
    fsdp_shard_model_weights: Any = None, manual_post_all_gather_processing: bool = False,
) -> None:  # fmt: skip
    """utils.py 54-155: cast each rank's fp32 main shard into the fp8 weights' data.

    Allocated as TE allocates: each main shard cast to the weight's 16-bit dtype (kept in the
    parameter lists until the call returns), an int overflow flag and a packed fp32 amax per
    weight (and packed scales for delayed scaling), the cast written in place into `_data`;
    without `manual_post_all_gather_processing` the transposes are dropped (`_reset_caches`).
    """
    if fsdp_shard_model_weights is not None:
        raise NotImplementedError("fp8 parameters under FSDP are not simulated")
    copies = [  # utils.py 118-127: kept in the per-recipe lists until the call returns
        None if master is None else master.to(weight.dtype)
        for weight, master in zip(model_weights, master_weights, strict=True)
    ]
    delayed = any(weight._get_quantizer() == "delayed" for weight in model_weights)
    work: list[torch.Tensor] = []
    if not delayed:  # current scaling (243-350): overflow flag and packed amaxes first
        work += [torch.zeros(1, dtype=torch.int, device="cuda"),
                 torch.zeros(len(model_weights), dtype=torch.float32, device="cuda")]  # fmt: skip
    for weight, copy, start in zip(model_weights, copies, start_offsets, strict=True):
        if not manual_post_all_gather_processing:
            weight._reset_caches()
        if copy is not None:
            fragment = weight._data.view(-1)[start : start + copy.numel()]
            fragment.copy_(copy.view(-1))  # quantizer.update_quantized: in place
    if delayed:  # delayed scaling (158-240): overflow flag, packed amaxes and scales after
        work += [torch.zeros(1, dtype=torch.int, device="cuda"),
                 torch.empty(len(model_weights), dtype=torch.float32, device="cuda"),
                 torch.empty(len(model_weights), dtype=torch.float32, device="cuda")]  # fmt: skip
    del copies, work


def post_all_gather_processing(model_weights: Any) -> None:
    """utils.py 602-624: after the all-gather, remake each Float8Tensor's transpose (Hopper:
    "if not is_non_tn_fp8_gemm_supported(): model_weight._create_transpose()", 615)."""
    weights = model_weights if isinstance(model_weights, list) else [model_weights]
    for weight in weights:
        if isinstance(weight, Float8Tensor):
            if not is_non_tn_fp8_gemm_supported():
                weight._create_transpose()
        elif getattr(weight, "_get_quantizer", lambda: None)() == "mxfp8":
            pass  # 627-629: "MXFP8 scaling: no need to do anything."
        elif isinstance(weight, QuantizedTensor):
            raise ValueError(f"post_processing for {type(weight)} is not supported")
