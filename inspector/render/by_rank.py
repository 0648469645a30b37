"""Muon's optimizer bytes by rank in the `memory` report: the imbalance of megatron's layer-wise
deal of whole matrices (memory/engine/muon.py), as a line of text and as json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inspector.memory.measure import StageMemory


def by_rank_line(s: StageMemory, size: Callable[[int], str]) -> str:
    """Return the stage's least and most loaded ranks' optimizer bytes and the data-parallel
    ranks the largest matrices went to."""
    low = min(s.optimizer_by_rank, key=lambda item: (item[1], item[0]))
    high = max(s.optimizer_by_rank, key=lambda item: (item[1], -item[0]))
    held = "".join(f"; {name} on data-parallel rank {rank}" for name, rank in s.largest_held_by)
    return (f"Stage {s.stage}: optimizer state {size(low[1])} (rank {low[0]}) to "
            f"{size(high[1])} (rank {high[0]}) by rank{held}.")  # fmt: skip


def by_rank_json(s: StageMemory) -> dict[str, Any]:
    """Return the stage's json keys for Muon's ranks (none for other optimizers)."""
    if not s.optimizer_by_rank:
        return {}
    return {
        "optimizer_by_rank": {str(rank): held for rank, held in s.optimizer_by_rank},
        "largest_held_by": dict(s.largest_held_by),
    }
