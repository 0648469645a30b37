"""`--fp8-dot-product-attention`: when Transformer Engine's attention computes in fp8.

megatron-core turns the flag into TransformerConfig.fp8_dot_product_attention and hands it to
the recipe as `fp8_dpa` (fp8_utils.py `get_fp8_recipe`): TEDelayedScaling (delayed) always;
Float8CurrentScaling (tensorwise) from megatron-core 0.16 (core_v0.13.1 builds it without
`fp8_dpa`, 0.16.1 with it; 0.14-0.15 not checked); MXFP8BlockScaling only from 0.18
(core_v0.16.1 and 0.17.1 build it without `fp8_dpa`, 0.18.2 and 0.19.2 with it); never
Float8BlockScaling nor NVFP4BlockScaling (fp4_utils.py). Transformer Engine 2.11's
DotProductAttention runs attention in fp8 for the per-tensor recipes only and asserts otherwise
(dot_product_attention.py 669-673: "DotProductAttention does not support ... recipe").
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.versions import megatron_version

PER_TENSOR = ("delayed", "tensorwise")  # TE's `float8_per_tensor_scaling()` recipes
MXFP8_DPA_SINCE = (0, 18)  # megatron-core passes fp8_dpa to MXFP8BlockScaling from here
TENSORWISE_DPA_SINCE = (0, 16)  # ... and to Float8CurrentScaling


def fp8_attention(fp8_format: str | None, recipe: str, flag: bool) -> bool:
    """Return whether TE's attention runs in fp8: the flag under a per-tensor fp8 recipe that
    megatron-core hands it to."""
    if not flag or fp8_format is None or recipe not in PER_TENSOR:
        return False
    return recipe == "delayed" or megatron_version() >= TENSORWISE_DPA_SINCE


def check_fp8_attention(fp8_format: str | None, recipe: str, flag: bool) -> None:
    """Refuse --fp8-dot-product-attention where Transformer Engine (2.11, 2.14) would assert."""
    if not flag or fp8_format is None or recipe in PER_TENSOR:
        return
    if recipe == "mxfp8" and megatron_version() >= MXFP8_DPA_SINCE:
        raise ConfigError(
            "--fp8-dot-product-attention with --fp8-recipe mxfp8: megatron-core 0.18+ passes "
            "fp8_dpa to MXFP8BlockScaling, and Transformer Engine's DotProductAttention (2.11, "
            "and 2.14 which this tool follows there) asserts 'DotProductAttention does not "
            "support MXFP8BlockScaling recipe' (dot_product_attention.py 669-673); fp8 attention "
            f"is modelled with --fp8-recipe {' or '.join(PER_TENSOR)}"
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
