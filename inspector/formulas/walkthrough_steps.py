"""The walkthrough's records: one tensor a rank holds per step, and the running allocation."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal

Mode = Literal["tp", "ulysses", "cp", "mlp"]
Kind = Literal["activation", "weight", "communication"]
Materialized = Literal["always", "naive", "flash"]

HALF = 2  # bytes per 16-bit element


@dataclass(frozen=True)
class WalkthroughStep:
    """One tensor of the attention layer on one rank, and the FLOPs that produce it."""

    name: str
    layout: str  # logical per-rank layout, e.g. "[b, h/P, N, N]"
    shape: tuple[int, ...]  # the same layout with numbers
    flops_global: float  # forward FLOPs of this step for the whole layer, all ranks
    flops_rank: float  # forward FLOPs this rank executes (replicated heads included)
    kind: Kind = "activation"
    materialized: Materialized = "always"  # "naive": without flash attention only
    bytes_per_element: int = HALF
    note: str = ""
    in_place: bool = False  # written into an existing buffer (an all-reduce): allocates nothing
    freed: bool = False  # released once the step is done (the MLP's forward-only intermediate)

    @property
    def elements(self) -> int:
        """Return the number of elements this rank holds."""
        return prod(self.shape)

    @property
    def bytes(self) -> int:
        """Return the bytes this rank holds."""
        return self.elements * self.bytes_per_element


def weight_step(name: str, layout: str, shape: tuple[int, ...]) -> WalkthroughStep:
    """Return a weight row (no FLOPs)."""
    return WalkthroughStep(name, layout, shape, 0.0, 0.0, kind="weight")


def comm_step(name: str, layout: str, shape: tuple[int, ...], note: str = "") -> WalkthroughStep:
    """Return a communication row: the tensor this rank holds after the collective."""
    return WalkthroughStep(name, layout, shape, 0.0, 0.0, kind="communication", note=note)


@dataclass(frozen=True)
class Allocation:
    """What one rank has allocated after a step: now, and at most so far."""

    current: int
    peak: int


def running_allocation(steps: list[WalkthroughStep]) -> list[Allocation]:
    """Return the allocation after each step, as torch.cuda.memory_allocated and
    max_memory_allocated report when each step's tensors are kept.

    Every step's tensor stays allocated (weights and activations alike), except an in-place
    collective (no new buffer) and a step marked `freed` (released once the next step is done).
    The path is the one without flash attention (the score matrix exists); rows that exist only
    with flash attention add nothing.
    """
    current = peak = 0
    release = 0
    out = []
    for step in steps:
        if not step.in_place and step.materialized != "flash":
            current += step.bytes
        peak = max(peak, current)
        current -= release
        release = step.bytes if step.freed else 0
        out.append(Allocation(current, peak))
    return out


Walk = tuple[Mode, int, list[WalkthroughStep]]
