"""NVFP4 training as Megatron-LM configures it: `--fp4-format e2m1`, `--fp4-recipe nvfp4`, and the
16-bit first and last layers (`--first-last-layers-bf16`), with their checks.

megatron-core's TransformerConfig takes `fp4` (`--fp4-format`, only 'e2m1'), `fp4_recipe`
(`nvfp4`, the default, or `custom`), `fp4_param` (`--fp4-param-gather`) and, for fp8 and fp4
alike, `first_last_layers_bf16` with `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16`
(default 1 each). megatron's fp4_utils.get_fp4_context then enters Transformer Engine's
`fp8_autocast` with `NVFP4BlockScaling()` around every transformer layer but those first and
last ones (fp4_utils.py 118-160, fp8_utils.py 510-530 for fp8): which layers compute in 4 bits is
megatron's own code, run by the engine. `--fp4-param-gather` (NVFP4 weights, TransformerConfig's
`fp4_param` and DistributedDataParallelConfig's `fp4_param_gather`) is modelled where megatron-core
runs it, 0.17 on (with Transformer Engine 2.14, world/te/nvfp4_tensor.py), and refused by name
before (inputs/unmodelled.py says why).
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.job.versions import FP4_SINCE, megatron_version

FP4_FORMATS = ("e2m1",)  # TransformerConfig.fp4: Literal['e2m1']
FP4_RECIPES = ("nvfp4",)  # enums.py Fp4Recipe, less `custom` (a user's quantizer factory)
DEFAULT_BF16_LAYERS = 1  # TransformerConfig num_layers_at_start_in_bf16 / _at_end_in_bf16
def validate_fp4(
    fp4_format: str | None, recipe: str, fp8_format: str | None, transformer_impl: str
) -> None:
    """Raise ConfigError for fp4 settings megatron rejects or this tool does not model
    (`--fp4-param-gather` before megatron-core 0.17 is refused by name: inputs/unmodelled.py)."""
    if fp4_format is None:
        if recipe != FP4_RECIPES[0]:
            raise ConfigError(f"--fp4-recipe {recipe} has no effect without --fp4-format; pass "
                              "--fp4-format e2m1, or drop it")  # fmt: skip
        return
    installed = megatron_version()
    if installed < FP4_SINCE:
        raise ConfigError(f"--fp4-format {fp4_format} needs megatron-core {FP4_SINCE[0]}."
                          f"{FP4_SINCE[1]} or later (megatron-core {installed[0]}.{installed[1]}'s "
                          "TransformerConfig has no fp4)")  # fmt: skip
    if fp4_format not in FP4_FORMATS:
        raise ConfigError(f"--fp4-format {fp4_format!r} is not one of: {', '.join(FP4_FORMATS)}")
    if recipe not in FP4_RECIPES:
        raise ConfigError(f"--fp4-recipe {recipe!r} is not modelled (a custom quantizer factory "
                          f"cannot be imported here); use: {', '.join(FP4_RECIPES)}")  # fmt: skip
    if fp8_format is not None:
        raise ConfigError(f"--fp4-format {fp4_format} with --fp8-format {fp8_format}: megatron-core's "
                          "TransformerConfig: 'fp4 and fp8 cannot be used simultaneously. Please "
                          "choose one.'")  # fmt: skip
    if transformer_impl != "transformer_engine":
        raise ConfigError(f"--fp4-format {fp4_format} needs --transformer-impl transformer_engine: "
                          "only Transformer Engine's layers compute in fp4")  # fmt: skip


def check_bf16_layers(num_layers: int, start: int, end: int) -> None:
    """Refuse a negative or too large count of 16-bit layers (TransformerConfig.__post_init__
    checks 0 <= count <= layers per pipeline stage, 988-1016, under fp8 only)."""
    for flag, count in (("--num-layers-at-start-in-bf16", start),
                        ("--num-layers-at-end-in-bf16", end)):  # fmt: skip
        if not 0 <= count <= num_layers:
            raise ConfigError(f"{flag} {count} must lie between 0 and --num-layers {num_layers}")


def fp4_fields(
    fp4_format: str | None, recipe: str, param: bool, bf16_layers: tuple[bool, int, int]
) -> dict[str, Any]:
    """Return TransformerConfig's fp4 and 16-bit-layer fields as Megatron-LM copies them
    (`kw_args['fp4_param'] = args.fp4_param_gather`)."""
    fields: dict[str, Any] = {}
    if fp4_format is not None:
        fields.update(fp4=fp4_format, fp4_recipe=recipe)
    if param:
        fields["fp4_param"] = True
    enabled, start, end = bf16_layers
    if enabled:
        fields.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                      num_layers_at_end_in_bf16=end)  # fmt: skip
    return fields
