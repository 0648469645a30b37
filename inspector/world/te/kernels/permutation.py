"""TE's fused MoE permutation (`transformer_engine.pytorch.permutation`): what it allocates and saves.

megatron-core calls these for `--moe-permute-fusion` (extensions/transformer_engine.py imports
`moe_permute`, `moe_permute_with_probs`, `moe_sort_chunks_by_index(_with_probs)`, `moe_unpermute`
as `fused_*`; moe_utils.py `permute`, `unpermute`, `sort_chunks_by_idxs` with `fused=True`),
always with the mask routing map. TE v2.11 pytorch/permutation.py:
- `_moe_permute_mask_map` (184-331): `triton_permutation.make_row_id_map` (212) allocates the
  row_id_map, int32 [tokens, 2 x experts + 1] (triton/permutation.py 52), and a workspace int32
  [experts, cdiv(tokens, 1024)] (55), freed on return; `permute_with_mask_map` the output
  [num_out_tokens, hidden] in the input's dtype and, with probs, the permuted probs
  [num_out_tokens] (156-158). Saves the row_id_map alone (295). Backward: `unpermute_with_mask_map`
  [tokens, hidden] and, with probs' grad, [tokens, experts] in the probs' dtype (230-234).
- `_moe_unpermute_mask_map` (333-501): the output [tokens, hidden] (unpermute_with_mask_map 230);
  saves (inp, row_id_map, merging_probs) with merging probs, else the row_id_map (376-378).
  Backward: with probs `unpermute_with_mask_map_bwd_with_merging_probs` [permuted, hidden] and
  [tokens, experts] (298-303), else `permute_with_mask_map` [permuted, hidden] (156).
- `_moe_chunk_sort` (623-722): `make_chunk_sort_map` int32 [tokens] (351), `sort_chunks_by_map`
  [tokens, hidden] and, with probs, [tokens] (389-391); saves the row_id_map (678); backward the
  same two.
TE 2.14 adds `pad_offsets` to the mask-map Functions, saved beside the row_id_map (v2.14 334,
435-437), None (nothing saved) unless `moe_permute_and_pad_with_probs` made it; 2.17 rewrites them
as `torch.library.custom_op`s whose `setup_context` saves the same tensors (v2.17.1 519, 805-808,
1250) and whose kernels allocate the same (triton/permutation.py v2.17.1 52-55, 162-170, 246-250,
327-331, 381, 419-421: the row_id_map layout is unchanged). Not simulated: fp8 inputs (megatron
permutes 16-bit hidden states) and the index map (megatron passes the mask).
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK = 1024  # triton/permutation.py make_row_id_map: block_size, the workspace's token tile


def _rows(num_out_tokens: Any) -> int:
    """The permuted rows: megatron passes an int or a 0-d tensor (`tokens_per_expert.sum()`)."""
    return int(num_out_tokens)


class PermuteMaskMap(torch.autograd.Function):
    """TE `_moe_permute_mask_map` (v2.11 permutation.py 184-331)."""

    SAVED = ("row_id_map",)  # 295 (2.14+: and pad_offsets, None here)

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Any,
                probs: torch.Tensor | None) -> tuple[Any, ...]:  # fmt: skip
        tokens, hidden = inp.shape
        experts = routing_map.shape[1]
        device = inp.device
        row_id_map = torch.empty((tokens, experts * 2 + 1), dtype=torch.int32, device=device)
        workspace = torch.empty((experts, -(-tokens // BLOCK)), dtype=torch.int32, device=device)
        del workspace  # make_row_id_map's, freed when it returns
        rows = _rows(num_out_tokens)
        output = torch.empty((rows, hidden), dtype=inp.dtype, device=device)
        permuted_probs = None
        if probs is not None:
            permuted_probs = torch.empty((rows,), dtype=probs.dtype, device=device)
        ctx.save_for_backward(row_id_map)
        ctx.shape = (tokens, hidden, experts)
        return output, row_id_map, permuted_probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any, probs_grad: Any) -> Any:
        tokens, hidden, experts = ctx.shape
        act_grad = torch.empty((tokens, hidden), dtype=grad.dtype, device=grad.device)
        unpermuted_probs = None
        if probs_grad is not None:
            unpermuted_probs = torch.empty((tokens, experts), dtype=probs_grad.dtype,
                                           device=grad.device)  # fmt: skip
        return act_grad, None, None, unpermuted_probs if ctx.needs_input_grad[3] else None


class UnpermuteMaskMap(torch.autograd.Function):
    """TE `_moe_unpermute_mask_map` (v2.11 permutation.py 333-501)."""

    SAVED = ("inp", "row_id_map", "merging_probs")  # 376; without merging probs the map alone

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, row_id_map: torch.Tensor,
                merging_probs: torch.Tensor | None, restore_shape: Any) -> torch.Tensor:  # fmt: skip
        tokens, hidden = restore_shape if restore_shape is not None else inp.shape
        experts = (row_id_map.shape[1] - 1) // 2
        output = torch.empty((tokens, hidden), dtype=inp.dtype, device=inp.device)
        if merging_probs is not None:
            ctx.save_for_backward(inp, row_id_map, merging_probs)
        else:
            ctx.save_for_backward(row_id_map)
        ctx.shape = (tokens, experts, inp.shape[0], hidden)
        ctx.probs_dtype = None if merging_probs is None else merging_probs.dtype
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        tokens, experts, permuted, hidden = ctx.shape
        act_grad = torch.empty((permuted, hidden), dtype=grad.dtype, device=grad.device)
        probs_grad = None
        if ctx.probs_dtype is not None:  # unpermute_with_mask_map_bwd_with_merging_probs
            probs_grad = torch.empty((tokens, experts), dtype=ctx.probs_dtype, device=grad.device)
        return act_grad, None, probs_grad if ctx.needs_input_grad[2] else None, None


class ChunkSort(torch.autograd.Function):
    """TE `_moe_chunk_sort` (v2.11 permutation.py 623-722)."""

    SAVED = ("row_id_map",)  # 678

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                probs: torch.Tensor | None) -> tuple[Any, ...]:  # fmt: skip
        tokens, hidden = inp.shape
        row_id_map = torch.empty((tokens,), dtype=torch.int32, device=inp.device)
        output = torch.empty((tokens, hidden), dtype=inp.dtype, device=inp.device)
        permuted_probs = None
        if probs is not None:
            permuted_probs = torch.empty((tokens,), dtype=probs.dtype, device=inp.device)
        ctx.save_for_backward(row_id_map)
        return output, permuted_probs

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, probs_grad: Any) -> Any:
        act_grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        permuted_probs = None
        if probs_grad is not None:
            permuted_probs = torch.empty(probs_grad.shape, dtype=probs_grad.dtype,
                                         device=grad.device)  # fmt: skip
        return act_grad, None, None, permuted_probs if ctx.needs_input_grad[3] else None


def _mask_only(map_type: str) -> None:
    if map_type != "mask":  # megatron-core passes the mask routing map only
        raise NotImplementedError("the stand-in simulates TE's mask-map permutation only")


def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: Any = -1,
                max_token_num: int = -1, map_type: str = "mask") -> tuple[Any, Any]:  # fmt: skip
    """TE `moe_permute` (v2.11 permutation.py 503-542): the permuted tokens and the row_id_map."""
    _mask_only(map_type)
    output, row_id_map, _ = PermuteMaskMap.apply(inp, routing_map, num_out_tokens, None)
    return output, row_id_map


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: Any = -1) -> tuple[Any, Any, Any]:  # fmt: skip
    """TE `moe_permute_with_probs` (545-575): tokens, permuted probs, row_id_map."""
    output, row_id_map, permuted_probs = PermuteMaskMap.apply(inp, routing_map, num_out_tokens, probs)
    return output, permuted_probs, row_id_map


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor, merging_probs: Any = None,
                  restore_shape: Any = None, map_type: str = "mask", probs: Any = None,
                  pad_offsets: Any = None) -> Any:  # fmt: skip
    """TE `moe_unpermute` (578-620; `pad_offsets` from 2.12, v2.14 713-721, which megatron-core
    0.19 passes under `is_te_min_version("2.12.0")`: None unless padded)."""
    _mask_only(map_type)
    if pad_offsets is not None:
        raise NotImplementedError("moe_permute_and_pad_with_probs is not simulated")
    return UnpermuteMaskMap.apply(inp, row_id_map, merging_probs if probs is None else probs,
                                  restore_shape)  # fmt: skip


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor,
                             sorted_index: torch.Tensor) -> Any:  # fmt: skip
    """TE `moe_sort_chunks_by_index` (724-744)."""
    output, _ = ChunkSort.apply(inp, split_sizes, sorted_index, None)
    return output


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor,
                                        split_sizes: torch.Tensor,
                                        sorted_index: torch.Tensor) -> tuple[Any, Any]:  # fmt: skip
    """TE `moe_sort_chunks_by_index_with_probs` (747-772)."""
    output, permuted_probs = ChunkSort.apply(inp, split_sizes, sorted_index, probs)
    return output, permuted_probs


FUNCTIONS = {f.__name__: f for f in (moe_permute, moe_permute_with_probs, moe_unpermute,
                                      moe_sort_chunks_by_index,
                                      moe_sort_chunks_by_index_with_probs)}  # fmt: skip
