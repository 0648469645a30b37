"""--pipeline-model-parallel-layout: megatron-core's layout strings, read without megatron."""

from __future__ import annotations

import re

from inspector.errors import ConfigError

_LAYOUT_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
LAYOUT_CHARACTERS = "ELtm"  # embedding, loss, transformer layer, MTP layer
MAX_LAYOUT_LENGTH = 100_000  # characters of a --pipeline-model-parallel-layout, unrolled


def expand_layout(text: str) -> list[str]:
    """Return a --pipeline-model-parallel-layout's stages, repetitions unrolled, as megatron does.

    megatron-core `PipelineParallelLayerLayout.parse_str_to_list` (0.13-0.16, the same code):
    commas are cosmetic, `(...)*n` then `x*n` repeat, `|` separates stages. Mirrored here because
    the job is checked without importing megatron; tests/test_versions.py compares the two.
    """
    text = text.replace(",", "")
    for pattern in _LAYOUT_REPEATS:
        text = _unroll(pattern, text)
    return text.split("|")


def _unroll(pattern: str, text: str) -> str:
    """Unroll one kind of repetition, refusing a layout longer than MAX_LAYOUT_LENGTH first."""
    grown = len(text)

    def repeat(match: re.Match[str]) -> str:
        nonlocal grown
        part, digits = match.group(1), match.group(2)
        count = int(digits) if len(digits) <= 9 else MAX_LAYOUT_LENGTH + 1  # Python's 4300 digits
        grown += len(part) * (count - 1)
        if grown > MAX_LAYOUT_LENGTH:
            shown = digits if len(digits) <= 20 else digits[:20] + "..."
            raise ConfigError(
                f"--pipeline-model-parallel-layout unrolls to more than {MAX_LAYOUT_LENGTH:,} "
                f"layers ({part!r} repeated {shown} times); docs/limits.md"
            )
        return part * count

    return re.sub(pattern, repeat, text)


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
    _check_ends(text, flat)
    for char, flag, wanted, what in (
        ("t", "--num-layers", num_layers, "transformer layers"),
        ("m", "--mtp-num-layers", mtp_layers, "multi-token prediction layers"),
    ):
        if flat.count(char) != wanted:
            raise ConfigError(
                f"--pipeline-model-parallel-layout {text!r} places {flat.count(char)} {what} "
                f"({char!r}) but {flag} is {wanted}"
            )


def _check_ends(text: str, flat: str) -> None:
    """Raise ConfigError unless the layout starts with the embedding and ends with the loss, once."""
    for char, where, index, name in (("E", "start", 0, "embedding"), ("L", "end", -1, "loss")):
        if not flat or flat[index] != char or flat.count(char) != 1:
            raise ConfigError(
                f"--pipeline-model-parallel-layout {text!r} must {where} with the {name} "
                f"{char!r} and hold it once (megatron-core: the {'first' if index == 0 else 'last'}"
                f" layer must be {name}, specified exactly once)"
            )
