"""Fine-grained activation offloading: megatron's own offload manager run on meta tensors."""

from __future__ import annotations

import importlib.util

import pytest

MIB = 1 << 20
MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(MODULE) is None, reason="megatron-core before 0.16 has no such offloading"
)


def _start_chunk(off) -> None:
    """Start a micro-batch's chunk: megatron-core 0.16.1's call, or 0.19.2's (pp rank 0, all of it)."""
    if hasattr(off, "group_commit"):
        off.init_chunk_handler(None, None, 1024)
    else:
        off.init_chunk_handler(0, None, None, 1024, 0, 1.0)


def _commit(off, group, y):
    """End the group: `group_commit` (0.16.1), the group's `group_offload` (0.19.2)."""
    return off.group_commit(y, "mlp_norm") if hasattr(off, "group_commit") else group.group_offload(y)


def _run(offload: bool, layers: int = 3):
    """Run `layers` offloaded groups forward (h -> gelu(h @ w)) and backward, as a layer does."""
    import torch
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    from inspector.memory.engine.allocator import Tracker
    from inspector.memory.engine.offload import HostBytes, offloading_on_meta

    host, tracker = HostBytes(), Tracker()
    w = torch.empty(256, 256, device="meta", requires_grad=True)
    x0 = torch.empty(1024, 256, device="meta", requires_grad=True)  # 1 MiB in fp32
    with offloading_on_meta(host):
        off.reset_instance()
        getattr(off, "mark_not_offloadable", getattr(off, "mark_not_offload", None))(w)  # as GPTModel does
        with tracker:
            _start_chunk(off)
            x = x0
            for _ in range(layers):
                group = off(offload, x, "mlp_norm")
                with group as h:
                    y = torch.nn.functional.gelu(h @ w)
                x = _commit(off, group, y) if offload else y
            del h, y, group  # a layer's locals die with its forward
            held, tracker.forward_events = tracker.allocated, len(tracker.events)
            x.sum().backward()
        manager = PipelineOffloadManager.get_instance()
        offloaded = [g.total_offload_bytes for c in manager._cached_chunks_forward for g in c.offload_groups]
        pooled = host.live  # before the manager, and its pool, go
        off.reset_instance()
    return held, tracker, host, offloaded, pooled


def test_offloaded_activations_leave_the_gpu_and_the_host_holds_them():
    plain_held, plain, no_host, _, _ = _run(False)
    held, tracker, host, offloaded, pooled = _run(True)
    # without offloading each layer keeps its output and gelu's input: 2 MiB a layer
    assert plain_held == 6 * MIB and no_host.peak == 0
    # with it only the last output stays on the GPU: the rest went to pinned host buffers
    assert held == 1 * MIB
    # each group copies out its input and gelu's input (the weight is marked not offloadable)
    assert offloaded == [2 * MIB] * 3
    assert host.peak == sum(offloaded) and host.buffers == 6
    # megatron's pool keeps its pinned buffers after the reload, for the next iteration
    assert pooled == host.peak
    assert tracker.peak < plain.peak


def test_reloaded_activations_come_back_to_the_gpu_in_backward():
    def reloads(tracker):
        return sum(1 for e in tracker.events[tracker.forward_events :] if e.bytes == MIB)

    _, plain, _, _, _ = _run(False)
    _, tracker, host, offloaded, _ = _run(True)
    # each of the 6 offloaded 1 MiB tensors is copied back into a new GPU tensor in backward
    assert reloads(tracker) - reloads(plain) == host.buffers == 6
    assert tracker.allocated == 0  # and freed once its gradient is made


def test_pinned_host_buffers_round_up_to_a_power_of_two():
    from inspector.memory.engine.offload import pinned

    assert [pinned(n) for n in (0, 1, 512, 513, 3 * MIB)] == [0, 1, 512, 1024, 4 * MIB]


def test_the_stand_ins_are_put_back():
    import torch

    from inspector.memory.engine.offload import HostBytes, offloading_on_meta, supported

    before = (torch.cuda.Stream, torch.cuda.Event, torch.empty, dict(vars(torch.Tensor)))
    with offloading_on_meta(HostBytes()):
        assert torch.cuda.Stream is not before[0] and "record_stream" in vars(torch.Tensor)
    assert (torch.cuda.Stream, torch.cuda.Event, torch.empty, dict(vars(torch.Tensor))) == before
    assert supported()  # megatron-core 0.16.1 has pipeline_parallel/fine_grained_activation_offload.py


def _gpt_trace(modules: tuple[str, ...], impl: str = "local"):
    """One micro-batch of a 2-layer GPT stage as the engine runs it, with megatron's offloading
    of `modules` switched on in its TransformerConfig (the CLI still refuses the flag)."""
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    from inspector.job.job import make_job
    from inspector.memory.engine import stage
    from inspector.memory.engine.offload import HostBytes, offloading_on_meta

    job = make_job(dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=1, tensor_model_parallel_size=1, data_parallel_size=1,
        micro_batch_size=2, global_batch_size=8, bf16=True, transformer_impl=impl,
    ))  # fmt: skip
    host = HostBytes()
    config, run = stage.runtime_config, stage.run_microbatch

    def offloading_config(job):
        fields = config(job)
        if modules:  # every saved tensor is big enough: Megatron-LM's default is 1M elements
            fields.update(fine_grained_activation_offloading=True, offload_modules=list(modules),
                          min_offloaded_tensor_size=0)  # fmt: skip
        return fields

    def offloaded_run(*args, **kwargs):
        with offloading_on_meta(host):
            PipelineOffloadManager.reset_instance()
            return run(*args, **kwargs)

    stage.runtime_config, stage.run_microbatch = offloading_config, offloaded_run
    try:
        (trace,) = stage.trace_stage(job, 0)
    finally:
        stage.runtime_config, stage.run_microbatch = config, run
    return trace, host


def test_a_gpt_layers_offloaded_norm_inputs_leave_the_gpu_block_for_block():
    from inspector.memory.engine.allocator import rounded

    plain, no_host = _gpt_trace(())
    trace, host = _gpt_trace(("attn_norm", "mlp_norm"))
    assert no_host.buffers == 0
    # each norm saves its input (s x b x h in bf16: 32 x 2 x 64 x 2 bytes) and its fp32 mean and
    # rstd per token: 3 tensors, 2 norms, 2 layers
    assert sorted(host.sizes) == [256] * 8 + [8192] * 4
    # and the GPU holds exactly those blocks less between forward and backward
    assert plain.held - trace.held == sum(rounded(size) for size in host.sizes)
    # they come back for the backward: its peak is lower by no more than what left
    assert max(e.allocated for e in trace.backward) <= max(e.allocated for e in plain.backward)


def test_under_transformer_engine_the_norms_are_fused_and_attention_is_offloaded():
    plain, _ = _gpt_trace((), "transformer_engine")
    normed, norm_host = _gpt_trace(("attn_norm", "mlp_norm"), "transformer_engine")
    # TE fuses each norm into the next linear (input_layernorm is an IdentityOp): nothing to offload
    assert norm_host.buffers == 0 and normed.held == plain.held
    trace, host = _gpt_trace(("qkv_linear", "core_attn", "attn_proj"), "transformer_engine")
    assert host.peak > 0 and trace.held < plain.held
