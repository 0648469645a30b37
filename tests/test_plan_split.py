"""plan_split.balance: the DP's split is valid and as fast as the best of every split."""

from __future__ import annotations

import itertools
import math

import pytest

from inspector.plan.split import balance


def _splits(layers: int, stages: int):
    """Yield every split of `layers` into `stages` positive counts."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def _cost(split, first: float, last: float) -> float:
    extra = [0.0] * len(split)
    extra[0] += first
    extra[-1] += last
    return max(n + e for n, e in zip(split, extra, strict=True))


@pytest.mark.parametrize("layers", [1, 5, 9, 12])
@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("first, last", [(0.0, 0.0), (0.0, 2.37), (1.5, 0.25), (0.1, 1.1)])
@pytest.mark.parametrize("caps", [None, "tight"])
def test_balance_is_valid_and_optimal(layers, stages, first, last, caps) -> None:
    if stages > layers:
        pytest.skip("more stages than layers")
    limits = tuple((layers + s) % 4 + 1 for s in range(stages)) if caps else None
    allowed = [
        s for s in _splits(layers, stages)
        if limits is None or all(n <= c for n, c in zip(s, limits, strict=True))
    ]
    split = balance(layers, stages, first, last, limits)
    if split is None:
        # balance clips every cap at the even split's cost ("no stage of an optimal split holds
        # more"), so caps that force a fuller stage leave it none: a known limit of the DP
        most = math.ceil(layers / stages + first + last)
        assert not allowed or all(max(s) > most for s in allowed)
        return
    assert split in allowed
    assert _cost(split, first, last) == pytest.approx(min(_cost(s, first, last) for s in allowed))


def _reference_balance(layers, stages, first, last, caps):
    """The DP as first written (every n tried, ties to the least n): balance's fast loop must
    pick the same split, tie for tie."""
    inf = float("inf")
    most = min(layers, math.ceil(layers / stages + first + last))
    caps = tuple(min(c, most) for c in caps) if caps else (most,) * stages
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        extra = (first if j == 1 else 0.0) + (last if j == stages else 0.0)
        for i in range(j, layers - (stages - j) + 1):
            for n in range(1, min(caps[j - 1], i - (j - 1)) + 1):
                value = max(best[j - 1][i - n], n + extra)
                if value < best[j][i] - 1e-12:
                    best[j][i], choice[j][i] = value, n
    if best[stages][layers] == inf:
        return None
    split, i = [], layers
    for j in range(stages, 0, -1):
        split.append(choice[j][i])
        i -= choice[j][i]
    return tuple(reversed(split))


@pytest.mark.parametrize("seed", range(40))
def test_balance_picks_the_reference_dps_split(seed) -> None:
    # the search's splits (and so its output) depend on which optimal split wins a tie
    import random

    rng = random.Random(seed)
    for _ in range(25):
        stages = rng.randint(1, 12)
        layers = rng.randint(stages, 40)
        first, last = round(rng.choice([0.0, rng.uniform(0, 3)]), 2), round(rng.uniform(0, 3), 2)
        caps = tuple(rng.randint(1, 9) for _ in range(stages)) if rng.random() < 0.6 else None
        args = (layers, stages, first, last, caps)
        assert balance.__wrapped__(*args) == _reference_balance(*args), args
