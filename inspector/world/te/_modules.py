"""The module objects `install()` puts into sys.modules, laid out as TE 2.11.0 lays them out.

Only what megatron-core 0.13-0.16 imports unconditionally, or imports in a `try` whose fallback
would change what it builds or runs, including TE's fused RoPE (`pytorch.attention.rope`, which
megatron calls with --apply-rope-fusion, Megatron-LM's default). What is left out raises
ImportError (ModuleNotFoundError for a missing submodule), so megatron takes its own fallback
exactly as with a TE lacking it: cross-entropy kernels, TE's
optimizers, cpp_extensions but `general_gemm` (megatron's `te_general_gemm`, the MoE router's
GEMM where megatron-core takes TE's own workspace: 0.19; 0.13-0.16 also import TE's older
`module.base.get_workspace`, which TE 2.11 no longer has, and use torch's), the fused-op API
(`pytorch.ops`) but what megatron-core 0.18+'s `--use-transformer-engine-op-fuser` experts run
under TE 2.14 (ops.py). The fused MoE permutation (`pytorch.permutation`, megatron's
`--moe-permute-fusion`) is kernels/permutation.py; 2.14's `moe_permute_and_pad_with_probs`
(megatron-core 0.19's padded flex dispatch) is left out, so megatron permutes without padding.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Any

from inspector.world.te import (
    NAME,
    VERSION,
    _base,
    attention,
    blockwise_tensor,
    cpu_offload,
    float8_tensor,
    grouped_linear,
    linear,
    mxfp8_tensor,
    norm,
    nvfp4_tensor,
    ops,
    state,
    tensor_utils,
)
from inspector.world.te.kernels import fp8_functions, functions, permutation, thd

_RECIPES = (
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
)
_FP8 = {
    "FP8GlobalStateManager": state.FP8GlobalStateManager,
    "fp8_autocast": state.fp8_autocast,
    "fp8_model_init": state.fp8_model_init,
    "quantized_model_init": state.quantized_model_init,
    **{name: getattr(state, name) for name in _RECIPES},
}
_MODULES = {
    "Linear": linear.Linear,
    "LayerNormLinear": linear.LayerNormLinear,
    "GroupedLinear": grouped_linear.GroupedLinear,
    "LayerNorm": norm.LayerNorm,
    "RMSNorm": norm.RMSNorm,
    "DotProductAttention": attention.DotProductAttention,
    "Fp8Padding": fp8_functions.Fp8Padding,
    "Fp8Unpadding": fp8_functions.Fp8Unpadding,
}

# TE 2.13 added ops.GroupedLinear and ops.ScaledSwiGLU (ops/basic/__init__.py): under 2.14 the
# fuser megatron-core 0.18+'s op-fuser experts run (ops.py); under 2.11 they are absent; the ops
# added later (ops.SINCE) only from their release on
_RELEASE = tuple(int(part) for part in VERSION.split(".")[:2])
_FUSER_OPS = {name: op for name, op in ops.OPS.items()
              if _RELEASE >= (2, 13) and _RELEASE >= ops.SINCE.get(name, (2, 13))}  # fmt: skip

# name -> (is a package, attributes); submodules are attached to their parents afterwards.
_LAYOUT: dict[str, tuple[bool, dict[str, Any]]] = {
    "": (True, {"__version__": VERSION, "__stand_in__": True}),
    ".common": (True, {}),
    ".common.recipe": (False, {name: getattr(state, name) for name in _RECIPES}),
    ".pytorch": (
        True,
        {**_MODULES, "fp8_autocast": state.fp8_autocast, "fp8_model_init": state.fp8_model_init,
         "quantized_model_init": state.quantized_model_init},
    ),
    ".pytorch.fp8": (False, _FP8),
    ".pytorch.quantization": (False, _FP8),
    ".pytorch.distributed": (
        False,
        {
            "CudaRNGStatesTracker": state.CudaRNGStatesTracker,
            "get_all_rng_states": state.get_all_rng_states,
            "activation_recompute_forward": state.activation_recompute_forward,
            "checkpoint": state.checkpoint,
            "set_tensor_model_parallel_attributes": _base.set_tensor_model_parallel_attributes,
        },
    ),
    ".pytorch.module": (True, dict(_MODULES)),
    ".pytorch.module.base": (
        False,
        {
            "TransformerEngineBaseModule": _base.TransformerEngineBaseModule,
            "get_dummy_wgrad": state.get_dummy_wgrad,
        },
    ),
    ".pytorch.cpp_extensions": (True, {"general_gemm": functions.general_gemm}),
    ".pytorch.tensor": (True, {"QuantizedTensor": state.QuantizedTensor}),
    ".pytorch.tensor.float8_tensor": (False, {"Float8Tensor": float8_tensor.Float8Tensor}),
    ".pytorch.tensor.mxfp8_tensor": (False, {"MXFP8Tensor": mxfp8_tensor.MXFP8Tensor}),
    ".pytorch.tensor.nvfp4_tensor": (False, {"NVFP4Tensor": nvfp4_tensor.NVFP4Tensor}),
    ".pytorch.tensor.float8_blockwise_tensor": (
        False, {"Float8BlockwiseQTensor": blockwise_tensor.Float8BlockwiseQTensor}),
    ".pytorch.tensor.utils": (False, tensor_utils.UTILS),
    ".pytorch.attention": (True, {"DotProductAttention": attention.DotProductAttention}),
    ".pytorch.attention.rope": (
        False,
        {"apply_rotary_pos_emb": thd.apply_rotary_pos_emb},  # thd's, else attention_functions
    ),
    ".pytorch.cpu_offload": (False, {name: getattr(cpu_offload, name) for name in (
        "get_cpu_offload_context", "is_cpu_offload_enabled", "mark_not_offload", "start_offload")}),
    ".pytorch.ops": (True, {"FusibleOperation": state.FusibleOperation, **state.OPS, **_FUSER_OPS}),
    ".pytorch.permutation": (False, dict(permutation.FUNCTIONS)),
    ".pytorch.router": (
        False,
        {
            "fused_topk_with_score_function": state.never_runs,
            "fused_compute_score_for_moe_aux_loss": state.never_runs,
            "fused_moe_aux_loss": state.never_runs,
        },
    ),
}


def _module(name: str, package: bool, attributes: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name, "Simulated Transformer Engine (inspector.world.te): no kernels.")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []  # submodules not listed here are ModuleNotFoundError
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def build() -> dict[str, types.ModuleType]:
    """Return the stand-in's modules by their `transformer_engine...` names."""
    modules = {
        NAME + suffix: _module(NAME + suffix, package, attributes)
        for suffix, (package, attributes) in _LAYOUT.items()
    }
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
