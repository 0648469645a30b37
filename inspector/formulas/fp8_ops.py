"""What Transformer Engine adds around an fp8 GEMM beyond the cast (formulas/ops.py prices them).

- Current scaling (`--fp8-recipe tensorwise`): an amax pass over the 16-bit input before each
  cast (`amax_pass`), except where a norm kernel computed it (`norm_fused_linears`).
- MoE experts under fp8 (megatron-core experts.py TEGroupedMLP): each expert's rows must be a
  multiple of 16 (32 for mxfp8; fp8_utils.py `get_fp8_align_size`). Where the dispatcher has not
  padded them, Transformer Engine's `Fp8Padding` pads the input and `Fp8Unpadding` the output
  (pytorch/module/fp8_padding.py, `fused_multi_row_padding`: a copy each, skipped only when every
  count is already aligned; the plan's equal shares are an average, and uneven routing, forced
  balancing's random logits included, leaves some count unaligned), their backward the opposite
  copies. The dispatcher pads them instead (`expert_padding`) with `--moe-router-padding-for-fp8`
  (token_dispatcher.py: the all-to-all's sender pads its routing map, `pad_routing_map`, so the
  padding rows are real tokens it sends; DeepEP's receiver pads what it received,
  `_DeepepManager._pad_routing_map`) and, under fp8 always, HybridEP's dispatch kernel
  (`dispatch_with_permute(pad_multiple=...)`, megatron-core 0.16): then TE copies nothing.
  Rows after padding (`padded_rows`): a count's remainder is taken as uniform under uneven
  routing, so padding adds (a - 1) / 2 rows on average, and at least up to the next multiple.
"""

from __future__ import annotations

import math

from inspector.formulas.kernels import Memory
from inspector.job.dims import ModelDims


def amax_pass(name: str, elements: int) -> Memory:
    """Return the amax pass Transformer Engine's current scaling makes before a cast to fp8.

    TE pytorch/csrc/quantizer.cpp `Float8CurrentScalingQuantizer::quantize_impl`: with
    `compute_amax` it runs `nvte_compute_amax_with_config` over the 16-bit input (reads 2 bytes
    an element), then the scale, then the cast (`nvte_quantize_v2`). `quantize_with_amax` skips
    it where the kernel before computed the amax: TE's LayerNorm/RMSNorm forward
    (extensions/normalization.cpp, `FUSED_NORM_AMAX_FP8`), i.e. a LayerNormLinear's input.
    Priced at the copy rate for the bytes read.
    """
    return Memory(name + " fp8 amax", "copy", elements, 2)


def norm_fused_linears(dims: ModelDims) -> frozenset[str]:
    """Return the linears megatron-core's Transformer Engine spec builds as
    TELayerNormColumnParallelLinear (gpt_layer_specs.py: the QKV and a dense layer's fc1; MLA's
    up projections with --qk-layernorm), whose input's amax the norm kernel computes."""
    names = {"QKV", "MLP fc1"}
    if dims.multi_latent_attention and dims.qk_layernorm:
        names |= {"q up projection", "kv up projection"}
    return frozenset(names)


def align_rows(dims: ModelDims) -> int:
    """Return the rows an fp8 GEMM's input is padded to a multiple of (megatron-core fp8_utils.py
    `get_fp8_align_size`, TE quantization.py `get_align_size_for_quantization`): 32 for mxfp8."""
    return 32 if dims.fp8_recipe == "mxfp8" else 16


def padded_rows(share: float, align: int) -> float:
    """Return the expected rows of a count whose balanced share is `share` once padded to a
    multiple of `align`: share + (align - 1) / 2 (its remainder uniform under uneven routing),
    and never less than the share rounded up to the multiple."""
    return max(share + (align - 1) / 2, math.ceil(share / align) * align)


def expert_padding(dims: ModelDims, tokens: int, experts: int, ep: int, etp: int, tp: int,
                   topk: int) -> tuple[int, float]:  # fmt: skip
    """Return an fp8 MoE layer's rows per local expert and the rows a rank dispatches (its
    `tokens` x topk / tp, before padding), as the padding point pads them (`dims.moe_row_padding`):
    "source" pads each of the E counts a rank sends (ep x etp senders reach an expert),
    "destination" and Transformer Engine ("") the count an expert receives."""
    align, sources = align_rows(dims), ep * etp
    per_source = tokens * topk / (experts * tp)  # a rank's balanced count for one expert
    if dims.moe_row_padding == "source":
        each = padded_rows(per_source, align)
        return max(1, math.ceil(sources * each)), experts * each
    return max(1, math.ceil(padded_rows(sources * per_source, align))), experts * per_source
