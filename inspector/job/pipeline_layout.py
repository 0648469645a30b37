"""--pipeline-model-parallel-layout: megatron-core's layout strings, read without megatron."""

from __future__ import annotations

import re

from inspector.errors import ConfigError

_LAYOUT_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
LAYOUT_CHARACTERS = "ELtm"  # embedding, loss, transformer layer, MTP layer


def expand_layout(text: str) -> list[str]:
    """Return a --pipeline-model-parallel-layout's stages, repetitions unrolled, as megatron does.

    megatron-core `PipelineParallelLayerLayout.parse_str_to_list` (0.13-0.16, the same code):
    commas are cosmetic, `(...)*n` then `x*n` repeat, `|` separates stages. Mirrored here because
    the job is checked without importing megatron; tests/test_versions.py compares the two.
    """
    text = text.replace(",", "")
    for pattern in _LAYOUT_REPEATS:
        text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
    return text.split("|")


def check_layout_string(text: str, pp: int, num_layers: int, mtp_layers: int) -> None:
    """Raise ConfigError unless the layout's characters, stages and layers fit the job's flags."""
    expanded = expand_layout(text)
    flat = "".join(expanded)
    wrong = sorted(set(flat) - set(LAYOUT_CHARACTERS))
    if wrong:
        raise ConfigError(
            f"--pipeline-model-parallel-layout {text!r}: invalid layer character {wrong[0]!r} "
            "(megatron-core knows E embedding, L loss, t transformer layer, m MTP layer, | between "
            "stages, (...)*n and x*n repetition)"
        )
    if len(expanded) % pp:
        raise ConfigError(
            f"--pipeline-model-parallel-layout {text!r} has {len(expanded)} stages, not a multiple "
            f"of --pp {pp} (megatron-core: the layout must be divisible by "
            "pipeline_model_parallel_size)"
        )
    for char, flag, wanted, what in (
        ("t", "--num-layers", num_layers, "transformer layers"),
        ("m", "--mtp-num-layers", mtp_layers, "multi-token prediction layers"),
    ):
        if flat.count(char) != wanted:
            raise ConfigError(
                f"--pipeline-model-parallel-layout {text!r} places {flat.count(char)} {what} "
                f"({char!r}) but {flag} is {wanted}"
            )
