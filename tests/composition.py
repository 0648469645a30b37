"""The engine tests' composition check: a stage composed from one layer of each kind
(memory/engine/stage.py) must run as the whole stage does."""

from __future__ import annotations

from typing import Any


def assert_composed_equals_whole(job: Any, persistent: bool = True) -> dict:
    """Trace every stage whole and composed: events (and persistent tensors) and memory agree.

    `persistent` False leaves the traces' persistent tensors out of the comparison (a dense
    stage's, whose memory still must agree). Returns the composition cache, whose small chunks
    say which layer kinds stood in.
    """
    from inspector.memory.engine.run import chunk_shapes, run_memory
    from inspector.memory.engine.stage import trace_chunks
    from inspector.world.build import View, build

    cache: dict = {}
    for stage in range(job.layout.pp):
        shapes = chunk_shapes(build(job, View((stage,)), expert_ranks=(0,)).stages[0])
        whole = trace_chunks(job, stage, shapes, whole=True)
        composed = trace_chunks(job, stage, shapes, cache)
        assert [(t.forward, t.backward, persistent and t.persistent) for t in composed] == [
            (t.forward, t.backward, persistent and t.persistent) for t in whole
        ]
        assert run_memory(job, stage, shapes, cache) == run_memory(job, stage, shapes, whole=True)
    return cache
