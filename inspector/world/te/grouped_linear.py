"""Stand-in for TE's GroupedLinear: parameters exactly as TE registers.

Mirrors transformer_engine 2.11.0 `pytorch/module/grouped_linear.py`; the class cites the lines.
Every tensor lives on meta (see `_base.empty`).
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te._base import (
    FP8_WEIGHT_INDEX,
    GEMM_PARALLEL_MODES,
    TransformerEngineBaseModule,
    divide,
    empty,
    mark_sequence_parallel,
    set_tensor_model_parallel_attributes,
    world_size,
)
from inspector.world.te.kernels import fp8_functions, functions, quantize
from inspector.world.te.linear import contiguous_input, fp8_param_operand, fp8_recipe_name
from inspector.world.te.state import FP8GlobalStateManager, QuantizedTensor


class GroupedLinear(TransformerEngineBaseModule):
    """TE's GroupedLinear (module/grouped_linear.py 528-750, constructor 588-711).

    One weight per GEMM, `weight0` ... `weight{num_gemms-1}` of (out, in) after the tp division,
    and `bias{i}` only with bias=True (otherwise empty plain tensors, 697-700). TE refuses bias
    with tp > 1 (650-654).
    """

    # Long by design: mirrors Transformer Engine's own argument list (see TE-NOTES.md).
    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Any = None,
        tp_size: int = 1,
        get_rng_state_tracker: Any = None,
        rng_tracker_name: str | None = None,
        init_method: Any = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: Any = "cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,  # TE 2.14 (grouped_linear.py 635-636), which
        single_grouped_bias: bool = False,  # megatron-core 0.18+ passes there
        name: str | None = None,
    ) -> None:
        super().__init__()
        if single_grouped_weight or single_grouped_bias:
            raise NotImplementedError("GroupedLinear's single grouped weight is not simulated")
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms = num_gemms
        # TE 2.14 grouped_linear.py 653-654 (False here); megatron-core 0.18+'s op fuser reads them
        self.single_grouped_weight = self.single_grouped_bias = False
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.ub_overlap_rs = ub_overlap_rs
        self.ub_overlap_ag = ub_overlap_ag
        self.ub_name = ub_name
        self.save_original_input = save_original_input
        if ub_overlap_rs or ub_overlap_ag:
            raise AssertionError("GroupedLinear doesn't support Userbuffer overlap.")
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.name = name
        self.delay_wgrad_compute = delay_wgrad_compute
        self.tp_size = world_size(tp_group, tp_size)
        if tp_group is not None or tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        if self.tp_size > 1 and bias:
            raise ValueError(
                "GroupedLinear doesn't support bias when TP > 1. "
                "Because the TP communication is handled outside of this module."
            )
        if parallel_mode not in GEMM_PARALLEL_MODES:
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel
        for i in range(num_gemms):
            self.register_parameter(
                f"weight{i}",
                torch.nn.Parameter(empty(self.out_features, self.in_features, dtype=params_dtype)),
                init_fn=init_method,
                get_rng_state_tracker=get_rng_state_tracker,
                fp8_meta_index=FP8_WEIGHT_INDEX + 3 * i,  # grouped_linear.py: 3 fwd tensors per GEMM
            )
            if self.use_bias:
                self.register_parameter(
                    f"bias{i}", torch.nn.Parameter(empty(self.out_features, dtype=params_dtype))
                )
            else:
                setattr(self, f"bias{i}", empty(0, dtype=params_dtype))
        self.reset_parameters(defer_init=device == "meta")

    def _fp8_weights(
        self, weights: list[Any], recipe: str, is_first_microbatch: bool | None, inp: torch.Tensor
    ) -> list[quantize.Quantized]:
        """Each GEMM's fp8 weight, cached as "weight{i}", and the recipe state for num_gemms
        GEMMs (grouped_linear.py 155-170; module/base.py 706-741, 1376-1427)."""
        if not self.fp8_meta_tensors_initialized:
            history = getattr(FP8GlobalStateManager.get_fp8_recipe(), "amax_history_len", 1)
            self.__dict__["fp8_recipe_state"] = quantize.recipe_state(recipe, self.num_gemms, history)
            self.__dict__["fp8_meta_tensors_initialized"] = True
        cache: dict[str, quantize.Quantized] = self.__dict__.setdefault("_fp8_workspaces", {})
        out = []
        for i, weight in enumerate(weights):
            if isinstance(weight, QuantizedTensor):
                out.append(fp8_param_operand(weight, inp.requires_grad))
                continue
            workspace = cache.get(f"weight{i}")
            if workspace is None or is_first_microbatch is None or (
                inp.requires_grad and not workspace.has_columnwise
            ):
                rows, cols = weight.shape
                workspace = quantize.quantize(rows, cols, recipe, True, inp.requires_grad, weight=True)
                if is_first_microbatch is not None:
                    cache[f"weight{i}"] = workspace
            out.append(workspace)
        return out

    def forward(
        self, inp: torch.Tensor, m_splits: list[int], is_first_microbatch: bool | None = None
    ) -> Any:
        """Run TE's `_GroupedLinear` as memory sees it (grouped_linear.py `forward` 752-850)."""
        if len(m_splits) != self.num_gemms:
            raise AssertionError("Number of splits should match number of GEMMs.")
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        gemm_biases = biases if self.apply_bias else [b.new_empty(0) for b in biases]
        recipe = fp8_recipe_name()
        if recipe is not None:
            out = fp8_functions.Fp8GroupedLinearFunction.apply(
                contiguous_input(inp), list(m_splits), bool(self.fuse_wgrad_accumulation), recipe,
                self._fp8_weights(weights, recipe, is_first_microbatch, inp), *weights, *gemm_biases,
            )  # fmt: skip
        else:
            out = functions.GroupedLinearFunction.apply(
                contiguous_input(inp), list(m_splits), bool(self.fuse_wgrad_accumulation), *weights,
                *gemm_biases,
            )  # fmt: skip
        if self.return_bias:
            return out, [b.to(out.dtype) for b in biases]
        return out

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Mark each GEMM's weight and bias for tensor parallelism (726-749)."""
        super().reset_parameters(defer_init=defer_init)
        if defer_init:
            return
        for i in range(self.num_gemms):
            set_tensor_model_parallel_attributes(
                getattr(self, f"weight{i}"), True, 1 if self.parallel_mode == "row" else 0, 1
            )
        if self.use_bias:
            for i in range(self.num_gemms):
                bias = getattr(self, f"bias{i}")
                if self.parallel_mode == "row":
                    mark_sequence_parallel(bias, self.sequence_parallel)
                elif self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(bias, True, 0, 1)
