"""The edge: merge where a job's arguments come from into one set of Megatron-LM arguments.

Later sources win: preset < config file < launch script < flags. Each command reads only the
argument groups it takes (arguments.py); the others, when a file or script sets them, are
dropped here so they can never change a command's result (or its cache key). The merged
arguments become a validated Job (job.py) in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inspector.arguments import BY_NAME


@dataclass(frozen=True)
class Sources:
    """Where the arguments come from: a preset, a config file, a launch script, flags."""

    preset: str | None = None
    config_file: str | None = None
    script: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)  # values given on the command line
    apex: bool | None = None


@dataclass(frozen=True)
class Resolved:
    """The merged arguments of one command, and what the user should be told about them."""

    args: dict[str, Any]
    notes: tuple[str, ...]  # for stderr, e.g. what a launch script set that is not modelled


def merge_sources(sources: Sources, groups: tuple[str, ...]) -> Resolved:
    """Merge preset, config file, launch script and flags (later ones winning) for `groups`."""
    layers: list[dict[str, Any]] = []
    notes: list[str] = []
    if sources.preset is not None:
        from inspector.presets import get_preset

        layers.append(dict(get_preset(sources.preset).args))
    if sources.config_file is not None:
        from inspector.sources import load_config_file

        layers.append(_megatron_lm_defaults(load_config_file(sources.config_file)))
    if sources.script is not None:
        from inspector.sources import read_launch_script

        parsed = read_launch_script(sources.script)
        if parsed.ignored:
            notes.append(f"Ignored from {sources.script}: {' '.join(parsed.ignored)}")
        layers.append(_megatron_lm_defaults(parsed.args))
    layers.append({name: value for name, value in sources.flags.items() if value is not None})
    if sources.apex is not None:
        layers.append({"apex": sources.apex})
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    args = {k: v for k, v in merged.items() if k not in BY_NAME or BY_NAME[k].group in groups}
    return Resolved(args, tuple(notes))


def _megatron_lm_defaults(args: dict[str, Any]) -> dict[str, Any]:
    """Return a config file's or launch script's arguments with Megatron-LM's own defaults.

    A Megatron-LM job that does not name --transformer-impl runs Transformer Engine (Megatron-LM
    arguments.py: default "transformer_engine"), so the file means it too; flags still win.
    """
    return {"transformer_impl": "transformer_engine", **args}
