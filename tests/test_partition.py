"""Ownership policies and preconditioner shapes, checked against brute force and Shampoo's rule."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from inspector.records import ParamRecord
from inspector.report import partition


def record(
    name: str, shape: tuple[int, ...], layer: int | None = None, embedding: bool = False
) -> ParamRecord:
    return ParamRecord(
        0,
        0,
        name,
        name,
        "M()",
        shape,
        shape,
        "float32",
        False,
        None,
        False,
        embedding,
        layer,
        None,
        None,
    )


def test_block_sizes():
    assert partition.block_sizes(1536, 512) == [512, 512, 512]
    assert partition.block_sizes(1000, 512) == [512, 488]
    assert partition.block_sizes(512, 512) == [512]  # BlockPartitioner splits only when B < d
    assert partition.block_sizes(100, 0) == [100]


def test_precs_block_major():
    r = record("w", (1000, 300))
    assert partition.precs_for(r) == [1000, 300]
    # 1000 -> 256, 256, 256, 232 and 300 -> 256, 44; blocks row-major, two factors each
    assert partition.precs_for(r, 256) == [
        256,
        256,
        256,
        44,
        256,
        256,
        256,
        44,
        256,
        256,
        256,
        44,
        232,
        256,
        232,
        44,
    ]
    assert partition.precs_for(record("b", (1000,))) == []
    assert partition.precs_for(record("e", (50, 8), embedding=True)) == []


def test_owners_by_layers_floor_rule():
    records = [record("embedding.word_embeddings.weight", (8, 2), embedding=True)]
    records += [record(f"decoder.layers.{j}.w", (2, 2), layer=j) for j in range(4, 9)]
    records.append(record("decoder.final_layernorm.weight", (2,)))
    owners = partition.owners_by_layers(records, 2)
    # layers 4..8 are j = 0..4 of n = 5: floor(j * 2 / 5) = 0, 0, 0, 1, 1
    assert owners == [(0,), (0,), (0,), (0,), (1,), (1,), (1,)]


def brute_force_best(costs: list[int], dp: int) -> int:
    n, best = len(costs), None
    for cuts in itertools.combinations_with_replacement(range(n + 1), dp - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 4))
def test_cost_split_is_optimal_and_contiguous(costs, dp):
    owners = partition.owners_by_cost(costs, dp)
    ranks = [o[0] for o in owners]
    assert ranks == sorted(ranks) and all(0 <= r < dp for r in ranks)
    loads = [sum(c for c, r in zip(costs, ranks) if r == k) for k in range(dp)]
    assert max(loads) == brute_force_best(costs, dp)
