"""formulas/ops.py's unfused softmax against what megatron's own code dispatches on fake tensors.

Megatron-core's FusedScaleMaskSoftmax (the path without a fused kernel, forward_torch_softmax)
runs forward and backward under FakeTensorMode with a dispatch recorder; the bytes its aten ops
read and write per attention score must equal what ops.py prices for "softmax in fp32".
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inspector.formulas.kernels import Gemm, Memory
from inspector.formulas.ops import Shard, layer_ops
from inspector.job.dims import ModelDims

VIEWS = ("aten.view", "aten.t.", "aten.transpose", "aten.detach", "aten.permute", "aten._unsafe_view",
         "aten.expand", "aten.empty_like", "aten.ones_like")


class _Recorder(TorchDispatchMode):
    """Record each aten op with the bytes of its tensor inputs and outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func), sum(t.numel() * t.element_size() for t in tensors)))
        return out


def _recorded(heads: int, s: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Return megatron's forward and backward ops of the torch softmax on [1, heads, s, s] bf16."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False, mask_func=attention_mask_func, softmax_in_fp32=True,
        scale=None)
    with FakeTensorMode():
        scores = torch.empty(1, heads, s, s, dtype=torch.bfloat16, requires_grad=True)
        # a full-shape mask (megatron builds [s, s] on the GPU and broadcasts it: 1 byte a score
        # either way as ops.py counts it)
        mask = torch.empty(1, heads, s, s, dtype=torch.bool)
        forward, backward = _Recorder(), _Recorder()
        with forward:
            probs = softmax(scores, mask)
        with backward:
            probs.backward(torch.empty_like(probs))
    keep = lambda ops: [op for op in ops  # noqa: E731
                        if op[0].startswith("aten.") and not op[0].startswith(VIEWS)]
    return keep(forward.ops), keep(backward.ops)


def test_torch_softmax_bytes_match_megatrons_dispatch() -> None:
    heads, s = 4, 64
    forward, backward = _recorded(heads, s)
    assert [name for name, _ in forward] == [
        "aten._to_copy.default", "aten.masked_fill_.Scalar", "aten._softmax.default",
        "aten._to_copy.default"]
    assert [name for name, _ in backward] == [
        "aten._to_copy.default", "aten._softmax_backward_data.default", "aten.masked_fill.Scalar",
        "aten._to_copy.default"]
    dims = ModelDims(num_layers=1, hidden_size=64 * heads, num_attention_heads=heads, seq_length=s,
                     vocab_size=128, fused_kernels=False, flash_attention=False)
    ops = layer_ops(dims, Shard(), moe=False)
    priced = {op.name: op for op in ops.forward + ops.backward if isinstance(op, Memory)}
    elements = heads * s * s
    parts = ("softmax casts and mask", "softmax in fp32")
    assert sum(priced[name].bytes for name in parts) == sum(b for _, b in forward)
    # the gradient the test feeds (grad of probs) is an input of the first backward op, as on the GPU
    assert sum(priced[name + " backward"].bytes for name in parts) == sum(b for _, b in backward)
    # the softmax kernels themselves are priced apart (their rows' kernel, test_softmax_rows)
    assert priced["softmax in fp32"].bytes == dict(forward)["aten._softmax.default"]
    assert priced["softmax in fp32 backward"].bytes == dict(backward)[
        "aten._softmax_backward_data.default"]
    assert priced["softmax in fp32"].elements == elements


@pytest.mark.parametrize(("s", "kernel"), [(1024, "copy"), (2048, "rms_norm"), (4096, "rms_norm")])
def test_softmax_rows(s: int, kernel: str) -> None:
    # torch's softmax runs rows of up to 1,024 fp32 elements in a warp's registers and longer ones a
    # block a row with block reductions, like the norm kernels (SoftMax.cu host_softmax);
    # megatron's fused kernel runs a warp a row at every length: elementwise (copy) rate
    def classes(fused: bool) -> dict[str, str]:
        dims = ModelDims(num_layers=1, hidden_size=128 * 4, num_attention_heads=4, seq_length=s,
                         vocab_size=128, fused_kernels=fused, flash_attention=False)
        ops = layer_ops(dims, Shard(), moe=False)
        return {op.name: op.cls for op in ops.forward + ops.backward if isinstance(op, Memory)}

    torch_path = classes(False)
    assert torch_path["softmax in fp32"] == torch_path["softmax in fp32 backward"] == kernel
    assert torch_path["softmax casts and mask"] == "copy"
    assert classes(True)["scale-mask-softmax"] == "copy"


GEMMS = ("aten.mm.", "aten.bmm.", "aten.baddbmm.", "aten.addmm.")
# views and allocations (torch.split of the QKV output, the baddbmm's output buffer): no kernel
NO_KERNEL = (*VIEWS, "aten.split", "aten.slice", "aten.empty")
H, HEADS, S, B = 64, 2, 128, 8  # T = s b = 1,024 tokens: more than any bias or norm vector


class _LayerRecorder(_Recorder):
    """Record each aten op with the bytes of its tensors larger than one value per token.

    Left out: the biases, the norms' weights and their fp32 mean and rstd per token (ops.py
    prices a norm by its rows), so what is summed is what ops.py prices per element.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor) and t.numel() > S * B]
        self.ops.append((str(func), sum(t.numel() * t.element_size() for t in tensors)))
        return out


def _local_layer(bias: bool) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Return the aten ops of one layer of bench/gpu_time.py's `local` jobs, forward and backward.

    get_gpt_layer_local_spec with LayerNorm, GeLU, bf16, dropout 0.1 (megatron-core's defaults),
    softmax in fp32, the bias fusions off (TransformerConfig's defaults, as the jobs leave them),
    run on meta tensors with the kernels a GPU picks (memory/engine/cuda.py), fed a [b, a, s, s] mask.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from inspector.job.layout import Layout
    from inspector.memory.engine.cuda import cuda_on_meta
    from inspector.world.environment import fresh_attention_env
    from inspector.world.setup import simulated_rank

    # as a fresh process starts, and as the tool's own builds clear them (world/stage.py): a job
    # built earlier in this process set TE's attention opt-outs, which GPTModel asserts against
    fresh_attention_env()

    with cuda_on_meta(), simulated_rank(Layout(), 0, None):
        config = TransformerConfig(
            num_layers=1, hidden_size=H, num_attention_heads=HEADS, normalization="LayerNorm",
            add_bias_linear=bias, params_dtype=torch.bfloat16, bf16=True,
            attention_softmax_in_fp32=True, perform_initialization=False)
        spec = get_gpt_layer_local_spec(normalization="LayerNorm")
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128,
                       max_sequence_length=S, position_embedding_type="learned_absolute")
        layer = gpt.to(device="meta", dtype=torch.bfloat16).decoder.layers[0].train()
        x = torch.empty(S, B, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
        mask = torch.empty(B, HEADS, S, S, dtype=torch.bool, device="meta")
        forward, backward = _LayerRecorder(), _LayerRecorder()
        with forward:
            y, _ = layer(x, attention_mask=mask)
        with backward:
            y.backward(torch.empty_like(y))
    return forward.ops, backward.ops


def _split(ops: list[tuple[str, int]]) -> tuple[int, int]:
    """Return (GEMMs, bytes of the memory-bound ops) of recorded aten ops."""
    ops = [op for op in ops if op[0].startswith("aten.") and not op[0].startswith(NO_KERNEL)]
    gemms = [op for op in ops if op[0].startswith(GEMMS)]
    return len(gemms), sum(b for name, b in ops if not name.startswith(GEMMS))


def _priced(ops: tuple[object, ...]) -> tuple[int, int]:
    """Return (GEMMs, bytes of the memory-bound ops) ops.py lists, less the causal mask it builds
    and DDP's main_grad.add_ (megatron's DistributedDataParallel, not the layer)."""
    gemms = [op for op in ops if isinstance(op, Gemm)]
    memory = [op for op in ops if isinstance(op, Memory) and op.name != "causal mask"
              and not op.name.endswith("main_grad.add_")]
    return len(gemms), int(sum(op.bytes for op in memory))


@pytest.mark.parametrize("bias", [True, False])
def test_local_layer_matches_megatrons_dispatch(bias: bool) -> None:
    # a missing or undercounted op (a bias add, a dropout, a residual add, a gradient's sum)
    # changes the bytes; the fed mask is megatron's, so ops.py's "causal mask" (made when none
    # is given) is left out of both sides
    forward, backward = _local_layer(bias)
    dims = ModelDims(num_layers=1, hidden_size=H, num_attention_heads=HEADS, seq_length=S,
                     vocab_size=128, fused_kernels=False, flash_attention=False,
                     add_bias_linear=bias, bias_activation_fusion=False, bias_dropout_fusion=False)
    ops = layer_ops(dims, Shard(micro_batch=B), moe=False)
    assert _priced(ops.forward) == _split(forward)
    assert _priced(ops.backward) == _split(backward)


def test_multi_latent_attention_unfused_gemms_take_megatrons_head_widths(monkeypatch) -> None:
    # megatron-core's MLA builds its core attention with k_channels = qk_head_dim +
    # qk_pos_emb_head_dim and v_channels = v_head_dim (multi_latent_attention.py); Transformer
    # Engine's unfused backend (--attention-backend unfused) multiplies Q K^T over the first and
    # P V over the second: ops.py's batched GEMMs have those shapes, not kv_channels'
    from inspector.world.te.attention import DotProductAttention

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    qk, rope, v, heads, s, b = 16, 8, 12, 2, 32, 2
    attention = DotProductAttention(heads, (qk + rope, v))
    q = torch.empty(s, b, heads, qk + rope, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(s, b, heads, qk + rope, dtype=torch.bfloat16, device="meta", requires_grad=True)
    value = torch.empty(s, b, heads, v, dtype=torch.bfloat16, device="meta", requires_grad=True)
    shapes: list[tuple[int, ...]] = []

    class _Shapes(_Recorder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if str(func).startswith(("aten.bmm.", "aten.baddbmm.")):
                a, w = args[-2], args[-1]
                shapes.append((a.shape[0], a.shape[1], w.shape[2], a.shape[2]))  # batch, m, n, k
            return func(*args, **(kwargs or {}))

    with _Shapes():
        attention(q, k, value)
    dims = ModelDims(num_layers=1, hidden_size=64, num_attention_heads=heads, seq_length=s,
                     vocab_size=128, flash_attention=False, te_attention=True,
                     multi_latent_attention=True, qk_head_dim=qk, qk_pos_emb_head_dim=rope,
                     v_head_dim=v, kv_channels=128)  # type: ignore[call-arg]  # fmt: skip
    forward = [op for op in layer_ops(dims, Shard(micro_batch=b), moe=False).core if isinstance(op, Gemm)]
    assert [(g.batch, g.m, g.n, g.k) for g in forward] == shapes == [
        (b * heads, s, s, qk + rope), (b * heads, s, v, s)]
