"""Muon in the `memory` report: what the optimizer is, and its bytes by rank (the imbalance of
megatron's layer-wise deal of whole matrices, memory/engine/muon.py), as text and as json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inspector.memory.measure import StageMemory

# the optimizer line of --optimizer muon / dist_muon, by (optimizer, layer-wise param layout)
MUON_SAID = {
    ("muon", False): "Muon (Adam for embeddings, output layer, norms and biases)",
    ("dist_muon", False): "Muon, layer-wise (whole matrices dealt over the data-parallel ranks; "
                          "Adam for embeddings, output layer, norms and biases)",
    ("dist_muon", True): "Muon, layer-wise (each matrix whole in one rank's shard of DDP's "
                         "buffers; a distributed optimizer's Adam for the rest)",
}  # fmt: skip


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
