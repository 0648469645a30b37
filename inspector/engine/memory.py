"""What the engine adds to a rank's state memory: persistent buffers, workspaces, the peak."""

from __future__ import annotations

from dataclasses import dataclass

from inspector.engine.schedule import Peak, iteration_peak
from inspector.engine.stage import trace_stage
from inspector.job.job import Job

# torch's cuBLAS workspace per (handle, stream): aten/src/ATen/cuda/CublasHandlePool.cpp
# `parseChosenWorkspaceSize`, ":4096:2:16:8 default, 32MiB for Hopper" (sm90: 4096 * 8 * 1024).
# Handles are per thread (`getCurrentCUDABlasHandle`'s thread-local pool window): the main
# thread runs the forward's GEMMs and the autograd engine's device thread the backward's.
CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
GEMM_THREADS = 2


@dataclass(frozen=True)
class RunMemory:
    """One rank's memory from megatron running: what persists, and the peak above static."""

    persistent: tuple[tuple[str, int], ...]  # buffers made in the run and kept (where, bytes)
    workspaces: int  # cuBLAS workspaces (a cited constant: nothing runs cuBLAS here)
    peak: Peak  # above static memory (state, persistent buffers, workspaces)

    @property
    def static(self) -> int:
        """Return the bytes the run adds to the state for good: persistent plus workspaces."""
        return sum(size for _, size in self.persistent) + self.workspaces


def run_memory(job: Job, stage: int) -> RunMemory:
    """Run one micro-batch of each chunk of `stage` and replay the iteration's schedule."""
    traces = trace_stage(job, stage)
    schedule = job.schedule()
    peak = iteration_peak(traces, stage, job.layout.pp, schedule.num_microbatches)
    persistent = tuple(item for trace in traces for item in trace.persistent)
    return RunMemory(persistent, CUBLAS_WORKSPACE_SM90 * GEMM_THREADS, peak)
