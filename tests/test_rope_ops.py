"""Rotary embedding without its fusion, and MLA's query/key/value assembly (formulas/rope_ops.py).

megatron-core's `_apply_rotary_pos_emb_bshd` runs forward and backward under FakeTensorMode with a
dispatch recorder: the bytes its kernels move per rotated element must equal what rope_ops.py
prices (cos and sin of the positions left out: tensors under half the rotated elements).
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inspector.formulas.ops import Shard, layer_ops
from inspector.formulas.rope_ops import mla_rope, rotary
from inspector.job.dims import ModelDims
from inspector.job.job import make_job
from tests.test_mla import MLA, TINY
from tests.test_versions import MLA_ROPE_KV_CP_ARGS

VIEWS = ("aten.alias", "aten.slice.", "aten.split.", "aten.view", "aten.expand", "aten.empty_like",
         "aten.detach", "aten.t.", "aten.transpose")


class _Kernels(TorchDispatchMode):
    """Record the bytes each kernel moves, counting tensors of at least `least` elements: reads
    and writes; slice_backward as torch runs it, a zero fill of its output and a copy of the
    gradient into it."""

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least, self.bytes = least, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("aten.") and not name.startswith(VIEWS):
            size = lambda tree: sum(t.numel() * t.element_size() for t in tree_leaves(tree)  # noqa: E731
                                    if isinstance(t, torch.Tensor) and t.numel() >= self.least)
            read, written = size((args, kwargs)), size(out)
            self.bytes += written + 2 * read if name.startswith("aten.slice_backward") else read + written
        return out


@pytest.mark.parametrize("mla", [False, True])
def test_unfused_rope_bytes_match_megatrons_dispatch(mla: bool) -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    s, b, n, r = 16, 2, 8, 32
    elements = s * b * n * r
    with FakeTensorMode():
        t = torch.empty(s, b, n, r, dtype=torch.bfloat16, requires_grad=True)
        freqs = torch.empty(s, 1, 1, r, dtype=torch.float32)
        forward, backward = _Kernels(elements // 2), _Kernels(elements // 2)
        with forward:
            out = _apply_rotary_pos_emb_bshd(t, freqs, False, mla, mscale=1.0)  # 0.19: mla_rotary_interleaved
        with backward:
            out.backward(torch.empty_like(out))
    priced = rotary(elements, 2, fused=False, mla=mla)
    assert (priced[0][0].bytes, priced[1][0].bytes) == (forward.bytes, backward.bytes)


def test_rope_fusion_is_megatrons_apply_rope_fusion() -> None:
    """On for Transformer Engine jobs with RoPE, off with --no-rope-fusion or the local spec."""
    assert make_job(TINY).dims().rope_fusion
    assert not make_job({**TINY, "no_rope_fusion": True}).dims().rope_fusion
    assert not make_job({**TINY, "transformer_impl": "local"}).dims().rope_fusion


def _mla_dims(fused: bool) -> ModelDims:
    return ModelDims(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                     vocab_size=128, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16,
                     qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rotary=True,
                     rope_fusion=fused)  # fmt: skip


def test_unfused_mla_prices_the_cats_and_recomputes_them() -> None:
    """T = 32 tokens, n = 2 heads (tp 2), c = 16, r = 8, v = 16, 2-byte activations:
    forward cats 2 x 32 x 2 x 24 elements and the value copy 32 x 2 x 16, read and written;
    backward the split cats 32 x 2 x (2c + r + v = 56) and the expand's sum (reads 32 x 2 x 8)."""
    assert MLA["qk_head_dim"] == 16  # the job the tests of test_mla.py build has these sizes
    z = Shard(tp=2)
    fused, unfused = layer_ops(_mla_dims(True), z, False), layer_ops(_mla_dims(False), z, False)
    named = {op.name: op for op in unfused.forward + unfused.backward}
    assert named["MLA query, key cat"].bytes == 2 * 32 * 2 * 24 * 4
    assert named["MLA value contiguous"].bytes == 32 * 2 * 16 * 4
    assert named["MLA q, kv split backward (cat)"].bytes == 32 * 2 * 56 * 4
    assert named["MLA key expand backward (sum)"].bytes == 32 * 2 * 8 * 2
    # RoPE on Q's 2 heads and K's one: 32 x 3 x 8 elements, 14 and 21 activations' bytes each
    assert named["rotary Q, K (unfused)"].bytes == 32 * 3 * 8 * 14 * 2
    assert named["rotary Q, K (unfused) backward"].bytes == 32 * 3 * 8 * 21 * 2
    # `--recompute-modules mla_up_proj` runs qkv_up_proj_and_rope_apply again: the cats too
    again = {op.name for op in unfused.recomputed(("mla_up_proj",))}
    assert {"MLA query, key cat", "MLA value contiguous", "rotary Q, K (unfused)"} <= again
    assert "MLA query, key cat" not in {op.name for op in fused.forward + fused.backward}


class _Launches:
    """A Triton kernel that records the bytes of the tensors it is launched with (each read or
    written whole by the kv kernels; cos and sin, [s, r] per position, left out by size)."""

    def __init__(self, least: int) -> None:
        self.least, self.bytes = least, 0

    def __getitem__(self, grid: object) -> object:
        return self._launch

    def _launch(self, *args: object, **kwargs: object) -> None:
        self.bytes += sum(t.numel() * t.element_size() for t in args
                          if isinstance(t, torch.Tensor) and t.numel() >= self.least)


def test_fused_mla_rope_prices_the_kv_kernel_megatron_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """ApplyMLARotaryEmbKV (fusions/fused_mla_yarn_rope_apply.py) hands its kernels kv and
    k_pos_emb, and the key and value it allocates (backward: dk, dv, d_kv, d_emb), each read or
    written whole: the bytes priced as "MLA key, value (fused RoPE)"; q's kernel rotates its r
    wide part in place (the rotary op over T n r only: no rotary op on K)."""
    from inspector.world.setup import megatron, simulate_fused_mla_rope

    megatron()
    simulate_fused_mla_rope()
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    s, b, n, c, r, v = 16, 2, 4, 16, 8, 32
    tokens = s * b
    forward, backward = _Launches(tokens * r), _Launches(tokens * r)
    monkeypatch.setattr(fused, "rotary_fwd_kv_kernel", forward)
    monkeypatch.setattr(fused, "rotary_bwd_kv_kernel", backward)
    meta = dict(device="meta", dtype=torch.bfloat16)
    cos, sin = torch.empty(s, 1, 1, r, **meta), torch.empty(s, 1, 1, r, **meta)
    kv = torch.empty(s, b, n, c + v, **meta, requires_grad=True)
    pos = torch.empty(s, b, 1, r, **meta, requires_grad=True)
    # the context-parallel rank and size from megatron-core 0.14; the kernels it launches are the same
    cp = (0, 1) if MLA_ROPE_KV_CP_ARGS else ()
    key, value = fused.ApplyMLARotaryEmbKV.apply(kv, pos, cos, sin, r, c, v, None, *cp)
    torch.autograd.grad((key, value), (kv, pos), [torch.empty_like(key), torch.empty_like(value)])
    priced = mla_rope(tokens, n, (c, r, v), 2, True)
    named = {op.name: op for op in priced[0] + priced[1]}
    assert named["MLA key, value (fused RoPE)"].bytes == forward.bytes
    assert named["MLA key, value (fused RoPE) backward"].bytes == backward.bytes
    assert named["rotary Q, K"].bytes == tokens * n * r * 2 * 2  # read and write q's part


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mla_sequence_parallel_gathers_its_latents(recompute: str) -> None:
    """Attention's gather (and its backward reduce-scatter; under full recomputation the gather
    again) moves q_lora + kv_lora + r wide rows in three collectives, not the layer input's h:
    the MLP's gather and reduce-scatter and attention's output reduce-scatter stay h wide. The
    up projections and fc1 gather their inputs again for their weight gradients: what each
    gather takes beyond its data-gradient GEMM (tests/test_regather.py) is added."""
    import inspector.caches as caches
    from inspector.formulas.kernels import ops_seconds
    from inspector.formulas.ops import linear
    from inspector.job.hardware import GPUS
    from inspector.job.layout import Layout
    from inspector.plan.cost import _layer_time
    from inspector.plan.network import Network

    dims = ModelDims(2, 256, 8, 512, 1024, swiglu=True, flash_attention=True, rotary=True,
                     multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=32,
                     qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32)  # fmt: skip
    lay, net = Layout(tp=2, dp=4, sequence_parallel=True), Network(GPUS["h100"], 8)
    caches.clear()
    _, tensor, _, _ = _layer_time(dims, lay, net, 0.0, 1, recompute, 0)
    alpha, bandwidth = net.link(2)
    one = lambda width: alpha + 512 * width * 2 * (2 - 1) / 2 / bandwidth  # noqa: E731  # ring of 2
    passes = 3 if recompute == "full" else 2  # forward, backward (and the recomputed forward)
    latents = one(96) + one(32) + one(16)
    dgrad = lambda fan_in, fan_out: ops_seconds(  # noqa: E731
        linear("", 512, fan_in, fan_out)[1:2], GPUS["h100"])
    again = [(96, dgrad(96, 4 * (32 + 16))), (32, dgrad(32, 4 * (32 + 32))), (256, dgrad(256, 1024))]
    exposed = sum(max(0.0, one(width) - seconds) for width, seconds in again)
    assert exposed > 0
    assert tensor == pytest.approx(passes * (3 * one(256) + latents) + exposed)
