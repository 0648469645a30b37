"""Stand-ins for TE's Linear and LayerNormLinear: parameters exactly as TE registers.

Mirrors transformer_engine 2.11.0 `pytorch/module/linear.py` and `layernorm_linear.py`; each class
cites the lines (GroupedLinear: grouped_linear.py). Every tensor lives on meta (see `_base.empty`).
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
from inspector.world.te.blockwise_tensor import Float8BlockwiseQTensor
from inspector.world.te.float8_tensor import Float8Tensor
from inspector.world.te.kernels import fp8_functions, functions, quantize
from inspector.world.te.mxfp8_tensor import MXFP8Tensor
from inspector.world.te.nvfp4_tensor import NVFP4Tensor
from inspector.world.te.state import FP8GlobalStateManager, QuantizedTensor, recipe_name


def fp8_recipe_name() -> str | None:
    """Return the recipe TE's modules quantize with inside fp8_autocast, else None (base.py
    `init_fp8_metadata`: `self.fp8 = FP8GlobalStateManager.is_fp8_enabled()`)."""
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    return recipe_name(FP8GlobalStateManager.get_fp8_recipe())


def fp8_param_operand(weight: QuantizedTensor, columnwise: bool) -> quantize.Quantized:
    """Return an fp8 parameter as the GEMM's weight: TE uses it as it is, no workspace
    (linear.py 252-278: `get_weight_workspace` returns the quantized weight itself). Its
    transpose, kept on the parameter, is made here where backward needs it if missing (TE makes
    it in backward, linear.py 695 `update_usage(columnwise_usage=True)`; with megatron-core 0.16
    it is never missing: post_all_gather_processing remakes it). An MXFP8Tensor, NVFP4Tensor or
    Float8BlockwiseQTensor is its own operand (mxfp8_tensor.py, nvfp4_tensor.py,
    blockwise_tensor.py)."""
    if isinstance(weight, (MXFP8Tensor, NVFP4Tensor, Float8BlockwiseQTensor)):
        return weight.operand(columnwise)
    assert isinstance(weight, Float8Tensor)
    weight.update_usage(rowwise_usage=True, columnwise_usage=columnwise)
    rows, cols = weight.shape
    transpose = (weight._transpose,) if columnwise and weight._transpose is not None else ()
    return quantize.Quantized(rows, cols, (weight._data,), transpose, (weight._scale_inv,))


class _ParallelLinear(TransformerEngineBaseModule):
    """What Linear and LayerNormLinear share: sizes after tensor parallelism, weight and bias."""

    def _set_parallel_sizes(
        self,
        in_features: int,
        out_features: int,
        tp_group: Any,
        tp_size: int,
        parallel_mode: str | None,
        sequence_parallel: bool,
    ) -> None:
        """Divide the sharded dimension by tp as TE does (linear.py 1103-1138)."""
        self.in_features = in_features
        self.out_features = out_features
        self.tp_size = world_size(tp_group, tp_size)
        if tp_group is not None or tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        if parallel_mode not in GEMM_PARALLEL_MODES:
            raise AssertionError(f"parallel_mode {parallel_mode} not supported")
        self.parallel_mode = parallel_mode
        if parallel_mode == "column":
            self.out_features = divide(self.out_features, self.tp_size)
        elif parallel_mode == "row":
            self.in_features = divide(self.in_features, self.tp_size)
        self.sequence_parallel = (self.tp_size > 1) and sequence_parallel

    def _register_weight_and_bias(
        self, init_method: Any, get_rng_state_tracker: Any, params_dtype: torch.dtype
    ) -> None:
        """Register `weight` and `bias` (linear.py 1192-1295; no `parameters_split` here).

        With bias off TE sets `bias` to an empty plain tensor, not a parameter (1289-1292).
        """
        self.weight_names = ["weight"]
        self.bias_names = ["bias"]
        self.parameter_split_sizes = [self.out_features]
        self.register_parameter(
            "weight",
            torch.nn.Parameter(empty(self.out_features, self.in_features, dtype=params_dtype)),
            init_fn=init_method,
            get_rng_state_tracker=get_rng_state_tracker,
            fp8_meta_index=FP8_WEIGHT_INDEX,
        )
        if self.use_bias:
            self.register_parameter(
                "bias", torch.nn.Parameter(empty(self.out_features, dtype=params_dtype))
            )
        else:
            self.bias = empty(0, dtype=params_dtype)

    def _set_linear_attributes(self) -> None:
        """Mark weight and bias for tensor parallelism (linear.py 1325-1344)."""
        for weight in self.weight_names:
            set_tensor_model_parallel_attributes(
                getattr(self, weight), True, 1 if self.parallel_mode == "row" else 0, 1
            )
        if self.use_bias:
            for bias in self.bias_names:
                if self.parallel_mode == "row":
                    mark_sequence_parallel(getattr(self, bias), self.sequence_parallel)
                elif self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(getattr(self, bias), True, 0, 1)


    def _setup(self, normalization: str = "LayerNorm") -> functions.GemmSetup:
        """Return the flags TE's autograd Function takes from the module (linear.py 1440-1470)."""
        return functions.GemmSetup(
            self.parallel_mode,
            self.tp_size,
            self.sequence_parallel,
            bool(self.fuse_wgrad_accumulation),
            normalization,
            fp8_recipe_name(),
        )

    def _fp8_weight(
        self, weight: Any, setup: functions.GemmSetup, is_first_microbatch: bool | None,
        inp: torch.Tensor,
    ) -> quantize.Quantized:  # fmt: skip
        """Return the fp8 weight TE's GEMM reads, and set up the module's recipe state.

        module/base.py `init_fp8_metadata` / `set_meta_tensor` (706-741) on first use, then
        `get_weight_workspace` (1322-1427): with `is_first_microbatch` given (megatron's TE
        linears pass it, transformer_engine.py `TELinear.forward`) the quantized weight is kept
        in `_fp8_workspaces["weight"]` and re-quantized in place each step; without, a new one
        per call. Column-wise data only where backward needs dgrad (linear.py 256-263).
        """
        recipe = str(setup.fp8)
        if not self.fp8_meta_tensors_initialized:
            history = getattr(FP8GlobalStateManager.get_fp8_recipe(), "amax_history_len", 1)
            self.__dict__["fp8_recipe_state"] = quantize.recipe_state(recipe, 1, history)
            self.__dict__["fp8_meta_tensors_initialized"] = True
        if isinstance(weight, QuantizedTensor):
            return fp8_param_operand(weight, inp.requires_grad)
        cache: dict[str, quantize.Quantized] = self.__dict__.setdefault("_fp8_workspaces", {})
        workspace = cache.get("weight")
        # linear.py 256-263: column-wise data where backward needs dgrad, also in the no-grad
        # forward of an activation checkpoint (TE's fp8 activation recompute)
        columnwise = inp.requires_grad
        if workspace is None or is_first_microbatch is None or (
            columnwise and not workspace.has_columnwise
        ):  # base.py 1376-1395: a cached workspace missing a usage is made again
            out_features, in_features = weight.shape
            workspace = quantize.quantize(
                out_features, in_features, recipe, True, columnwise, weight=True
            )
            if is_first_microbatch is not None:
                cache["weight"] = workspace
        return workspace

    def _finish_output(self, out: torch.Tensor) -> Any:
        """Add an unfused bias and return as TE does (linear.py `Linear.forward` 1490-1505)."""
        if self.gemm_bias_unfused_add:
            out = out + self.bias.to(out.dtype)
        if self.return_bias:
            return out, self.bias.to(out.dtype)
        return out


def contiguous_input(inp: torch.Tensor) -> torch.Tensor:
    """Copy a non-contiguous input, as TE's `prepare_forward` does (module/base.py 1072-1073)."""
    return inp if inp.is_contiguous() else inp.contiguous()


def _gemm_bias(module: _ParallelLinear) -> torch.Tensor:
    """Return the bias the GEMM fuses: TE passes none when adding it unfused or returning it."""
    if module.apply_bias and not module.gemm_bias_unfused_add:
        return module.bias
    return module.bias.new_empty(0)


def _check_no_split(parameters_split: Any) -> None:
    if parameters_split is not None:
        raise NotImplementedError("parameters_split is not simulated (megatron never passes it)")


class Linear(_ParallelLinear):
    """TE's Linear (module/linear.py 985-1345, constructor 1072-1310).

    Parameters: `weight` (out/tp for column, in/tp for row) and `bias` (only with bias=True;
    otherwise an empty plain tensor). Attributes megatron reads: in_features, out_features (local),
    use_bias, return_bias, tp_size, parallel_mode, sequence_parallel, ub_name.
    """

    # Long by design: mirrors Transformer Engine's own argument list (see TE-NOTES.md).
    def __init__(
        self,
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
        parameters_split: Any = None,
        device: Any = "cuda",
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        save_original_input: bool = False,
        name: str | None = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        _check_no_split(parameters_split)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.rng_tracker_name = rng_tracker_name
        self.symmetric_ar_type = symmetric_ar_type
        self.save_original_input = save_original_input
        self.delay_wgrad_compute = delay_wgrad_compute
        self.ub_name = ub_name
        self.name = name
        self._set_parallel_sizes(
            in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel
        )
        self._register_weight_and_bias(init_method, get_rng_state_tracker, params_dtype)
        self.reset_parameters(defer_init=device == "meta")
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
    ) -> Any:
        """Run TE's `_Linear` as memory sees it (linear.py `Linear.forward` 1347-1505)."""
        setup, inp = self._setup(), contiguous_input(inp)
        if setup.fp8 is not None:
            weight_q = self._fp8_weight(self.weight, setup, is_first_microbatch, inp)
            out = fp8_functions.Fp8LinearFunction.apply(
                inp, self.weight, _gemm_bias(self), setup, weight_q
            )
        else:
            out = functions.LinearFunction.apply(inp, self.weight, _gemm_bias(self), setup)
        return self._finish_output(out)

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Set the parallel attributes unless deferred (linear.py 1325-1344)."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self._set_linear_attributes()


class LayerNormLinear(_ParallelLinear):
    """TE's LayerNormLinear (module/layernorm_linear.py 1036-1462, constructor 1135-1395).

    Parameters in registration order: `layer_norm_weight` (in_features), `layer_norm_bias` (only
    for normalization="LayerNorm"; RMSNorm sets the attribute to None, 1259-1275), then `weight`
    and `bias` as Linear. The norm acts on the full input (in_features is never divided in
    column mode).
    """

    # Long by design: mirrors Transformer Engine's own argument list (see TE-NOTES.md).
    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Any = None,
        tp_size: int = 1,
        get_rng_state_tracker: Any = None,
        init_method: Any = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split: Any = None,
        zero_centered_gamma: bool = False,
        device: Any = "cuda",
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        symmetric_ar_type: str | None = None,
        name: str | None = None,
        ub_overlap_ag: bool = False,
        ub_overlap_rs: bool = False,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        _check_no_split(parameters_split)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise AssertionError("Unsupported normalization type!")
        self.normalization = normalization
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.apply_bias = self.use_bias and not return_bias
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered
        self.zero_centered_gamma = zero_centered_gamma
        self.symmetric_ar_type = symmetric_ar_type
        self.delay_wgrad_compute = delay_wgrad_compute
        self.get_rng_state_tracker = get_rng_state_tracker
        self.ub_name = ub_name
        self.name = name
        self._set_parallel_sizes(
            in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel
        )
        self.eps = eps
        self.register_parameter(
            "layer_norm_weight", torch.nn.Parameter(empty(self.in_features, dtype=params_dtype))
        )
        if self.normalization != "RMSNorm":
            self.register_parameter(
                "layer_norm_bias", torch.nn.Parameter(empty(self.in_features, dtype=params_dtype))
            )
        else:
            self.layer_norm_bias = None
        self._register_weight_and_bias(init_method, get_rng_state_tracker, params_dtype)
        self.reset_parameters(defer_init=device == "meta")
        self.gemm_bias_unfused_add = self.parallel_mode == "row" and self.apply_bias
        # 1383-1388 of TE 2.20.2: the userbuffers all-gather of column-parallel sequence parallel
        self.ub_overlap_ag_fprop = ub_overlap_ag and self.sequence_parallel and \
            self.parallel_mode == "column"  # fmt: skip

    def forward(
        self,
        inp: torch.Tensor,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad: bool = False,
    ) -> Any:
        """Run TE's `_LayerNormLinear` as memory sees it (layernorm_linear.py 1540-1620)."""
        setup, inp = self._setup(self.normalization), contiguous_input(inp)
        args = (inp, self.layer_norm_weight, self.layer_norm_bias, self.weight, _gemm_bias(self))
        ret_ln = 0  # what TE returns beside the output (1788-1789, 619-625 of TE 2.20.2)
        if self.return_layernorm_output:
            gathered = self.return_layernorm_output_gathered
            ret_ln = functions.RETURN_GATHERED if gathered else functions.RETURN_LOCAL
        if setup.fp8 is not None:
            weight_q = self._fp8_weight(self.weight, setup, is_first_microbatch, inp)
            out = fp8_functions.Fp8LayerNormLinearFunction.apply(*args, setup, weight_q, ret_ln)
        else:
            out = functions.LayerNormLinearFunction.apply(*args, setup, ret_ln)
        if not ret_ln:
            return self._finish_output(out)
        out, ln_out = out
        finished = self._finish_output(out)  # 1832-1844: (out, bias, ln_out) or (out, ln_out)
        if self.return_bias:
            return (*finished, ln_out)
        return finished, ln_out

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        """Mark the norm for sequence parallelism and the linear for TP (1437-1461)."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            norm_params = ["layer_norm_weight"]
            if self.normalization != "RMSNorm":
                norm_params.append("layer_norm_bias")
            for param in norm_params:
                mark_sequence_parallel(getattr(self, param), self.sequence_parallel)
            self._set_linear_attributes()
