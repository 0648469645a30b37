"""Render the preset list (`inspect-model models`)."""

from __future__ import annotations

from tabulate import tabulate

from inspector.inputs.presets import PRESETS


def render_presets() -> str:
    """Return the preset list with each preset's key sizes."""
    rows = [[p.name, p.summary] for p in PRESETS.values()]
    return tabulate(rows, headers=["preset", "summary"]) + "\n"
