"""engine/cuda_graphs.py: Transformer Engine per-layer graphs' capture order and static inputs,
from megatron-core's own TECudaGraphHelper, against hand counts from its source."""

from __future__ import annotations

import pytest

SEQ, HIDDEN, HEAD = 256, 128, 32  # 4 heads of 32


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
        max_position_embeddings=SEQ, vocab_size=1000, data_parallel_size=1, micro_batch_size=1,
        global_batch_size=8, bf16=True, transformer_impl="transformer_engine",
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True,
    )  # fmt: skip
    return make_job({**args, **flags})


# per (layer, micro-batch) sample (TransformerLayer.get_layer_static_inputs): hidden states
# [s, b, h] in bf16 (megatron makes them bf16 whatever the job's dtype) and, with attention in
# the scope, the causal mask [b, 1, s, s] of bools; one rope table [s, 1, 1, d] in fp32 for all
HIDDEN_BYTES = SEQ * 1 * HIDDEN * 2
MASK_BYTES = SEQ * SEQ
ROPE_BYTES = SEQ * HEAD * 4


def test_the_capture_order_is_megatrons_docstring_example():
    from inspector.engine.cuda_graphs import capture_order

    # transformer/cuda_graphs.py convert_schedule_table_to_order: PP2, 5 micro-batches, VP2,
    # groups of 3, 5 warm-up forwards (rank 0: (2 - 0 - 1) * 2 + (2 - 1) * 3)
    assert capture_order(2, 0, 2, 5, group_size=3) == [
        1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]  # fmt: skip


def test_without_a_pipeline_one_micro_batch_is_captured_per_layer():
    from inspector.engine.cuda_graphs import static_inputs

    got = static_inputs(_job(pipeline_model_parallel_size=1), 0)
    assert (got.graphs, got.order) == (4, (1, -1))
    assert got.buffers == 4 * 2 + 1
    assert got.bytes == 4 * (HIDDEN_BYTES + MASK_BYTES) + ROPE_BYTES


def test_an_mlp_scope_takes_no_mask_and_no_rope():
    from inspector.engine.cuda_graphs import static_inputs

    got = static_inputs(_job(pipeline_model_parallel_size=1), 0, ("mlp",))
    assert (got.buffers, got.bytes) == (4, 4 * HIDDEN_BYTES)


@pytest.mark.parametrize(("stage", "in_flight"), [(0, 2), (1, 1)])
def test_a_pipeline_captures_every_micro_batch_and_reuses_finished_ones(stage, in_flight):
    from inspector.engine.cuda_graphs import static_inputs

    # pp 2, 8 micro-batches, 2 layers a stage: every (layer, micro-batch) is captured, but a
    # forward reuses the samples of a micro-batch whose backward ran, so the buffers are the
    # 1F1B schedule's micro-batches in flight (stage 0: one warm-up forward, 2; stage 1: 1)
    got = static_inputs(_job(pipeline_model_parallel_size=2), stage)
    assert got.graphs == 2 * 8
    assert got.buffers == 2 * in_flight * 2 + 1
    assert got.bytes == 2 * in_flight * (HIDDEN_BYTES + MASK_BYTES) + ROPE_BYTES
