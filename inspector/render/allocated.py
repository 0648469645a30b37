"""What torch.cuda counts on a stage's rank at the moments Megatron-LM logs memory: the line and
the json key `memory` prints per stage (memory/segments.py `torch_counts`, what `check LOG`
compares with the log's `allocated` and `max allocated` lines)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inspector.memory.measure import MemoryReport, StageMemory


def allocated_line(report: MemoryReport, stage: StageMemory, size: Callable[[int], str]) -> str:
    """Return the line giving what torch.cuda.memory_allocated after the step and
    max_memory_allocated report on the stage's rank (Megatron-LM's `mem-allocated-bytes` and
    `mem-max-allocated-bytes`), and what of it is the allocator's blocks beyond the requests."""
    from inspector.memory.segments import torch_counts
    from inspector.render.check import MIB  # the tails in MiB whatever the report's unit

    after, peak = torch_counts(stage)
    if report.expandable_segments:
        tails = "PYTORCH_CUDA_ALLOC_CONF's expandable segments size every block to its request"
    else:
        tails = (f"of each, {stage.block_tails / MIB:,.2f} MiB is the caching allocator's blocks "
                 "beyond megatron's set-up requests")  # fmt: skip
    return (f"Stage {stage.stage}: torch.cuda.memory_allocated {size(after)} after the step, "
            f"max_memory_allocated {size(peak)} (Megatron-LM logs them as allocated and max "
            f"allocated); {tails}.")  # fmt: skip


def allocated_json(report: MemoryReport, stage: StageMemory) -> dict[str, Any]:
    """Return a stage's json key for what torch.cuda counts (bytes), and the allocator setting."""
    from inspector.memory.segments import torch_counts

    after, peak = torch_counts(stage)
    return {"torch_allocated": {"after_step": after, "max": peak, "block_tails": stage.block_tails,
                                "expandable_segments": report.expandable_segments}}  # fmt: skip


def graph_pool_line(stage: StageMemory, size: Callable[[int], str]) -> str:
    """Return the line saying a stage's captured CUDA graphs' pool is reserved, not allocated
    (engine/cuda_graphs.py `allocated_peak`), and what torch.cuda counts then."""
    from inspector.memory.segments import torch_counts

    assert stage.run is not None
    now, top = (size(v) for v in torch_counts(stage))
    return (f"Stage {stage.stage}: the CUDA graphs' memory pool {size(stage.run.graph_pool)} is "
            "reserved, not allocated, once captured: torch.cuda.memory_allocated reports "
            f"{now} after the step, max_memory_allocated {top}.")  # fmt: skip
