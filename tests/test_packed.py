"""Packed sequences (--sft): TE's thd attention and RoPE, the packed batch, attention per document.

The saved tensors are written by hand from TE v2.11's source (backends.py `FusedAttnFunc`
1322-1333; common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu: thd softmax statistics
{max_tokens_q, num_attn_heads, 1} on cuDNN >= 9.6; rope.py `FusedRoPEFunc` 152).
"""

from __future__ import annotations

import pytest

from tests.test_te_engine import _job, _meta, _saved
from tests.test_versions import VERSION

# packed sequences are modelled from megatron-core 0.16 (job/versions.py packed_checked);
# tests/test_versions.py checks the refusal before
pytestmark = pytest.mark.skipif(VERSION < (0, 16), reason="--sft is modelled from 0.16")

T, HEADS, GROUPS, D = 32, 4, 2, 16


def _cu(*lengths):
    from inspector.memory.engine.packed import cu_seqlens

    return cu_seqlens(list(lengths))


def test_thd_attention_saves_cu_seqlens_and_one_statistics_row_per_token():
    import torch

    from inspector.world import te

    te.install()
    from inspector.world.te import attention

    dpa = attention.DotProductAttention(HEADS, D, num_gqa_groups=GROUPS)
    q, k, v = _meta(T, HEADS, D), _meta(T, GROUPS, D), _meta(T, GROUPS, D)
    cu = _cu(10, 10, 12)
    out = dpa(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
              cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=12,
              max_seqlen_kv=12, attn_mask_type="padding_causal")  # fmt: skip
    assert out.shape == (T, HEADS * D)  # FusedAttention.forward's view(*shape[:-2], -1)
    bf16, int32 = torch.bfloat16, torch.int32
    # the padded cu_seqlens default to the unpadded ones: four cu_seqlens saved, not None
    fused = out.grad_fn.next_functions[0][0]  # under the final view
    assert [(None if t is None else (tuple(t.shape), t.dtype)) for t in fused.saved_tensors] == [
        ((T, HEADS, D), bf16), ((T, GROUPS, D), bf16), ((T, GROUPS, D), bf16), ((T, HEADS, D), bf16),
        ((4,), int32), ((4,), int32), ((4,), int32), ((4,), int32),
        ((T, HEADS, 1), torch.float32), ((2,), torch.int64),
    ]  # fmt: skip
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_thd_fused_rope_saves_the_frequencies_and_cu_seqlens():
    import torch

    from inspector.world import te

    te.install()
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    t, freqs = _meta(T, HEADS, D), torch.empty(12, 1, 1, D, device="meta")
    out = apply_rotary_pos_emb(t, freqs, tensor_format="thd", fused=True, cu_seqlens=_cu(20, 12))
    assert out.shape == t.shape
    assert _saved(out) == [((12, 1, 1, D), torch.float32), ((3,), torch.int32), None]


@pytest.mark.slow
def test_a_packed_micro_batch_runs_megatrons_thd_path_without_the_causal_mask():
    """Same model, same tokens: the packed batch has no [b, 1, s, s] bool mask (32 x 32 = 1 KiB),
    and megatron's rotary cache covers the longest document only (get_rotary_seq_len)."""
    from inspector.memory.engine.stage import trace_stage

    base = dict(num_layers=2, pipeline_model_parallel_size=1, tensor_model_parallel_size=1,
                data_parallel_size=1, micro_batch_size=1, global_batch_size=1,
                position_embedding_type="rope")  # fmt: skip
    causal, one, docs = (trace_stage(_job(**base, **extra), 0)[0] for extra in
                         ({}, dict(sft=True), dict(sft=True, packed_document_length=8)))  # fmt: skip
    assert causal.held - one.held == 32 * 32
    assert one.held == docs.held
    rotary = [[size for where, size in t.persistent if where == "rotary_pos_emb"] for t in (one, docs)]
    # fp32 freqs [s, 1, 1, d] with d = 64 / 4 = 16: 32 x 16 x 4 = 2 KiB, then 8 x 16 x 4 (512)
    assert rotary == [[512, 32 * 16 * 4], [512, 512]]


def test_core_attention_is_priced_per_document():
    from inspector.formulas.flops import layer_flops
    from inspector.job.packing import attention_squares, document_lengths

    assert document_lengths(32, 10) == [10, 10, 10, 2]
    assert document_lengths(32, 64) == [32]
    assert attention_squares(32, None) == attention_squares(32, 32) == 32 * 32
    base = dict(num_layers=2, micro_batch_size=1, global_batch_size=1, pipeline_model_parallel_size=1)
    causal = layer_flops(_job(**base).dims(), 0, 3)
    packed = layer_flops(_job(**base, sft=True, packed_document_length=10).dims(), 0, 3)
    assert packed.core_attention * 1024 == causal.core_attention * (3 * 100 + 4)  # 10^2 x 3 + 2^2 of 32^2
    assert (packed.attention, packed.mlp) == (causal.attention, causal.mlp)


@pytest.mark.parametrize(
    "flags, error",
    [
        # the batch dimension is squeezed for thd (transformer/attention.py)
        (["--bf16", "--sft", "--micro-batch-size", "2"], "Error: --sft packs a micro-batch into one sequence: "
         "--micro-batch-size 2 must be 1 (megatron's thd attention squeezes the batch dimension)"),
        # the document length is the packed data's: meaningless without packing
        (["--bf16", "--packed-document-length", "100"],
         "Error: --packed-document-length 100 needs --sft (packed sequences)"),
        (["--bf16", "--sft", "--packed-document-length", "9000"], "Error: --packed-document-length 9000 is "
         "longer than --seq-length 8192: a document is packed into one sequence"),
        (["--bf16", "--sft", "--packed-document-length", "0"],
         "Error: --packed-document-length must be at least 1, got 0"),
        # TE's thd context-parallel ring and partitioning are not simulated
        (["--bf16", "--sft", "--context-parallel-size", "2"], "Error: --sft with --context-parallel-size 2 "
         "is not modelled (Transformer Engine's thd partitioning, thd_get_partitioned_indices, "
         "and its thd context-parallel ring)"),
        # fp32 (the preset without --bf16): megatron's thd format runs in TE's fused or flash only
        (["--sft"], "Error: --sft (packed sequences) needs Transformer Engine's fused "
         "or flash attention in bf16 or fp16: megatron's thd format has no unfused path"),
        # megatron-core's own stop (GatedDeltaNet.forward)
        (["--bf16", "--sft", "--model", "qwen3-next-80b-a3b"], "Error: --sft with gated delta net "
         "layers: megatron-core stops (\"GDN does not support packed sequence for now\")"),
        # Mamba's packed path runs mamba_ssm kernels with seq_idx, not simulated
        (["--bf16", "--sft", "--model", "nemotron-3-nano-30b-a3b"], "Error: --sft with a hybrid "
         "(Mamba) model is not modelled: megatron's Mamba mixer runs packed documents through "
         "mamba_ssm's kernels with seq_idx, which are not simulated"),
        # TE's fp8 attention has no thd stand-in
        (["--bf16", "--sft", "--fp8-format", "hybrid", "--fp8-dot-product-attention"],
         "Error: --sft with --fp8-dot-product-attention is not modelled: Transformer Engine's fp8 "
         "attention in the thd format is not simulated"),
    ],  # fmt: skip
    ids=["micro-batch", "no-sft", "too-long", "zero", "cp", "fp32", "gdn", "mamba", "fp8-attention"],
)
def test_packed_sequences_bad_input(cli, flags, error):
    model = [] if "--model" in flags else ["--model", "llama3-8b"]
    result = cli("memory", *model, "--micro-batch-size", "1", *flags)
    assert result.code == 2
    assert result.err.strip() == error


def test_plans_flash_attention_kernel_is_priced_per_document():
    """formulas/ops.py: the flash kernel's FLOPs (2 b a s^2 d causal) take the documents' squares."""
    from inspector.formulas.kernels import Attention
    from inspector.formulas.ops import Shard, layer_ops

    base = dict(num_layers=2, micro_batch_size=1, global_batch_size=1, pipeline_model_parallel_size=1)

    def flash(**extra):
        ops = layer_ops(_job(**base, **extra).dims(), Shard(), False)
        return [op.flops for op in ops.forward if isinstance(op, Attention)]

    assert flash(sft=True, packed_document_length=8) == [f / 4 for f in flash()]  # 4 x 8^2 of 32^2


def test_plan_keeps_packing_for_every_candidate():
    """A plan request carries the packing to every candidate job (packing.py refuses mbs > 1, cp > 1)."""
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request

    flags = dict(num_layers=2, global_batch_size=8, bf16=True, sft=True, packed_document_length=100)
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    req = make_request(args, PlanFlags(8, top=1))
    assert req.training.packed_document_length == 100


def test_memory_says_the_sequences_are_packed(cli):
    result = cli("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
                 "--transformer-impl", "transformer_engine", "--sft", "--packed-document-length", "8",
                 "--no-cache")  # fmt: skip
    assert result.code == 0, result.err
    assert "sequence 32 packed (--sft) in documents of 8; tp 1" in result.out
    assert "run on meta tensors, replayed in the pipeline schedule" in result.out
