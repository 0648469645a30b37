"""--use-precision-aware-optimizer: its dtypes' bytes per parameter, its checks, the engine's step.

Hand arithmetic (megatron-core 0.16.1 optimizer_config.py, optimizer/__init__.py,
distrib_optimizer.py; Transformer Engine 2.11 optimizers/fused_adam.py): each element a rank's
distributed optimizer updates holds exp_avg and exp_avg_sq in their dtypes (fp32 4 bytes, bf16 and
fp16 2, fp8 2: the Float8Tensor's data and transpose) and a master weight: megatron's fp32 one
without the flag (and with an fp8 recipe other than delayed and fp32 main params), else
FusedAdam's: the 16-bit remainder of a bf16 weight (store_param_remainders) with fp32 main params,
2 bytes in fp16.
"""

from __future__ import annotations

import json

import pytest

from inspector.inputs.versions import megatron_core_version
from tests.test_versions import BF16_MOMENTS_UNSCALED, GRAD_NORM_MADE_FIRST

SMALL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--vocab-size 1000 --micro-batch-size 1 --bf16 --dp 2 "
         "--use-distributed-optimizer").split()  # fmt: skip
AWARE = ("--use-precision-aware-optimizer",)


def _report(cli, *extra: str) -> dict:
    result = cli("memory", *SMALL, *extra, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)


def _stage(cli, *extra: str) -> dict:
    return _report(cli, *extra)["stages"][0]


def test_the_report_says_what_the_optimizer_keeps(cli):
    flags = ("--exp-avg-dtype", "bf16", "--main-grads-dtype", "bf16")
    training = _report(cli, *AWARE, *flags)["training"]
    assert training["use_precision_aware_optimizer"] is True
    assert (training["exp_avg_dtype"], training["exp_avg_sq_dtype"]) == ("bf16", "fp32")
    assert training["main_grads_dtype"] == "bf16" and training["main_params_dtype"] == "fp32"
    assert "use_precision_aware_optimizer" not in _report(cli)["training"]
    text = cli("memory", *SMALL, *AWARE, *flags).out
    assert ("distributed optimizer with the precision-aware optimizer (Transformer Engine's "
            "FusedAdam: exp_avg bf16, exp_avg_sq fp32, fp32 master weights kept as 16-bit "
            "remainders of the bf16 weights, bf16 main gradients)") in text  # fmt: skip


def _updated(cli) -> int:
    """Return the elements rank 0 updates: Megatron-LM's default Adam holds 12 bytes of each."""
    optimizer = _stage(cli)["optimizer"]
    assert optimizer % 12 == 0
    return optimizer // 12


# (exp_avg, exp_avg_sq, main params) -> bytes per updated element, by hand
BY_HAND = {
    ("fp32", "fp32", "fp32"): 4 + 4 + 2,  # the master as a 16-bit remainder
    ("bf16", "bf16", "fp32"): 2 + 2 + 2,
    ("fp16", "bf16", "fp32"): 2 + 2 + 2,
    ("fp8", "fp8", "fp32"): 2 + 2 + 2,  # fp8: data and its transpose
    ("bf16", "fp32", "fp16"): 2 + 4 + 2,
    ("fp32", "fp32", "fp16"): 4 + 4 + 2,
}


@pytest.mark.slow
@pytest.mark.parametrize(("m", "v", "master"), list(BY_HAND))
def test_optimizer_bytes_per_parameter(cli, m, v, master):
    flags = ("--exp-avg-dtype", m, "--exp-avg-sq-dtype", v, "--main-params-dtype", master)
    stage = _stage(cli, *AWARE, *flags)
    assert stage["optimizer"] == _updated(cli) * BY_HAND[(m, v, master)]


def test_every_dtype_combination_by_hand():
    """The job's bytes per element for all 32 combinations, bf16 and fp16 weights."""
    from inspector.job.optimizer_precision import CHOICES, OptimizerPrecision

    size = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
    for m in CHOICES["exp_avg_dtype"]:
        for v in CHOICES["exp_avg_sq_dtype"]:
            for master in CHOICES["main_params_dtype"]:
                precision = OptimizerPrecision(True, "fp32", master, m, v)
                bf16 = precision.for_model(True, None, "delayed")
                fp16 = precision.for_model(False, None, "delayed")
                assert bf16.per_element(2) == size[m] + size[v] + 2
                # fp16 weights: no remainders (TE keeps them for bf16 weights only)
                assert fp16.per_element(2) == size[m] + size[v] + size[master]
                # an fp32 parameter still gets FusedAdam's master copy (initialize_state)
                assert bf16.per_element(4) == size[m] + size[v] + size[master]


def test_bf16_main_grads_halve_the_gradients(cli):
    """--main-grads-dtype bf16 leaves Megatron-LM's --accumulate-allreduce-grads-in-fp32 off."""
    fp32 = _stage(cli, *AWARE)
    bf16 = _stage(cli, *AWARE, "--main-grads-dtype", "bf16")
    assert fp32["gradients"] == 2 * bf16["gradients"] == 2 * fp32["weights"]  # bf16 weights


def test_a_non_delayed_fp8_recipe_keeps_megatrons_fp32_master(cli):
    """use_precision_aware_optimizer_no_fp8_or_ds_fp8 is False for tensorwise scaling with fp32
    main params: megatron keeps its fp32 master, FusedAdam only the moments (12 -> 8 bytes)."""
    fp8 = ("--transformer-impl", "transformer_engine", "--fp8-format", "hybrid")
    default = _stage(cli, *fp8, "--fp8-recipe", "tensorwise")
    moments = ("--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16")
    tensorwise = _stage(cli, *fp8, "--fp8-recipe", "tensorwise", *AWARE, *moments)
    delayed = _stage(cli, *fp8, "--fp8-recipe", "delayed", *AWARE, *moments)
    assert default["optimizer"] % 12 == 0
    updated = default["optimizer"] // 12
    assert tensorwise["optimizer"] == updated * (4 + 2 + 2)
    assert delayed["optimizer"] == updated * (2 + 2 + 2)


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        tensor_model_parallel_size=2, data_parallel_size=2, micro_batch_size=2,
        global_batch_size=8, bf16=True, use_distributed_optimizer=True,
        use_precision_aware_optimizer=True, transformer_impl="local", normalization="RMSNorm",
    )  # fmt: skip
    return make_job({**args, **flags})


def _shards(job):
    """Return rank 0's updated elements and its parameter tensors with a shard (distopt)."""
    from inspector.world.build import View, build

    built = build(job, View((0,)), expert_ranks=(0,))
    buffers = [b for chunk in built.chunks for b in chunk.buffers()]
    tensors = sum(1 for chunk in built.chunks for _ in chunk.module.parameters())
    return sum(b.owned_numel[0] for b in buffers), tensors


@pytest.mark.parametrize(
    ("flags", "per_element", "reduced"),
    [
        (dict(), 4 + 4 + 2, 0),  # fp32 moments, the master as int16 remainders: no scale
        (dict(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"), 2 + 2 + 2, 2),
        (dict(exp_avg_dtype="fp8", main_params_dtype="fp16"), 2 + 4 + 2, 2),
        # fp16 weights: no remainders, FusedAdam's fp32 master
        (dict(bf16=False, fp16=True, accumulate_allreduce_grads_in_fp32=True), 4 + 4 + 4, 0),
        # fp32 weights: FusedAdam still makes a master copy of each (initialize_state)
        (dict(bf16=False), 4 + 4 + 4, 0),
    ],
)
def test_the_first_step_makes_fusedadams_state(flags, per_element, reduced):
    """The engine's first step makes all of FusedAdam's state (moments and master): the bytes
    memory/measure.py counts, plus at most the allocator's rounding and small tensors per
    parameter tensor (a scale per reduced state; fp8: scale, amax, scale_inv)."""
    from inspector.memory.engine.optimizer import stage_step

    job = _job(**flags)
    updated, tensors = _shards(job)
    state = stage_step(job, 0).state
    assert 0 <= state - per_element * updated <= (3 + 4 * reduced) * 512 * tensors


def _steady_peak(job) -> tuple[int, int, int, str]:
    """Return the steady step's peak bytes and where, rank 0's updated elements and tensors."""
    from inspector.memory.engine.optimizer import stage_step

    updated, tensors = _shards(job)
    run = stage_step(job, 0)
    assert run.events[-1].allocated == 0
    peak = max(run.events, key=lambda e: e.allocated)
    return peak.allocated, updated, tensors, peak.where


# fused_adam.py `step`'s fp32 temporaries per updated element, re-derived from each release's
# source: (TE release, moments' and master's dtypes) -> bytes. 2.11: every state not in fp32
# gets one (`get_unscaled_state`: `.float()`), kept in `unscaled_lists` until the group's
# kernels ran. 2.14 (v2.14 219 `fuse_unscale`, 344-348, 650-653): bf16 moments, both of them,
# go to the kernel as they are (adam.cu `MOMENT_T`); an fp16 master or fp16 moment still
# gets its temporary, and one bf16 moment beside an fp16 one is not fused.
TEMPORARIES = {
    ("2.11.0", "bf16", "bf16", "fp32"): 4 + 4,
    ("2.14.0", "bf16", "bf16", "fp32"): 0,
    ("2.17.1", "bf16", "bf16", "fp32"): 0,
    ("2.11.0", "bf16", "bf16", "fp16"): 4 + 4 + 4,
    ("2.14.0", "bf16", "bf16", "fp16"): 4,  # the fp16 master's
    ("2.14.0", "fp16", "bf16", "fp32"): 4 + 4,
}


@pytest.mark.parametrize(("release", "m", "v", "master"), list(TEMPORARIES))
def test_the_steps_temporaries_follow_the_te_release(monkeypatch, release, m, v, master):
    """The steady step's peak is the largest group's temporaries (the weight-decay group: at
    least 90% of the elements), or, with none, the grad norm's small tensors."""
    import inspector.world.te

    monkeypatch.setattr(inspector.world.te, "VERSION", release)
    job = _job(exp_avg_dtype=m, exp_avg_sq_dtype=v, main_params_dtype=master)
    allocated, updated, tensors, where = _steady_peak(job)
    each = TEMPORARIES[(release, m, v, master)]
    if each:
        assert where.startswith("optimizer step: FusedAdam")
        assert 0.9 * each * updated <= allocated <= each * updated + 3 * 512 * tensors + 1024
    else:  # the grad norm's small tensors; 0.19 makes its total first (GRAD_NORM_MADE_FIRST)
        assert allocated <= (3 + GRAD_NORM_MADE_FIRST) * 512


def test_bf16_moments_are_unscaled_into_fp32_before_te_2_14():
    """With the TE release this megatron-core declares: each bf16 moment of the group is copied
    into an fp32 temporary (8 bytes per updated element of the largest group) before TE 2.14,
    none from 2.14 (BF16_MOMENTS_UNSCALED); without the flag nothing is allocated either way."""
    from inspector.memory.engine.optimizer import stage_step

    job = _job(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    allocated, updated, tensors, where = _steady_peak(job)
    small = (3 + GRAD_NORM_MADE_FIRST) * 512
    if BF16_MOMENTS_UNSCALED:
        assert where.startswith("optimizer step: FusedAdam")
        assert 0.9 * 8 * updated <= allocated <= 8 * updated + 2 * 512 * tensors + 1024
    else:
        assert allocated <= small
    assert max(e.allocated for e in stage_step(_job(), 0).events) <= small


def _priced(job) -> dict[str, int]:
    """Return the passes plan prices for the job's optimizer step (bytes per updated element)."""
    from inspector.formulas.optimizer import passes
    from inspector.plan.price import job_dims
    from inspector.plan.timing import _step_setup

    return dict(passes(_step_setup(job, job_dims(job))))


@pytest.mark.parametrize(("m", "v"), [("bf16", "bf16"), ("fp32", "fp32"), ("fp16", "bf16")])
def test_the_priced_step_follows_the_te_release(monkeypatch, m, v):
    """plan prices FusedAdam's step as the declared TE release runs it: from 2.13 (PR #2632, in
    the v2.13 and v2.14 tags, not v2.12) both moments in bf16 are neither unscaled into fp32
    (`.float()`: read 2, write 4) nor written back (`.bfloat16()` and `copy_`: 4 + 2 + 2 + 2),
    and the kernel reads and writes them in bf16 (adam.cu `MOMENT_T`); other dtypes as 2.11."""
    import inspector.world.te
    from inspector.job.hardware import GPUS
    from inspector.plan.kernel_seconds import optimizer_step_seconds
    from inspector.plan.price import job_dims
    from inspector.plan.timing import _step_setup

    def priced(release: str) -> dict[str, int]:
        monkeypatch.setattr(inspector.world.te, "VERSION", release)
        return _priced(_job(exp_avg_dtype=m, exp_avg_sq_dtype=v))

    old, new = priced("2.11.0"), priced("2.14.0")
    assert priced("2.12.0") == old and priced("2.13.0") == priced("2.17.1") == new
    if (m, v) != ("bf16", "bf16"):
        assert new == old
        return
    kernel = "FusedAdam multi_tensor_adam"
    assert {name: size for name, size in old.items() if name not in new} == {
        "FusedAdam unscale exp_avg": 2 + 4, "FusedAdam unscale exp_avg_sq": 2 + 4,
        "FusedAdam rescale exp_avg": 4 + 2 + 2 + 2, "FusedAdam rescale exp_avg_sq": 4 + 2 + 2 + 2,
    }  # fmt: skip
    assert old[kernel] - new[kernel] == 2 * 2 * (4 - 2)  # m and v read and written in bf16
    assert {name: size for name, size in new.items() if name != kernel} == {
        name: size for name, size in old.items() if name in new and name != kernel}
    job = _job(exp_avg_dtype=m, exp_avg_sq_dtype=v)
    seconds = {}
    for release in ("2.11.0", "2.14.0"):
        monkeypatch.setattr(inspector.world.te, "VERSION", release)
        seconds[release] = optimizer_step_seconds(10**9, _step_setup(job, job_dims(job)), GPUS["h100"])
    assert seconds["2.14.0"] < 0.8 * seconds["2.11.0"]


def test_the_priced_step_of_the_installed_megatron_core():
    """With the TE release this megatron-core declares (BF16_MOMENTS_UNSCALED): the step plan
    prices unscales bf16 moments before TE 2.13 (megatron-core 0.13-0.16), not from 0.17."""
    got = _priced(_job(exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
    assert ("FusedAdam unscale exp_avg" in got) == ("FusedAdam rescale exp_avg_sq" in got)
    assert ("FusedAdam unscale exp_avg" in got) == BF16_MOMENTS_UNSCALED


def test_no_main_grad_copy_when_fusedadam_keeps_the_master():
    """distrib_optimizer.py `_copy_model_grads_to_main_grads`: the grad buffer's shard becomes
    `decoupled_grad` (no `main_grad.float()`), even with bf16 main grads."""
    from inspector.memory.engine.optimizer import stage_step

    run = stage_step(_job(main_grads_dtype="bf16"), 0)
    assert not any("main_grad.float()" in e.where and e.allocated > 3 * 512 for e in run.events)


ERRORS = {
    # OptimizerConfig asserts fp32 without the flag
    "--exp-avg-dtype bf16": "Error: --exp-avg-dtype bf16 needs --use-precision-aware-optimizer "
    "(megatron-core OptimizerConfig: \"exp_avg_dtype can only be fp32 when not using "
    "precision-aware optimizer\")",
    "--main-grads-dtype bf16": "Error: --main-grads-dtype bf16 needs --use-precision-aware-optimizer",
    # OptimizerConfig: only with the distributed optimizer
    "--use-precision-aware-optimizer --no-use-distributed-optimizer": "Error: "
    "--use-precision-aware-optimizer needs --use-distributed-optimizer (megatron-core "
    "OptimizerConfig: \"--use-precision-aware-optimizer only supported with distributed "
    "optimizer\")",
    # validate_args: bf16 main grads contradict fp32 accumulation
    "--use-precision-aware-optimizer --main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32":
    "Error: --main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32",
    # clip_grads.py asserts the decoupled gradients are fp32 or bf16: fp16's grad buffer is not
    "--use-precision-aware-optimizer --fp16": "Error: --use-precision-aware-optimizer with --fp16 "
    "needs --accumulate-allreduce-grads-in-fp32",
    # Megatron-LM's argparse choices
    "--use-precision-aware-optimizer --main-params-dtype bf16": "Error: --main-params-dtype",
}

if megatron_core_version() < (0, 19):  # FusedAdam's master copy beside Megatron-FSDP's: refused
    ERRORS["--use-precision-aware-optimizer --use-megatron-fsdp --ckpt-format fsdp_dtensor"] = (
        "Error: --use-precision-aware-optimizer with --use-megatron-fsdp is not modelled before "
        "megatron-core 0.19")


@pytest.mark.parametrize("flags", list(ERRORS))
def test_megatrons_rules_are_errors(cli, flags):
    base = [flag for flag in SMALL if not ("--fp16" in flags and flag == "--bf16")]
    result = cli("memory", *base, *flags.split())
    assert result.code == 2 and result.err.startswith(ERRORS[flags]), result.err
    assert "Traceback" not in result.err


@pytest.mark.slow
def test_plan_keeps_the_distributed_optimizer_and_prints_the_flags(cli):
    """plan: the flag pins the distributed optimizer (a plan without it would be refused by
    megatron) and the plan's flags carry the dtypes."""
    result = cli(
        "plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "1000", "--bf16", "--gpus", "4",
        "--global-batch-size", "8", "--gpu", "h100", "--use-precision-aware-optimizer",
        "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--main-grads-dtype", "bf16",
        "--format", "json",
    )  # fmt: skip
    assert result.code == 0, result.err
    plans = json.loads(result.out)["plans"]
    assert plans
    for plan in plans:
        flags = " ".join(plan["flags"])
        assert "--use-distributed-optimizer" in flags
        assert ("--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 "
                "--exp-avg-sq-dtype bf16") in flags  # fmt: skip


def test_plans_composed_state_equals_memory():
    """The planner composes a stage's state from pieces (memory/compose/stage_state.py) with the same bytes per
    element as `memory`."""
    from tests.test_plan import _assert_composed_equals_memory
    from tests.test_plan import _job as plan_job

    job = plan_job(
        num_layers=4, pp=2, dp=4, bf16=True, use_precision_aware_optimizer=True,
        exp_avg_dtype="bf16", exp_avg_sq_dtype="fp8", main_grads_dtype="bf16",
    )  # fmt: skip
    _assert_composed_equals_memory(job, "precision-aware")


def test_the_steps_passes_over_memory_by_hand():
    """formulas/optimizer.py prices TE's FusedAdam step: bf16 moments, the master as remainders,
    bf16 grads read as they are (no main_grad.float() copy, nothing copied back to the weight)."""
    from inspector.formulas.optimizer import OptimizerStep, passes
    from inspector.job.optimizer_precision import OptimizerPrecision

    each = OptimizerPrecision(True, "bf16", "fp32", "bf16", "bf16").for_model(True, None, "delayed")
    step = OptimizerStep(2, 2, True, False, each)
    assert step.state_per_element == 6
    got = dict(passes(step))
    assert got == {
        "grad norm": 2,
        "clip multi_tensor_scale": 4,
        "FusedAdam unscale exp_avg": 2 + 4,  # bf16 read, fp32 written
        "FusedAdam unscale exp_avg_sq": 2 + 4,
        # read g (2), p (2), m, v (fp32 temporaries), the remainder (2); write p, m, v, remainder
        "FusedAdam multi_tensor_adam": 2 + 2 * 2 + 4 * 4 + 2 * 2,
        "FusedAdam rescale exp_avg": 4 + 2 + 2 + 2,  # .bfloat16(), then copy_
        "FusedAdam rescale exp_avg_sq": 4 + 2 + 2 + 2,
    }


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
@pytest.mark.parametrize("master", ["fp32", "fp16"])
def test_megatrons_own_rule_for_who_keeps_the_master(recipe, master):
    """The installed megatron-core's OptimizerConfig (0.13.1 and 0.16.1 alike: both know the
    flag, the four dtypes and store_param_remainders, and Megatron-LM core_v0.13.1 parses the
    same flags with the same choices) decides `use_precision_aware_optimizer_no_fp8_or_ds_fp8`
    as job/optimizer_precision.py does."""
    import torch

    from inspector.job.optimizer_precision import OptimizerPrecision
    from inspector.memory.engine.optimizer import _te_optimizers
    from inspector.world.fastimport import import_megatron

    def names():
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig

    OptimizerConfig = import_megatron(names)  # noqa: N806 (megatron's class)

    dtype = {"fp32": torch.float32, "fp16": torch.float16}[master]
    with _te_optimizers():
        config = OptimizerConfig(
            bf16=True, use_distributed_optimizer=True, use_precision_aware_optimizer=True,
            main_params_dtype=dtype, fp8_recipe=recipe,
        )  # fmt: skip
    ours = OptimizerPrecision(True, main_params_dtype=master).te_master("hybrid", recipe)
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 == ours
    assert config.store_param_remainders  # Transformer Engine 2.11 (the stand-in's version)


# transformer_engine/pytorch/optimizers/fused_adam.py (TE 2.11) `FusedAdam.__init__`, in order
TE_FUSED_ADAM_ARGUMENTS = (
    "params", "lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode",
    "capturable", "master_weights", "master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
    "use_decoupled_grad", "store_param_remainders", "set_grad_none",
)


def test_the_stand_in_takes_tes_arguments_and_is_in_place_only_for_the_step():
    """The stand-in's constructor is TE's (megatron-core's OptimizerConfig inspects four of its
    names); `transformer_engine.pytorch.optimizers` exists only while the optimizer is made."""
    import inspect
    import sys

    from inspector.memory.engine.optimizer import _te_optimizers
    from inspector.world.te.optimizers import FusedAdam

    assert tuple(inspect.signature(FusedAdam).parameters) == TE_FUSED_ADAM_ARGUMENTS
    name = "transformer_engine.pytorch.optimizers"
    assert name not in sys.modules
    with _te_optimizers():
        assert sys.modules[name].FusedAdam is FusedAdam
    assert name not in sys.modules


def test_an_fp8_state_is_tes_float8tensor_with_its_transpose():
    """float8_tensor.py `Float8Quantizer.make_empty` (row-wise and column-wise usage by default):
    uint8 data and transpose of the parameter's elements, an fp32 scale_inv; the quantizer's
    fp32 scale and amax (fused_adam.py `_initialize_state`)."""
    import torch

    from inspector.world.te.optimizers import Fp8State

    state = Fp8State(torch.Size([6, 4]), torch.device("meta"))
    assert (state._data.dtype, tuple(state._data.shape)) == (torch.uint8, (6, 4))
    assert (state._transpose.dtype, tuple(state._transpose.shape)) == (torch.uint8, (4, 6))
    assert [t.numel() for t in (state._scale_inv, state.scale, state.amax)] == [1, 1, 1]
    assert state.float().dtype == torch.float32 and tuple(state.float().shape) == (6, 4)


@pytest.mark.parametrize(("recipe", "master"), [("delayed", 2), ("tensorwise", 4)])
def test_fp8_parameters_state_as_the_engine_makes_it(recipe, master):
    """--fp8-param-gather: the fp8 weights' buffer holds 1-byte elements, yet FusedAdam sees a
    Float8Tensor of dtype bf16 and keeps its master as a 16-bit remainder (delayed scaling);
    with tensorwise scaling megatron keeps its fp32 master (made with the optimizer, before the
    first step) and FusedAdam the bf16 moments alone."""
    from inspector.memory.engine.optimizer import stage_step
    from inspector.memory.measure import job_optimizer_bytes
    from inspector.world.build import View, build

    job = _job(
        num_layers=2, hidden_size=256, seq_length=64, transformer_impl="transformer_engine",
        normalization="LayerNorm", tensor_model_parallel_size=1, fp8_format="hybrid",
        fp8_recipe=recipe, fp8_param_gather=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16",
    )  # fmt: skip
    built = build(job, View((0,)), expert_ranks=(0,))
    buffers = [b for chunk in built.chunks for b in chunk.buffers()]
    fp8 = sum(b.owned_numel[0] for b in buffers if b.param_dtype.itemsize == 1)
    assert fp8 > 0
    each = job_optimizer_bytes(job)
    assert each.per_element(1) == master + 2 + 2
    updated = sum(b.owned_numel[0] for b in buffers)
    tensors = sum(1 for chunk in built.chunks for _ in chunk.module.parameters())
    made = (master if recipe == "delayed" else 0) + 2 + 2  # what the first step allocates
    state = stage_step(job, 0).state
    assert 0 <= state - made * updated <= 3 * 512 * tensors
