"""The optimizer step on meta: megatron's optimizer over the stage in DDP, its temporaries counted.

The hand counts follow the sources the step runs (megatron-core 0.16 optimizer/optimizer.py,
torch/optim/adam.py `_multi_tensor_adam`): every temporary is one tensor per parameter tensor,
and the caching allocator rounds each to 512 bytes (allocator.py).
"""

from __future__ import annotations

import pytest


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=1, tensor_model_parallel_size=2, data_parallel_size=2,
        micro_batch_size=2, global_batch_size=8, bf16=True, use_distributed_optimizer=False,
        transformer_impl="local", normalization="RMSNorm",
    )  # fmt: skip
    return make_job({**args, **flags})


def _step(job, fused=False):
    """Return the step's run and the stage's parameters (stage 0, every layer)."""
    from inspector.memory.engine.microbatch import runtime_config
    from inspector.memory.engine.optimizer import run_step
    from inspector.memory.engine.stage import _ddp as ddp_wrapped  # the engine's DDP wrap
    from inspector.world.stage import stage_world

    runtime = runtime_config(job)
    with stage_world(job.model, job.layout, 0, checkpoint=False, runtime=runtime) as chunks:
        ddps = [ddp_wrapped(job, chunk.module, 0, i) for i, chunk in enumerate(chunks)]
        params = [(n, tuple(p.shape)) for c in chunks for n, p in c.module.named_parameters()]
        return run_step(job, ddps, fused), params


def _fp32(shapes):
    """Return the caching allocator's bytes for one fp32 tensor of each shape."""
    from math import prod

    from inspector.memory.engine.allocator import rounded

    return sum(rounded(4 * prod(shape)) for shape in shapes)


def _groups(params):
    """Megatron's param groups (optimizer/__init__.py _get_param_groups): no weight decay for
    biases and 1-d parameters (norms); torch's foreach step runs group by group."""
    decay = [shape for name, shape in params if not name.endswith(".bias") and len(shape) > 1]
    rest = [shape for name, shape in params if name.endswith(".bias") or len(shape) == 1]
    return decay, rest


def _peak(run):
    return max(run.events, key=lambda e: e.allocated)


def test_foreach_adamw_peaks_at_sqrt_of_the_largest_group():
    """fp32 grad buffer (bf16's default): main_grad.float() is the buffer itself; the clip's
    `src * scale` temporaries live one at a time; `_foreach_sqrt(exp_avg_sqs)` makes one fp32
    tensor per parameter of the group, alive until its `_foreach_addcdiv_`."""
    run, params = _step(_job())
    decay, rest = _groups(params)
    top = _peak(run)
    assert top.where == "optimizer step: adamw _foreach_sqrt"
    assert top.allocated == max(_fp32(decay), _fp32(rest))
    assert run.events[-1].allocated == 0  # the steady step keeps nothing


def test_bf16_grads_add_the_fp32_main_grads_which_live_through_the_step():
    """--grad-reduce-in-bf16: `main_param.grad = main_grad.float()` (Float16OptimizerWithFloat16Params
    `_copy_model_grads_to_main_grads`), a new fp32 tensor per parameter, kept until zero_grad."""
    run, params = _step(_job(grad_reduce_in_bf16=True))
    decay, rest = _groups(params)
    grads = _fp32(decay) + _fp32(rest)
    top = _peak(run)
    assert top.where == "optimizer step: adamw _foreach_sqrt"
    assert top.allocated == grads + max(_fp32(decay), _fp32(rest))
    assert run.events[-1].allocated == grads


def test_fused_adam_works_in_place():
    """TE's/apex's FusedAdam, multi_tensor_l2norm and multi_tensor_scale: one fp32 norm element
    and the int overflow flag (clip_grads.py `dummy_overflow_buf`), nothing per parameter."""
    from tests.test_versions import GRAD_NORM_MADE_FIRST

    run, _ = _step(_job(), fused=True)
    # 0.19's get_grad_norm_fp32 makes its 1-element result before the norm kernel runs
    assert _peak(run).allocated <= (4 if GRAD_NORM_MADE_FIRST else 3) * 512


def test_first_step_makes_the_moments_report_memory_counts():
    """Adam's exp_avg and exp_avg_sq are made lazily on the first step: the state memory/measure.py
    counts (job/optimizer_precision.py ADAM_MOMENTS per updated element), up to the allocator's rounding per tensor."""
    from inspector.job.optimizer_precision import ADAM_MOMENTS
    from inspector.world.build import View, build

    for distributed in (False, True):
        job = _job(use_distributed_optimizer=distributed)
        run, params = _step(job)
        built = build(job, View((0,)), expert_ranks=(0,))
        buffers = [b for chunk in built.chunks for b in chunk.buffers()]
        updated = sum(b.owned_numel[0] if distributed else b.numel for b in buffers)
        assert 0 <= run.state - ADAM_MOMENTS * updated <= 2 * 512 * len(params)


@pytest.mark.parametrize("fused", [False, True])
def test_a_job_whose_peak_is_the_optimizer_step_names_it(fused):
    """Full recomputation, micro-batch 1, a short sequence: few activations, many parameters.
    With LayerNorm the local layers are apex's (job.model.use_apex): FusedAdam, in place."""
    from inspector.memory.engine.run import run_memory

    job = _job(
        hidden_size=256, seq_length=8, micro_batch_size=1, global_batch_size=4,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        normalization="LayerNorm" if fused else "RMSNorm",
    )  # fmt: skip
    assert job.dims().fused_kernels == fused
    peak = run_memory(job, 0).peak
    if fused:
        assert not peak.moment.startswith("optimizer step")
    else:
        assert peak.moment == "optimizer step: adamw _foreach_sqrt"
        assert (peak.held, peak.micro_batches) == (0, 0)


GPU = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "gpu"
BENCH = __import__("pathlib").Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.skipif(not (GPU / "memory-h200.json").exists(), reason="shared/gpu not present")
def test_probed_gpu_ranks_moments_are_the_state_report_memory_counts():
    """The static memory after an iteration (measured on the H200 after step 3) holds the moments
    the first step made: they are ADAM_MOMENTS per updated element (job/optimizer_precision.py), so the
    static ratios of bench/gpu_memory.py still hold with the step run."""
    import sys

    from inspector.job.optimizer_precision import ADAM_MOMENTS
    from inspector.memory.engine.optimizer import stage_step

    sys.path.insert(0, str(BENCH))
    from gpu_memory import probed_ranks

    probed = list(probed_ranks(GPU / "memory-h200.json", GPU / "jobs"))
    assert len(probed) >= 5  # every H200 run finished
    for run, job, stage, built in probed:
        buffers = [b for chunk in built.chunks for b in chunk.buffers()]
        distributed = job.training.use_distributed_optimizer
        updated = sum(b.owned_numel[0] if distributed else b.numel for b in buffers)
        tensors = sum(1 for chunk in built.chunks for _ in chunk.module.parameters())
        state = stage_step(job, stage).state
        assert 0 <= state - ADAM_MOMENTS * updated <= 2 * 512 * tensors, run


def test_a_failure_in_the_step_says_so(monkeypatch):
    import torch

    from inspector.errors import ConfigError
    from inspector.memory.engine.optimizer import stage_step

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this op")

    monkeypatch.setattr(torch, "_foreach_sqrt", broken)  # torch's _multi_tensor_adam calls it
    with pytest.raises(ConfigError) as error:
        stage_step(_job(), 0)
    message = str(error.value)
    assert "refused to build" not in message
    assert message.startswith("megatron-core failed running the optimizer step of stage 0")
    assert "no kernel for this op" in message


def test_stages_with_equal_step_keys_run_equal_steps(monkeypatch):
    """run_job runs the optimizer step once per `step_key`: the middle stages of a pipeline
    share one (same pieces, layer kinds, no bucketing); each run alone gives the same events."""
    from inspector.memory.engine import run as memory
    from inspector.memory.engine.optimizer import stage_step
    from inspector.world.build import View, build

    job = _job(num_layers=8, pipeline_model_parallel_size=4, use_distributed_optimizer=True)
    built = build(job, View(tuple(range(4))), expert_ranks=(0,))
    keys = [memory.step_key(job, s.stage, memory.chunk_shapes(s)) for s in built.stages]
    assert keys[1] == keys[2] and len(set(keys)) == 3  # stage 0 buckets; stage 3 has the output
    assert stage_step(job, 1) == stage_step(job, 2)  # independent runs, every event equal
    ran = []
    monkeypatch.setattr(memory, "stage_step", lambda job, stage: ran.append(stage) or stage_step(job, stage))
    runs = memory.run_job(job, built.stages).runs
    assert ran == [0, 1, 3]
    assert [runs[s].optimizer_state for s in range(4)] == [
        stage_step(job, s).state for s in range(4)
    ]


def test_eager_step_allocates_as_torchs_own(monkeypatch):
    """torch's AdamW step with its own wrappers (which import dynamo) and as the engine runs it
    (`_eager_step`): the same allocations and frees, event for event."""
    from inspector.memory.engine import optimizer

    job = _job()
    assert not job.dims().fused_kernels  # torch's foreach AdamW
    eager, _ = _step(job)
    monkeypatch.setattr(optimizer, "_eager_step", lambda inner: None)
    own, _ = _step(job)
    assert eager == own and len(own.events) > 20


def test_objects_gathered_as_torchs_fake_backend_gathers_them():
    """The optimizer's all_gather_object stand-in returns what torch's own returns on the fake
    backend (each rank's object a fresh copy of this rank's), and leaves torch's in place after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from inspector.memory.engine.optimizer import _objects_gathered

    real = dist.all_gather_object
    obj = [((("wd_mult", 0.0),), False), (None, True)]
    ours = not dist.is_initialized()  # a fake world of our own, unless one is up
    if ours:
        dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=6)
    try:
        assert dist.get_backend() == "fake"
        size = dist.get_world_size()
        expected: list = [None] * size
        dist.all_gather_object(expected, obj)
        got: list = [None] * size
        with _objects_gathered():
            dist.all_gather_object(got, obj)
        assert got == expected == [obj] * size
        assert len({id(o) for o in got}) == size and all(o is not obj for o in got)
    finally:
        if ours:
            dist.destroy_process_group()
    assert dist.all_gather_object is real


@pytest.mark.parametrize("distributed", [False, True])
def test_fp16_main_grads_are_allocated_when_the_step_is_logged(distributed):
    """fp16 keeps a 16-bit grad buffer, so the step's `main_grad.float()` (Float16Optimizer's and
    the distributed optimizer's `_copy_model_grads_to_main_grads`) makes a new fp32 tensor per
    parameter (per owned shard), set to None only by the next iteration's `zero_grad`:
    Megatron-LM logs mem-allocated-bytes after `train_step`, with them held. Not in the state,
    nor in the peak of the next forward."""
    from inspector.memory.engine.run import run_memory
    from inspector.world.build import View, build

    job = _job(bf16=False, fp16=True, use_distributed_optimizer=distributed)
    built = build(job, View((0,)), expert_ranks=(0,)).stages[0]
    run = run_memory(job, 0)
    if distributed:
        buffers = [b for chunk in built.chunks for b in chunk.buffers()]
        grads = 4 * sum(b.owned_numel[0] for b in buffers)
        tensors = sum(1 for chunk in built.chunks for _ in chunk.module.parameters())
        assert 0 <= run.after_step - grads < 512 * tensors
    else:
        shapes = [tuple(p.shape) for chunk in built.chunks for p in chunk.module.parameters()]
        assert run.after_step == _fp32(shapes)
    static = 10**9
    allocated, peak = run.torch_reports(static)
    assert (allocated, peak) == (static + run.after_step, static + run.peak.bytes)
    assert run_memory(_job(), 0).after_step == 0  # bf16: the fp32 grad buffer is the main grad


def test_one_iteration_peaks_at_the_first_step_before_the_moments_exist():
    """--train-iters 1 (the reruns functional test): the only iteration is the first, whose
    forward and backward run before any Adam moment exists, and torch's AdamW makes them lazily,
    group by group (`_init_group` inside the loop over param_groups), so the decay group's
    `_foreach_sqrt` runs with that group's moments only. Its peak is that sqrt's, not the
    steady iteration's forward (which sits on top of every moment)."""
    from inspector.memory.engine.run import run_memory

    steady = run_memory(_job(), 0)
    first = run_memory(_job(train_iters=1), 0)
    _, params = _step(_job())
    decay, rest = (_fp32(group) for group in _groups(params))
    moments = 2 * (decay + rest)  # exp_avg and exp_avg_sq of the fp32 main params
    assert first.optimizer_state == moments
    # the sqrt of each group over the moments made so far, less all of them (static counts them)
    expected = max(2 * decay + decay, moments + rest) - moments
    assert first.peak.bytes == expected
    assert first.peak.moment == "first optimizer step (it makes Adam's moments): _foreach_sqrt"
    assert steady.peak.bytes > expected and steady.peak.moment.startswith("forward")
