"""`--fp8-dot-product-attention`: when Transformer Engine's attention computes in fp8.

megatron-core turns the flag into TransformerConfig.fp8_dot_product_attention and hands it to
the recipe as `fp8_dpa` (fp8_utils.py `get_fp8_recipe`): TEDelayedScaling (delayed) always;
Float8CurrentScaling (tensorwise) from megatron-core 0.16 (core_v0.13.1 builds it without
`fp8_dpa`, 0.16.1 with it; 0.14-0.15 not checked); MXFP8BlockScaling only from 0.18
(core_v0.16.1 and 0.17.1 build it without `fp8_dpa`, 0.18.2 and 0.19.2 with it); never
Float8BlockScaling nor NVFP4BlockScaling (fp4_utils.py). Transformer Engine runs attention in
fp8 for the per-tensor recipes, and for MXFP8 from 2.15 (2.11-2.14 assert, v2.14
dot_product_attention.py 676-680: "DotProductAttention does not support ... recipe"): the
release megatron-core 0.18 and 0.19 install (their uv.lock: 2.16.0, 2.17.1), which the
stand-in follows (world/te/__init__.py), runs it on Blackwell GPUs only (utils.py
get_attention_backend, v2.17.1 621-638: FusedAttention on sm100+ with cuDNN 9.21+).
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.versions import megatron_version

PER_TENSOR = ("delayed", "tensorwise")  # TE's `float8_per_tensor_scaling()` recipes
MXFP8_DPA_SINCE = (0, 18)  # megatron-core passes fp8_dpa to MXFP8BlockScaling from here
TENSORWISE_DPA_SINCE = (0, 16)  # ... and to Float8CurrentScaling
MXFP8_SEQUENCE, MXFP8_HEAD_DIM = 128, 32  # TE utils.py combine_and_quantize (v2.17.1 2796-2799)


def fp8_attention(fp8_format: str | None, recipe: str, flag: bool) -> bool:
    """Return whether TE's attention runs in fp8: the flag under a recipe that megatron-core
    hands it to (per-tensor, or MXFP8 from 0.18, whose TE runs it)."""
    if not flag or fp8_format is None:
        return False
    if recipe == "mxfp8":
        return megatron_version() >= MXFP8_DPA_SINCE
    if recipe not in PER_TENSOR:
        return False
    return recipe == "delayed" or megatron_version() >= TENSORWISE_DPA_SINCE


def check_fp8_attention(fp8_format: str | None, recipe: str, flag: bool, seq_length: int,
                        head_dims: tuple[int, ...]) -> None:  # fmt: skip
    """Refuse MXFP8 attention where Transformer Engine (2.15+) would assert: its quantization
    of q, k, v needs the sequence a multiple of 128 and each head dimension of 32."""
    if recipe != "mxfp8" or not fp8_attention(fp8_format, recipe, flag):
        return
    odd = [d for d in head_dims if d % MXFP8_HEAD_DIM]
    if seq_length % MXFP8_SEQUENCE or odd:
        raise ConfigError(
            "--fp8-dot-product-attention with --fp8-recipe mxfp8 needs --seq-length a multiple "
            f"of {MXFP8_SEQUENCE} and head dimensions multiples of {MXFP8_HEAD_DIM} (Transformer "
            f"Engine's combine_and_quantize asserts it); got --seq-length {seq_length} and head "
            f"dimensions {', '.join(map(str, head_dims))}"
        )


def fp8_attention_note(fp8_format: str | None, recipe: str, flag: bool) -> str | None:
    """Return why the flag changes nothing, where megatron-core does not hand it to the recipe."""
    if not flag or fp8_attention(fp8_format, recipe, flag):
        return None
    if fp8_format is None:
        return ("--fp8-dot-product-attention without --fp8-format changes nothing: no fp8 "
                "recipe reads it.")  # fmt: skip
    return (f"--fp8-dot-product-attention with --fp8-recipe {recipe} changes nothing here: "
            f"megatron-core {'.'.join(map(str, megatron_version()))} does not pass it to the "
            "recipe (fp8_utils.py get_fp8_recipe), so attention runs in bf16.")  # fmt: skip
