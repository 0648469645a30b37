"""What a stage holds that torch.cuda.max_memory_allocated does not count: GPU memory outside
PyTorch's allocator (DeepEP's and HybridEP's buffers), and activations offloaded to pinned host
memory (--fine-grained-activation-offloading, the MoE paged stash's host buffers); `memory` and
`plan` print them alike. And the MoE paged stash's GPU buffers, sized after the first iteration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def outside_line(label: str, outside: tuple[tuple[str, int], ...], size: Callable[[int], str],
                 counted_in: str, total: int) -> str:  # fmt: skip
    """Return the line naming what a stage holds outside PyTorch's allocator (DeepEP's or
    HybridEP's buffers), where its `total` counts them, and what torch.cuda.max_memory_allocated
    would say without them; `memory` and `plan` print it alike."""
    held = sum(b for _, b in outside)
    parts = ", ".join(f"{what} {size(b)}" for what, b in outside)
    return (f"{label}: outside PyTorch's allocator {size(held)} ({parts}): in {counted_in}, not "
            f"in what torch.cuda.max_memory_allocated reports ({size(total - held)}).")


def host_line(label: str, host: tuple[int, int], size: Callable[[int], str]) -> str:
    """Return the line naming the pinned host memory a stage's offloaded activations take
    (bytes asked, and as torch's pinned allocator reserves them: each a power of two)."""
    return (f"{label}: offloaded activations take {size(host[0])} of pinned host memory "
            f"({size(host[1])} as torch's pinned allocator rounds each buffer up to a power of "
            "two), not in the GPU's total.")  # fmt: skip


def host_json(host: tuple[int, int]) -> dict[str, Any]:
    """Return a stage's json key for offloaded activations (none without offloading)."""
    return {"host_offload": {"bytes": host[0], "pinned": host[1]}} if host[0] else {}


def held_lines(label: str, run: Any, size: Callable[[int], str]) -> list[str]:
    """Return the lines naming a stage's pinned host memory (offloaded activations, the paged
    stash's host buffers) and the MoE paged stash's GPU buffers (engine/paged_stash.py), where
    its run (engine/run.py RunMemory) holds any."""
    from inspector.memory.engine.paged_stash import STASH

    lines = [host_line(label, run.host, size)] if run.host[0] else []
    stash = [(where.removeprefix(f"{STASH}: "), b) for where, b in run.persistent if where.startswith(STASH)]
    if stash:
        pages = ", ".join(f"{what} {size(b)}" for what, b in stash if " pages (" in what)
        lines.append(f"{label}: the MoE paged stash's buffers {size(sum(b for _, b in stash))} "
                     f"({pages}), sized after its profiling first iteration: in buffers and the total.")
    return lines
