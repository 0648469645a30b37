"""--log-params-norm and --log-num-zeros-in-grad: their reads of the rank's state, every iteration.

Megatron-LM's training loop (megatron/training/training.py `train`): `if args.log_params_norm:
params_norm = calc_params_l2_norm(model)` every iteration (training/utils.py: one
multi_tensor_l2norm over the fp32 `main_param`s, the rank's shard under the distributed
optimizer); megatron-core's optimizer step: `num_zeros_in_grad = self.count_zeros() if
self.config.log_num_zeros_in_grad` (optimizer/clip_grads.py `count_zeros_fp32`:
`grad.numel() - torch.count_nonzero(grad)` per main grad).
"""

from __future__ import annotations

import json

import pytest

from inspector.formulas.optimizer import OptimizerStep, passes
from inspector.job.hardware import GPUS
from inspector.job.job import make_training
from inspector.plan.kernel_seconds import optimizer_step_seconds

BF16_FUSED = OptimizerStep(2, 4, True)


def test_each_flag_adds_one_fp32_read_of_the_updated_elements() -> None:
    plain = dict(passes(BF16_FUSED))
    logged = dict(passes(OptimizerStep(2, 4, True, params_norm=True, count_zeros=True)))
    assert set(logged) - set(plain) == {"params norm (--log-params-norm)",
                                        "count_zeros (--log-num-zeros-in-grad)"}  # fmt: skip
    assert logged["params norm (--log-params-norm)"] == 4  # the fp32 main_param
    assert logged["count_zeros (--log-num-zeros-in-grad)"] == 4 == plain["grad norm"]
    # 7B tp1 pp4 dp2 under the distributed optimizer: 1.75e9 / 2 elements a rank, 8 bytes each
    # more at the H100's measured copy rate: a few milliseconds, never free
    h100 = GPUS["h100"]
    extra = optimizer_step_seconds(875_000_000, OptimizerStep(2, 4, True, params_norm=True,
                                                              count_zeros=True), h100)  # fmt: skip
    extra -= optimizer_step_seconds(875_000_000, BF16_FUSED, h100)
    assert 1e-3 < extra < 5e-3


def test_the_flags_are_read_from_megatron_lms_arguments() -> None:
    training = make_training({"log_params_norm": True, "log_num_zeros_in_grad": True})
    assert (training.log_params_norm, training.log_num_zeros_in_grad) == (True, True)
    assert not make_training({}).log_params_norm


PLAN = ("plan --model llama2-7b --num-layers 4 --gpus 8 --global-batch-size 8 --seq-length 1024 "
        "--tp 1 --pp 1 --micro-batch-size 1 --bf16 --use-distributed-optimizer "
        "--gpu h100 --format json").split()  # fmt: skip


@pytest.mark.slow
def test_plan_prices_the_logging_passes_beside_the_optimizer_step(cli) -> None:
    def optimizer(*more: str) -> float:
        result = cli(*PLAN, *more)
        assert result.code == 0, result.err
        return json.loads(result.out)["plans"][0]["time_shares"]["optimizer"]

    plain = optimizer()
    logged = optimizer("--log-params-norm", "--log-num-zeros-in-grad")
    # every pass is a copy-class read or write of the same elements, 8 more bytes of some 46 (the
    # copy rate's curve over sizes moves it a little): the share grows by about a sixth
    moved = sum(each for _, each in passes(BF16_FUSED))
    assert (moved + 8) / moved == pytest.approx(1.174, abs=1e-3)
    assert 1.1 < logged / plain < 1.3
