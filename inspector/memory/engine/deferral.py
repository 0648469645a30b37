"""The output layer's deferred weight gradient (--defer-embedding-wgrad-compute), as megatron keeps it.

megatron-core's ColumnParallelLinear appends its input to `embedding_activation_buffer` in its
forward, and LinearWithGradAccumulationAndAsyncCommunication's backward appends the logits'
gradient to `grad_output_buffer` instead of computing the weight gradient, for the first
`wgrad_deferral_limit` micro-batches (0: all; tensor_parallel/layers.py). The pipeline schedule
computes them after its last backward (`finish_embedding_wgrad_compute`, pipeline_parallel/
schedules.py, through utils.py `drain_embedding_wgrad_compute`), before the optimizer step. A
micro-batch's run keeps both lists' tensors; they are released here and the replay
(schedule.py) holds their bytes from each deferred micro-batch's backward to the drain.
"""

from __future__ import annotations

from typing import Any

from inspector.memory.engine.allocator import Tracker


def drain_deferred(gpt: Any, tracker: Tracker) -> int:
    """Return the bytes the micro-batch left in the output layer's deferral lists, releasing
    them as the schedule's drain does (module notes); 0 without deferral."""
    buffers = [getattr(gpt, name, None) for name in ("embedding_activation_buffer",
                                                       "grad_output_buffer")]  # fmt: skip
    if not any(buffers):
        return 0
    before = tracker.allocated
    tracker.at("embedding wgrad drain")
    for buffer in buffers:
        if buffer:
            buffer.clear()
    return before - tracker.allocated

