"""The optimizer step, as Megatron-LM's `train_step` runs it after the last backward, recorded.

megatron-core builds its optimizer (megatron/core/optimizer/__init__.py `get_megatron_optimizer`,
with an OptimizerConfig as Megatron-LM's `training.py` makes it from its flags: Adam, weight decay
0.01, --clip-grad 1.0, the job's bf16/fp16 and distributed optimizer) over the stage's chunks
wrapped in megatron's DDP, in the simulated rank's world, and `optimizer.step()` runs on meta
tensors under the allocator model (allocator.py). What megatron runs per iteration
(formulas/optimizer.py lists the passes): `main_grad.float()`, the fp16 unscale, the grad norm and
clip, the inner optimizer's step, the copy of the main parameters into the model's weights.

The inner optimizer is what megatron imports (optimizer/__init__.py): Transformer Engine's or
apex's FusedAdam when the job has those kernels (`fused`: Transformer Engine layers, or apex, the
ModelDims `fused_kernels` notion of formulas/optimizer.py), else torch.optim.AdamW. Simulated:

- torch.optim.AdamW picks its foreach implementation (`_multi_tensor_adam`) for CUDA tensors
  (torch/optim/optimizer.py `_default_to_fused_or_foreach`) but not for meta ones: `foreach` is
  set, as the GPU would choose;
- `Tensor.type()` names a meta tensor as the CUDA one (megatron's optimizers check
  'torch.cuda.BFloat16Tensor'), and a meta scalar's `.item()` answers: 0 for the fp16 scaler's
  found-inf flag, 2.0 for a grad norm (above --clip-grad 1.0, so the clip runs, as on every
  iteration measured in shared/gpu/gpu-time-h200.json);
- the grad norm without TE or apex is megatron.core.utils `local_multi_tensor_l2_norm`: its
  per-tensor `torch.norm`s, then a 1-element fp32 tensor (the host round trip cannot run on meta);
- FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py, apex/optimizers/fused_adam.py)
  is its smallest stand-in: the moments made on the first step, then one in-place
  `multi_tensor_adam` per group (allocating nothing), and TE's/apex's multi_tensor_l2norm and
  multi_tensor_scale likewise: a 1-element norm, an in-place scale;
- with --use-precision-aware-optimizer, Transformer Engine's FusedAdam (world/te/optimizers.py,
  what megatron-core requires for the flag): its state in the flag's dtypes, made on the first
  step, and the fp32 temporaries its step makes for every state held in a reduced dtype.
Megatron-FSDP's jobs step in DDP too (their state: FSDP's buffers, memory/fsdp_buffers.py).

The first step makes Adam's moments (lazily: `exp_avg`, `exp_avg_sq`); they are state memory,
counted by memory/measure.py, and returned here to be checked. The second step is the steady one;
before it, Megatron-LM's `train_step` calls `optimizer.zero_grad()`, which frees the fp32 main
grads `main_grad.float()` made when the grad buffer is 16-bit (they live from the step to the
next iteration's start, above the static memory).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from inspector.job.job import Job
from inspector.job.optimizers import MUON
from inspector.memory.engine.allocator import Event, Tracker
from inspector.memory.engine.cuda import cuda_on_meta
from inspector.world.shards import reuses_grad_buf

GRAD_NORM = 2.0  # what a grad norm reads: above --clip-grad 1.0, so the clip runs
# Megatron-LM arguments.py defaults: --weight-decay 0.01, --clip-grad 1.0, Adam's betas and eps
WEIGHT_DECAY, CLIP_GRAD = 0.01, 1.0


@dataclass(frozen=True)
class StepRun:
    """One steady optimizer step of a rank: its allocations, and the state its first step made."""

    events: tuple[Event, ...]
    state: int  # bytes the first step allocated and kept (Adam's moments)
    first: tuple[Event, ...] = ()  # the first step's own events (it makes the moments)

    @property
    def held(self) -> int:
        """Return the bytes the step leaves allocated (the fp32 main grads `main_grad.float()`
        makes from a 16-bit grad buffer, until the next `zero_grad`)."""
        return self.events[-1].allocated if self.events else 0


def optimizer_config(job: Job) -> Any:
    """Return megatron's OptimizerConfig as Megatron-LM's training.py builds it from the flags."""
    from megatron.core.optimizer import OptimizerConfig

    precision = job.training.optimizer_precision
    aware: dict[str, Any] = {}
    if precision.precision_aware:  # Megatron-LM's validate_args `dtype_map`: fp8 is torch.uint8
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                  "fp8": torch.uint8}  # fmt: skip
        aware = {name: dtypes[getattr(precision, name)] for name in PRECISION_FIELDS}
        aware.update(use_precision_aware_optimizer=True, fp8_recipe=job.model.fp8_recipe)
    return OptimizerConfig(
        optimizer="adam",
        lr=1.0e-4,
        weight_decay=WEIGHT_DECAY,
        clip_grad=CLIP_GRAD,
        bf16=job.model.bf16,
        fp16=job.model.fp16,
        use_distributed_optimizer=job.training.use_distributed_optimizer,
        reuse_grad_buf_for_mxfp8_param_ag=reuses_grad_buf(job),  # main shards -> grad buf view
        **aware,
    )


PRECISION_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def run_step(job: Job, ddps: Sequence[Any], fused: bool) -> StepRun:
    """Build megatron's optimizer over `ddps` (the stage's chunks in DDP), run two steps."""
    with optimizer_world(job, fused) as (answers, clip):
        optimizer = build_optimizer(job, ddps)
        answers.zeros = {id(o.found_inf) for o in _parts(optimizer) if hasattr(o, "found_inf")}
        _foreach(optimizer)
        first = _GpuTracker()
        with first:
            optimizer.step()
        optimizer.zero_grad()  # train_step's, before the next forward: frees the fp32 main grads
        steady = clip.tracker = _GpuTracker()
        with steady:
            _labelled(optimizer, steady)
            optimizer.step()
    return StepRun(tuple(steady.events), first.allocated, tuple(first.events))


@contextlib.contextmanager
def optimizer_world(job: Job, fused: bool) -> Iterator[tuple[_Answers, _Clip]]:
    """Give megatron's optimizers, inside the block, the kernels and GPU answers they ask for."""
    from inspector.memory.engine.muon import stand_in_gathers

    aware = job.training.optimizer_precision.precision_aware
    kernels = _te_optimizers() if aware else _kernels(fused)
    with kernels, _on_gpu() as answers, _clip_named() as clip, _objects_gathered():
        with stand_in_gathers():  # Muon's layer-wise all-gather over the stand-in groups
            yield answers, clip


def build_optimizer(job: Job, ddps: Sequence[Any]) -> Any:
    """Build megatron's optimizer for the job over the chunks in DDP (Adam, or Muon: muon.py)."""
    from megatron.core.optimizer import get_megatron_optimizer

    from inspector.memory.engine.muon import build_muon, heaviest_index, muon_taken

    if job.training.optimizer in MUON:  # the step of the rank `memory` reports: the most loaded
        with muon_taken() as taken:
            optimizer = build_muon(job, ddps, optimizer_config(job))
        index = heaviest_index(optimizer, taken)
        return build_muon(job, ddps, optimizer_config(job), index) if index else optimizer
    return get_megatron_optimizer(optimizer_config(job), list(ddps), use_gloo_process_groups=False)


def stage_step(job: Job, stage: int) -> StepRun:
    """Build `stage` (every layer, expert-parallel rank 0), wrap its chunks in megatron's DDP as
    Megatron-LM's get_model does, and run its optimizer step."""
    from inspector.memory.engine.microbatch import MEGATRON_ERRORS, megatron_failed
    from inspector.memory.engine.runtime import runtime_config
    from inspector.memory.engine.stage import _ddp as ddp_wrapped  # the engine's DDP wrap
    from inspector.memory.engine.stage import moe_build
    from inspector.world.stage import stage_world

    runtime = runtime_config(job)
    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime)
    with moe_build(job), world as chunks:
        ddps = [ddp_wrapped(job, chunk.module, stage, index) for index, chunk in enumerate(chunks)]
        try:
            return run_step(job, ddps, job.dims().fused_kernels)
        except MEGATRON_ERRORS as exc:
            what = f"the optimizer step of stage {stage} on meta tensors"
            raise megatron_failed(what, exc) from exc


class _Clip:
    tracker: Tracker | None = None


@contextlib.contextmanager
def _clip_named() -> Iterator[_Clip]:
    """Name megatron's clip (optimizer.py calls clip_grads' clip_grad_by_total_norm_fp32)."""
    from megatron.core.optimizer import optimizer as module

    clip, real = _Clip(), module.clip_grad_by_total_norm_fp32

    def named(*args: Any, **kwargs: Any) -> Any:
        if clip.tracker is None:
            return real(*args, **kwargs)
        return _named(real, "clip", clip.tracker)(*args, **kwargs)

    module.clip_grad_by_total_norm_fp32 = named
    try:
        yield clip
    finally:
        module.clip_grad_by_total_norm_fp32 = real


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _foreach(optimizer: Any) -> None:
    """Give torch's AdamW the foreach implementation it picks for CUDA tensors, stepping as in
    eager mode (`_eager_step`)."""
    for part in _parts(optimizer):
        inner = part.optimizer
        if isinstance(inner, torch.optim.Optimizer):
            for group in inner.param_groups:
                group["foreach"] = True
            _eager_step(inner)


def _eager_step(inner: torch.optim.Optimizer) -> None:
    """Run `inner.step` as torch's wrappers run it in eager mode, without importing dynamo.

    torch/optim/optimizer.py wraps an optimizer's step in `_use_grad_for_differentiable` (the
    grad mode of `differentiable`, around two `torch._dynamo.graph_break()` calls: nothing
    outside torch.compile, but each call imports torch._dynamo, ~0.5 s) and that in
    `Optimizer.profile_hook_step` (hooks, profiler range). The step keeps the latter and the grad
    mode; a torch whose wrappers are not found keeps its own step.
    """
    from torch.optim.optimizer import Optimizer, _use_grad_for_differentiable

    use_grad = _use_grad_for_differentiable(lambda: None).__code__
    wrapper: Any = type(inner).step
    while wrapper is not None and getattr(wrapper, "__code__", None) is not use_grad:
        wrapper = getattr(wrapper, "__wrapped__", None)
    if wrapper is None:
        return
    step = wrapper.__wrapped__

    @functools.wraps(step)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return step(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(before)

    inner.step = types.MethodType(Optimizer.profile_hook_step(run), inner)  # type: ignore[method-assign]


class _GpuTracker(Tracker):
    """The tracker, each allocation named by megatron's pass and the aten op that made it."""

    op: str = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.op = func.overloadpacket.__name__
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _location(self) -> str:
        return f"{self.where} {self.op}" if self.where else self.op


def _labelled(optimizer: Any, tracker: Tracker) -> None:
    """Name each allocation by megatron's pass and the aten op that made it."""
    for part in [optimizer, *_parts(optimizer)]:
        for method, name in _PASSES:
            if hasattr(part, method):
                setattr(part, method, _named(getattr(part, method), name, tracker))
        # ChainedOptimizer (dense and expert parameters: MoE) asserts on `.optimizer`: ask parts only
        inner = None if part is optimizer else getattr(part, "optimizer", None)
        if inner is not None:
            fused = isinstance(inner, FusedAdam) or type(inner).__name__ == "FusedAdam"
            adam = "adamw" if isinstance(inner, torch.optim.Optimizer) and not fused else "FusedAdam"
            muon = type(inner).__name__ == "TensorParallelMuon"  # muon.py's, Newton-Schulz inside
            inner.step = _named(inner.step, "muon" if muon else adam, tracker)


_PASSES = (
    ("_copy_model_grads_to_main_grads", "main_grad.float()"),
    ("_unscale_main_grads_and_check_for_nan", "unscale"),
    ("get_grad_norm", "grad norm"),
    ("_compute_grad_norms_by_group", "grad norm by group"),  # megatron-core 0.19+
    ("_copy_main_params_to_model_params", "main params to weights"),
    ("allgather_params", "layer-wise all-gather"),  # dist_muon: every rank's updated weights
)


def _named(function: Any, name: str, tracker: Tracker) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        before = tracker.where
        tracker.at(f"optimizer step: {name}")
        try:
            return function(*args, **kwargs)
        finally:
            tracker.at(before)

    return run


class _Answers(TorchFunctionMode):
    """Answer what megatron's optimizers ask a CUDA tensor: its type() name, a scalar's item()."""

    def __init__(self) -> None:
        super().__init__()
        self.zeros: set[int] = set()  # tensors whose value reads 0 (the found-inf flags)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return str(func(*args)).replace("torch.meta.", "torch.cuda.")
        if func in (torch.Tensor.item, torch.Tensor.__float__) and args[0].is_meta:
            return 0.0 if id(args[0]) in self.zeros else GRAD_NORM
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on_gpu() -> Iterator[_Answers]:
    """Run megatron's CUDA path on meta (cuda.py, world/ddp.py) and answer as a GPU would."""
    from inspector.world.ddp import cuda_current_device_on_meta

    answers = _Answers()
    with cuda_current_device_on_meta(), cuda_on_meta(), answers:
        yield answers


@contextlib.contextmanager
def _objects_gathered() -> Iterator[None]:
    """Gather objects over the simulated world as torch does on its fake backend, in one pickle.

    megatron's `_get_param_groups` all-gathers each rank's parameter-group keys over the whole
    world (optimizer/__init__.py). On the fake backend every rank's object is this rank's:
    FakeProcessGroup::allgather copies the input into every output
    (torch/csrc/distributed/c10d/FakeProcessGroup.hpp), and all_gather_object unpickles each
    output (distributed_c10d.py `_tensor_to_object`). Done here without a tensor per rank: the
    same objects, unpickled afresh for each rank; any other backend gets torch's own.
    """
    dist = torch.distributed
    real = dist.all_gather_object

    def gather(object_list: list[Any], obj: Any, group: Any = None) -> None:
        if dist.get_backend(group) != "fake":
            return real(object_list, obj, group)
        data = pickle.dumps(obj)
        for index in range(dist.get_world_size(group)):
            object_list[index] = pickle.loads(data)  # our own bytes, just made
        return None

    dist.all_gather_object = gather
    try:
        yield
    finally:
        dist.all_gather_object = real


@contextlib.contextmanager
def _te_optimizers() -> Iterator[None]:
    """Give megatron Transformer Engine's FusedAdam (world/te/optimizers.py) and kernels, and
    put `transformer_engine.pytorch.optimizers` in place, which megatron-core's OptimizerConfig
    imports to check FusedAdam's arguments (optimizer_config.py `__post_init__`)."""
    import sys
    import types

    from inspector.world.te import optimizers

    name = "transformer_engine.pytorch.optimizers"
    module = types.ModuleType(name, "Simulated Transformer Engine optimizers (inspector.world.te)")
    module.FusedAdam = optimizers.FusedAdam  # type: ignore[attr-defined]
    saved = sys.modules.get(name)
    sys.modules[name] = module
    try:
        with _kernels(True, optimizers.FusedAdam):
            yield
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


@contextlib.contextmanager
def _kernels(fused: bool, fused_adam: Any = None) -> Iterator[None]:
    """Give megatron the inner optimizer and multi-tensor kernels the job's set-up has (what
    optimizer/__init__.py, distrib_optimizer.py and clip_grads.py import at their top)."""
    from megatron.core import optimizer as package
    from megatron.core.optimizer import clip_grads, distrib_optimizer

    adam: Any = (fused_adam or FusedAdam) if fused else torch.optim.AdamW
    stand_ins: list[tuple[Any, str, Any]] = [
        (package, "Adam", adam),
        (package, "USING_PYTORCH_OPTIMIZER", not fused),
        (distrib_optimizer, "Adam", adam),
        (clip_grads, "l2_norm_impl", _fused_l2norm if fused else _local_l2_norm),
    ]
    if fused:
        stand_ins.append((clip_grads, "multi_tensor_scale_impl", _fused_scale))
        stand_ins.append((clip_grads, "multi_tensor_applier", _applier))
    # megatron-core 0.13 has no USING_PYTORCH_OPTIMIZER: it calls Adam(**kwargs) either way
    stand_ins = [(module, name, value) for module, name, value in stand_ins if hasattr(module, name)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in stand_ins]
    for module, name, value in stand_ins:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _local_l2_norm(chunk_size: int, noop: Any, tensor_lists: Any, per_tensor: bool) -> Any:
    """megatron.core.utils `local_multi_tensor_l2_norm`: a torch.norm per tensor, kept in a list
    until the result is made (its host round trip, torch.tensor(l2), cannot run on meta)."""
    norms = [[torch.norm(tensor) for tensor in tensors] for tensors in tensor_lists]
    result = torch.empty(1, dtype=torch.float, device="cuda")
    del norms
    return result, None


def _applier(op: Any, noop: Any, tensor_lists: Any, *args: Any) -> Any:
    """apex/TE `multi_tensor_applier`: call the kernel on the lists (chunking is on the GPU)."""
    return op(2048 * 32, noop, tensor_lists, *args)


def _fused_l2norm(chunk_size: int, noop: Any, tensor_lists: Any, per_tensor: bool) -> Any:
    """apex csrc/multi_tensor_l2norm_kernel.cu (TE's is the same): the norm, one fp32 element
    (per-tensor norms only when asked: megatron does not ask)."""
    return torch.empty(1, dtype=torch.float, device="cuda"), torch.empty(0, device="cuda")


def _fused_scale(chunk_size: int, noop: Any, tensor_lists: Any, scale: float) -> None:
    """apex csrc/multi_tensor_scale_kernel.cu: out = in * scale in one kernel, in place here."""
    for source, out in zip(*tensor_lists, strict=True):
        if source is out:
            out.mul_(scale)
        else:
            out.copy_(source)


class FusedAdam(torch.optim.Optimizer):
    """TE's / apex's FusedAdam as megatron drives it: lazily made moments, one in-place
    multi_tensor_adam per group (transformer_engine/pytorch/optimizers/fused_adam.py `step`,
    apex/optimizers/fused_adam.py; csrc multi_tensor_adam.cu writes p, m, v in place)."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, capturable: bool = False) -> None:  # fmt: skip
        # megatron-core 0.19 passes `capturable` (OptimizerConfig.optimizer_cuda_graph) always
        if capturable:
            raise RuntimeError("FusedAdam's capturable mode is not simulated")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Update every parameter in place."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                param.add_(state["exp_avg"])  # multi_tensor_adam: in place, no temporaries
