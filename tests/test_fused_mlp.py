"""Transformer Engine 2.14's CuTe DSL fused grouped MLP in MXFP8 (world/te/fused_mlp.py): when TE's
fuser takes it, what its forward saves and marks, what it allocates and frees, and its gradients.

Expectations by hand from TE's `v2.14` tag: ops/_common.py `fuse_grouped_mlp_ops` 103-180,
ops/fused/forward_grouped_mlp.py (fwd) and backward_grouped_mlp.py (bwd); MXFP8 scale shapes from
tensor/mxfp8_tensor.py `make_empty` (one uint8 per 32 elements, padded to 128 x 4).
"""

from __future__ import annotations

import pytest

G, H, F = 2, 256, 256  # local experts, hidden, expert FFN (every feature count a multiple of 256)
SPLITS, N = [256, 256], 512  # tokens per local expert, rows


def _te():
    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from transformer_engine.common import recipe

    from inspector.world.te import ops

    return te_pytorch, recipe, ops


def _meta(*shape, grad=True):
    import torch

    return torch.empty(shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)


def _mlp(ops, interleave=32, h=H):
    import torch

    fc1 = ops.GroupedLinear(G, h, 2 * F, bias=False, device="meta")
    fc2 = ops.GroupedLinear(G, F, h, bias=False, device="meta")
    for i in range(G):
        fc1.register_parameter(f"weight{i}", torch.nn.Parameter(_meta(2 * F, h).detach()))
        fc2.register_parameter(f"weight{i}", torch.nn.Parameter(_meta(h, F).detach()))
    return ops.Sequential().append(fc1).append(ops.ScaledSwiGLU(interleave)).append(fc2)


@pytest.fixture
def fused_env(monkeypatch):
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")


def test_the_fuser_takes_the_kernel_only_where_te_does(fused_env, monkeypatch):
    from inspector.world.te import fused_mlp

    _, _, ops = _te()
    monkeypatch.setattr(fused_mlp, "te_release", lambda: (2, 14))  # the stand-in under 0.17-0.18
    mlp = [*_mlp(ops)._modules.values()]
    assert fused_mlp.taken(mlp, "mxfp8")
    assert not fused_mlp.taken(mlp, "delayed") and not fused_mlp.taken(mlp, None)  # 132-133
    assert not fused_mlp.taken([*_mlp(ops, interleave=None)._modules.values()], "mxfp8")  # 162
    assert not fused_mlp.taken([*_mlp(ops, h=128)._modules.values()], "mxfp8")  # 156-160
    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "0")  # is_supported 74-75
    assert not fused_mlp.taken(mlp, "mxfp8")


def test_the_forward_saves_and_marks_what_te_saves(fused_env):
    # fwd 455-510: fc1 (split sizes, split points, the input's column-wise data and scales, its
    # offsets), ScaledSwiGLU (swiglu_in, the probs), fc2 (the same for its input), then here the
    # quantized weights (row- and column-wise data and scales each)
    import torch

    te_pytorch, recipe, ops = _te()
    mlp, x, probs = _mlp(ops), _meta(N, H), torch.empty(N, device="meta", requires_grad=True)
    splits = torch.tensor(SPLITS)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        out = mlp(x, splits, probs, splits)
    u8, bf16, i64, i32, f32 = torch.uint8, torch.bfloat16, torch.int64, torch.int32, torch.float32
    saved = out.grad_fn.saved_tensors
    shapes = [(tuple(t.shape), t.dtype) for t in saved]
    assert shapes[:10] == [
        ((G,), i64), ((G,), i32), ((N, H), u8), ((N // 32, H), u8), ((G + 1,), i64),
        ((N, 2 * F), bf16), ((N,), f32), ((N, F), u8), ((N // 32, F), u8), ((G + 1,), i64)]  # fmt: skip
    weight = [((2 * F, H), u8), ((2 * F, H // 32), u8), ((2 * F, H), u8), ((2 * F // 32, H), u8)]
    assert shapes[10:] == weight * G + [((H, F), u8), ((H, F // 32), u8), ((H, F), u8), ((H // 32, F), u8)] * G
    marked = {i: t.grouped_tensor_scale_inv for i, t in enumerate(saved) if hasattr(t, "grouped_tensor_scale_inv")}
    # mark_grouped_tensor(grouped_fc1_x, swiglu_in, scales, grouped_fc2_x): True on the
    # column-wise scales only (TE v2.14 utils.py 173-193)
    assert marked == {2: False, 3: True, 5: False, 6: False, 7: False, 8: True}
    assert out.shape == (N, H) and out.dtype == bf16


def test_the_fused_mlp_allocates_frees_and_differentiates(fused_env):
    import torch

    from inspector.memory.engine.allocator import Tracker

    te_pytorch, recipe, ops = _te()
    mlp, x, probs = _mlp(ops), _meta(N, H), torch.empty(N, device="meta", requires_grad=True)
    splits = torch.tensor(SPLITS)
    tracker = Tracker()
    with tracker, te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        out = mlp(x, splits, probs, splits)
    held = sum(e.bytes for e in tracker.events)
    mx = N * H + N * H // 32  # one direction of an [N, H] MXFP8 tensor
    weights = G * 2 * (2 * F * H + 2 * F * H // 32) + G * 2 * (H * F + H * F // 32)
    # kept: the columns of fc1's and fc2's inputs, swiglu_in, the output, the weights, the small ones
    small = 4 * 512  # split sizes, split points, two offsets: the allocator's 512-byte blocks
    assert held == mx + (N * F + N * F // 32) + N * 2 * F * 2 + N * H * 2 + weights + small
    with tracker:
        grads = torch.autograd.grad(out, (x, probs, *mlp.parameters()), torch.empty_like(out))
    assert [tuple(g.shape) for g in grads[:2]] == [(N, H), (N,)]
    assert [tuple(g.shape) for g in grads[2:]] == [(2 * F, H)] * G + [(H, F)] * G


MXFP8_JOB = ("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--ep", "8", "--dp", "8",
             "--micro-batch-size", "1", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
             "--use-transformer-engine-op-fuser", "--moe-token-dispatcher-type", "flex",
             "--moe-flex-dispatcher-backend", "hybridep")  # fmt: skip


def _peak(out: str) -> float:
    return float(out.split(", peak ")[1].split(" GiB")[0])


@pytest.mark.skipif(not __import__("tests.test_op_fuser").test_op_fuser.HAS_OP_FUSER,
                    reason="megatron-core 0.18 added the op fuser")  # fmt: skip
def test_memory_runs_mxfp8_s_fused_mlp_and_a_budget_above_what_arrives(cli):
    # the SwiGLU interleaved by 32 lets TE's fuser take the kernel; without it TE would run its
    # basic operations quantized, which are not simulated
    plain = cli(*MXFP8_JOB)
    assert plain.code == 2 and "basic operations in mxfp8 (split_quantize) are not simulated" in plain.err
    fused = cli(*MXFP8_JOB, "--moe-mlp-glu-interleave-size", "32")
    assert fused.code == 0, fused.err
    # the kernel takes HybridEP's whole budget (its split points end where the tokens do): 1.5
    # makes every expert tensor 49,152 rows instead of 32,768, so the peak grows
    budget = cli(*MXFP8_JOB, "--moe-mlp-glu-interleave-size", "32", "--moe-expert-rank-capacity-factor", "1.5")
    assert budget.code == 0, budget.err
    assert _peak(budget.out) > _peak(fused.out)


# TE 2.17 (megatron-core 0.19 locks 2.17.1): the fused grouped MLP of ops/fused/grouped_mlp.py
# ("gm" below, the `v2.17.1` tag), which also takes gpt-oss's clamped quick-GEGLU with biases and
# Nemotron 3's squared ReLU (ScaledSReLU, ops/basic/activation.py 351-463), and recomputes the
# squared ReLU's output where megatron asks (activation_recompute_in_mlp)


@pytest.fixture
def te_217(fused_env, monkeypatch):
    from inspector.world.te import fused_mlp

    monkeypatch.setattr(fused_mlp, "te_release", lambda: (2, 17))


def _mlp_217(ops, act, bias=False, h=H, f=F):
    """megatron-core 0.19.2 experts.py `_make_fused_ops` 402-571: fc1, the activation, fc2 (its
    biases scaled by the probs), the parameters attached to the meta shells."""
    import torch

    a = f if isinstance(act, ops.ScaledSReLU) else 2 * f
    fc1 = ops.GroupedLinear(G, h, a, bias=bias, device="meta")
    fc2 = ops.GroupedLinear(G, f, h, bias=bias, device="meta", scale_bias=bias)
    for i in range(G):
        fc1.register_parameter(f"weight{i}", torch.nn.Parameter(_meta(a, h).detach()))
        fc2.register_parameter(f"weight{i}", torch.nn.Parameter(_meta(h, f).detach()))
        if bias:
            fc1.register_parameter(f"bias{i}", torch.nn.Parameter(_meta(a).detach()))
            fc2.register_parameter(f"bias{i}", torch.nn.Parameter(_meta(h).detach()))
    return ops.Sequential().append(fc1).append(act).append(fc2)


def test_te_2_17_takes_the_kernel_where_grouped_mlp_py_does(te_217, monkeypatch):
    from inspector.world.te import fused_mlp

    _, _, ops = _te()

    def taken(*args, **kwargs):
        return fused_mlp.taken([*_mlp_217(ops, *args, **kwargs)._modules.values()], "mxfp8")

    assert taken(ops.ScaledSReLU())  # gm 2173-2193: fuse_srelu_ops
    assert taken(ops.ScaledClampedQGeGLU(32), bias=True)  # gm 1106-1107: the biases packed
    assert taken(ops.ScaledSwiGLU(32), h=192)  # gm 650-659: multiples of 64
    assert not taken(ops.ScaledClampedQGeGLU(None))  # gm 673-677: interleaved by 32
    srelu = [*_mlp_217(ops, ops.ScaledSwiGLU(32))._modules.values()]
    srelu[1] = ops.ScaledSReLU()  # fc1 gives 2F columns, the squared ReLU takes F (gm 662-671)
    assert not fused_mlp.taken(srelu, "mxfp8")
    monkeypatch.setattr(fused_mlp, "te_release", lambda: (2, 14))  # 2.14: SwiGLU, no bias, 256
    assert not taken(ops.ScaledSReLU()) and not taken(ops.ScaledClampedQGeGLU(32), bias=True)
    assert not taken(ops.ScaledSwiGLU(32), h=192) and taken(ops.ScaledSwiGLU(32))


def _run_srelu(ops, recompute):
    import torch

    from inspector.memory.engine.allocator import Tracker

    te_pytorch, recipe, _ = _te()
    mlp = _mlp_217(ops, ops.ScaledSReLU(activation_recompute_in_mlp=recompute))
    x, probs = _meta(N, H), torch.empty(N, device="meta", requires_grad=True)
    splits = torch.tensor(SPLITS)
    forward, backward = Tracker(), Tracker()
    with forward, te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        out = mlp(x, splits, probs, splits)
    saved = [None if t is None else (tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]
    held = sum(e.bytes for e in forward.events)
    with backward:
        grads = torch.autograd.grad(out, (x, probs, *mlp.parameters()), torch.empty_like(out))
    return held, backward, saved, grads


def test_the_squared_relu_saves_its_input_and_recomputes_fc2_s(te_217):
    # gm 1429-1475: the activation's input c_tensor is bf16 [N, F] (F columns: no gate); with
    # activation_recompute_in_mlp fc2's column-wise MXFP8 input is not saved (1443) and the
    # dSReLU kernel makes it again in the backward (1822-1843, d_srelu_tensor)
    import torch

    _, _, ops = _te()
    held, again, saved, grads = _run_srelu(ops, recompute=False)
    assert saved[5] == ((N, F), torch.bfloat16) and saved[7] == ((N, F), torch.uint8)
    weights = G * 2 * (F * H + F * H // 32) + G * 2 * (H * F + H * F // 32)
    fc2_x = N * F + N * F // 32  # its column-wise data and E8M0 scales
    assert held == (N * H + N * H // 32) + fc2_x + N * F * 2 + N * H * 2 + weights + 4 * 512
    less, more, saved_r, grads_r = _run_srelu(ops, recompute=True)
    assert saved_r[7:9] == [None, None] and less == held - fc2_x
    rows = [e.bytes for e in again.events].count(N * F)  # fc1's gradient both ways [N, F]
    assert [e.bytes for e in more.events].count(N * F) == rows + 1
    assert [tuple(g.shape) for g in grads] == [tuple(g.shape) for g in grads_r]
    assert [tuple(g.shape) for g in grads[2:]] == [(F, H)] * G + [(H, F)] * G


def test_gpt_oss_s_biased_geglu_runs_fused_with_its_bias_gradients(te_217):
    # gm 1845-1882: fc2's biases scaled by the probs: triton's fp32 [G, H] bias gradient
    # (grouped_dbias_dscales.py), fc1's from the dGeGLU kernel ([G, 2F], cast as 1875), both
    # cast to bf16; gradients in parameter order (weights, then biases, `_compute_grad_params`)
    import torch

    from inspector.memory.engine.allocator import Tracker

    te_pytorch, recipe, ops = _te()
    mlp = _mlp_217(ops, ops.ScaledClampedQGeGLU(32), bias=True)
    x, probs = _meta(N, H), torch.empty(N, device="meta", requires_grad=True)
    splits = torch.tensor(SPLITS)
    with te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
        out = mlp(x, splits, probs, splits, probs)
    assert out.grad_fn.saved_tensors[5].shape == (N, 2 * F)  # the GeGLU's input
    with Tracker() as tracker:
        grads = torch.autograd.grad(out, (x, probs, *mlp.parameters()), torch.empty_like(out))
    assert [tuple(g.shape) for g in grads[2:]] == (
        [(2 * F, H)] * G + [(2 * F,)] * G + [(H, F)] * G + [(H,)] * G)  # fmt: skip
    assert all(g.dtype == torch.bfloat16 for g in grads[2:])
    made = [e.bytes for e in tracker.events if e.bytes > 0]
    assert G * H * 4 in made and G * 2 * F * 4 in made  # the fp32 bias gradients
