"""A hybrid model's MTP depths (`/` in --hybrid-layer-pattern, megatron-core 0.17+): memory runs
megatron's own MultiTokenPredictionBlock of the MTP pattern's layers, workload writes them."""

from __future__ import annotations

import pytest

from inspector.job.versions import hybrid_pattern_separators
from tests.test_hybrid import SMALL, small_hybrid_flops

pytestmark = pytest.mark.skipif(not hybrid_pattern_separators(),
                                reason="megatron-core 0.17+ reads '/'")  # fmt: skip

MTP = ("--position-embedding-type", "rope", "--micro-batch-size", "1", "--global-batch-size", "1")


def _trace(pattern: str):  # type: ignore[no-untyped-def]
    from inspector.job.job import make_job
    from inspector.memory.engine.stage import trace_stage

    job = make_job(dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=512,
                        vocab_size=1024, hybrid_override_pattern=pattern,
                        mtp_num_layers=pattern.count("/") or None, position_embedding_type="rope",
                        micro_batch_size=1, global_batch_size=1, bf16=True,
                        transformer_impl="transformer_engine"))  # fmt: skip
    (trace,) = trace_stage(job, 0)
    return trace


def test_one_mtp_depth_keeps_what_a_hand_count_gives():
    # 'M*M-/M*': one MTP depth of a Mamba and an attention layer; s 512, b 1, h 256, 4 heads,
    # vocab 1024, bf16, LayerNorm, dropout on. T: one [s, b, h] bf16 tensor.
    s, h, vocab = 512, 256, 1024
    t, stats, mask = 2 * s * h, 2 * 4 * s, s * h  # LayerNorm's fp32 mean and rstd; a dropout mask
    # multi_token_prediction.py: the rolled input and position ids (int64 [b, s]); the embedding's
    # dropout output (enorm's input) and mask; enorm's and hnorm's statistics (their outputs go
    # after the cat); the cat [s, b, 2h] eh_proj saves and its output (the first layer's input)
    wrapper = 2 * 8 * s + (t + mask) + 2 * stats + 2 * t + t
    # MambaLayer (MambaMixer, d_inner 512, 8 heads of 64, 8 groups, state 128): in_proj's normed
    # input, statistics and output zxbcdt (2 x 512 + 2 x 8 x 128 + 8 = 3080 wide), the scan's
    # output before and after its gate, three per-head vectors (one 512-byte block each), the
    # gated norm's output and fp32 rstd per group, the layer's output and dropout mask
    mamba = t + stats + 2 * s * 3080 + 2 * (2 * s * 512) + 3 * 512 + 2 * s * 512 + 4 * s * 8 + t + mask
    # attention layer: normed input, statistics, rotated Q and K and Transformer Engine's
    # contiguous copy of V (get_qkv_layout: the QKV output is freed), the core attention's
    # output, fp32 log-sum-exp [b, a, s] and RNG block, the layer's output and dropout mask
    attention = t + stats + 2 * t + t + t + 4 * 4 * s + 512 + t + mask
    final_norm = stats + t  # its output, the output layer's input
    # the block's [2s, b, h] of main and MTP hidden states (the depth's output freed, less one
    # rolled id vector); the MTP loss: the cross entropy's fp32 [s, b, vocab], and its [b, s]
    # labels, mask and loss vectors (22 blocks of 512 bytes)
    block, loss = t - 8 * s, 4 * s * vocab + 22 * 512
    depth = _trace("M*M-/M*").held - _trace("M*M-").held
    assert depth == wrapper + mamba + attention + final_norm + block + loss == 10_949_632


def test_memory_counts_each_depth(cli):
    totals = []
    for pattern in ("M*M-", "M*M-/M*", "M*M-/M*/M*"):
        result = cli("memory", *SMALL, "--hybrid-layer-pattern", pattern, *MTP, "--format", "json")
        assert result.code == 0, result.err
        totals.append(result.out)
    # megatron's MultiTokenPredictionBlock: one more depth, one more MTP layer's parameters
    import json

    params = [json.loads(out)["stages"][0]["parameters"] for out in totals]
    assert params[2] - params[1] == params[1] - params[0] > 0


def test_workload_writes_the_mtp_patterns_layers(cli):
    result = cli("workload", *SMALL, "--hybrid-layer-pattern", "M*M-/M-", *MTP, "--tp", "2",
                 "--gpu", "h100", "--stage", "0", "--no-cache")  # fmt: skip
    assert result.code == 0, result.err
    names = [line.split("\t")[0] for line in result.out.splitlines()[2:]]
    mtp = [n for n in names if n.startswith("mtp1_")]
    # the MTP depth is the pattern after '/': a Mamba and an MLP layer, not the GPT MTP layer
    assert mtp == ["mtp1_embedding", "mtp1_eh_proj_layer", "mtp1_mamba_layer", "mtp1_mlp_layer",
                   "mtp1_final_column", "mtp1_cross_entropy1", "mtp1_cross_entropy2",
                   "mtp1_cross_entropy3"]  # fmt: skip


def test_the_deprecated_pattern_flag_builds_the_mtp_depths_too(cli):
    # Megatron-LM 0.17+ validate_args reads --hybrid-override-pattern as --hybrid-layer-pattern,
    # MTP depths and all; before, the depths were silently dropped
    counts = []
    for flag in ("--hybrid-override-pattern", "--hybrid-layer-pattern"):
        result = cli("params", *SMALL, flag, "M*M-/M*", "--position-embedding-type", "rope")
        assert result.code == 0, result.err
        counts.append(sum(line.startswith("mtp.layers.0.") for line in result.out.splitlines()))
    assert counts[0] == counts[1] > 0


def test_hybrid_flops_count_each_depths_layers_and_logits(cli):
    import json

    result = cli("memory", *SMALL, "--hybrid-layer-pattern", "M*M-/M*/M*", "--is-hybrid-model",
                 "--bf16", *MTP, "--seq-length", "512", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    # Megatron-LM training.py hybrid_flops (core_v0.19.0): get_hybrid_layer_counts counts the MTP
    # pattern once a depth, the logits `vocab_size * (1 + mtp_num_layers)`; by hand as in
    # tests/test_hybrid.py
    mamba, attention, mlp, logits = small_hybrid_flops()
    main = 2 * mamba + attention + mlp
    depth = mamba + attention
    assert json.loads(result.out)["iteration_flops"] == round(3 * (main + 2 * depth + 3 * logits))
