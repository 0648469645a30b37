"""--fp8-dot-product-attention: what Transformer Engine 2.11's (MXFP8: 2.17.1's) fused attention
saves in fp8,
written from the sources (pytorch/attention/dot_product_attention/backends.py FusedAttnFunc,
utils.py combine_and_quantize, csrc/extensions/attention.cpp fused_attn_fwd/bwd) and which
recipes megatron-core hands the flag to (fp8_utils.py get_fp8_recipe)."""

from __future__ import annotations

import json

import pytest

from inspector.job.fp8_attention import MXFP8_DPA_SINCE, TENSORWISE_DPA_SINCE, fp8_attention
from inspector.job.versions import megatron_version

S, B, HEADS, D = 8, 2, 4, 16
SMALL = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size "
         "1000 --micro-batch-size 1 --bf16 --swiglu --normalization RMSNorm --disable-bias-linear "
         "--position-embedding-type rope --transformer-impl transformer_engine "
         "--use-distributed-optimizer --dp 2 --fp8-format hybrid").split()  # fmt: skip


def _attention_saves(recipe_name: str, s: int = S, d: int = D):
    import torch

    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from transformer_engine.common import recipe

    from inspector.world.te import attention

    dpa = attention.DotProductAttention(HEADS, d)
    q, k, v = (torch.empty((s, B, HEADS, d), dtype=torch.bfloat16, device="meta",
                           requires_grad=True) for _ in range(3))  # fmt: skip
    made = getattr(recipe, recipe_name)(fp8_dpa=True)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=made):
        out = dpa(q, k, v)
    function = out.grad_fn.next_functions[0][0]  # under the final view
    saved = [(tuple(t.shape), t.dtype) for t in function.saved_tensors]
    grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    return out, saved, grads


def test_delayed_scaling_saves_one_fp8_qkv_buffer_the_fp8_output_and_m_zinv():
    """backends.py 1139-1290 with delayed scaling: q, k, v quantized together into one uint8
    buffer (utils.py 2183-2193) + scale_inv; O in fp8 + scale_inv (attention.cpp quantizer_helper:
    a Float8Quantizer makes an fp8 O); aux M and ZInv fp32 [b, h, s, 1]; rng state int64 [2]."""
    import torch

    out, saved, grads = _attention_saves("DelayedScaling")
    u8, f32 = torch.uint8, torch.float32
    n = S * B * HEADS * D
    assert saved == [((3 * n,), u8), ((1,), f32), ((S, B, HEADS, D), u8), ((1,), f32),
                     ((B, HEADS, S, 1), f32), ((B, HEADS, S, 1), f32), ((2,), torch.int64)]  # fmt: skip
    assert (out.shape, out.dtype) == ((S, B, HEADS * D), torch.bfloat16)  # dequantized
    assert all((g.shape, g.dtype) == ((S, B, HEADS, D), torch.bfloat16) for g in grads)


def test_current_scaling_keeps_the_output_in_16_bits():
    """NVTE_DPA_FP8CS_O_in_F16 defaults to 1 (backends.py 154): O stays bf16 with an fp32 amax
    (attention.cpp `create_hp_tensor_with_amax`), and is what backward reads."""
    import torch

    _, saved, _ = _attention_saves("Float8CurrentScaling")
    n = S * B * HEADS * D
    assert saved[:4] == [((3 * n,), torch.uint8), ((1,), torch.float32),
                         ((S, B, HEADS, D), torch.bfloat16), ((1,), torch.float32)]  # fmt: skip


def _te_runs_mxfp8_attention() -> bool:
    from inspector.world import te
    from inspector.world.te.attention import MXFP8_ATTENTION_SINCE

    return tuple(int(p) for p in te.VERSION.split(".")[:2]) >= MXFP8_ATTENTION_SINCE


def test_block_recipes_with_fp8_dpa_hit_tes_assertion():
    """dot_product_attention.py 669-673 (v2.11), 676-680 (v2.14): only per-tensor recipes may set
    fp8_dpa; from 2.15 MXFP8 too (the stand-in's 2.16.0 / 2.17.1 under megatron-core 0.18 / 0.19)."""
    with pytest.raises(AssertionError, match="does not support Float8BlockScaling recipe"):
        _attention_saves("Float8BlockScaling")
    if not _te_runs_mxfp8_attention():
        with pytest.raises(AssertionError, match="does not support MXFP8BlockScaling recipe"):
            _attention_saves("MXFP8BlockScaling")


@pytest.mark.skipif(not _te_runs_mxfp8_attention(), reason="TE before 2.15 asserts")
def test_mxfp8_attention_saves_q_k_v_both_ways_with_bhsd_scales_and_a_16_bit_output():
    """backends.py 1383-1496 (v2.17.1): q, k, v each quantized row- and column-wise (uint8 in
    their own shape), their E8M0 scales in one row-wise buffer [b, h, s, round_up(d/32, 4)] and
    one column-wise [b, h, s/32, round_up(d, 128)] (utils.py 2700-2745); O saved in bf16; Stats
    fp32 [b, h, s, 1]; rng state. Gradients in bf16. s must be a multiple of 128, d of 32."""
    import torch

    s, d = 128, 32
    out, saved, grads = _attention_saves("MXFP8BlockScaling", s, d)
    u8, f32 = torch.uint8, torch.float32
    data = [((s, B, HEADS, d), u8)] * 6
    row, col = 3 * B * HEADS * s * 4, 3 * B * HEADS * (s // 32) * 128
    assert saved == [*data, ((row,), u8), ((col,), u8), ((s, B, HEADS, d), torch.bfloat16),
                     ((B, HEADS, s, 1), f32), ((2,), torch.int64)]  # fmt: skip
    assert (out.shape, out.dtype) == ((s, B, HEADS * d), torch.bfloat16)
    assert all((g.shape, g.dtype) == ((s, B, HEADS, d), torch.bfloat16) for g in grads)
    with pytest.raises(AssertionError, match="MXFP8 quantization requires s_q % 128 == 0"):
        _attention_saves("MXFP8BlockScaling", 64, d)


def _run(cli, *flags):
    result = cli("memory", *SMALL, "--format", "json", *flags)
    assert result.code == 0, result.err
    stage = json.loads(result.out)["stages"][0]
    return stage["static"], stage["total"] - stage["static"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_attention_keeps_less_for_backward_and_nothing_more_for_the_run(cli, recipe):
    """Per layer the bf16 attention saves q, k, v and O in 2 bytes an element; the fp8 one 1 byte
    (O 2 bytes under current scaling) and two fp32 statistics instead of one: the peak falls,
    the static memory does not move (megatron-core 0.13 hands tensorwise no fp8_dpa: equal)."""
    static, peak = _run(cli, "--fp8-recipe", recipe)
    static_fp8, peak_fp8 = _run(cli, "--fp8-recipe", recipe, "--fp8-dot-product-attention")
    assert static_fp8 == static
    fp8 = fp8_attention("hybrid", recipe, True)
    assert fp8 == (recipe == "delayed" or megatron_version() >= TENSORWISE_DPA_SINCE)
    assert (peak_fp8 < peak) if fp8 else (peak_fp8 == peak)


@pytest.mark.skipif(megatron_version() >= MXFP8_DPA_SINCE, reason="0.18+ passes fp8_dpa to MXFP8")
def test_megatron_core_0_16_leaves_mxfp8_attention_in_bf16_and_says_so(cli):
    """fp8_utils.py get_fp8_recipe (0.16.1): MXFP8BlockScaling(fp8_format=...) without fp8_dpa."""
    assert _run(cli, "--fp8-recipe", "mxfp8") == _run(
        cli, "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention")
    text = cli("memory", *SMALL, "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention")
    assert "does not pass it to the recipe" in text.out and "attention runs in bf16" in text.out


@pytest.mark.skipif(megatron_version() < MXFP8_DPA_SINCE, reason="before 0.18 the flag is unused")
def test_megatron_core_0_18_runs_mxfp8_attention_in_fp8_as_its_te_does(cli):
    """0.18+ hand MXFP8BlockScaling fp8_dpa, and the TE they install (2.16.0, 2.17.1) runs it:
    the static memory does not move, the peak does (here it rises by 96 KiB, 192 bytes a token
    and layer: the fp8 copies of q, k and v with their scales against the 16-bit q, k and v
    bf16 attention keeps; it fell while the stand-in kept the whole QKV output beside the bf16
    ones, tests/test_te_qkv_layout.py), the job line and the note say so."""
    static, peak = _run(cli, "--fp8-recipe", "mxfp8")
    static_fp8, peak_fp8 = _run(cli, "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention")
    assert static_fp8 == static and peak_fp8 == peak + 2 * 256 * 192
    text = cli("memory", *SMALL, "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention")
    assert "attention in fp8" in text.out.splitlines()[0]
    assert "Transformer Engine 2.15+" in text.out and "no attention backend on Hopper" in text.out


@pytest.mark.skipif(megatron_version() < MXFP8_DPA_SINCE, reason="before 0.18 the flag is unused")
def test_mxfp8_attention_refuses_a_sequence_te_cannot_quantize(cli):
    at = SMALL.index("--seq-length") + 1
    flags = [*SMALL[:at], "192", *SMALL[at + 1 :]]
    result = cli("memory", *flags, "--fp8-recipe", "mxfp8", "--fp8-dot-product-attention")
    assert result.code == 2 and "--seq-length a multiple of 128" in result.err
    assert "got --seq-length 192 and head dimensions 32" in result.err


def test_the_job_line_and_the_plan_name_fp8_attention(cli):
    text = cli("memory", *SMALL, "--fp8-dot-product-attention")  # delayed scaling
    assert text.code == 0 and "attention in fp8" in text.out.splitlines()[0]
    from inspector.job.job import make_job
    from inspector.plan.flags import megatron_flags
    job = make_job(dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=256,
                        vocab_size=1000, transformer_impl="transformer_engine", bf16=True,
                        fp8_format="hybrid", fp8_dot_product_attention=True,
                        micro_batch_size=1))  # fmt: skip
    assert "--fp8-dot-product-attention" in megatron_flags(job, (2,))


def test_fp8_dpa_since_is_what_the_installed_megatron_core_passes():
    """job/fp8_attention.py's versions against megatron's own fp8_utils source (get_fp8_recipe;
    0.13 builds the recipe inside get_fp8_context)."""
    import inspect

    from megatron.core import fp8_utils

    source = inspect.getsource(getattr(fp8_utils, "get_fp8_recipe", fp8_utils.get_fp8_context))
    current = source[source.index("Float8CurrentScaling("):].split(")", 1)[0]
    mx = source[source.index("MXFP8BlockScaling("):].split(")", 1)[0]
    version = megatron_version()
    assert ("fp8_dpa" in current) == (version >= TENSORWISE_DPA_SINCE)
    assert ("fp8_dpa" in mx) == (version >= MXFP8_DPA_SINCE)
