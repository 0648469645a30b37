"""The stand-in's global state and helpers: fp8 state manager, recipes, RNG tracker, stubs.

Mirrors transformer_engine 2.11.0: `pytorch/quantization.py` (FP8GlobalStateManager 234-460,
`fp8_model_init` 672, `quantized_model_init`, `fp8_autocast` 766),
`common/recipe/__init__.py` (Format 23, Recipe 86,
DelayedScaling 121-222 and the other recipes), `pytorch/distributed.py` (CudaRNGStatesTracker
776-886). Only what megatron-core touches while importing, building and running; `fp8_autocast`
sets the global state TE's modules read (world/te/kernels/quantize.py holds what fp8 allocates).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_NEVER_RUNS = "the simulated Transformer Engine builds modules, never runs them"


def never_runs(*args: Any, **kwargs: Any) -> Any:
    """Stand in for a TE kernel megatron imports but only calls in a forward/backward pass."""
    raise NotImplementedError(_NEVER_RUNS)


class Format(enum.Enum):
    """fp8 formats (common/recipe/__init__.py 23-45); values are (fwd, bwd) format names."""

    E4M3 = ("E4M3", "E4M3")
    E5M2 = ("E5M2", "E5M2")
    HYBRID = ("E4M3", "E5M2")


class Recipe:
    """Base of TE's quantization recipes (common/recipe/__init__.py 86-118)."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)


def _ignore_extra(cls: Any) -> Any:
    """Drop unknown keyword arguments, as TE's pydantic dataclasses do (`extra="ignore"`):
    megatron's TEDelayedScaling passes `params_dtype` and `device` (transformer_engine.py)."""
    names = set(cls.__dataclass_fields__)
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{k: v for k, v in kwargs.items() if k in names})

    cls.__init__ = __init__
    return cls


@_ignore_extra
@dataclass()
class DelayedScaling(Recipe):
    """Delayed-scaling recipe, TE's fields and defaults (common/recipe/__init__.py 121-222)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)


@_ignore_extra
@dataclass()
class Float8CurrentScaling(Recipe):
    """Per-tensor current scaling (common/recipe/__init__.py 224)."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignore_extra
@dataclass()
class MXFP8BlockScaling(Recipe):
    """MXFP8 block scaling (common/recipe/__init__.py 265)."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignore_extra
@dataclass()
class Float8BlockScaling(Recipe):
    """fp8 block scaling (common/recipe/__init__.py 306)."""

    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignore_extra
@dataclass()
class NVFP4BlockScaling(Recipe):
    """NVFP4 block scaling (common/recipe/__init__.py 387)."""

    fp8_dpa: bool = False
    fp8_mha: bool = False


@_ignore_extra
@dataclass()
class CustomRecipe(Recipe):
    """User-defined quantizers (common/recipe/__init__.py 484)."""

    qfactory: Any = None
    fp8_dpa: bool = False
    fp8_mha: bool = False


def recipe_name(recipe: Recipe) -> str:
    """Return the name --fp8-recipe (--fp4-recipe for NVFP4) gives `recipe` (megatron
    fp8_utils.py `get_fp8_recipe`, fp4_utils.py `get_fp4_recipe`)."""
    for name, test in (("delayed", recipe.delayed), ("tensorwise", recipe.float8_current_scaling),
                       ("blockwise", recipe.float8_block_scaling), ("mxfp8", recipe.mxfp8),
                       ("nvfp4", recipe.nvfp4)):  # fmt: skip
        if test():
            return name
    raise NotImplementedError(f"Transformer Engine's {type(recipe).__name__} is not simulated")


class FP8GlobalStateManager:
    """TE's global fp8 state (quantization.py 234-460): set by `fp8_autocast`, read by modules."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Recipe | None = None
    FP8_DISTRIBUTED_GROUP: Any = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    skip_fp8_weight_update_tensor: Any = None

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        first, cls.IS_FIRST_FP8_MODULE = cls.IS_FIRST_FP8_MODULE, False
        return first

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else DelayedScaling()

    @classmethod
    def get_fp8_group(cls) -> Any:
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        cls.skip_fp8_weight_update_tensor = skip

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> Any:
        return cls.skip_fp8_weight_update_tensor

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Reduce amaxes over the fp8 group and update scales (quantization.py 497): in place
        on the modules' recipe state, so nothing is allocated that outlives the call."""

    add_fp8_tensors_to_global_buffer = classmethod(never_runs)


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: Any = None,
    _graph: bool = False,
) -> Iterator[None]:
    """TE's fp8 autocast (quantization.py 766 `fp8_autocast`, 800 `autocast`): set the
    global fp8 state for the modules run inside, restore it on exit."""
    cls = FP8GlobalStateManager
    saved = (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
             cls.IS_FIRST_FP8_MODULE)  # fmt: skip
    cls.FP8_ENABLED, cls.FP8_CALIBRATION = enabled, calibrating
    cls.FP8_RECIPE = fp8_recipe if fp8_recipe is not None else DelayedScaling()
    cls.FP8_DISTRIBUTED_GROUP = fp8_group
    if enabled and not saved[0]:
        cls.IS_FIRST_FP8_MODULE = True
    try:
        yield
    finally:
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE) = saved  # fmt: skip


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """TE's activation checkpoint (distributed.py `checkpoint` / `_CheckpointFunction`, v2.11),
    reentrant: the forward keeps only its inputs, and backward runs it again inside the fp8
    state it first ran in (TE saves the autocast state and re-enters it for the recompute).

    Run here by torch's reentrant checkpoint, which saves the same inputs; megatron's `te_checkpoint`
    uses it for full recomputation under fp8.
    """
    import functools

    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    for name in ("distribute_saved_activations", "get_rng_state_tracker", "tp_group", "use_reentrant"):
        kwargs.pop(name, None)
    cls = FP8GlobalStateManager
    enabled, recipe, group = cls.FP8_ENABLED, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP

    def run(*inputs: Any) -> Any:
        with fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group):
            return functools.partial(function, **kwargs)(*inputs)

    return torch_checkpoint(run, *args, use_reentrant=True, preserve_rng_state=False)


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False
) -> Iterator[None]:
    """TE's fp8 parameter context (quantization.py `quantized_model_init`, v2.11): the modules
    built inside keep their GEMM weights quantized (float8_tensor.py here); restored on exit."""
    cls = FP8GlobalStateManager
    saved = (cls.FP8_PARAMETERS, cls.FP8_RECIPE, cls.HIGH_PRECISION_INIT_VAL)
    cls.FP8_PARAMETERS = enabled
    cls.FP8_RECIPE = DelayedScaling() if recipe is None else recipe
    cls.HIGH_PRECISION_INIT_VAL = preserve_high_precision_init_val
    try:
        yield
    finally:
        cls.FP8_PARAMETERS, cls.FP8_RECIPE, cls.HIGH_PRECISION_INIT_VAL = saved


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False
) -> Iterator[None]:
    """TE's deprecated name for `quantized_model_init` (quantization.py 672-700, v2.11)."""
    with quantized_model_init(enabled, recipe, preserve_high_precision_init_val):
        yield


@contextlib.contextmanager
def activation_recompute_forward(
    activation_recompute: bool = False, recompute_phase: bool = False
) -> Iterator[None]:
    """TE's recomputation marker (distributed.py 228-263): it only sets the flags TE's fp8 modules
    read (`_FP8_ACTIVATION_RECOMPUTE_ENABLED` needs fp8 on, which the stand-in never is) and
    allocates nothing. megatron's CheckpointWithoutOutput enters it around every checkpoint."""
    yield


class CudaRNGStatesTracker:
    """TE's RNG-state tracker (distributed.py 776-886), keeping seeds instead of CUDA states.

    megatron subclasses it as TECudaRNGStatesTracker (`--te-rng-tracker`); only `fork`, which
    would switch CUDA generators around a kernel, is refused.
    """

    def __init__(self) -> None:
        self.states_: dict[str, Any] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, Any]:
        return dict(self.states_)

    def set_states(self, states: dict[str, Any]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = seed

    def fork(self, name: str = "model-parallel-rng") -> Any:
        raise NotImplementedError(_NEVER_RUNS)


def get_all_rng_states() -> dict[str, Any]:
    """TE's registry of RNG states (distributed.py 72); none is ever registered here."""
    return {}


class QuantizedTensor(torch.Tensor):
    """Base of TE's quantized tensors (pytorch/tensor/quantized_tensor.py).

    megatron tests `isinstance(param, QuantizedTensor)` (fp8_utils.py `is_float8tensor`): only
    fp8 parameters (float8_tensor.py, under `quantized_model_init`) are one here.
    """


class ScaledWeight(QuantizedTensor):
    """What TE's row- and column-wise scaled weights share (MXFP8Tensor, Float8BlockwiseQTensor,
    NVFP4Tensor; storage/*_tensor_storage.py): a nominal 16-bit meta tensor (subclass
    propagation off: megatron only tests the class and reads `.data`, `.float()`) whose bytes
    are the tensors below; `dequantize` makes a new one."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # plain results

    _rowwise_data: torch.Tensor | None
    _rowwise_scale_inv: torch.Tensor | None
    _columnwise_data: torch.Tensor | None
    _columnwise_scale_inv: torch.Tensor | None
    _high_precision_init_val: torch.Tensor | None
    _is_param: bool

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return the values in `dtype` (default the nominal one): a new tensor."""
        return torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)


# TE's `_dummy_wgrads` (module/base.py, v2.11): one placeholder per (rows, cols, dtype), kept.
_DUMMY_WGRADS: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
# What names a placeholder's allocation while one is made (the engine's tracker, `naming`)
_NAMING: list[Callable[[str], contextlib.AbstractContextManager[None]]] = []
DUMMY_WGRAD = "Transformer Engine's placeholder weight gradient"


def get_dummy_wgrad(shape: list[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """Return TE's placeholder weight gradient (module/base.py 79-92 `get_dummy_wgrad`, v2.11).

    A module that accumulated its weight gradient into `main_grad` returns this as the weight's
    gradient; TE keeps one per shape and dtype for the process (made on "cuda": meta here) and
    returns a detached alias, so autograd stores it as `.grad` without copying.
    """
    if len(shape) != 2:
        raise AssertionError("get_dummy_wgrad takes a 2-D shape")
    key = (shape[0], shape[1], dtype)
    if key not in _DUMMY_WGRADS:
        label = f"{DUMMY_WGRAD} ({shape[0]} x {shape[1]}, {str(dtype).removeprefix('torch.')})"
        with _NAMING[-1](label) if _NAMING else contextlib.nullcontext():
            _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype, device="meta")
    return _DUMMY_WGRADS[key].detach()


@contextlib.contextmanager
def placeholders_named(name: Callable[[str], contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """Make each new placeholder inside `name(label)`: one per process, so a rank's chunks share
    them (the engine counts them once per rank, as it does megatron's global memory buffer)."""
    _NAMING.append(name)
    try:
        yield
    finally:
        _NAMING.pop()


def reset_dummy_wgrads() -> None:
    """Forget the placeholders, as a new process would start without them."""
    _DUMMY_WGRADS.clear()


class FusibleOperation(torch.nn.Module):
    """TE's fused-operation API (pytorch/ops): megatron names these classes in annotations.

    Only `--use-te-op-fuser` and TE activation ops construct them; that is not simulated.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "Transformer Engine's fused operations (--use-te-op-fuser, TE activation functions) "
            "are not simulated"
        )


# The pytorch.ops classes megatron-core's extensions/transformer_engine.py names (TEFusedMLP,
# TEActivationOp).
OPS = {
    name: type(name, (FusibleOperation,), {"__doc__": f"TE's ops.{name}; not simulated."})
    for name in (
        "Sequential",
        "BasicLinear",
        "Bias",
        "LayerNorm",
        "RMSNorm",
        "AllReduce",
        "ReduceScatter",
        "GELU",
        "GEGLU",
        "ReLU",
        "ReGLU",
        "SiLU",
        "SwiGLU",
    )
}
