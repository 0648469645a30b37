"""Activation memory against the paper's Table 2 and Megatron-LM's estimator, evaluated by hand."""

from __future__ import annotations

import pytest

from inspector.errors import ConfigError
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout
from inspector.memory.closed.activations import (
    embedding_activations,
    layer_activations,
    output_activations,
    stage_activations,
)

# GPT-3 175B as the paper's Table 3 runs it: s = 2048, h = 12288, a = 96, L = 96, t = 8.
S, H, A, L, V = 2048, 12288, 96, 96, 51200
GPT3 = ModelDims(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V)


def per_layer(dims: ModelDims, par: Layout, recompute: str, b: int = 1) -> float:
    """Return one layer's bytes (layer 0)."""
    return layer_activations(dims, par, 0, b, recompute).total  # type: ignore[arg-type]


@pytest.mark.parametrize("b", [1, 4])
def test_table2_no_parallelism(b: int) -> None:
    # Table 2, "no parallelism": sbh (34 + 5as/h).
    expected = S * b * H * (34 + 5 * A * S / H)
    assert per_layer(GPT3, Layout(), "none", b) == pytest.approx(expected, rel=1e-12)


def test_table2_tensor_parallel() -> None:
    t = 8
    # Table 2, "tensor parallel (baseline)": sbh (10 + 24/t + 5as/(ht)).
    expected = S * H * (10 + 24 / t + 5 * A * S / (H * t))
    assert per_layer(GPT3, Layout(tp=t), "none") == pytest.approx(expected, rel=1e-12)


def test_table2_tensor_and_sequence_parallel() -> None:
    t = 8
    # Table 2, "tensor + sequence parallel": sbh/t (34 + 5as/h).
    expected = S * H / t * (34 + 5 * A * S / H)
    par = Layout(tp=t, sequence_parallel=True)
    assert per_layer(GPT3, par, "none") == pytest.approx(expected, rel=1e-12)


def test_table2_selective_recompute_without_sequence_parallel() -> None:
    # Table 2, "tensor parallel + selective activation recomputation": sbh (10 + 24/t).
    assert per_layer(GPT3, Layout(tp=8), "selective") == 2048 * 12288 * (10 + 3)


def test_table2_selective_recompute_with_sequence_parallel() -> None:
    # Table 2, "tensor + sequence parallel + selective": 34 sbh/t = 106,954,752 bytes.
    par = Layout(tp=8, sequence_parallel=True)
    assert per_layer(GPT3, par, "selective") == 106_954_752


def test_table2_full_recompute() -> None:
    # Table 2, "full activation recomputation": 2sbh = 50,331,648 bytes ...
    assert per_layer(GPT3, Layout(tp=8), "full") == 50_331_648
    # ... which megatron splits by t when the layer input is sequence parallel (our reading).
    par = Layout(tp=8, sequence_parallel=True)
    assert per_layer(GPT3, par, "full") == 50_331_648 / 8


def test_itemised_terms_match_section_4_1() -> None:
    # Section 4.1: attention 11sbh + 5as^2b, MLP 19sbh, two norms 4sbh.
    layer = layer_activations(GPT3, Layout(), 0, 1)
    assert layer.attention == 11 * S * H
    assert layer.core_attention == 5 * A * S * S
    assert layer.mlp == 19 * S * H
    assert layer.norms == 4 * S * H
    assert layer.checkpoint == 0


def test_flash_attention_keeps_only_softmax_statistics() -> None:
    par = Layout(tp=8, sequence_parallel=True)
    flash = layer_activations(GPT3, par, 0, 1, "none", flash_attention=True)
    # fp32 log-sum-exp per head and query: 4 * a * s * b / t bytes, instead of 5as^2b/t.
    assert flash.core_attention == 4 * A * S / 8
    assert flash.total - flash.core_attention == 34 * S * H / 8
    assert layer_activations(GPT3, par, 0, 1, "selective", True).core_attention == 0


def test_gqa_and_swiglu_llama3_70b_layer() -> None:
    # Llama-3 70B: h 8192, a 64, g 8, d 128, f 28672, SwiGLU; t = 8 with SP, flash attention.
    s, h, a, g, d, f, t = 8192, 8192, 64, 8, 128, 28672, 8
    dims = ModelDims(80, h, a, s, 128256, ffn_hidden_size=f, num_query_groups=g, swiglu=True)
    par = Layout(tp=t, sequence_parallel=True)
    layer = layer_activations(dims, par, 0, 1, "none", flash_attention=True)
    assert layer.norms == 4 * s * h / t
    # QKV input 2sbh, dropout mask sbh; Q 2sb*a*d, K and V 2sb*g*d each, projection input 2sb*a*d.
    assert layer.attention == (3 * s * h + 2 * s * a * d + 4 * s * g * d + 2 * s * a * d) / t
    # fc1 input 2sbh, dropout mask sbh; SwiGLU input 2sb*2f, fc2 input 2sbf.
    assert layer.mlp == (3 * s * h + 4 * s * f + 2 * s * f) / t
    assert layer.core_attention == 4 * a * s / t


def test_moe_layer_balanced_routing() -> None:
    # Mixtral-like: 8 experts, top-2, expert f 14336, SwiGLU; t = etp = 2 with SP, ep = 4.
    s, h, f, k, t = 4096, 4096, 14336, 2, 2
    dims = ModelDims(
        32,
        h,
        32,
        s,
        32000,
        num_query_groups=8,
        swiglu=True,
        num_experts=8,
        moe_router_topk=k,
        moe_ffn_hidden_size=f,
    )
    par = Layout(tp=t, ep=4, sequence_parallel=True)
    mlp = layer_activations(dims, par, 0, 1, "selective", flash_attention=True).mlp
    # Router input 2sbh/t and mask sbh/t; the rank's experts see s*k token copies (gathered over
    # the expert TP group), keep them (2h each) and their SwiGLU terms (6f each) split by t.
    assert mlp == 3 * s * h / t + 2 * s * k * h + 6 * s * k * f / t


def test_context_parallel_divides_the_sequence() -> None:
    par1 = Layout(tp=8, sequence_parallel=True)
    par4 = Layout(tp=8, cp=4, sequence_parallel=True)
    one = layer_activations(GPT3, par1, 0, 1, "none", flash_attention=True).total
    four = layer_activations(GPT3, par4, 0, 1, "none", flash_attention=True).total
    assert four == pytest.approx(one / 4, rel=1e-12)


def test_output_and_embedding_extras_section_4_4() -> None:
    t, p, b = 8, 1, 1
    par = Layout(tp=t, sequence_parallel=True)
    # Section 4.4: output side 4sbh/t (1 + v/h); embedding dropout sbh/t per micro-batch.
    assert output_activations(GPT3, par, b).total == 4 * S * H / t * (1 + V / H)
    assert embedding_activations(GPT3, par, b).dropout_mask == S * H * p / t
    assert embedding_activations(GPT3, par, b).token_ids == 8 * S  # int64 ids, whole on each rank


def megatron_activation_memory(
    s: int, b: int, h: int, f: int, v: int, layers: int, t: int, p: int, m: int | None
) -> float:
    """Evaluate Megatron-LM's `compute_activation_memory` (SP + selective) by hand.

    megatron/training/theoretical_memory_usage.py, tag core_v0.16.1, non-interleaved schedule.
    """
    memory = s * b * h * (18 + 4 * f / h) * layers  # per layer: sbh (18 + 4f/h)
    memory += 8 * s * b * p + s * b * h * p  # input ids and embedding dropout, p in flight
    if p > 1 and m is not None:
        memory *= min(1, m / p)
    if p == 1:
        memory += s * b * h * 4 * (1 + v / h)  # output layer and loss
    return memory / t


@pytest.mark.parametrize(
    ("f", "t", "p", "m"),
    [(4 * H, 8, 1, 4), (4 * H, 4, 4, 8), (4 * H, 4, 8, 3), (3 * H, 2, 2, 16)],
)
def test_first_stage_equals_megatron_estimator(f: int, t: int, p: int, m: int) -> None:
    b = 2
    dims = ModelDims(L, H, A, S, V, ffn_hidden_size=f)
    par = Layout(tp=t, pp=p, sequence_parallel=True)
    per_stage = L // p
    ours = stage_activations(dims, par, 0, [range(per_stage)], b, m, "selective")
    theirs = megatron_activation_memory(S, b, H, f, V, L, t, p, m)
    # The deliberate differences: megatron divides the int64 token ids (8sb per micro-batch in
    # flight) by t, although every tensor-parallel rank holds all of them; where the first stage
    # is the last, megatron counts the loss's fp32 logits only, not the 16-bit ones beside them
    # while the loss runs (2sbv/t, `loss_logits`).
    in_flight = min(p, m)
    assert ours.in_flight == (in_flight,)
    logits = 2 * S * b * V / t if p == 1 else 0
    assert ours.loss_logits == logits
    assert ours.total == pytest.approx(theirs - 8 * S * b * in_flight / t + 8 * S * b * in_flight + logits)


def test_interleaved_first_stage_layers_match_megatron_penalty() -> None:
    t, p, v, m, b = 8, 4, 3, 8, 1
    par = Layout(tp=t, pp=p, vpp=v, sequence_parallel=True)
    chunk = L // (p * v)
    chunks = [range(c * p * chunk, c * p * chunk + chunk) for c in range(v)]  # stage 0's chunks
    ours = stage_activations(GPT3, par, 0, chunks, b, m, "selective")
    # Megatron-LM: all L layers times 1 + (p - 1) / (p v) (paper Section 4.3).
    assert ours.layers == pytest.approx(34 * S * b * H / t * L * (1 + (p - 1) / (p * v)))
    # Only chunk 0 holds the embedding. Replaying megatron's order (groups of p = 4 micro-batches
    # through chunks 0, 1, 2): 14 warm-up forwards leave (6, 4, 4) alive; step 14 runs chunk 0
    # forward (7, 4, 4) then chunk 2 backward (7, 4, 3); step 15 runs chunk 0 forward (8, 4, 3).
    # That point has the most embeddings alive: 8, where Megatron-LM's estimator spreads its
    # penalty evenly, (pv + p - 1) / v = 5 micro-batches' worth.
    assert ours.in_flight == (8, 4, 3)
    assert ours.embedding == 8 * (8 * S * b + S * b * H / t)


def test_last_stage_holds_one_micro_batch_under_1f1b() -> None:
    par = Layout(tp=8, pp=4, sequence_parallel=True)
    last = stage_activations(GPT3, par, 3, [range(72, 96)], 1, 16, "selective")
    assert last.in_flight == (1,)
    assert last.output == 4 * S * H / 8 * (1 + V / H)
    assert last.layers == 24 * 34 * S * H / 8
    assert last.embedding == 0


def test_full_recompute_stage_adds_one_rebuilt_layer() -> None:
    par = Layout(tp=8, pp=2, sequence_parallel=True)
    stage = stage_activations(GPT3, par, 1, [range(48, 96)], 1, 8, "full")
    assert stage.layers == 48 * 2 * S * H / 8
    assert stage.recompute_buffer == S * H / 8 * (34 + 5 * A * S / H)


def test_bad_recompute_mode() -> None:
    # Only megatron's three granularities (plus none) have a formula.
    with pytest.raises(ConfigError, match="--recompute-granularity"):
        layer_activations(GPT3, Layout(), 0, 1, "partial")  # type: ignore[arg-type]


def test_context_parallel_needs_flash_attention() -> None:
    # Megatron runs context parallelism only through Transformer Engine's fused attention.
    with pytest.raises(ConfigError, match="--context-parallel-size 2 needs flash or fused attention"):
        layer_activations(GPT3, Layout(cp=2), 0, 1)


def test_moe_with_tensor_parallel_needs_sequence_parallel() -> None:
    # megatron-core's MoELayer refuses to train with TP > 1 and no sequence parallelism.
    dims = ModelDims(4, 1024, 16, 1024, 32000, num_experts=8)
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        layer_activations(dims, Layout(tp=2), 0, 1)


def test_chunk_count_must_match_virtual_stages() -> None:
    # Two chunks given for a layout without interleaving.
    with pytest.raises(ConfigError, match="chunks"):
        stage_activations(GPT3, Layout(pp=2), 0, [range(24), range(48, 72)], 1, 4)


def test_interleaved_peak_weighs_the_output_chunk() -> None:
    # Last stage of pp = 2, v = 2, m = 4: chunk order 0 0 1 1 0 0 1 1 and
    # 2 (p - s - 1) + (v - 1) * p = 2 warm-up forwards, so the live points are
    # (1,0) (2,0) (2,1) (2,1) (3,0) (3,0) (2,1) (2,1). Chunk 0 has two layers, chunk 1 one layer
    # plus the output layer, whose fp32 logits (v = 256000) outweigh a layer: (2, 1) wins.
    dims = ModelDims(6, H, A, S, 256000)
    par = Layout(tp=8, pp=2, vpp=2, sequence_parallel=True)
    stage = stage_activations(dims, par, 1, [range(2, 4), range(5, 6)], 1, 4, "selective")
    layer = 34 * S * H / 8
    out = 4 * S * H / 8 * (1 + 256000 / H)
    assert out > layer
    assert stage.in_flight == (2, 1)
    assert stage.layers == 5 * layer and stage.output == out


def test_block_recompute_leaves_the_mtp_layers_alone() -> None:
    # megatron-core MultiTokenPredictionLayer._checkpointed_forward: `uniform` checkpoints the
    # MTP layer, `block` warns "not supported for MTP yet. Skipping recompute." and keeps all of
    # its activations; the decoder's layers are checkpointed alike (block 2 of a 2-layer chunk).
    from inspector.memory.closed.activations import mtp_activations

    dims = ModelDims(4, 1024, 16, 1024, 32000, mtp_num_layers=1)
    par = Layout(pp=2)
    args = (dims, par, 1, [range(2, 4)], 1, 4, "full")
    uniform = stage_activations(*args, mtp_chunks=(1,))  # type: ignore[arg-type]
    block = stage_activations(*args, mtp_chunks=(1,), recompute_method="block",  # type: ignore[arg-type]
                              recompute_num_layers=2)
    assert block.layers == uniform.layers and block.recompute_buffer == uniform.recompute_buffer
    kept = mtp_activations(dims, par, 1, "none") - mtp_activations(dims, par, 1, "full")
    assert kept > 0
    assert block.output - uniform.output == kept


def test_qk_layernorm_keeps_the_q_and_k_norms_inputs() -> None:
    # Qwen3: megatron-core attention.py runs q_layernorm(query) and k_layernorm(key) per head;
    # Transformer Engine's RMSNorm saves its (contiguous) input: 2sb*a*d + 2sb*g*d more, over t.
    s, h, a, g, d, t = 4096, 2048, 32, 4, 128, 2
    plain = ModelDims(48, h, a, s, 151936, num_query_groups=g, kv_channels=d)
    normed = ModelDims(48, h, a, s, 151936, num_query_groups=g, kv_channels=d, qk_layernorm=True)
    par = Layout(tp=t, sequence_parallel=True)
    before, after = (layer_activations(x, par, 0, 1, "none", flash_attention=True)
                     for x in (plain, normed))
    assert after.attention - before.attention == 2 * s * (a + g) * d / t


def test_the_last_stage_adds_the_losss_16_bit_logits_or_a_rebuild_whichever_is_more() -> None:
    # cross_entropy.py makes the loss's fp32 copy of the logits while the caller holds the 16-bit
    # ones: 2sbv/t beside the 4sbv/t kept, during the forward; a rebuild only ever in backward.
    par = Layout(tp=8, pp=4, sequence_parallel=True)
    last = stage_activations(GPT3, par, 3, [range(72, 96)], 1, 16, "selective")
    assert last.loss_logits == 2 * S * V / 8
    assert last.total == last.layers + last.output + 2 * S * V / 8
    full = stage_activations(GPT3, par, 3, [range(72, 96)], 1, 16, "full")
    assert full.recompute_buffer > full.loss_logits  # one GPT-3 layer rebuilt: 34sbh + 5as^2b
    assert full.total == full.layers + full.output + full.recompute_buffer
    first = stage_activations(GPT3, par, 0, [range(0, 24)], 1, 16, "selective")
    assert first.loss_logits == 0
