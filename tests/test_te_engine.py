"""The Transformer Engine stand-in's forwards and backwards, and TE jobs run in the engine.

The saved-tensor expectations are written by hand from TE 2.11's source (tag v2.11), each with
the lines it mirrors; the engine checks follow tests/test_engine.py.
"""

from __future__ import annotations

import pytest

from tests.composition import assert_composed_equals_whole
from tests.test_engine import _MOE, _MOE_TP1

S, B, H, OUT, TP = 8, 2, 64, 96, 2  # sequence, micro-batch, in and out features, tp
# DeepSeek-V3's attention, small: q and kv low-rank, a RoPE part of the head (yarn, the default)
_MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
            qk_pos_emb_head_dim=8, v_head_dim=16)  # fmt: skip


def _functions():
    from inspector.world import te

    te.install()
    from inspector.world.te.kernels import functions

    return functions


def _attention_functions():
    from inspector.world import te

    te.install()
    from inspector.world.te.kernels import attention_functions

    return attention_functions


def _meta(*shape, grad=True, dtype=None):
    import torch

    return torch.empty(shape, device="meta", dtype=dtype or torch.bfloat16, requires_grad=grad)


def _setup(mode="column", sp=False, fuse=False, normalization="LayerNorm", tp=TP):
    return _functions().GemmSetup(mode, tp, sp, fuse, normalization)


def _saved(out):
    return [(None if t is None else (tuple(t.shape), t.dtype)) for t in out.grad_fn.saved_tensors]


def test_linear_saves_what_tes_linear_forward_saves():
    """linear.py `_Linear.forward` 433-439: prepare_for_saving(saved_inputmat, weightmat,
    weight, bias); saved_inputmat is the local (not gathered) input, even under SP (404)."""
    import torch

    f = _functions()
    assert f.LinearFunction.SAVED == ("inputmat", "weightmat", "weight", "bias")
    x, w, bias = _meta(S, B, H), _meta(OUT, H), _meta(OUT)
    out = f.LinearFunction.apply(x, w, bias, _setup(sp=True))
    bf16 = torch.bfloat16
    assert out.shape == (S * TP, B, OUT)  # column parallel under SP: the gathered sequence
    assert _saved(out) == [((S * B, H), bf16), ((OUT, H), bf16), ((OUT, H), bf16), ((OUT,), bf16)]


def test_layernorm_linear_saves_ln_out_and_fp32_statistics():
    """layernorm_linear.py `_LayerNormLinear.forward` 466-476: prepare_for_saving(inputmat,
    weightmat, weight, bias, ln_weight, ln_out, mu, rsigma); ln_out local (not the gathered
    ln_out_total, cleared at 381-383), mu and rsigma fp32 per row, mu None for RMSNorm."""
    import torch

    f = _functions()
    assert f.LayerNormLinearFunction.SAVED == (
        "inputmat", "weightmat", "weight", "bias", "ln_weight", "ln_out", "mu", "rsigma",
    )  # fmt: skip
    x, w, empty = _meta(S, B, H), _meta(OUT, H), _meta(0)
    bf16, f32, rows = torch.bfloat16, torch.float32, S * B
    rms = f.LayerNormLinearFunction.apply(x, _meta(H), None, w, empty, _setup(sp=True, normalization="RMSNorm"))
    assert _saved(rms) == [
        ((rows, H), bf16), ((OUT, H), bf16), ((OUT, H), bf16), ((0,), bf16), ((H,), bf16),
        ((rows, H), bf16), None, ((rows,), f32),
    ]  # fmt: skip
    ln = f.LayerNormLinearFunction.apply(x, _meta(H), _meta(H), w, empty, _setup())
    assert _saved(ln)[6:] == [((rows,), f32), ((rows,), f32)]


def test_norms_save_input_and_fp32_statistics():
    """ops/basic/rmsnorm.py 202 save_for_backward(x, rstdevs); layer_norm.py 221 (x, means,
    rstdevs)."""
    import torch

    f = _functions()
    x = _meta(S, B, H)
    rms = f.NormFunction.apply(x, _meta(H), None)
    ln = f.NormFunction.apply(x, _meta(H), _meta(H))
    f32 = torch.float32
    assert _saved(rms) == [((S * B, H), torch.bfloat16), ((S * B,), f32)]
    assert _saved(ln) == [((S * B, H), torch.bfloat16), ((S * B,), f32), ((S * B,), f32)]
    assert f.NormFunction.SAVED_RMS_NORM == ("x", "rstdevs")
    assert f.NormFunction.SAVED_LAYER_NORM == ("x", "means", "rstdevs")


def test_fused_attention_saves_qkv_out_and_softmax_stats_not_probabilities():
    """backends.py `FusedAttnFunc.forward` 1322-1333: q, k, v, out, four cu_seqlens (None for
    sbhd without padding), aux_ctx_tensors = [softmax stats fp32 [b, h, s, 1], rng_state]."""
    import torch

    f = _attention_functions()
    heads, groups, d = 4, 2, 16
    q, k, v = _meta(S, B, heads, d), _meta(S, B, groups, d), _meta(S, B, groups, d)
    out = f.FusedAttnFunction.apply(q, k, v)
    bf16 = torch.bfloat16
    assert _saved(out) == [
        ((S, B, heads, d), bf16), ((S, B, groups, d), bf16), ((S, B, groups, d), bf16),
        ((S, B, heads, d), bf16), None, None, None, None,
        ((B, heads, S, 1), torch.float32), ((2,), torch.int64),
    ]  # fmt: skip
    assert len(f.FusedAttnFunction.SAVED) == 10
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_learnable_softmax_offset_gets_its_gradient_from_the_fused_kernel():
    """dot_product_attention.py 1404-1408: the offset goes to the kernel as fp32 [1, h, 1, 1];
    backends.py 1602-1604: `FusedAttnFunc.backward` returns d_softmax_offset (gpt-oss's sinks)."""
    import torch

    from inspector.world.te import attention

    _attention_functions()
    heads, d = 4, 16
    dpa = attention.DotProductAttention(heads, d, softmax_type="learnable")
    q, k, v = (_meta(S, B, heads, d) for _ in range(3))
    out = dpa(q, k, v)
    (grad,) = torch.autograd.grad(out, (dpa.softmax_offset,), torch.empty_like(out))
    assert (grad.shape, grad.dtype) == ((heads,), dpa.softmax_offset.dtype)
    unfused = dpa(*(t.float() for t in (q, k, v)))  # fp32: TE's unfused backend, the sink column
    (grad,) = torch.autograd.grad(unfused, (dpa.softmax_offset,), torch.empty_like(unfused))
    assert grad.shape == (heads,)


def test_fused_rope_saves_only_the_frequencies():
    """rope.py `FusedRoPEFunc.forward` 152: save_for_backward(freqs, cu_seqlens, start_positions)."""
    import torch

    f = _attention_functions()
    t = _meta(S, B, 4, 16)
    freqs = torch.empty(S, 1, 1, 16, device="meta")
    out = f.apply_rotary_pos_emb(t, freqs, fused=True)
    assert _saved(out) == [((S, 1, 1, 16), torch.float32), None, None]


def test_grouped_linear_saves_each_gemms_input_view_and_weights():
    """grouped_linear.py `_GroupedLinear.forward` 152 (torch.split of the input: views) and
    250-256 prepare_for_saving(*inputmats, *weights_fp8, *weights, *biases); backward returns
    one dgrad and a gradient per weight (into main_grad with fusion)."""
    import torch

    f = _functions()
    splits = [5, 11]
    x = _meta(sum(splits), H)
    weights = [_meta(OUT, H), _meta(OUT, H)]
    out = f.GroupedLinearFunction.apply(x, splits, False, *weights, _meta(0), _meta(0))
    bf16 = torch.bfloat16
    assert out.shape == (sum(splits), OUT)
    assert _saved(out) == [((5, H), bf16), ((11, H), bf16)] + [((OUT, H), bf16)] * 4 + [((0,), bf16)] * 2
    assert all(t._base is not None or t.untyped_storage()._cdata == x.untyped_storage()._cdata
               for t in out.grad_fn.saved_tensors[:2])  # views of the input, no copies  # fmt: skip
    grads = torch.autograd.grad(out, (x, *weights), torch.empty_like(out))
    assert [g.shape for g in grads] == [x.shape, weights[0].shape, weights[1].shape]


@pytest.mark.parametrize("rank", [0, 1])
def test_p2p_context_parallel_attention_keeps_tes_ring_buffers(rank):
    """context_parallel.py `AttnFuncWithCPAndKVP2P.forward` (v2.11), cp 2, causal, bf16: the
    packed KV (1543) and one received KV buffer (1554); per step an output, fp32 statistics
    [b, h, rows, 1] and an rng state, rows = s on the diagonal and the lower triangle (step
    i <= rank), s / 2 on the upper triangle (1615-1690); step 1 clones step 0's statistics
    (1729); the merged output (105-115). Saved (1956-1967): q, the last KV buffer, out, the
    merged statistics, two rng states; the rest goes when the forward returns."""
    import torch

    from inspector.memory.engine.allocator import Tracker, rounded

    f = _attention_functions()
    heads, groups, d, s = 4, 2, 16, 8
    q, k, v = _meta(s, B, heads, d), _meta(s, B, groups, d), _meta(s, B, groups, d)
    tracker = Tracker()
    with tracker:
        out = f.P2PAttnFunction.apply(q, k, v, (2, rank, True))
    kv = rounded(2 * s * B * groups * d * 2)
    full, stats = rounded(s * B * heads * d * 2), rounded(B * heads * s * 4)
    half = (rounded(s // 2 * B * heads * d * 2), rounded(B * heads * s // 2 * 4))
    step1 = (full, stats) if rank == 1 else half
    rng = rounded(16)
    allocations = [kv, kv, full, stats, rng, step1[0], step1[1], rng, stats, full]
    assert [e.bytes for e in tracker.events if e.bytes > 0] == allocations
    assert tracker.peak == sum(allocations)
    assert tracker.allocated == kv + full + stats + 2 * rng  # what backward keeps
    bf16, f32 = torch.bfloat16, torch.float32
    assert _saved(out) == [
        None, None, None, ((s, B, heads, d), bf16), ((2 * s * B * groups * d,), bf16),
        ((s, B, heads, d), bf16), ((B, heads, s), f32), *[None] * 6,
        ((2,), torch.int64), ((2,), torch.int64), None, None,
    ]  # fmt: skip
    assert out.grad_fn.saved_tensors[3] is q  # q itself, no copy
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    # dk and dv are views of one [2, KV] ring buffer (context_parallel.py 2644-2650)
    assert dk.untyped_storage().nbytes() == 2 * 2 * s * B * groups * d * 2


def test_te_attention_runs_the_ring_on_the_cp_rank():
    """DotProductAttention under a cp group of 2 runs the p2p ring; fp32 has no TE backend."""
    import torch

    from inspector.world.setup import megatron

    megatron()
    from transformer_engine.pytorch import DotProductAttention

    attention = DotProductAttention(4, 16, cp_group=object())
    q = _meta(8, B, 4, 16)
    with patch_cp_size(2):
        out = attention(q, q, q, None, attn_mask_type="causal")
        assert out.shape == (8, B, 64)
        ring = out.grad_fn.next_functions[0][0]
        assert type(ring).__name__.startswith("P2PAttnFunction")
        with pytest.raises(NotImplementedError, match="fp16/bf16"):
            attention(*(_meta(8, B, 4, 16, dtype=torch.float32) for _ in range(3)), None)


def patch_cp_size(size):
    from unittest import mock

    from inspector.world.te import attention

    stack = mock.patch.object(attention, "_size", lambda group: size)
    return _both(stack, mock.patch.object(attention, "_rank", lambda group: 0))


def _both(first, second):
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(first)
    stack.enter_context(second)
    return stack


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_attention_backend_follows_tes_choice_by_dtype(dtype_name):
    """TE's get_attention_backend runs fused/flash attention only in fp16/bf16: bf16 keeps the
    output, fp32 statistics and rng state; fp32 runs UnfusedDotProductAttention, whose softmax
    output [b, heads, s, s] stays for backward (backends.py 246-560)."""
    import torch

    from inspector.memory.engine.allocator import Tracker, rounded
    from inspector.memory.engine.cuda import cuda_on_meta
    from inspector.world.setup import megatron

    megatron()  # the stand-in installed, as the engine has it
    from transformer_engine.pytorch import DotProductAttention

    dtype, heads, d, s = getattr(torch, dtype_name), 4, 16, 64
    attention = DotProductAttention(heads, d, attention_dropout=0.0)
    q, k, v = (_meta(s, B, heads, d, dtype=dtype) for _ in range(3))
    tracker = Tracker()
    with cuda_on_meta(), tracker:
        out = attention(q, k, v, None, attn_mask_type="causal")
    assert out.shape == (s, B, heads * d)
    size = dtype.itemsize
    if dtype == torch.bfloat16:
        expected = rounded(s * B * heads * d * size) + rounded(B * heads * s * 4) + rounded(16)
    else:  # the softmax output, and the context made contiguous (bmm's output freed)
        expected = rounded(B * heads * s * s * size) + rounded(s * B * heads * d * size)
    assert tracker.allocated == expected


def _record(fn):
    from inspector.memory.engine.allocator import Tracker

    tracker = Tracker()
    with tracker:
        result = fn()
    return tracker, result


def test_column_parallel_sp_gathers_then_frees_the_gemm_input():
    """linear.py 213 gather_along_first_dim, 341-345 clear_tensor_data(inputmat_total): the
    gathered input lives only during the GEMM."""
    f = _functions()
    x, w = _meta(S, B, H), _meta(OUT, H)
    tracker, out = _record(lambda: f.LinearFunction.apply(x, w, _meta(0), _setup(sp=True)))
    gathered, gemm = S * TP * B * H * 2, S * TP * B * OUT * 2
    assert [e.bytes for e in tracker.events] == [gathered, gemm, -gathered]


def test_row_parallel_sp_reduce_scatters_and_gathers_grad_in_backward():
    """linear.py 379-381 reduce_scatter_along_first_dim; base.py 1113-1119 gathers grad_output."""
    import torch

    f = _functions()
    x, w = _meta(S * TP, B, H), _meta(OUT, H)
    tracker, out = _record(lambda: f.LinearFunction.apply(x, w, _meta(0), _setup("row", sp=True)))
    assert out.shape == (S, B, OUT)
    full, local = S * TP * B * OUT * 2, S * B * OUT * 2
    assert [e.bytes for e in tracker.events] == [full, local, -full]
    tracker, _ = _record(lambda: torch.autograd.grad(out, (x,), torch.empty_like(out)))
    assert [e.bytes for e in tracker.events][:2] == [local, full]  # given grad, gathered grad


def test_fused_wgrad_accumulation_returns_tes_kept_placeholder():
    """linear.py 945-964: with fuse_wgrad_accumulation the wgrad GEMM writes weight.main_grad and
    the weight's gradient is get_dummy_wgrad (base.py 79-92), one kept tensor per shape."""
    import torch

    from inspector.world.te.state import reset_dummy_wgrads

    f = _functions()
    reset_dummy_wgrads()
    x, w = _meta(S, B, H), torch.nn.Parameter(_meta(OUT, H))
    w.main_grad = torch.empty(OUT, H, device="meta", dtype=torch.float32)
    w.grad_added_to_main_grad = False
    tracker, _ = _record(lambda: None)
    grads = []
    with tracker:
        for _ in range(2):
            out = f.LinearFunction.apply(x, w, _meta(0), _setup(fuse=True))
            out.backward(torch.empty_like(out))
            grads.append(w.grad.untyped_storage()._cdata)
            w.grad = None
            del out
    assert w.grad_added_to_main_grad
    assert grads[0] == grads[1]  # the same placeholder both times: no per-call gradient
    # kept: the input's gradient (x is a leaf here) and the one placeholder, nothing per call
    assert sorted(size for size, _ in tracker.live.values()) == [S * B * H * 2, OUT * H * 2]
    reset_dummy_wgrads()


def _job(**flags):
    """test_engine.py's small job, with the Transformer Engine layer spec."""
    from tests.test_engine import _job as small_job

    return small_job(**{"transformer_impl": "transformer_engine", **flags})


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(num_layers=6, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
             group_query_attention=True, num_query_groups=2),
        dict(num_layers=8, num_layers_per_virtual_pipeline_stage=2, sequence_parallel=True,
             hidden_dropout=0.1, attention_dropout=0.1),
    ],  # fmt: skip
    ids=["dense-gqa-rope", "vpp-sp-dropout"],
)
def test_te_composed_stage_equals_every_layer_run(flags):
    """One layer of each kind stands for the rest in a TE job too, event for event."""
    assert_composed_equals_whole(_job(**flags), persistent=False)


_FULL = dict(recompute_granularity="full")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        # 6 layers a chunk, the first 3 checkpointed one by one, the rest plain
        dict(num_layers=12, recompute_method="block", recompute_num_layers=3, swiglu=True,
             normalization="RMSNorm", position_embedding_type="rope", **_FULL),
        # interleaved, sequence parallel, dropout: groups of 2 layers checkpointed together
        dict(num_layers=32, num_layers_per_virtual_pipeline_stage=8, sequence_parallel=True,
             hidden_dropout=0.1, attention_dropout=0.1, recompute_method="uniform",
             recompute_num_layers=2, **_FULL),
        # MoE and dense layers, recomputed and plain
        dict(num_layers=16, moe_layer_freq=2, recompute_method="block", recompute_num_layers=3,
             **_MOE, **_FULL),
        # fp8: megatron checkpoints through te_checkpoint, and block counts the layers whose
        # input needs no gradient out of the N (none here)
        dict(num_layers=12, fp8_format="hybrid", recompute_method="block", recompute_num_layers=3,
             **_FULL),
        dict(num_layers=16, fp8_format="hybrid", recompute_method="uniform",
             recompute_num_layers=2, **_FULL),
    ],  # fmt: skip
    ids=["block-rope", "uniform-vpp-sp-dropout", "block-moe-mixed", "block-fp8", "uniform-fp8"],
)
def test_te_grouped_full_recompute_composes_equal_to_every_layer_run(flags):
    """Full recomputation by block or by groups composes in a TE job, event for event."""
    cache = assert_composed_equals_whole(_job(**flags), persistent="num_experts" in flags)
    layers = 6 if flags["num_layers"] == 12 else 8
    assert all(len(kinds) < layers for _, _, kinds, _ in cache)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(num_layers=8, moe_layer_freq=2),  # MoE and dense layers, allgather, ep 1
        dict(num_layers=6, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
             moe_grouped_gemm=True),  # fmt: skip
        dict(num_layers=8, moe_layer_freq=2, expert_model_parallel_size=2,
             moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, **_MLA),  # fmt: skip
    ],
    ids=["allgather-mixed", "alltoall-ep2-grouped", "deepseek-like-mla-mixed-ep2"],
)
def test_te_composed_moe_stage_equals_every_layer_run(flags):
    """A TE MoE layer is its own kind too: one of each kind stands for the rest, buffers included."""
    from inspector.errors import ConfigError
    from inspector.memory.engine.run import chunk_shapes
    from inspector.memory.engine.stage import trace_chunks
    from inspector.world.build import View, build

    job = _job(**_MOE, **flags)
    if "multi_latent_attention" in flags and _mla_rope_is_experimental():
        shapes = chunk_shapes(build(job, View((0,)), expert_ranks=(0,)).stages[0])
        with pytest.raises(ConfigError, match="only under Megatron-LM's --enable-experimental"):
            trace_chunks(job, 0, shapes, whole=True)
        return
    cache = assert_composed_equals_whole(job)
    kinds = {moe for _, _, small, _ in cache for moe, _ in small}  # (MoE, GDN) per layer
    assert kinds == {True, False} if "moe_layer_freq" in flags else kinds == {True}


def _mla_rope_is_experimental() -> bool:
    """megatron-core 0.13 wraps the fused MLA RoPE in `experimental_fn`; 0.14 on call it plainly."""
    from inspector.world.setup import megatron

    megatron()
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    return hasattr(fused.fused_apply_mla_rope_for_q, "__wrapped__")


def test_te_grouped_experts_hold_what_grouped_linear_saves_for_backward():
    """Hand count of what one TE MoE layer's grouped experts keep (N = tokens * topk rows).

    megatron's TEGroupedMLP.forward (experts.py) runs linear_fc1, a TE GroupedLinear, on the
    dispatcher's permuted tokens: `_GroupedLinear.forward` (grouped_linear.py, v2.11) splits its
    input into views (`torch.split`, 152) and saves them with the weights (250-256,
    `prepare_for_saving(*inputmats, *weights_fp8, *weights, *biases)`): no new tensor. Its
    output [N, 2f] is saved by the weighted SwiGLU, whose output [N, f] linear_fc2 saves as views;
    linear_fc2's output [N, h] lives until the combine.
    """
    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron

    megatron()
    job = _job(**_MOE_TP1, num_layers=1,
               pipeline_model_parallel_size=1, data_parallel_size=1, global_batch_size=2,
               ffn_hidden_size=128, moe_grouped_gemm=True)  # fmt: skip
    forward = trace_stage(job, 0)[0].forward
    held = sum(e.bytes for e in forward if e.where.startswith("decoder.layers.0.mlp.experts"))
    tokens, topk, h, f, bf16 = 32 * 2, 2, 64, 128, 2
    n = tokens * topk
    assert held == n * (2 * f + f + h) * bf16, [(e.where, e.bytes) for e in forward]


def test_fused_mla_rope_stand_in_replaces_only_the_kernels_the_source_launches():
    """The stand-in is the kernels: every `kernel[grid](...)` launch in the source, nothing else.

    fused_mla_yarn_rope_apply.py's ApplyMLARotaryEmbQ and ApplyMLARotaryEmbKV each launch one
    kernel in forward and one in backward and save `(cos, sin)`; they run as written.
    """
    import inspect
    import re

    from inspector.world.setup import MLA_ROPE_KERNELS, megatron, simulate_fused_mla_rope

    megatron()
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    source = inspect.getsource(fused)
    assert sorted(re.findall(r"(\w+)\[grid\]\(", source)) == sorted(MLA_ROPE_KERNELS)
    for function in (fused.ApplyMLARotaryEmbQ, fused.ApplyMLARotaryEmbKV):
        saved = re.findall(r"ctx\.save_for_backward\(([^)]*)\)", inspect.getsource(function))
        assert saved == ["cos, sin"], (function, saved)
    simulate_fused_mla_rope()
    assert fused.ApplyMLARotaryEmbQ.forward.__module__ == fused.__name__  # megatron's own Function
    assert all(getattr(fused, name).__name__.endswith("(simulated)") for name in MLA_ROPE_KERNELS)


def test_fused_mla_rope_keeps_shapes_and_saves_cos_and_sin_on_meta():
    """megatron's fused MLA RoPE on meta: q rotated in place, key/value allocated, (cos, sin) kept."""
    from inspector.world.setup import megatron, simulate_fused_mla_rope

    torch = megatron().torch
    simulate_fused_mla_rope()
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    s, b, n, qk, emb, v = 8, 2, 4, 16, 8, 16
    meta = dict(device="meta", dtype=torch.bfloat16)
    cos, sin = torch.empty(s, 1, 1, emb, **meta), torch.empty(s, 1, 1, emb, **meta)
    q_in = torch.empty(s, b, n, qk + emb, **meta, requires_grad=True)
    kv_in = torch.empty(s, b, n, qk + v, **meta, requires_grad=True)
    pos_in = torch.empty(s, b, 1, emb, **meta, requires_grad=True)
    # megatron's wrappers, unwrapped from `experimental_fn` where megatron-core 0.13 wraps them
    rope_q = getattr(fused.fused_apply_mla_rope_for_q, "__wrapped__", fused.fused_apply_mla_rope_for_q)
    rope_kv = getattr(fused.fused_apply_mla_rope_for_kv, "__wrapped__",
                      fused.fused_apply_mla_rope_for_kv)  # fmt: skip
    q = rope_q(q_in * 1, cos, sin, qk, emb)
    key, value = rope_kv(kv_in * 1, pos_in * 1, cos, sin, emb, qk, v)
    assert (q.shape, key.shape, value.shape) == ((s, b, n, qk + emb), (s, b, n, emb + qk), (s, b, n, v))
    assert {q.dtype, key.dtype, value.dtype} == {torch.bfloat16}
    for out, function in ((q, "ApplyMLARotaryEmbQ"), (key, "ApplyMLARotaryEmbKV")):
        assert type(out.grad_fn).__name__ == f"{function}Backward"
        assert [t.shape for t in out.grad_fn.saved_tensors] == [cos.shape, sin.shape]
    outputs = (q, key, value)  # attention's backward hands back contiguous gradients
    grads = torch.autograd.grad(outputs, (q_in, kv_in, pos_in), [torch.empty_like(t) for t in outputs])
    assert [g.shape for g in grads] == [q_in.shape, kv_in.shape, pos_in.shape]


def test_te_mla_rope_allocates_key_and_value_and_frees_the_kv_up_projection():
    """Hand count of megatron's fused MLA RoPE in one layer's forward (tokens T = s x b).

    `ApplyMLARotaryEmbKV.forward` allocates o_key [T, n, emb + qk] and o_value [T, n, v]
    (`kv.new_empty`) and saves only cos and sin, so the up projection's kv [T, n, qk + v] is freed
    once the key and value exist; `ApplyMLARotaryEmbQ` rotates q in place (nothing allocated).
    """
    if _mla_rope_is_experimental():
        pytest.skip("megatron-core 0.13 runs the fused MLA RoPE only under --enable-experimental")
    from inspector.memory.engine.stage import trace_stage

    job = _job(**_MLA, position_embedding_type="rope", num_layers=1, pipeline_model_parallel_size=1,
               tensor_model_parallel_size=1, data_parallel_size=1, global_batch_size=2)  # fmt: skip
    forward = trace_stage(job, 0)[0].forward
    attention = "decoder.layers.0.self_attention"
    after = max(i for i, e in enumerate(forward) if e.where == f"{attention}.linear_kv_up_proj")
    tokens, n, qk, emb, v, bf16 = 32 * 2, 4, 16, 8, 16, 2
    key, value, kv = tokens * n * (emb + qk) * bf16, tokens * n * v * bf16, tokens * n * (qk + v) * bf16
    assert forward[after].bytes == kv
    rope = [e.bytes for e in forward[after + 1 : after + 4]]
    assert rope == [key, value, -kv] and all(e.where == attention for e in forward[after + 1 : after + 4])


def test_te_mla_memory_runs_in_the_engine(cli):
    """A dense TE job with multi-latent attention (yarn RoPE, fused) runs through megatron."""
    result = cli("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
                 "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
                 "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
                 "--position-embedding-type", "rope", "--transformer-impl", "transformer_engine",
                 "--no-cache")  # fmt: skip
    if _mla_rope_is_experimental():  # megatron-core 0.13: Megatron-LM's run fails the same way
        assert result.code == 2 and result.err.startswith("Error: megatron-core failed running the "
                                                          "forward"), result.err  # fmt: skip
        assert "only under Megatron-LM's --enable-experimental" in result.err
        return
    assert result.code == 0, result.err
    assert "run on meta tensors, replayed in the pipeline schedule" in result.out
    assert "closed forms" not in result.out


def _held_per_layer(**flags):
    from inspector.memory.engine.stage import trace_stage

    def held(layers):
        job = _job(num_layers=layers, pipeline_model_parallel_size=1, **flags)
        return trace_stage(job, 0)[0].held

    return (held(3) - held(2)), _job(num_layers=2, pipeline_model_parallel_size=1, **flags)


@pytest.mark.parametrize(
    "flags, rope_copies",
    [
        (dict(), False),
        (dict(swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
              group_query_attention=True, num_query_groups=2), True),
    ],  # fmt: skip
    ids=["mha-gelu", "gqa-swiglu-rope"],
)
def test_te_layer_holds_close_to_korthikantis_flash_attention_formula(flags, rope_copies):
    """A dense TE layer holds what Korthikanti et al.'s Table 2 counts (no recomputation; flash
    attention's fp32 statistics instead of the s x s scores), within 1%.

    The 1% covers what the formula leaves out: the fp32 norm statistics (8 bytes a row), the
    rng state, 512-byte rounding. With RoPE, megatron hands TE the rotated q and k (new tensors)
    beside v, a view of its fused QKV output: TE's `get_qkv_layout` finds no layout it supports
    and copies them contiguous (tests/test_te_qkv_layout.py), so the QKV output is freed and the
    formula's Q, K, V is what stays. One known difference is added, not tolerated: older
    megatron-core (0.13) copies q, k, v to bshd under rope fusion ("WAR for peak memory usage" in
    TEDotProductAttention.forward), and the attention output reaches linear_proj transposed:
    TE's `prepare_forward` saves a contiguous copy, 2sbad.
    """
    import inspect

    from inspector.world.setup import megatron

    megatron()  # megatron-core imported over the stand-in, as the engine has it
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from inspector.memory.closed.activations import layer_activations

    base = dict(hidden_size=256, num_attention_heads=8, seq_length=128,
                tensor_model_parallel_size=1, data_parallel_size=1, global_batch_size=2)  # fmt: skip
    measured, job = _held_per_layer(**base, **flags)
    dims, b = job.dims(), 2
    formula = layer_activations(dims, job.layout, 1, b, "none", flash_attention=True).total
    bshd = "WAR for peak memory usage" in inspect.getsource(TEDotProductAttention.forward)
    a = dims.num_attention_heads
    if rope_copies and bshd:
        formula += 2 * dims.seq_length * b * a * dims.head_dim
    assert formula <= measured <= formula * 1.01, (measured, formula)


def test_llama3_8b_memory_runs_in_the_engine():
    """The default (TE) preset runs through megatron's forward and backward, not the formulas."""
    from typer.testing import CliRunner

    from inspector.cli.app import app

    result = CliRunner().invoke(app, ["memory", "--model", "llama3-8b", "--micro-batch-size", "1",
                                      "--no-cache"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "run on meta tensors, replayed in the pipeline schedule" in result.output
    assert "closed forms" not in result.output


def test_a_rank_s_chunks_share_te_s_placeholder_weight_gradients():
    """get_dummy_wgrad keeps one placeholder per (rows, cols, dtype) for the process
    (base.py 79-92), so a rank with virtual stages holds each once, not once per chunk: one per
    distinct weight shape of the layers' fused-accumulation linears (QKV, projection, fc1, fc2)
    and of megatron's output layer (tensor_parallel/layers.py calls the same function)."""
    from inspector.memory.engine.run import run_job
    from inspector.world.build import build, select_view
    from inspector.world.setup import megatron
    from inspector.world.te.state import DUMMY_WGRAD

    megatron()
    job = _job(num_layers=4, num_layers_per_virtual_pipeline_stage=1, global_batch_size=8,
               pipeline_model_parallel_size=2, data_parallel_size=1)  # fmt: skip
    [built] = [s for s in build(job, select_view(job), expert_ranks=(0,)).stages if s.stage == 1]
    assert len(built.chunks) == 2
    kept = run_job(job, [built]).runs[1].persistent
    placeholders = sorted(size for where, size in kept if where.startswith(DUMMY_WGRAD))
    h, t, f, vocab = 64, 2, 256, 1024  # test_engine._job: hidden 64 (4h MLP), tp 2, vocab padded
    # bf16 weights, split by t: QKV [3h/t, h], projection [h, h/t], fc1 [f/t, h], fc2 [h, f/t]
    layers = [3 * h // t * h * 2, h * h // t * 2, f // t * h * 2, h * f // t * 2]
    from megatron.core.tensor_parallel import layers as megatron_layers

    # megatron-core 0.16's output layer takes TE's placeholder too; 0.13's makes an empty
    # gradient each backward (layers.py), freed with it
    output = [vocab // t * h * 2] if hasattr(megatron_layers, "get_dummy_wgrad") else []
    assert placeholders == sorted(layers + output)
