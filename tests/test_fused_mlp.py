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
