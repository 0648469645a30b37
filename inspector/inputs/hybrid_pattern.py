"""Megatron-LM 0.17+'s `--hybrid-layer-pattern`, read as its `validate_args` reads it.

Megatron-LM core_v0.19.0 megatron/training/arguments.py (`validate_args`, "Hybrid layer pattern"):
--hybrid-override-pattern is the deprecated spelling, copied into --hybrid-layer-pattern (the
two together stop it), and the pattern's layer count, its symbols before the first `/` without
the `|` stage boundaries (`get_hybrid_total_layer_count`), replaces --num-layers ("ignoring
--num-layers"), and the MTP depths after `/` set --mtp-num-layers ("Infer mtp_num_layers from
unified pattern"; a different value is replaced with a warning). This tool keeps one pattern,
under the older name megatron-core 0.16's MambaModel takes; HybridModel gets it as
`hybrid_layer_pattern`.
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version

FIRST = (0, 17)  # the first Megatron-LM whose parser has --hybrid-layer-pattern


def layer_pattern(merged: dict[str, Any]) -> list[str]:
    """Move --hybrid-layer-pattern into the pattern and --num-layers, as Megatron-LM does;
    return the notes it prints."""
    pattern = str(merged.pop("hybrid_layer_pattern"))
    installed = megatron_core_version()
    if installed < FIRST:
        raise ConfigError(
            f"--hybrid-layer-pattern is an argument of Megatron-LM 0.17+; this tool builds with "
            f"megatron-core {installed[0]}.{installed[1]}, whose Megatron-LM takes "
            "--hybrid-override-pattern"
        )
    older = merged.get("hybrid_override_pattern")
    if older is not None and older != pattern:
        raise ConfigError(
            "--hybrid-override-pattern and --hybrid-layer-pattern cannot both be specified "
            "(Megatron-LM's validate_args); --hybrid-override-pattern is the deprecated one"
        )
    merged["hybrid_override_pattern"] = pattern
    notes = []
    depths = pattern.count("/")  # "Infer mtp_num_layers from unified pattern"
    if depths:
        given = merged.get("mtp_num_layers")
        merged["mtp_num_layers"] = depths
        if given is not None and int(given) != depths:
            notes.append(f"Note: --hybrid-layer-pattern has {depths} MTP depths; --mtp-num-layers "
                         f"{given} is replaced by them, as Megatron-LM replaces it")  # fmt: skip
    count = len(pattern.split("/")[0].replace("|", ""))
    given = merged.get("num_layers")
    merged["num_layers"] = count
    if given is not None and int(given) != count:
        notes.append(f"Note: --hybrid-layer-pattern has {count} layers; --num-layers {given} is "
                     "ignored, as Megatron-LM ignores it")  # fmt: skip
    _virtual_stages(pattern, merged)
    return notes


_VIRTUAL_FLAGS = ("num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage",
                  "pipeline_model_parallel_layout")  # fmt: skip


def _virtual_stages(pattern: str, merged: dict[str, Any]) -> None:
    """Give the job the virtual pipeline size the pattern's `|` segments imply, as validate_args
    does ("Derive VPP from pipe segments in the pattern": segments // --pp when there are more
    segments than stages); a virtual-pipeline flag given too is read after it, as Megatron-LM
    reads it (job/hybrid_model.py checks the two agree)."""
    segments = pattern.split("/")[0].count("|") + 1
    pp = int(merged.get("pipeline_model_parallel_size") or 1)
    if pp == 1 or segments <= pp or segments % pp:
        return  # --pp 1 and segments that do not divide: job/hybrid_model.py says so (plan
        # takes --pp from the segments)
    if all(merged.get(f) is None for f in _VIRTUAL_FLAGS):
        merged["num_virtual_stages_per_pipeline_rank"] = segments // pp
