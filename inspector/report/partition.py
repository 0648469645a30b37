"""Optimizer-work ownership across data-parallel ranks, and Shampoo preconditioner shapes.

Pure functions over ParamRecords of one pipeline stage (all its chunks, in row order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from inspector.records import ParamRecord

Owners = tuple[int, ...]


def block_sizes(dim: int, block_size: int) -> list[int]:
    """Split one dimension into blocks of `block_size`, the last one the remainder.

    Shampoo's BlockPartitioner (google-research/google-research, scalable_shampoo/optax/
    distributed_shampoo.py) splits a dimension d only when 0 < block_size < d.
    """
    if not 0 < block_size < dim:
        return [dim]
    full, rest = divmod(dim, block_size)
    return [block_size] * full + ([rest] if rest else [])


def precs_for(record: ParamRecord, block_size: int = 0) -> list[int]:
    """Return the preconditioner (Kronecker factor) sizes d, one [d, d] factor each.

    None for 1-D parameters, embedding tables and frozen parameters (LoRA); otherwise one factor
    per dimension of the local shape, and with blocking the factors of every block, block-major
    (BlockPartitioner's `shapes_for_preconditioners`: itertools.product over each dimension's block sizes).
    """
    if len(record.shape) < 2 or record.embedding or not record.trainable:
        return []
    splits = [block_sizes(d, block_size) for d in record.shape]
    return [d for block in itertools.product(*splits) for d in block]


def precs_cost(factors: Sequence[int]) -> int:
    """Return a parameter's Shampoo cost: the sum of d**3 over its factors (docs/params-table.md: `cost`)."""
    return sum(d**3 for d in factors)


def owners_by_layers(records: Sequence[ParamRecord], dp: int) -> list[Owners]:
    """Split the stage's layers into dp contiguous equal-count groups (layer j of n -> j*dp//n).

    Embedding parameters go with the stage's first layer; final norm and output layer with its
    last. A stage with no layers gives everything to rank 0.
    """
    layers = sorted({r.layer for r in records if r.layer is not None})
    rank_of = {layer: j * dp // len(layers) for j, layer in enumerate(layers)}
    first = rank_of[layers[0]] if layers else 0
    last = rank_of[layers[-1]] if layers else 0
    owners: list[Owners] = []
    for record in records:
        if record.layer is not None:
            owners.append((rank_of[record.layer],))
        elif record.name.startswith("embedding."):
            owners.append((first,))
        else:
            owners.append((last,))
    return owners


def owners_by_cost(costs: Sequence[int], dp: int) -> list[Owners]:
    """Split rows contiguously over dp ranks, minimising the largest per-rank cost.

    The smallest feasible maximum is found by binary search with a greedy check; the split
    returned is the greedy one at that maximum (each rank filled in row order as far as it goes),
    which makes it unique and stable.
    """
    if not costs:
        return []
    low, high = max(costs), sum(costs)
    while low < high:
        middle = (low + high) // 2
        if _ranks_needed(costs, middle) <= dp:
            high = middle
        else:
            low = middle + 1
    owners: list[Owners] = []
    rank, load = 0, 0
    for cost in costs:
        if load + cost > low and load > 0:
            rank, load = rank + 1, 0
        load += cost
        owners.append((rank,))
    return owners


def _ranks_needed(costs: Sequence[int], limit: int) -> int:
    ranks, load = 1, 0
    for cost in costs:
        if load + cost > limit and load > 0:
            ranks, load = ranks + 1, 0
        load += cost
    return ranks
