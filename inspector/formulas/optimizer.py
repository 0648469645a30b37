"""The optimizer step's passes over memory, as megatron-core 0.16.1 and torch 2.13 run them.

Megatron's mixed-precision optimizers (Float16OptimizerWithFloat16Params without the distributed
optimizer, DistributedOptimizer with it: megatron/core/optimizer/optimizer.py and
distrib_optimizer.py) run, per iteration, over the fp32 elements the rank updates (all of its
parameters, or its shard of the grad buffers with the distributed optimizer):
  1. `_copy_model_grads_to_main_grads`: `main_grad.float()` (a shard view of it with the distributed
     optimizer): no copy when the grad buffer is fp32 (Megatron-LM's default with bf16), a 16-bit
     read and fp32 write otherwise;
  2. fp16 only (DynamicGradScaler; bf16 has no grad scaler): `_unscale_main_grads_and_check_for_nan`,
     `torch._amp_foreach_non_finite_check_and_unscale_`, in place;
  3. `clip_grad_norm` (--clip-grad, 1.0 by default): `get_grad_norm_fp32` reads every main grad
     once (`multi_tensor_l2norm` of TE or apex; without them megatron.core.utils'
     `local_multi_tensor_l2_norm`, a torch.norm per tensor); `clip_grad_by_total_norm_fp32` scales
     them when the norm exceeds the limit (counted here: it did on every iteration measured in
     shared/gpu/gpu-time-h200.json, norms 7-18): TE/apex `multi_tensor_scale` in place, or
     `local_multi_tensor_scale`, `dst.copy_(src * scale)`: a temporary written and copied back;
     with --log-num-zeros-in-grad `count_zeros` (clip_grads.py `count_zeros_fp32`: `grad.numel() -
     torch.count_nonzero(grad)` per main grad) reads every main grad once more (`logged_passes`);
  4. the inner optimizer's step (megatron/core/optimizer/__init__.py picks it): Transformer Engine's
     FusedAdam, else apex's (a cluster's set-up; one `multi_tensor_adam` kernel reading the param,
     grad and both moments and writing param and moments), else torch.optim.AdamW with torch's
     default foreach implementation, `_multi_tensor_adam` (torch/optim/adam.py) for each parameter
     group: `_foreach_mul_(params, 1 - lr wd)` (decoupled weight decay), `_foreach_lerp_(exp_avgs,
     grads)`, `_foreach_mul_(exp_avg_sqs, beta2)`, `_foreach_addcmul_(exp_avg_sqs, grads, grads)`,
     `_foreach_sqrt(exp_avg_sqs)` into a new list, `_foreach_div_` and `_foreach_add_` on it, and
     `_foreach_addcdiv_(params, exp_avgs, it)`: eight passes, 20 fp32 tensor traversals (the step
     counters live on the CPU; the weight-decay pass is counted for every element though megatron's
     norms and biases sit in a group without weight decay, a fraction of a percent of a layer);
  5. `_copy_main_params_to_model_params`: fp32 main parameter to the 16-bit weight (a `copy_` per
     tensor; bf16 passes no overflow buffer, so never the multi-tensor path).
fp32 parameters (FP32Optimizer) have no master copy: steps 1 and 5 move nothing.
With --log-params-norm, Megatron-LM's training loop (megatron/training/training.py `train`: `if
args.log_params_norm: params_norm = calc_params_l2_norm(model)`, every iteration, inside the
interval its iteration time measures) reads each parameter the rank does not share with another
tensor-parallel rank once, in fp32 (training/utils.py `calc_params_l2_norm`: with bf16 the
optimizer's `main_param`, the rank's shard of them under the distributed optimizer, through one
`multi_tensor_l2norm`): one fp32 read over the elements the rank updates (`logged_passes`).

Which set-up runs: `fused` (the job's fused kernels: Transformer Engine, or apex) means TE's or
apex's FusedAdam and multi-tensor norm and scale; without them (the runs of shared/gpu/) torch's
foreach AdamW and megatron's local fallbacks. Each pass is a formulas/kernels.py memory-bound op
priced at the measured copy bandwidth for the bytes it moves (the table's "copy" class: the plain
streaming rate; its "add" rows imply more than the HBM peak). Kernel launches and the host work of
the per-tensor loops are not priced. The step's memory (its temporaries) is not a formula: the
engine runs it (memory/engine/optimizer.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from inspector.formulas.kernels import Memory
from inspector.job.optimizer_precision import FP32, OptimizerBytes

# torch's _multi_tensor_adam, decoupled weight decay, not capturable: fp32 bytes per element
FOREACH_ADAMW: tuple[tuple[str, int], ...] = (
    ("adamw _foreach_mul_ params (weight decay)", 2 * FP32),  # read, write param
    ("adamw _foreach_lerp_ exp_avgs", 3 * FP32),  # read m, g; write m
    ("adamw _foreach_mul_ exp_avg_sqs", 2 * FP32),  # read, write v
    ("adamw _foreach_addcmul_ exp_avg_sqs", 3 * FP32),  # read v, g (twice, one tensor); write v
    ("adamw _foreach_sqrt exp_avg_sqs", 2 * FP32),  # read v; write a new tensor
    ("adamw _foreach_div_ bias correction", 2 * FP32),
    ("adamw _foreach_add_ eps", 2 * FP32),
    ("adamw _foreach_addcdiv_ params", 4 * FP32),  # read p, m, denominator; write p
)
FUSED_ADAM = ("FusedAdam multi_tensor_adam", 7 * FP32)  # read p, g, m, v; write p, m, v
# fused_adam.py, a state held in a reduced dtype, bytes per element: `get_unscaled_state`
# (`.float()`: read it, write fp32; fp16 also `mul_` by its scale, fp8 reads its row-wise data)
UNSCALE = {"bf16": 2 + FP32, "fp16": 2 + FP32 + 2 * FP32, "fp8": 1 + FP32}
# `_apply_scale`: bf16 `copy_(unscaled.bfloat16())`; fp16 `aminmax`, `mul_`, `copy_`; fp8
# `aminmax`, then `copy_` quantizes into the data and its transpose
RESCALE = {"bf16": FP32 + 2 + 2 * 2, "fp16": FP32 + 2 * FP32 + FP32 + 2, "fp8": 2 * FP32 + 2}


@dataclass(frozen=True)
class OptimizerStep:
    """What a rank's optimizer step runs on: element sizes and the set-up."""

    param_bytes: int  # the model's weights: 2 in bf16/fp16, 4 in fp32
    grad_bytes: int  # an element of megatron's grad buffer (main_grad)
    fused: bool  # Transformer Engine's or apex's FusedAdam, else torch's foreach AdamW
    loss_scaling: bool = False  # fp16's dynamic grad scaler
    # the state's dtypes (--use-precision-aware-optimizer: job/optimizer_precision.py)
    optimizer: OptimizerBytes = OptimizerBytes()
    params_norm: bool = False  # --log-params-norm
    count_zeros: bool = False  # --log-num-zeros-in-grad
    # the job's Transformer Engine takes bf16 moments in FusedAdam's kernel (TE 2.13+: the
    # declared release's, world/environment.py `te_fuses_bf16_moments`, which plan/ hands in)
    te_fuses_bf16_moments: bool = False

    @property
    def state_per_element(self) -> int:
        """Return the optimizer-state bytes of an updated element: moments and master weight."""
        return self.optimizer.per_element(self.param_bytes)


def logged_passes(step: OptimizerStep, grad: int) -> list[tuple[str, int]]:
    """Return the logging flags' reads per updated element (module docstring): the main grads'
    zeros counted (`grad` bytes, what the grad norm reads) and the fp32 parameters' norm."""
    out = [("count_zeros (--log-num-zeros-in-grad)", grad)] if step.count_zeros else []
    return out + ([("params norm (--log-params-norm)", FP32)] if step.params_norm else [])


def passes(step: OptimizerStep) -> tuple[tuple[str, int], ...]:
    """Return the step's passes over memory: (name, bytes moved per updated element)."""
    if step.optimizer.precision.precision_aware:
        return _precision_aware(step)
    out: list[tuple[str, int]] = []
    sixteen_bit = step.param_bytes != FP32
    if sixteen_bit and step.grad_bytes != FP32:
        out.append(("main_grad.float() copy", step.grad_bytes + FP32))
    if step.loss_scaling:
        out.append(("unscale and inf check", 2 * FP32))
    out.append(("grad norm", FP32))
    if step.fused:
        out.append(("clip multi_tensor_scale", 2 * FP32))
        out.append(FUSED_ADAM)
    else:
        out.append(("clip src * scale", 2 * FP32))
        out.append(("clip dst.copy_", 2 * FP32))
        out.extend(FOREACH_ADAMW)
    if sixteen_bit:
        out.append(("main param to 16-bit weight copy_", FP32 + step.param_bytes))
    return tuple(out + logged_passes(step, FP32))


def optimizer_ops(updated: int, step: OptimizerStep) -> tuple[Memory, ...]:
    """Return the step's passes over `updated` elements as memory-bound kernels (kernels.py)."""
    return tuple(Memory(name, "copy", updated, moved) for name, moved in passes(step))


def _precision_aware(step: OptimizerStep) -> tuple[tuple[str, int], ...]:
    """Return the passes with --use-precision-aware-optimizer: Transformer Engine's FusedAdam
    (fused_adam.py `step`, TE 2.11, and 2.13+'s bf16 moments) over the state in its dtypes.

    Where FusedAdam keeps the master weights, megatron hands it the grad buffer's shard as
    `decoupled_grad` (distrib_optimizer.py `_copy_model_grads_to_main_grads`: no copy) and copies
    nothing back (`_copy_main_params_to_model_params` returns): the kernel writes the weight.
    Else megatron's fp32 master is FusedAdam's parameter, as without the flag. Each state not in
    fp32 is unscaled into an fp32 temporary (`get_unscaled_state`: `.float()`, and `mul_` by its
    scale for fp16), the kernel runs on the temporaries, and `_apply_scale` writes them back
    (bf16: `.bfloat16()` then `copy_`; fp16: `aminmax`, `mul_`, `copy_`; fp8: `aminmax`, `copy_`).
    From TE 2.13, with both moments bf16 (`fuse_unscale`, fused_adam.py v2.14 219): neither is
    unscaled nor written back (v2.14 650-653, 344-348, 871-874); the kernel reads and writes them
    in bf16 (common/multi_tensor/adam.cu `MOMENT_T`).
    """
    each, te = step.optimizer, step.optimizer.te_master
    precision = each.precision
    grad = step.grad_bytes if te else FP32
    out: list[tuple[str, int]] = []
    if not te and step.param_bytes != FP32 and step.grad_bytes != FP32:
        out.append(("main_grad.float() copy", step.grad_bytes + FP32))
    if step.loss_scaling:
        out.append(("unscale and inf check", 2 * grad))
    out += [("grad norm", grad), ("clip multi_tensor_scale", 2 * grad)]
    moments = (("exp_avg", precision.exp_avg_dtype), ("exp_avg_sq", precision.exp_avg_sq_dtype))
    in_kernel = step.te_fuses_bf16_moments and precision.exp_avg_dtype == precision.exp_avg_sq_dtype == "bf16"
    reduced = [(name, dtype) for name, dtype in (
        *(() if in_kernel else moments), ("master_param", precision.main_params_dtype if te else "fp32"),
    ) if dtype != "fp32"]  # fmt: skip
    master = each.master(step.param_bytes) if te else 0
    for name, dtype in reduced:
        out.append((f"FusedAdam unscale {name}", UNSCALE[dtype]))
    weight = step.param_bytes if te else FP32  # the weight, or megatron's fp32 master
    held = (master if precision.main_params_dtype == "fp32" else FP32) if te else 0
    moment = 2 if in_kernel else FP32  # bf16 moments as they are, else fp32 (or temporaries)
    # read g, p, m, v (and the master); write p, m, v (and the master)
    out.append(("FusedAdam multi_tensor_adam", grad + 2 * weight + 4 * moment + 2 * held))
    for name, dtype in reduced:
        out.append((f"FusedAdam rescale {name}", RESCALE[dtype]))
    if not te and step.param_bytes != FP32:
        out.append(("main param to 16-bit weight copy_", FP32 + step.param_bytes))
    return tuple(out + logged_passes(step, grad))
