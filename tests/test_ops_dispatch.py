"""formulas/ops.py's unfused softmax against what megatron's own code dispatches on fake tensors.

Megatron-core's FusedScaleMaskSoftmax (the path without a fused kernel, forward_torch_softmax)
runs forward and backward under FakeTensorMode with a dispatch recorder; the bytes its aten ops
read and write per attention score must equal what ops.py prices for "softmax in fp32".
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inspector.formulas.kernels import Memory
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
    assert priced["softmax in fp32"].bytes == sum(b for _, b in forward)
    # the gradient the test feeds (grad of probs) is an input of the first backward op, as on the GPU
    assert priced["softmax in fp32 backward"].bytes == sum(b for _, b in backward)
    assert priced["softmax in fp32"].elements == elements
