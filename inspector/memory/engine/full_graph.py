"""Full-iteration CUDA graphs (`--cuda-graph-impl local --cuda-graph-scope full_iteration`).

Megatron-LM wraps its forward-backward function in megatron-core's FullCudaGraphWrapper
(full_cuda_graph.py, 0.16.1; training.py: `args.cuda_graph_impl == "local" and "full_iteration"
in args.cuda_graph_scope`), which

- reads every micro-batch of the iteration from the data iterator first and copies each batch to
  its own static buffers on the GPU (`StaticBufferLoader`, `copy_tensors_in_struct`: a
  `clone().detach().cuda()` of each tensor), kept for the run and refilled in place; from the
  first iteration on, eager warm-up iterations included;
- runs `--cuda-graph-warmup-steps` iterations eagerly, then captures the whole forward and
  backward of all micro-batches in ONE `torch.cuda.graph` (the optimizer step stays outside)
  and replays it. The capture allocates in the graph's private pool what the eager iteration
  allocated, in the same order, so the pool's size is the forward-backward's high-water mark;
  the optimizer step, outside the graph, cannot use those blocks.

So the peak with the graph is the static batches, the pool and the optimizer step's own peak
side by side, never below the eager warm-up iteration's. Every iteration, warm-up included,
reads the static batch (Megatron-LM training/utils.py `get_batch_on_this_tp_rank`: `.cuda()` of
a tensor already on the GPU copies nothing): the traces' "inputs" allocations are left out. A
tensor-parallel rank other than 0 receives its batch by broadcast into new tensors instead; the
rank reported is rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from inspector.job.job import Job
from inspector.memory.engine.allocator import Event, rounded
from inspector.memory.engine.cuda_graphs import GRAPHS, POOL, allocated_peak
from inspector.memory.engine.microbatch import Trace
from inspector.memory.engine.schedule import Peak, iteration_peak

INPUTS = "inputs"  # the tracker's label of the batch a micro-batch reads (microbatch._forward)


def batch_bytes(job: Job) -> int:
    """Return one micro-batch's batch as megatron-core's GPTDataset gives it (datasets/
    gpt_dataset.py `__getitem__`, collated to [b, s]): tokens and labels int64, the causal
    attention mask [b, 1, s, s] of bools (Megatron-LM's default --create-attention-mask-in-
    dataloader), loss mask fp32, position ids int64; each tensor its own block."""
    b, s = job.schedule().micro_batch_size, job.model.seq_length
    sizes = (8 * b * s, 8 * b * s, b * s * s, 4 * b * s, 8 * b * s)
    return sum(rounded(size) for size in sizes)


def static_batches(job: Job, stage: int) -> int:
    """Return the static batch buffers a rank of `stage` keeps (tensor-parallel rank 0).

    Megatron-LM builds a data iterator per model chunk (training.py) where the chunk is the
    first or the last virtual pipeline stage (pretrain_gpt.py `is_dataset_built_on_rank`:
    `is_first_or_last_pipeline_stage(vp_stage)`, tensor-parallel rank 0), None elsewhere;
    `data_read` copies every micro-batch of each iterator."""
    last, chunks = job.layout.pp - 1, job.layout.vpp or 1
    iterators = sum(1 for chunk in range(chunks)
                    if (stage, chunk) in ((0, 0), (last, chunks - 1)))  # fmt: skip
    return iterators * job.schedule().num_microbatches * batch_bytes(job)


def _without_inputs(trace: Trace) -> Trace:
    """Return a trace without its batch's blocks (the static batch serves the graph)."""
    phases = []
    total = 0
    for events in (trace.forward, trace.backward):
        kept = []
        for event in events:
            label = event.origin if event.bytes < 0 and event.origin else event.where
            if label != INPUTS:
                total += event.bytes
                kept.append(Event(event.bytes, total, event.where, event.origin))
        phases.append(tuple(kept))
    return Trace(phases[0], phases[1], trace.persistent, retained=trace.retained)


def full_iteration_peak(
    job: Job, stage: int, traces: Sequence[Trace], step: Sequence[Event], extra: int = 0
) -> tuple[Peak, tuple[tuple[str, int], ...], tuple[Trace, ...], int]:
    """Return a stage's peak above static with a full-iteration graph, what it keeps (the
    static batches, the graph's pool), the traces of the rest of the step (none: every
    forward and backward runs in the pool) and the peak as PyTorch counts allocations
    (cuda_graphs.py `allocated_peak`)."""
    pp, count = job.layout.pp, job.schedule().num_microbatches
    graphed = tuple(_without_inputs(trace) for trace in traces)
    eager = iteration_peak(graphed, stage, pp, count, step=tuple(step), extra=extra)
    pool = iteration_peak(graphed, stage, pp, count, extra=extra)
    batches = static_batches(job, stage)
    kept = (
        (f"{GRAPHS}static inputs ({count} micro-batches' batches)", batches),
        (f"{POOL} (the full iteration's graph, high-water mark at the {pool.moment})",
         pool.bytes),
    )  # fmt: skip
    rest = tuple(Trace((), (), trace.persistent) for trace in traces)
    top = max(step, key=lambda event: event.allocated, default=Event(0, 0, "optimizer step"))
    if eager.bytes > pool.bytes + top.allocated:  # the static batches are there in both
        moment = f"a warm-up iteration before the graph is captured (eager): {eager.moment}"
        peak = Peak(eager.bytes - pool.bytes, eager.held, eager.micro_batches, moment)
        return peak, kept, rest, allocated_peak(peak, pool.bytes, True)
    moment = f"{top.where}, beside the full-iteration CUDA graph's memory pool"
    peak = Peak(top.allocated, 0, 0, moment)
    return peak, kept, rest, allocated_peak(peak, pool.bytes, False)
