"""Built-in checks that the tables agree with megatron itself; a mismatch is a bug (exit 3)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from inspector.errors import FidelityError
from inspector.report.table import Block


def check_layers(blocks: Sequence[Block], num_layers: int, complete: bool) -> None:
    """Every global layer appears on exactly one stage (all of them when every stage is shown)."""
    seen = [layer for block in blocks for layer in block.layers]
    if len(seen) != len(set(seen)):
        twice = sorted({layer for layer in seen if seen.count(layer) > 1})
        raise FidelityError(f"layers {twice} appear on more than one stage")
    if complete and sorted(seen) != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(seen))
        raise FidelityError(f"layers {missing} of {num_layers} appear on no stage")
    for block in blocks:
        in_rows = {row.record.layer for row in block.rows if row.record.layer is not None}
        if not in_rows <= set(block.layers):
            raise FidelityError(
                f"stage {block.stage} lists rows of layers {sorted(in_rows)} it does not hold"
            )


def check_totals(
    blocks: Sequence[Block], checkpoints: dict[int, dict[tuple[str, tuple[int, ...]], int]]
) -> None:
    """Per stage, the rows' unsharded sizes add up to megatron's sharded_state_dict() sizes.

    `checkpoints` maps a stage to megatron's checkpoint entries of every rank built for it
    (merged, so tensors replicated across expert-parallel ranks count once).
    """
    for stage, entries in checkpoints.items():
        rows = [row.record for block in blocks if block.stage == stage for row in block.rows]
        ours = sum(math.prod(record.global_shape) for record in rows)
        theirs = sum(entries.values())
        if ours != theirs:
            raise FidelityError(
                f"stage {stage}: the table holds {ours} unsharded parameters but megatron's "
                f"sharded_state_dict() reports {theirs}"
            )
