"""What every stand-in TE module shares: the base module, tensor-parallel attributes, allocation.

Mirrors transformer_engine 2.11.0, `pytorch/module/base.py` (TransformerEngineBaseModule, lines
601-630 `__init__`, 806-841 `get_extra_state`, 1197-1208 `register_parameter`, 1210-1240
`reset_parameters`) and `pytorch/distributed.py` 145-158 (`set_tensor_model_parallel_attributes`).
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te.state import FP8GlobalStateManager, recipe_name

# TE's tex.FP8FwdTensors.GEMM1_WEIGHT: the fp8_meta_index TE registers a GEMM weight with
# (linear.py 1205, layernorm_linear.py; grouped_linear.py adds 3 per GEMM)
FP8_WEIGHT_INDEX = 1

# TE's GemmParallelModes (pytorch/constants.py): the values `parallel_mode` may take.
GEMM_PARALLEL_MODES = ("row", "column", None)

# TE distributed.py _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS: the attributes a tensor-parallel weight gets.
_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Set the attributes megatron reads off a tensor-parallel weight (TE distributed.py 145-158)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTES:
        if hasattr(tensor, attribute):
            raise RuntimeError(
                f"Tensor already has attribute '{attribute}' set. Cannot set "
                "tensor model parallel attributes on a tensor that already has them."
            )
    tensor.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    tensor.partition_dim = dim  # type: ignore[attr-defined]
    tensor.partition_stride = stride  # type: ignore[attr-defined]


def mark_sequence_parallel(tensor: Any, sequence_parallel: bool | None) -> None:
    """Flag a tensor whose gradient megatron all-reduces over tp under sequence parallelism."""
    tensor.sequence_parallel = sequence_parallel


def divide(numerator: int, denominator: int) -> int:
    """Divide exactly, as TE's pytorch/utils.py `divide` does (it asserts divisibility)."""
    if numerator % denominator != 0:
        raise AssertionError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def world_size(tp_group: Any, tp_size: int) -> int:
    """Return the tensor-parallel size as TE's modules take it (linear.py 1118-1125)."""
    if tp_group is None:
        return tp_size
    if not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=tp_group)


def empty(*shape: int, dtype: torch.dtype | None) -> torch.Tensor:
    """Allocate on meta, whatever device the caller named: the stand-in never holds values.

    TE allocates on `device` (megatron passes "cpu", "meta" or the current CUDA device); on meta
    the shapes, dtypes and names are the same and nothing is allocated.
    """
    return torch.empty(shape, device="meta", dtype=dtype or torch.get_default_dtype())


def deferred(device: Any) -> bool:
    """Return TE's `defer_init`: parameters on meta skip reset_parameters (linear.py 1297)."""
    return torch.device(device).type == "meta" if device is not None else False


class TransformerEngineBaseModule(torch.nn.Module):
    """Stand-in for TE's TransformerEngineBaseModule (module/base.py 601-630).

    Keeps the state megatron reads (fp8 flags, `fp8_meta`, `tp_group`, `tp_size`,
    `param_init_meta`) and the `_extra_state` TE writes into every state dict. TE asserts
    `torch.cuda.is_available()` here; the stand-in does not, since it never runs forward.
    """

    name: str | None
    fp8_meta: dict[str, Any]
    tp_group: Any
    tp_size: int
    sequence_parallel: bool
    param_init_meta: dict[str, dict[str, Any]]

    def __init__(self) -> None:
        super().__init__()
        # Plain values only, so they skip nn.Module.__setattr__'s checks (as TE's __setattr__
        # does for some, base.py 633-650): builds create hundreds of these modules.
        self.__dict__.update(
            name=None,
            fp8_initialized=False,
            fp8=False,
            fp8_calibration=False,
            fp8_meta={"fp8_checkpoint": False, "fp8_group": None},
            fp8_meta_tensors_initialized=False,
            quantizers={"scaling_fwd": {}, "scaling_bwd": {}},
            tp_group=None,
            tp_size=1,
            sequence_parallel=False,
            param_init_meta={},
            primary_weights_in_fp8=FP8GlobalStateManager.with_fp8_parameters(),
            preserve_high_precision_init_val=FP8GlobalStateManager.with_high_precision_init_val(),
            fsdp_wrapped=False,
            fsdp_group=None,
            activation_dtype=None,
            wgrad_accumulation_and_reduce_hooks=[],
        )

    def register_parameter(self, name: str, param: Any, **kwargs: Any) -> None:
        """Register, and stash TE's init metadata for the parameter (base.py 1197-1208)."""
        super().register_parameter(name, param)
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = kwargs

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Do what TE's base reset does to shapes and names (base.py 1210-1300).

        TE materialises and initialises values here; on meta there are none. Under
        `quantized_model_init` each GEMM weight (one registered with an `fp8_meta_index`)
        becomes a Float8Tensor parameter (float8_tensor.py), an MXFP8Tensor with the MXFP8
        recipe (mxfp8_tensor.py), a Float8BlockwiseQTensor with block scaling
        (blockwise_tensor.py), or an NVFP4Tensor with NVFP4 (nvfp4_tensor.py). The parallel
        attributes are set by each subclass after this call, as in TE.
        """
        if defer_init or not self.primary_weights_in_fp8:
            return
        from inspector.world.te import blockwise_tensor, float8_tensor, mxfp8_tensor, nvfp4_tensor

        recipe = recipe_name(FP8GlobalStateManager.get_fp8_recipe())
        for name, param in list(self.named_parameters(recurse=False)):
            if self.param_init_meta[name].get("fp8_meta_index") is None:
                continue
            preserve = bool(self.__dict__["preserve_high_precision_init_val"])
            quantized: Any = (
                mxfp8_tensor.quantize_weight(param, preserve) if recipe == "mxfp8"
                else nvfp4_tensor.quantize_weight(param, preserve) if recipe == nvfp4_tensor.RECIPE
                else blockwise_tensor.quantize_weight(param, preserve)
                if recipe == blockwise_tensor.RECIPE
                else float8_tensor.quantize_weight(param, recipe, preserve)
            )  # fmt: skip
            torch.nn.Module.register_parameter(self, name, quantized)

    def set_tensor_parallel_group(self, tp_group: Any) -> None:
        """Set the tensor-parallel group (base.py 946-958)."""
        self.tp_group = tp_group
        self.tp_group_initialized = True

    def get_extra_state(self) -> torch.Tensor:
        """Return TE's extra state without fp8: an empty byte tensor (base.py 839-841)."""
        return torch.empty(0, dtype=torch.uint8, device="cpu")

    def set_extra_state(self, state: Any) -> None:
        """Accept TE's extra state; an empty tensor means no fp8 state (base.py 867-879)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "the simulated Transformer Engine builds modules, never runs them"
        )

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None:
        """Keep a hook for `backward_dw` to call (base.py 1545-1553 of TE 2.14)."""
        self.__dict__["wgrad_accumulation_and_reduce_hooks"].append(hook)

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        """Call the kept hooks (base.py 1584-1588); megatron-core 0.19's TEGroupedMLP.backward_dw
        calls it after the op fuser's delayed weight gradients (experts.py)."""
        for hook in self.__dict__["wgrad_accumulation_and_reduce_hooks"]:
            hook()

    def backward_dw(self) -> None:
        """TE's delayed weight-gradient step of a module; never runs here."""
        raise NotImplementedError(
            "the simulated Transformer Engine builds modules, never runs them"
        )
