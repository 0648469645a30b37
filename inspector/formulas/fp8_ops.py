"""What Transformer Engine adds around an fp8 GEMM beyond the cast (formulas/ops.py prices them).

- Current scaling (`--fp8-recipe tensorwise`): an amax pass over the 16-bit input before each
  cast (`amax_pass`), except where a norm kernel computed it (`norm_fused_linears`).
- MoE experts under fp8 (megatron-core experts.py TEGroupedMLP, without
  `--moe-router-padding-for-quantization`, which Megatron-Bridge's recipes leave off): each
  expert's rows are padded to a multiple of 16 by Transformer Engine's `Fp8Padding` and the
  output unpadded by `Fp8Unpadding` (pytorch/module/fp8_padding.py, `fused_multi_row_padding`:
  a copy each, skipped only when every count is already aligned; the plan's equal shares are
  an average, and uneven routing, forced balancing's random logits included, leaves some count
  unaligned), their backward the opposite copies.
"""

from __future__ import annotations

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
