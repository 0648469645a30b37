"""Transformer Engine's FusedAdam, as megatron's precision-aware optimizer drives it.

transformer_engine/pytorch/optimizers/fused_adam.py (TE 2.11): the state each parameter gets
(`_initialize_state`, `initialize_state`), the fp32 temporaries its `step` makes for every state
held in a reduced dtype (`get_unscaled_state`, kept in `unscaled_lists` until the group's
kernels ran), and `_apply_scale`, which writes them back. From TE 2.13 (PR #2632, "Fuse scaling
and unscaling of bf16 momentums into kernels", in the v2.13 and v2.14 tags; fused_adam.py v2.14
219 `fuse_unscale`, 650-653 `get_unscaled_state(..., skip_unscale=self.fuse_unscale)`, 344-348
the bf16 state returned as it is, 871-874 no `_apply_scale` of the moments) bf16 exp_avg and
exp_avg_sq (both bf16) go to the kernel as they are (common/multi_tensor/adam.cu: `MOMENT_T`
bf16, read and written in place): no temporary for them; an fp16 or fp8 state, and an fp16
master, still get theirs. The stand-in follows the TE release it declares (te/__init__.py
`fuses_bf16_moments`, VERSION). The CUDA kernels
(`multi_tensor_adam`, `multi_tensor_adam_param_remainder`: csrc/multi_tensor_adam.cu) update
their tensors in place and allocate nothing: they are not called. An fp8 state (dtype
`torch.uint8`) is a Float8Tensor from `Float8Quantizer.make_empty` (tensor/float8_tensor.py):
row-wise data and its column-wise transpose, one byte an element each, and its fp32 scale_inv,
beside the quantizer's scale and amax.

megatron-core imports it only with --use-precision-aware-optimizer (memory/engine/optimizer.py puts it
in place as `transformer_engine.pytorch.optimizers` while the optimizer is made and stepped);
without the flag megatron's own fallback runs, as with the rest of TE's optimizers.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te import fuses_bf16_moments

FP8 = torch.uint8  # Megatron-LM's and TE's spelling of an fp8 optimizer state
_STATES = ("exp_avg", "exp_avg_sq", "master_param")
# fused_adam.py `dtype_to_range_map`: the largest value a scaled state may take
_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, FP8: 448.0}


class Fp8State:
    """A Float8Tensor optimizer state (float8_tensor.py `Float8Quantizer.make_empty`, default
    row-wise and column-wise usage): data, transpose and scale_inv, the quantizer's scale, amax."""

    def __init__(self, shape: torch.Size, device: torch.device) -> None:
        self.scale = torch.ones([1], dtype=torch.float32, device=device)
        self.amax = torch.zeros([1], dtype=torch.float32, device=device)
        self._data = torch.empty(shape, dtype=FP8, device=device)
        self._transpose = torch.empty([shape[-1], *shape[:-1]], dtype=FP8, device=device)
        self._scale_inv = torch.empty(1, dtype=torch.float32, device=device)
        self.dtype = torch.float32  # the nominal dtype make_empty gives

    def float(self) -> torch.Tensor:
        """Dequantize into a new fp32 tensor (`_FromFloat8Func.forward`)."""
        return torch.empty(self._data.shape, dtype=torch.float32, device=self._data.device)

    def copy_(self, source: torch.Tensor) -> Fp8State:
        """Quantize `source` into the data and its transpose, in place (`tex.quantize`)."""
        del source
        return self


class FusedAdam(torch.optim.Optimizer):
    """TE's FusedAdam: its constructor's checks and arguments, its states, its step's temporaries."""

    def __init__(
        self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
        bias_correction: bool = True, adam_w_mode: bool = True, capturable: bool = False,
        master_weights: bool = False, master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False, store_param_remainders: bool = False,
        set_grad_none: bool | None = None,
    ) -> None:  # fmt: skip
        reduced = (torch.float32, torch.float16, torch.bfloat16, FP8)
        if amsgrad or capturable:
            raise RuntimeError("FusedAdam's AMSGrad and capturable modes are not simulated")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        if exp_avg_dtype not in reduced or exp_avg_sq_dtype not in reduced:
            raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg and exp_avg_sq.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)  # fmt: skip
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.master_weights = master_weights
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device="cuda")
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }  # fmt: skip
        self._scales: dict[Any, dict[str, torch.Tensor]] = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        # fused_adam.py v2.14 219: both moments in bf16 are updated in the kernel as they are
        self.fuse_unscale = exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16 and (
            fuses_bf16_moments()
        )

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Reset the gradients (`.decoupled_grad` with use_decoupled_grad), as TE does."""
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.decoupled_grad = None
                elif getattr(param, "decoupled_grad", None) is not None:
                    param.decoupled_grad.zero_()

    def _initialize_state(self, param: Any, name: str, zero: bool, remainders: bool = False) -> None:
        """fused_adam.py `_initialize_state`: the state in its dtype, and its fp32 scale."""
        dtype = self.name_to_dtype_map[name]
        if remainders:
            data = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        else:
            data = torch.empty(param.shape, dtype=dtype, device=param.device)
        if zero:
            data.zero_()
        if dtype == FP8:
            state = Fp8State(param.shape, param.device)
            state.copy_(data.float())  # quantize_(data.float()): a temporary fp32 copy
            self.state[param][name] = state
        else:
            self.state[param][name] = data
        if dtype != torch.float32:
            scales = self._scales.setdefault(param, {})
            scales[name] = torch.ones([1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param: Any, store_param_remainders: bool = False) -> None:
        """fused_adam.py `initialize_state`: moments zeroed; the master copied from the weight."""
        self._initialize_state(param, "exp_avg", zero=True)
        self._initialize_state(param, "exp_avg_sq", zero=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", False, store_param_remainders)
            if not store_param_remainders:
                self._set_master(param, param.clone().detach().float())

    def _set_master(self, param: Any, unscaled: torch.Tensor) -> None:
        """fused_adam.py `set_scaled_state` of the master weight."""
        if self.name_to_dtype_map["master_param"] != torch.float32:
            scale = self._scales[param]["master_param"]
            self._apply_scale("master_param", unscaled, self.state[param]["master_param"], scale)
        else:
            self.state[param]["master_param"].copy_(unscaled)

    def get_unscaled_state(self, param: Any, name: str, skip_unscale: bool = False) -> Any:
        """fused_adam.py `get_unscaled_state`: an fp32 temporary for a reduced state (2.13+:
        a bf16 state as it is with `skip_unscale`)."""
        state, dtype = self.state[param][name], self.name_to_dtype_map[name]
        if dtype == torch.float32 or (skip_unscale and dtype == torch.bfloat16):
            return state
        unscaled = state.float()
        if dtype == torch.float16:
            unscaled.mul_(self._scales[param][name])
        return unscaled

    def _apply_scale(self, name: str, unscaled: torch.Tensor, scaled: Any, scale: Any) -> None:
        """fused_adam.py `_apply_scale`: write an fp32 temporary back into its reduced state."""
        if isinstance(scaled, torch.Tensor) and scaled.dtype == torch.bfloat16:
            scaled.copy_(unscaled.bfloat16())
            return
        low, high = torch.aminmax(unscaled)
        absmax = torch.maximum(-low, high).to(dtype=torch.float32)
        limit = torch.full([1], _RANGE[self.name_to_dtype_map[name]], device=unscaled.device)
        torch.div(absmax, limit, out=scale)
        if isinstance(scaled, Fp8State):
            scaled.scale.copy_(1 / scale)
            scaled.copy_(unscaled)
        else:
            unscaled.mul_(torch.where(scale > 0, scale.reciprocal(), 0.0))
            scaled.copy_(unscaled)

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> None:  # type: ignore[override]
        """fused_adam.py `step`, not capturable: per group, the reduced states unscaled into
        fp32 temporaries, the in-place kernel (not called), the temporaries written back; from
        TE 2.13 bf16 moments (`fuse_unscale`) go to the kernel as they are, nothing written back."""
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            unscaled_lists: dict[str, list[tuple[torch.Tensor, Any, Any]]] = {n: [] for n in _STATES}
            for param in group["params"]:
                remainders = self.store_param_remainders and param.dtype == torch.bfloat16
                if not self.state[param]:
                    self.initialize_state(param, remainders)
                grad = getattr(param, "decoupled_grad", None) if self.use_decoupled_grad else param.grad
                if grad is None:
                    continue
                for name in _STATES:
                    if name not in self.state[param] or self.name_to_dtype_map[name] == torch.float32:
                        continue
                    if name == "master_param" and remainders:
                        continue  # the int16 remainders go to the kernel as they are
                    scale = self._scales[param][name]
                    unscaled = self.get_unscaled_state(param, name, self.fuse_unscale)
                    unscaled_lists[name].append((unscaled, self.state[param][name], scale))
            # multi_tensor_adam / multi_tensor_adam_param_remainder: in place, nothing allocated
            for name in _STATES:
                if self.fuse_unscale and name != "master_param":
                    continue  # v2.14 871-874: scaled in the kernel
                for unscaled, scaled, scale in unscaled_lists[name]:
                    self._apply_scale(name, unscaled, scaled, scale)
            del unscaled_lists
