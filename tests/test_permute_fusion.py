"""TE's fused MoE permutation, megatron's `--moe-permute-fusion` (issues #43, #44).

The stand-in's Functions (inspector/world/te/kernels/permutation.py) save what TE's do, counted by
hand from TE's source: v2.11 pytorch/permutation.py `_moe_permute_mask_map` 212 and 295 (the
row_id_map alone, int32 [tokens, 2 x experts + 1]: triton/permutation.py 52),
`_moe_unpermute_mask_map` 376-378, `_moe_chunk_sort` 678 (int32 [tokens]: triton 351); v2.14
(334, 435-437, 832) and v2.17.1 (519, 805-808, 1250) save the same tensors (and `pad_offsets`,
None unless padded) with the same row_id_map layout (triton/permutation.py 52 in both), so every
release the stand-in declares (2.11, 2.14, 2.16, 2.17.1) gives these counts. The engine takes
megatron's fused path with the flag only.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

T, E, HIDDEN, TOPK = 512, 8, 256, 2  # tokens, experts, hidden size, top-k


def _permutation() -> Any:
    from inspector.world import te

    te.install()
    import transformer_engine.pytorch.permutation as permutation

    return permutation


def _meta(*shape: int, dtype: Any = None, grad: bool = True) -> Any:
    import torch

    return torch.empty(shape, device="meta", dtype=dtype or torch.bfloat16, requires_grad=grad)


def _saved(out: Any) -> list[Any]:
    return [(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]


def test_fused_permute_saves_the_int32_row_id_map_alone() -> None:
    import torch

    p = _permutation()
    tokens, probs = _meta(T, HIDDEN), _meta(T, E, dtype=torch.float32)
    routing = _meta(T, E, dtype=torch.bool, grad=False)
    out, permuted_probs, row_id_map = p.moe_permute_with_probs(tokens, probs, routing, T * TOPK)
    assert out.shape == (T * TOPK, HIDDEN) and out.dtype == torch.bfloat16
    assert permuted_probs.shape == (T * TOPK,) and permuted_probs.dtype == torch.float32
    assert _saved(out) == [((T, 2 * E + 1), torch.int32)]  # 512 x 17 x 4 = 34,816 B
    assert row_id_map.shape == (T, 17) and not row_id_map.requires_grad
    grads = torch.autograd.grad((out, permuted_probs), (tokens, probs),
                                (torch.empty_like(out), torch.empty_like(permuted_probs)))  # fmt: skip
    assert [g.shape for g in grads] == [(T, HIDDEN), (T, E)]  # unpermute_with_mask_map 230-234


def test_fused_unpermute_saves_the_map_or_with_merging_probs_its_input_too() -> None:
    import torch

    p = _permutation()
    row_id_map = _meta(T, 2 * E + 1, dtype=torch.int32, grad=False)
    permuted = _meta(T * TOPK, HIDDEN)
    plain = p.moe_unpermute(permuted, row_id_map, restore_shape=torch.Size((T, HIDDEN)))
    assert plain.shape == (T, HIDDEN) and _saved(plain) == [((T, 17), torch.int32)]
    probs = _meta(T, E, dtype=torch.float32)
    merged = p.moe_unpermute(permuted, row_id_map, merging_probs=probs,
                             restore_shape=torch.Size((T, HIDDEN)))  # fmt: skip
    assert _saved(merged) == [((T * TOPK, HIDDEN), torch.bfloat16), ((T, 17), torch.int32),
                              ((T, E), torch.float32)]  # fmt: skip


def test_fused_chunk_sort_saves_an_int32_map_a_row() -> None:
    import torch

    p = _permutation()
    split = _meta(8, dtype=torch.int64, grad=False)
    out, probs = p.moe_sort_chunks_by_index_with_probs(
        _meta(T * TOPK, HIDDEN), _meta(T * TOPK, dtype=torch.float32), split, split)
    assert out.shape == (T * TOPK, HIDDEN) and probs.shape == (T * TOPK,)
    assert _saved(out) == [((T * TOPK,), torch.int32)]  # 4 B a row, not megatron's split and cat
    assert p.moe_sort_chunks_by_index(_meta(T, HIDDEN), split, split).shape == (T, HIDDEN)


def _mlp_buffers(cli: Any, *flags: str) -> list[int]:
    """The persistent buffers megatron's layer 0 MoE MLP keeps (the dispatcher's state)."""
    job = (f"memory --hidden-size {HIDDEN} --num-attention-heads 8 --seq-length 256 "
           "--max-position-embeddings 256 --vocab-size 1000 --bf16 --micro-batch-size 2 "
           "--global-batch-size 16 --swiglu --normalization RMSNorm --disable-bias-linear "
           f"--num-experts {E} --moe-router-topk {TOPK} --moe-ffn-hidden-size 128 "
           "--moe-grouped-gemm --num-layers 2 --dp 4 --ep 4 --format json")  # fmt: skip
    result = cli(*job.split(), *flags)
    assert result.code == 0, result.err
    stage = json.loads(result.out)["stages"][0]
    return [size for where, size in stage["buffers"]["persistent"] if where == "layer 0 mlp"]


@pytest.mark.slow
@pytest.mark.parametrize(("dispatcher", "row_id_map"), [
    # all-to-all: the rank's 512 tokens over all 8 experts, 512 x 17 x 4 B
    ("alltoall", T * (2 * E + 1) * 4),
    # all-gather: the ep group's 2,048 gathered tokens over the 2 local experts, 2048 x 5 x 4 B
    ("allgather", 4 * T * (2 * 2 + 1) * 4),
])  # fmt: skip
def test_the_dispatcher_keeps_tes_row_id_map_only_with_the_flag(cli: Any, dispatcher: str,
                                                                 row_id_map: int) -> None:  # fmt: skip
    """megatron's dispatchers keep the permute's third output for the combine
    (`reversed_local_input_permutation_mapping`, token_dispatcher.py): unfused megatron's int64
    sorted indices, one a permuted row (1,024 x 8 B); fused TE's row_id_map."""
    flags = ("--moe-token-dispatcher-type", dispatcher)
    unfused = _mlp_buffers(cli, *flags)
    fused = _mlp_buffers(cli, *flags, "--moe-permute-fusion")
    assert T * TOPK * 8 in unfused and row_id_map not in unfused
    assert row_id_map in fused and T * TOPK * 8 not in fused
