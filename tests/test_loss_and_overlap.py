"""What Megatron-LM's functional tests showed missing (issue #43): the fused cross entropy as
torch.compile runs it, the output layer's deferred weight gradient, Transformer Engine's
userbuffers workspace."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # megatron's forward and backward on small stages


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=2, tensor_model_parallel_size=2, data_parallel_size=2,
        micro_batch_size=2, global_batch_size=8, bf16=True, transformer_impl="transformer_engine",
    )  # fmt: skip
    return make_job({**args, **flags})


# the last stage's logits: s x b x (vocab padded to 128 x tp = 1024) / tp
LOGITS = 32 * 2 * 1024 // 2


def _traces(job, stage):
    from inspector.memory.engine.run import chunk_shapes
    from inspector.memory.engine.stage import trace_chunks
    from inspector.world.build import View, build

    shapes = chunk_shapes(build(job, View((stage,)), expert_ranks=(0,)).stages[0])
    return trace_chunks(job, stage, shapes, None, True)


def test_fused_cross_entropy_backward_holds_the_compiled_clone_of_the_softmax():
    # inductor clones the saved fp32 softmax for calculate_gradients' indexed update (torch's
    # fx_passes/reinplace.py can_inplace, lowering.py index_put): one more fp32 logits copy,
    # beside the softmax itself and the bf16 gradient it returns
    from inspector.memory.engine.run import run_memory

    def at_loss(**flags):
        trace = _traces(_job(**flags), 1)[-1]
        return [e for e in trace.backward if "_VocabParallelCrossEntropyBackward" in e.where]

    plain, fused = at_loss(), at_loss(cross_entropy_loss_fusion=True)
    # the softmax is freed at the end of both; the fused one also frees the clone it made
    assert [e.bytes for e in plain].count(-LOGITS * 4) == 1
    assert [e.bytes for e in fused].count(-LOGITS * 4) == 2
    assert fused[0].bytes == LOGITS * 4 and LOGITS * 2 in [e.bytes for e in fused]
    top = max(e.allocated for e in fused) - max(e.allocated for e in plain)
    assert LOGITS * 4 <= top < LOGITS * 4 + 2048  # the clone, and where a few 512 B temporaries sit
    assert "_VocabParallelCrossEntropyBackward" in run_memory(
        _job(cross_entropy_loss_fusion=True), 1).peak.moment


def test_the_compiled_gradients_write_back_into_the_softmax():
    import torch

    from inspector.memory.engine.cuda import _compiled_gradients

    def original(softmax, grad_output, target_mask, target):
        softmax.mul_(2)
        return softmax.to(torch.bfloat16)

    softmax = torch.ones(3, 4)
    out = _compiled_gradients(original)(softmax, None, None, None)
    assert torch.equal(softmax, torch.full((3, 4), 2.0)) and out.dtype == torch.bfloat16
    twice = _compiled_gradients(_compiled_gradients(original))
    assert twice.__wrapped__ is original  # a nested run wraps megatron's function once


@pytest.mark.parametrize("limit, kept", [(0, 4), (1, 1), (2, 2)])
def test_deferred_embedding_wgrad_keeps_input_and_grad_of_limit_micro_batches(limit, kept):
    # ColumnParallelLinear.forward appends its input [s, b, h] bf16, the backward the logits'
    # gradient [s, b, v/tp] bf16, for the first --wgrad-deferral-limit micro-batches (0: all)
    # until the schedule's drain, after the last backward (finish_embedding_wgrad_compute)
    from inspector.memory.engine.run import run_memory

    deferred = dict(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=limit,
                    global_batch_size=16)  # fmt: skip
    trace = _traces(_job(**deferred), 1)[-1]
    per_microbatch = 32 * 2 * 64 * 2 + LOGITS * 2
    assert trace.deferred == (per_microbatch, limit)
    plain = run_memory(_job(global_batch_size=16), 1)
    run = run_memory(_job(**deferred), 1)
    assert run.persistent == plain.persistent  # drained each iteration, not kept for good
    # the last stage runs its 4 micro-batches one after the other: the last one's peak sits on
    # what the earlier deferred ones keep
    assert run.peak.bytes - plain.peak.bytes == min(kept, 3) * per_microbatch


def test_tp_comm_overlap_takes_transformer_engines_userbuffers_workspace():
    # TE 2.20 cpp_extensions/gemm.py get_cublas_workspace(ub=True): 3 (_NUM_MAX_UB_STREAMS)
    # workspaces of 32 MiB + 1 KiB in one tensor, beside the plain one
    from inspector.memory.engine.run import te_workspaces

    flags = dict(sequence_parallel=True)
    assert te_workspaces(_job(**flags)) == 32 * 2**20 + 1024
    assert te_workspaces(_job(**flags, tp_comm_overlap=True)) == 4 * (32 * 2**20 + 1024)


def test_tp_comm_overlap_needs_transformer_engine_and_sequence_parallelism():
    # Megatron-LM initialize.py _initialize_tp_communicators imports TE; validate_args asserts
    # sequence parallelism
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --sequence-parallel"):
        _job(tp_comm_overlap=True)
    with pytest.raises(ConfigError, match="needs --transformer-impl transformer_engine"):
        _job(tp_comm_overlap=True, sequence_parallel=True, transformer_impl="local")


def test_the_native_cross_entropy_fusion_is_read_and_te_s_refused():
    # megatron-core language_module.py: "te" runs Transformer Engine's Triton kernels, unmodelled
    from inspector.inputs.unmodelled import refusal_message

    assert refusal_message("--cross-entropy-fusion-impl", "native") is None
    assert "not modelled" in refusal_message("--cross-entropy-fusion-impl", "te")
