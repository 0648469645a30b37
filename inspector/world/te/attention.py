"""Stand-in for TE's DotProductAttention, as megatron's TEDotProductAttention constructs it.

Mirrors transformer_engine 2.11.0 `pytorch/attention/dot_product_attention/dot_product_attention.py`
(DotProductAttention 154-470, constructor 318-470) and the three backends it always builds
(`backends.py`: UnfusedDotProductAttention 206-245, FlashAttention 623-660, FusedAttention
1641-1700; `softmax.py` FusedScaleMaskSoftmax 144). None holds a parameter, except the learnable
softmax offset. `forward` runs the fused (cuDNN) backend's memory contract
(`attention_functions.FusedAttnFunction`), under context parallelism TE's p2p ring
(`attention_functions.P2PAttnFunction`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from inspector.world.te import release
from inspector.world.te._base import TransformerEngineBaseModule, empty, world_size
from inspector.world.te.kernels.attention_functions import FusedAttnFunction, P2PAttnFunction
from inspector.world.te.kernels.fp8_attention import FP8FusedAttnFunction
from inspector.world.te.kernels.thd import thd_attention
from inspector.world.te.state import FP8GlobalStateManager


def _fused_backend(dtype: torch.dtype) -> bool:
    """Return whether TE runs fused (cuDNN) or flash attention, as `get_attention_backend` picks
    (dot_product_attention/utils.py, v2.11): both need fp16/bf16 and are not opted out of
    (NVTE_FUSED_ATTN / NVTE_FLASH_ATTN, which megatron sets from --attention-backend in
    LanguageModule._set_attention_backend); otherwise the unfused backend runs."""
    allowed = os.getenv("NVTE_FUSED_ATTN", "1") != "0" or os.getenv("NVTE_FLASH_ATTN", "1") != "0"
    return allowed and dtype in (torch.float16, torch.bfloat16)


# TE runs attention in MXFP8 from 2.15 (dot_product_attention.py `init_fp8_metadata`: 2.14
# asserts, 676-680; 2.15+ keep the MXFP8 recipe, utils.py get_attention_backend 621-638 at
# v2.17.1 picks FusedAttention on sm100+ with cuDNN 9.21+, sbhd or bshd).
MXFP8_ATTENTION_SINCE = (2, 15)


def fp8_attention_recipe() -> str | None:
    """Return the scaling TE runs this attention in fp8 with, "delayed", "current" or "mxfp8";
    None for 16 bits (dot_product_attention.py 575-680, 1010-1030 at v2.11: fp8 inside
    fp8_autocast when the recipe's `fp8_dpa` is set; the per-tensor recipes, and MXFP8 from
    TE 2.15, v2.17.1 `init_fp8_metadata` 629-768). Other recipes assert, as TE does (v2.14 676-680)."""
    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    recipe = FP8GlobalStateManager.get_fp8_recipe()
    if not (getattr(recipe, "fp8_dpa", False) or getattr(recipe, "fp8_mha", False)):
        return None
    if recipe.delayed() or recipe.float8_current_scaling():
        return "delayed" if recipe.delayed() else "current"
    if recipe.mxfp8() and release() >= MXFP8_ATTENTION_SINCE:
        return "mxfp8"
    raise AssertionError(f"DotProductAttention does not support {type(recipe).__name__} recipe")


def _size(group: Any) -> int:
    """Return a process group's size (1 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 1
    return int(torch.distributed.get_world_size(group=group))


def _rank(group: Any) -> int:
    """Return this rank's index in a process group (0 without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return 0
    return int(torch.distributed.get_rank(group=group))


# TE's AttnTypes (pytorch/constants.py).
ATTN_TYPES = ("self", "cross")


def _window_size(attn_mask_type: str, window_size: Any) -> Any:
    """Default the sliding window as TE's check_set_window_size does (dpa utils.py 2031-2075)."""
    if window_size is not None:
        return tuple(window_size)
    return (-1, 0) if "causal" in attn_mask_type else (-1, -1)


def qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Return q, k and v as Transformer Engine's attention takes them (v2.11 attention/
    dot_product_attention/utils.py `get_qkv_layout`, called by DotProductAttention.forward for
    every backend): as given where `run_iteratively` finds a layout it supports (one packed
    buffer, q beside a packed kv, or three tensors whose k and v strides agree), else each copied
    contiguous. Megatron's roped q and k are new tensors while v stays a view of the QKV linear's
    output: not supported, so TE copies v and the linear's output is freed.
    (TE asserts a contiguous last dimension; the copy stands in for its error.)"""
    if all(t.stride(-1) == 1 for t in (q, k, v)) and _supported(q, k, v):
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


def _supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Return whether `get_qkv_layout`'s `run_iteratively` names a layout (not "not_supported");
    storages compared by identity, as data pointers (meta tensors have none)."""
    def same(*ts: torch.Tensor) -> bool:
        first = ts[0].untyped_storage()._cdata
        return all(t.untyped_storage()._cdata == first for t in ts)

    ptrs_qkv, ptrs_qk, ptrs_kv = same(q, k, v), same(q, k), same(k, v)
    shapes_qkv = q.shape == k.shape == v.shape
    shapes_kv = k.shape[:-1] == v.shape[:-1]
    strides_qkv = q.stride() == k.stride() == v.stride()
    strides_kv = (tuple(s / k.shape[-1] for s in k.stride()[:-1])
                  == tuple(s / v.shape[-1] for s in v.stride()[:-1]))  # fmt: skip
    hd = q.shape[-1] * q.shape[-2]
    offsets = [t.storage_offset() for t in (q, k, v)]
    if ptrs_qkv and strides_qkv and shapes_qkv and (offsets == [0, hd, 2 * hd]
                                                    or offsets == [0, q.shape[-1], 2 * q.shape[-1]]):
        return True  # sb3hd, sbh3d
    sizes = [q.numel(), k.numel()]
    start = sizes[0] if ptrs_qkv else 0
    kv_hd = k.shape[-1] * k.shape[-2]
    if ptrs_kv and strides_kv and shapes_kv and (offsets[1:] == [start, start + kv_hd]
                                                 or offsets[1:] == [start, start + k.shape[-1]]):
        return True  # sbhd_sb2hd, sbhd_sbh2d
    hd_qkv = offsets == [0, sizes[0], sizes[0] + sizes[1]] if ptrs_qkv else offsets == [0, 0, 0]
    hd_qk = offsets[:2] == [0, sizes[0]] if not ptrs_qkv and ptrs_qk else offsets[:2] == [0, 0]
    hd_kv = offsets[1:] == [0, sizes[1]] if not ptrs_qkv and ptrs_kv else offsets[1:] == [0, 0]
    return strides_kv and shapes_kv and (hd_qkv or hd_kv or hd_qk)  # sbhd_sbhd_sbhd


class FusedScaleMaskSoftmax(torch.nn.Module):
    """TE's fused softmax module (softmax.py 144); no parameters."""

    def __init__(self, mask_func: Any = None) -> None:
        super().__init__()
        self.mask_func = mask_func


class UnfusedDotProductAttention(torch.nn.Module):
    """TE's unfused backend (backends.py 206-245): a softmax module and a dropout."""

    def __init__(self, softmax_scale: float, attention_dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.layer_number = kwargs.get("layer_number")
        self.softmax_type = kwargs.get("softmax_type", "vanilla")
        self.scale_mask_softmax = FusedScaleMaskSoftmax()
        self.attention_dropout = torch.nn.Dropout(attention_dropout)


class FlashAttention(torch.nn.Module):
    """TE's flash-attn backend (backends.py 623-660); no submodules, no parameters."""

    def __init__(self, softmax_scale: float, attention_dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.layer_number = 1 if kwargs.get("layer_number") is None else kwargs["layer_number"]


class FusedAttention(torch.nn.Module):
    """TE's cuDNN fused backend (backends.py 1641-1700); no submodules, no parameters."""

    def __init__(self, softmax_scale: float, attention_dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.layer_number = 1 if kwargs.get("layer_number") is None else kwargs["layer_number"]
        self.softmax_type = kwargs.get("softmax_type", "vanilla")


class DotProductAttention(TransformerEngineBaseModule):
    """TE's DotProductAttention (dot_product_attention.py 318-470).

    No parameters, except `softmax_offset` of (num_attention_heads // tp_size,) for
    softmax_type="learnable" (432-437; torch's default dtype: TE passes none);
    "off-by-one" keeps a plain zero tensor of that shape, "vanilla" None (426-431). Attributes
    megatron and TE read back: num_attention_heads, num_gqa_groups(_per_partition),
    hidden_size_per_attention_head_k/_v, tp_size, cp_group, cp_global_ranks, cp_comm_type,
    layer_number, attention_type, attn_mask_type, window_size, softmax_type.
    """

    # Long by design: mirrors Transformer Engine's own argument list (see TE-NOTES.md).
    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Any = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Any = None,
        tp_group: Any = None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group: Any = None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
    ) -> None:
        super().__init__()
        self.qkv_format = qkv_format
        attn_mask_type = attn_mask_type.replace(",", "_")
        if attn_mask_type == "causal_padding":
            attn_mask_type = "padding_causal"
        self.attn_mask_type = attn_mask_type
        self.window_size = _window_size(attn_mask_type, window_size)
        self.tp_size = world_size(tp_group, tp_size)
        if tp_group is not None or tp_size == 1:
            self.set_tensor_parallel_group(tp_group)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads = num_attention_heads
        self.layer_number = 1 if layer_number is None else layer_number
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type
        k_channels = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.hidden_size_per_attention_head_k = k_channels
        self.hidden_size_per_attention_head_v = (
            kv_channels if isinstance(kv_channels, int) else kv_channels[1]
        )
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        self.num_gqa_groups_per_partition = int(self.num_gqa_groups // self.tp_size)
        if num_attention_heads % self.num_gqa_groups != 0:
            raise AssertionError(
                "The number of attention heads must be divisible by the number of GQA groups!"
            )
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        if attention_type not in ATTN_TYPES:
            raise AssertionError(f"attention_type {attention_type} not supported")
        self.attention_type = attention_type
        self.attention_dropout = attention_dropout
        self.return_max_logit = return_max_logit
        self._register_softmax_offset(softmax_type, get_rng_state_tracker)
        backend = dict(attention_type=attention_type, layer_number=layer_number)
        self.flash_attention = FlashAttention(softmax_scale, attention_dropout, **backend)
        self.fused_attention = FusedAttention(
            softmax_scale, attention_dropout, softmax_type=softmax_type, **backend
        )
        self.unfused_attention = UnfusedDotProductAttention(
            softmax_scale, attention_dropout, softmax_type=softmax_type, **backend
        )

    def _register_softmax_offset(self, softmax_type: str, get_rng_state_tracker: Any) -> None:
        """Hold the softmax offset as TE does for each softmax type (425-437)."""
        self.softmax_type = softmax_type
        heads = self.num_attention_heads // self.tp_size
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device="meta")
        elif softmax_type == "learnable":
            self.register_parameter(
                "softmax_offset",
                torch.nn.Parameter(empty(heads, dtype=None)),
                get_rng_state_tracker=get_rng_state_tracker,
            )

    def forward(
        self,
        query_layer: torch.Tensor,
        key_layer: torch.Tensor,
        value_layer: torch.Tensor,
        attention_mask: Any = None,
        qkv_format: str | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Run the fused backend as memory sees it (dot_product_attention.py `forward`, v2.11).

        sbhd in, [s, b, heads * head dim] out (FusedAttention.forward's final view); q, k
        and v as TE's `get_qkv_layout` leaves them (`qkv_layout`).
        """
        qkv_format = qkv_format or self.qkv_format
        cp_size = _size(self.cp_group) if self.cp_group is not None else 1
        if qkv_format == "thd" and cp_size == 1 and _fused_backend(query_layer.dtype):
            q, k, v = qkv_layout(query_layer, key_layer, value_layer)
            return thd_attention(q, k, v, kwargs)  # kernels/thd.py
        if qkv_format not in ("sbhd", "bshd"):
            raise NotImplementedError(
                "the simulated Transformer Engine runs attention in the sbhd and bshd formats, "
                "and thd (packed sequences) in 16 bits without context parallelism"
            )
        if cp_size > 1:
            mask = kwargs.get("attn_mask_type", self.attn_mask_type)
            return self._context_parallel(query_layer, key_layer, value_layer, qkv_format, mask)
        if not _fused_backend(query_layer.dtype):
            return self._unfused(query_layer, key_layer, value_layer, qkv_format)
        q, k, v = qkv_layout(query_layer, key_layer, value_layer)
        # the learned offset as TE passes it to the kernels (dot_product_attention.py 1404-1408)
        offset = self.softmax_offset
        offset = None if offset is None else offset.reshape(1, -1, 1, 1).to(torch.float32)
        scaling = fp8_attention_recipe()
        if scaling is not None:  # the FP8 backend (kernels/fp8_attention.py)
            out: torch.Tensor = FP8FusedAttnFunction.apply(q, k, v, qkv_format, offset, scaling)
        else:
            out = FusedAttnFunction.apply(q, k, v, qkv_format, offset)
        return out.view(out.shape[0], out.shape[1], -1)

    def _context_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str, mask: str
    ) -> torch.Tensor:
        """FusedAttention.forward under context parallelism (backends.py 1868-1910, v2.11): q, k,
        v made contiguous, then `attn_forward_func_with_cp` (context_parallel.py 3890-4110) runs
        the p2p ring, `attention_functions.P2PAttnFunction`. TE has no context-parallel unfused
        attention (`get_attention_backend` disables it), so 32-bit inputs leave no backend: TE
        raises."""
        fp8 = fp8_attention_recipe() is not None
        if not _fused_backend(q.dtype) or self.cp_comm_type != "p2p" or fp8:
            raise NotImplementedError(
                "the simulated Transformer Engine runs context-parallel attention in fp16/bf16 "
                "(not fp8) with cp_comm_type p2p only"
            )
        q, k, v = (t.contiguous() for t in (q, k, v))
        ring = (_size(self.cp_group), _rank(self.cp_group), "causal" in mask)
        out: torch.Tensor = P2PAttnFunction.apply(q, k, v, ring, qkv_format)
        return out.view(out.shape[0], out.shape[1], -1)

    def _unfused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv_format: str
    ) -> torch.Tensor:
        """TE's UnfusedDotProductAttention.forward (backends.py 246-560, v2.11) in torch ops, so
        autograd saves what it saves: the s x s probabilities (softmax output) and, with
        dropout, their mask and dropped copy. The causal mask's s x s temporaries (utils.py
        `get_full_mask`, softmax.py `_get_default_causal_mask`) are left out."""
        if qkv_format == "bshd":  # to sbhd views (backends.py 285-290)
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        sq, b, heads, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[0]
        if k.shape[2] != heads:  # GQA: repeat K and V to every head (backends.py 363-371)
            k = k.repeat_interleave(heads // k.shape[2], dim=2)
            v = v.repeat_interleave(heads // v.shape[2], dim=2)
        q2, k2 = q.reshape(sq, b * heads, -1), k.reshape(sk, b * heads, -1)
        scores = torch.empty((b * heads, sq, sk), dtype=q.dtype, device=q.device)
        scale = self.unfused_attention.softmax_scale
        keys = k2.transpose(0, 1).transpose(1, 2)
        scores = torch.baddbmm(scores, q2.transpose(0, 1), keys, beta=0.0, alpha=scale)
        scores = scores.view(b, heads, sq, sk)
        if self.softmax_offset is not None:  # the sink as a last column, dropped after (481-506)
            sink = self.softmax_offset.reshape(1, -1, 1, 1).to(scores.dtype)
            scores = torch.cat([scores, sink.expand(b, -1, sq, -1)], dim=-1)
        probs = torch.nn.functional.softmax(scores, dim=-1)  # masked in place first (utils.py 72)
        probs = probs[..., :sk]
        probs = self.unfused_attention.attention_dropout(probs)
        v2 = v.reshape(sk, b * heads, -1)
        context = torch.bmm(probs.view(b * heads, sq, sk), v2.transpose(0, 1))
        context = context.view(b, heads, sq, -1)
        if qkv_format == "bshd":  # [b, np, sq, hn] -> [b, sq, np, hn] (backends.py 546-552)
            return context.permute(0, 2, 1, 3).contiguous().view(b, sq, -1)
        return context.permute(2, 0, 1, 3).contiguous().view(sq, b, -1)

    def set_context_parallel_group(
        self,
        cp_group: Any,
        cp_global_ranks: list[int],
        cp_stream: Any,
        cp_comm_type: str = "p2p",
    ) -> None:
        """Set the context-parallel group (dot_product_attention.py 529-570)."""
        self.cp_group = cp_group
        self.cp_global_ranks = cp_global_ranks
        self.cp_stream = cp_stream
        self.cp_comm_type = cp_comm_type
