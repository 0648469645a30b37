"""Render the preset list (`inspect-model models`)."""

from __future__ import annotations

from tabulate import tabulate

from inspector.inputs.presets import PRESETS


def _count(params: float) -> str:
    """Return a published parameter count as papers write it (124M, 6.7B)."""
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def render_presets() -> str:
    """Return the preset list: each preset's key sizes and published parameter count (which
    tests/test_presets.py checks the built model against within 0.5%), then where each
    configuration and count are published."""
    rows = [[p.name, _count(p.published_params), p.summary] for p in PRESETS.values()]
    lines = [tabulate(rows, headers=["preset", "params", "summary"]), "", "Sources:"]
    for p in PRESETS.values():
        lines.append(f"  {p.name}: {p.source}; parameters: {p.published_source}")
    return "\n".join(lines) + "\n"
