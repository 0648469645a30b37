"""The optimizer step's time: formulas/optimizer.py's passes, priced by cost.optimizer_seconds."""

from __future__ import annotations

import inspect

import pytest

from inspector.formulas.kernels import memory_curve
from inspector.formulas.optimizer import FOREACH_ADAMW, OptimizerStep, optimizer_ops, passes
from inspector.job.hardware import GPUS
from inspector.plan.cost import Network, optimizer_seconds
from inspector.report.memory import ADAM_MOMENTS, MASTER_COPY

BF16_FP32_GRADS = OptimizerStep(param_bytes=2, grad_bytes=4, fused=False)


@pytest.mark.parametrize(("step", "per_element"), [
    # grad norm 4, clip through a temporary 16, foreach AdamW 80, fp32 -> bf16 copy 6
    (BF16_FP32_GRADS, 4 + 16 + 80 + 6),
    # norm 4, clip in place 8, one FusedAdam kernel (read p g m v, write p m v) 28, copy 6
    (OptimizerStep(2, 4, True), 4 + 8 + 28 + 6),
    # a bf16 grad buffer: main_grad.float() reads 2 and writes 4
    (OptimizerStep(2, 2, True), 6 + 4 + 8 + 28 + 6),
    # fp16: the grad scaler's unscale and inf check, in place
    (OptimizerStep(2, 4, True, loss_scaling=True), 8 + 4 + 8 + 28 + 6),
    # fp32 parameters: no master copy, nothing to copy back
    (OptimizerStep(4, 4, True), 4 + 8 + 28),
])
def test_passes_move_the_bytes_counted_by_hand(step: OptimizerStep, per_element: int) -> None:
    assert sum(moved for _, moved in passes(step)) == per_element


def test_foreach_adamw_is_eight_passes_of_torchs_multi_tensor_adam() -> None:
    from torch.optim import adam

    source = inspect.getsource(adam._multi_tensor_adam)
    assert len(FOREACH_ADAMW) == 8 and sum(moved for _, moved in FOREACH_ADAMW) == 20 * 4
    for name, _ in FOREACH_ADAMW:
        call = name.split()[1]  # e.g. _foreach_lerp_
        assert f"torch.{call}(" in source, call


def test_state_per_element_is_what_memory_counts() -> None:
    assert OptimizerStep(2, 4, True).state_per_element == MASTER_COPY + ADAM_MOMENTS
    assert OptimizerStep(4, 4, True).state_per_element == ADAM_MOMENTS


def test_optimizer_seconds_by_hand_for_the_single_gpu_1_8b_job() -> None:
    # bench/gpu_time.py's h4096 L8 jobs: 1,825,480,704 bf16 parameters, fp32 grad buffer, no
    # distributed optimizer: every pass moves over a gigabyte, where the copy curve is clamped.
    n = 1_825_480_704
    weights, grads, optimizer = 2 * n, 4 * n, 12 * n
    net = Network(GPUS["h200"], 8)
    seconds = optimizer_seconds(net, (grads, weights), weights + grads + optimizer, BF16_FP32_GRADS)
    top = memory_curve("copy")[1][-1]
    assert seconds == pytest.approx(106 * n / top, rel=1e-9)
    assert 0.040 < seconds < 0.055  # the GPU took 55 ms (shared/gpu/gpu-time-h200.json)


def test_the_distributed_optimizer_steps_only_the_ranks_shard() -> None:
    n, dp = 1 << 30, 8
    net = Network(GPUS["h100"], 8)
    fused = OptimizerStep(2, 4, True)
    whole = optimizer_seconds(net, (4 * n, 2 * n), 18 * n, fused)
    shard = optimizer_seconds(net, (4 * n, 2 * n), 6 * n + 12 * n // dp, fused)
    assert sum(op.bytes for op in optimizer_ops(n // dp, fused)) == 46 * n // dp
    # the same passes over an eighth of the elements, at the rate of their (smaller) sizes
    assert whole / dp < shard < whole / dp * 1.5


def test_a_slower_gpu_takes_longer_by_its_hbm() -> None:
    n = 1 << 28
    h100, h200 = (optimizer_seconds(Network(GPUS[g], 8), (4 * n, 2 * n), 18 * n, BF16_FP32_GRADS)
                  for g in ("h100", "h200"))
    assert h100 / h200 == pytest.approx(GPUS["h200"].hbm / GPUS["h100"].hbm)
