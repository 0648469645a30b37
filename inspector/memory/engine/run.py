"""What the engine adds to a rank's state memory: persistent buffers, workspaces, the peak."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import ConfigError
from inspector.job.device import te_cublas_workspace, torch_cublas_workspace
from inspector.job.ep_overlap import extra_warmup
from inspector.job.job import Job
from inspector.memory.engine.microbatch import GLOBAL_BUFFER, Trace
from inspector.memory.engine.offload_steady import host_demand
from inspector.memory.engine.optimizer import StepRun, stage_step
from inspector.memory.engine.schedule import Peak, iteration_peak, replay_passes, top_event
from inspector.memory.engine.stage import Cache, ChunkShape, trace_chunks
from inspector.memory.engine.timeline import Replay
from inspector.world.te.state import DUMMY_WGRAD

# torch's cuBLAS workspace per (handle, stream), its size by the GPU's compute capability and
# CUBLAS_WORKSPACE_CONFIG (job/device.py `torch_cublas_workspace`: PyTorch's
# aten/src/ATen/cuda/CublasHandlePool.cpp). Handles are per thread (`getCurrentCUDABlasHandle`'s
# thread-local pool window): the main thread runs the forward's GEMMs and the autograd engine's
# device thread the backward's.
GEMM_THREADS = 2
# Transformer Engine's own cuBLAS workspaces, made by its first GEMMs and kept for the process
# (transformer_engine/pytorch/cpp_extensions/gemm.py, TE 2.11-2.20: `get_cublas_workspace`, an
# lru_cache), each `get_cublas_workspace_size_bytes()` (job/device.py `te_cublas_workspace`:
# 32 MiB + 1 KiB from Hopper on, 4 MiB before); grouped GEMMs (`general_grouped_gemm`) take one
# per compute stream, `get_num_cublas_streams()` = 4 on every GPU (common/util/multi_stream.cpp
# `num_compute_streams`, a constexpr).
TE_GROUPED_STREAMS = 4
# With --tp-comm-overlap every GEMM given a userbuffers communicator takes `get_cublas_workspace(
# device, ub=True, ...)`, another lru_cache entry: `_NUM_MAX_UB_STREAMS` (3) workspaces in one
# tensor, for the chunks of the overlapped GEMM (cpp_extensions/gemm.py, TE 2.20; TE 2.0-2.8's
# module/base.py `initialize_ub`: `get_workspace().repeat(_NUM_MAX_UB_STREAMS)`). The userbuffers
# themselves are registered with cudaMalloc by TE's C++ (common/comm_gemm_overlap/
# comm_gemm_overlap.cpp `register_user_buffer_collective`): outside PyTorch's allocator.
TE_UB_STREAMS = 3


@dataclass(frozen=True)
class RunMemory:
    """One rank's memory from megatron running: what persists, and the peak above static."""

    persistent: tuple[tuple[str, int], ...]  # buffers made in the run and kept (where, bytes)
    workspaces: int  # cuBLAS workspaces (a cited constant: nothing runs cuBLAS here)
    peak: Peak  # above static memory (state, persistent buffers, workspaces)
    optimizer_state: int = 0  # bytes the first optimizer step made (Adam's moments): state memory
    # the iteration pass by pass, made when asked (memory --timeline, --snapshot: timeline.py)
    replay: Replay | None = field(default=None, repr=False, compare=False)
    # GPU memory held outside PyTorch's caching allocator (what, bytes): DeepEP's buffers
    # (`outside_allocator`); torch.cuda.max_memory_allocated never sees them
    outside: tuple[tuple[str, int], ...] = ()
    # CUDA graphs: the peak above `static - graph_pool` as torch.cuda.max_memory_allocated sees it
    # (engine/cuda_graphs.py `allocated_peak`); None without graphs (then static + peak)
    allocated_peak: int | None = None
    # what the steady optimizer step leaves allocated: the fp32 copies of a 16-bit grad buffer's
    # main grads (optimizer.py `_copy_model_grads_to_main_grads`, `main_grad.float()`), kept until
    # the next iteration's `optimizer.zero_grad()` sets them to None; Megatron-LM logs
    # mem-allocated-bytes between the two (training.py `training_log`, after `train_step`)
    after_step: int = 0
    # --fine-grained-activation-offloading: pinned host memory the offloaded activations take,
    # (bytes asked, bytes pinned: each buffer a power of two) at the iteration's highest demand
    host: tuple[int, int] = (0, 0)

    @property
    def outside_bytes(self) -> int:
        """Return the bytes held outside PyTorch's allocator."""
        return sum(size for _, size in self.outside)

    @property
    def graph_buffers(self) -> int:
        """Return the bytes CUDA graphs keep (engine/cuda_graphs.py), among the persistent ones."""
        from inspector.memory.engine.cuda_graphs import GRAPHS

        return sum(size for where, size in self.persistent if where.startswith(GRAPHS))

    @property
    def graph_pool(self) -> int:
        """Return the bytes of the CUDA graphs' memory pools, among the persistent ones: reserved
        by PyTorch's caching allocator once captured, not allocated (torch.cuda.memory_allocated,
        Megatron-LM's mem-allocated-bytes, never counts them then)."""
        from inspector.memory.engine.cuda_graphs import POOL

        return sum(size for where, size in self.persistent if where.startswith(POOL))

    def torch_reports(self, static: int) -> tuple[int, int]:
        """Return what torch.cuda.memory_allocated (after the step: what the step leaves
        allocated included) and max_memory_allocated report for a rank holding `static` with this
        run's peak above it: neither sees what is outside PyTorch's allocator, nor a captured CUDA
        graphs' pool (reserved, not allocated)."""
        allocated = static - self.outside_bytes - self.graph_pool
        above = self.peak.bytes if self.allocated_peak is None else self.allocated_peak
        return allocated + self.after_step, allocated + above

    @property
    def static(self) -> int:
        """Return the bytes the run adds to the state for good: persistent plus workspaces, and
        what is held outside PyTorch's allocator."""
        return sum(size for _, size in self.persistent) + self.workspaces + self.outside_bytes


Steps = dict[Hashable, StepRun]  # a job's optimizer steps by `step_key`


def run_memory(
    job: Job,
    stage: int,
    shapes: Sequence[ChunkShape] | None = None,
    cache: Cache | None = None,
    whole: bool = False,
    steps: Steps | None = None,
) -> RunMemory:
    """Run one micro-batch of each chunk of `stage`, its optimizer step, and replay the
    iteration's schedule.

    `shapes`: what megatron put on each chunk (`chunk_shapes`; built here when not given);
    `cache`: the small chunks traced for other stages of the same job (stage.py); `whole`:
    run every layer instead of composing the chunks from one layer of each kind; `steps`: the
    optimizer steps run for other stages of the same job (`step_key`). It all runs on the
    job's GPU, as the world reads it (world/setup.py `on_job_gpu`).
    """
    from inspector.world.setup import on_job_gpu

    with on_job_gpu(job.device):
        return _run_memory(job, stage, shapes, cache, whole, steps)


def _run_memory(job: Job, stage: int, shapes: Sequence[ChunkShape] | None, cache: Cache | None,
                whole: bool, steps: Steps | None) -> RunMemory:  # fmt: skip
    if shapes is None:
        from inspector.world.build import View, build

        shapes = chunk_shapes(build(job, View((stage,)), expert_ranks=(0,)).stages[0])
    traces = trace_chunks(job, stage, shapes, cache, whole)
    stash, stash_host = rank_stash(job, stage, traces)  # --moe-paged-stash: the rank's buffers
    if job.training.megatron_fsdp:  # its gradient buckets, allocated as the backward goes
        from inspector.memory.engine.fsdp_grads import fsdp_traces

        traces = fsdp_traces(job, stage, shapes, traces)
    steps = {} if steps is None else steps
    key = step_key(job, stage, shapes)
    if key not in steps:
        steps[key] = stage_step(job, stage)
    step = steps[key]
    schedule = job.schedule()
    extra = extra_warmup(job.training)
    group = job.training.microbatch_group_size
    kept: tuple[tuple[str, int], ...] = ()
    allocated: int | None = None
    if job.training.cuda_graph_impl != "none" and group is not None:
        raise ConfigError("--microbatch-group-size-per-virtual-pipeline-stage with "
                          f"--cuda-graph-impl {job.training.cuda_graph_impl}: the graphs' capture "
                          "order under micro-batch groups is not modelled")  # fmt: skip
    full = "full_iteration" in job.training.cuda_graph_scope
    if job.training.cuda_graph_impl == "transformer_engine" or (
        job.training.cuda_graph_impl == "local" and not full
    ):  # per-layer graphs, Transformer Engine's or megatron-core's (engine/local_graphs.py)
        from inspector.memory.engine.cuda_graphs import graphed_peak
        from inspector.memory.engine.local_graphs import local_static_inputs

        given = local_static_inputs(job, stage) if job.training.cuda_graph_impl == "local" else None
        peak, kept, traces, allocated = graphed_peak(job, stage, traces, step.events, extra,
                                                     step.state, given)
    elif job.training.cuda_graph_impl == "local":  # full_iteration
        from inspector.memory.engine.full_graph import full_iteration_peak

        peak, kept, traces, allocated = full_iteration_peak(job, stage, traces, step.events, extra)
    elif job.training.train_iters == 1:
        peak = first_iteration_peak(
            iteration_peak(traces, stage, job.layout.pp, schedule.num_microbatches, group,
                           extra=extra), step)  # fmt: skip
    else:
        peak = iteration_peak(traces, stage, job.layout.pp, schedule.num_microbatches, group,
                              step=step.events, extra=extra)  # fmt: skip
    workspaces = cublas_workspaces(job)
    phases = (("optimizer step", step.events),)  # its events' labels start "optimizer step: "
    replay = Replay(traces, stage, job.layout.pp, schedule.num_microbatches, phases, extra, group)
    outside = outside_allocator(job, shapes)
    host = host_demand(traces, stage, job.layout.pp, schedule.num_microbatches, group, extra)
    host = (host[0] + stash_host[0], host[1] + stash_host[1])
    return RunMemory(_persistent(traces) + kept + stash, workspaces, peak, step.state, replay,
                     outside, allocated, step.held, host)


def rank_stash(job: Job, stage: int, traces: Sequence[Trace]
               ) -> tuple[tuple[tuple[str, int], ...], tuple[int, int]]:  # fmt: skip
    """Return the MoE paged stash's buffers a rank allocates after its profiling iteration: the
    most tokens its micro-batches in flight save at once (megatron counts across micro-batches
    and chunks), by kind, given to megatron's `allocate_stash_buffers` (engine/paged_stash.py)."""
    if not any(trace.stash for trace in traces):
        return (), (0, 0)
    from inspector.memory.engine.paged_stash import layer_counts, most_counted, stash_buffers

    passes = replay_passes(traces, stage, job.layout.pp, job.schedule().num_microbatches,
                           job.training.microbatch_group_size, extra_warmup(job.training))  # fmt: skip
    top = most_counted(passes, [layer_counts(trace.stash) for trace in traces])
    t = job.training
    sizes = (t.moe_paged_stash_page_size, t.moe_paged_stash_factor_cuda, t.moe_paged_stash_factor_cpu)
    return stash_buffers(sizes, top)


def first_iteration_peak(passes: Peak, step: StepRun) -> Peak:
    """Return the peak above static memory of a run whose only iteration is the first
    (--train-iters 1): its forwards and backwards (`passes`, their peak above static) run before
    Adam's moments exist, which the first optimizer step makes (torch's and TE's Adam fill
    `state` lazily: optimizer.py); the higher of those passes and that step, less the moments."""
    top = top_event(step.first)
    first = Peak(top.allocated - step.state, 0, 0,
                 f"first optimizer step (it makes Adam's moments): {top.where}")  # fmt: skip
    if first.bytes >= passes.bytes - step.state:
        return first
    return Peak(passes.bytes - step.state, passes.held, passes.micro_batches,
                f"{passes.moment} (before the first optimizer step made Adam's moments)")


class _Group:
    """What DeepEP's Buffer and megatron's `get_buffer` ask of a process group: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


def outside_allocator(job: Job, shapes: Sequence[ChunkShape]) -> tuple[tuple[str, int], ...]:
    """Return the GPU memory a rank of the stage holds outside PyTorch's allocator: DeepEP's
    buffers under the flex dispatcher, on a stage with an MoE layer (an MTP layer of an MoE
    model is one).

    megatron-core keeps one DeepEP Buffer per process (moe/fused_a2a.py `get_buffer`), sized by
    the largest of DeepEP's dispatch and combine hints for the flex group (expert tensor x expert
    parallel ranks) and the hidden bytes `get_hidden_bytes` gives the layer's input (hidden x 2
    bytes, 4 in fp32). megatron's own `get_buffer` runs here, on the DeepEP stand-in
    (world/deep_ep.py), with DeepEP's SMs set as megatron sets them (`set_deepep_num_sms`).
    HybridEP's buffers (one `HybridEPBuffer` per process, fused_a2a.py `init_hybrid_ep_buffer`)
    are sized from the arguments megatron passes it, by job/hybrid_ep.py.
    """
    model, training = job.model, job.training
    if training.moe_token_dispatcher_type != "flex" or model.num_experts is None:
        return ()
    if not any(shape.mtp or any(map(model.is_moe_layer, shape.layers)) for shape in shapes):
        return ()
    from inspector.job.flex import runs_hybridep

    if runs_hybridep(training):
        from inspector.job.hybrid_ep import hybridep_buffers, hybridep_shape

        return hybridep_buffers(hybridep_shape(model, job.layout, job.schedule().micro_batch_size))
    import torch
    from megatron.core.transformer.moe import fused_a2a

    from inspector.job.flex import flex_group_size
    from inspector.world.deep_ep import NUM_WORKSPACE_BYTES, NVL_METADATA_BYTES

    fused_a2a.set_deepep_num_sms(training.moe_deepep_num_sms)
    dtype = torch.float32 if model.dtype_name == "float32" else torch.bfloat16
    hidden = torch.empty(1, model.hidden_size, dtype=dtype, device="meta")
    saved = fused_a2a._buffer
    fused_a2a._buffer = None
    try:
        buffer = fused_a2a.get_buffer(_Group(flex_group_size(job.layout)),
                                      fused_a2a.get_hidden_bytes(hidden))  # fmt: skip
    finally:
        fused_a2a._buffer = saved
    nvl = buffer.num_nvl_bytes + NVL_METADATA_BYTES if buffer.num_nvl_bytes else 0
    held = (("DeepEP NVLink buffer", nvl), ("DeepEP RDMA buffer", buffer.num_rdma_bytes),
            ("DeepEP workspace", NUM_WORKSPACE_BYTES))  # fmt: skip
    return tuple((what, size) for what, size in held if size)


def cublas_workspaces(job: Job) -> int:
    """Return the bytes of the cuBLAS workspaces a rank of the job keeps: torch's, one per GEMM
    thread, and Transformer Engine's (both sized by the job's GPU, job/device.py)."""
    return torch_cublas_workspace(job.device) * GEMM_THREADS + te_workspaces(job)


def te_workspaces(job: Job) -> int:
    """Return the bytes of Transformer Engine's cuBLAS workspaces the job's GEMMs make.

    Besides TE's own modules, megatron's MoE router runs its GEMMs through TE where megatron-core
    has a `te_general_gemm` (moe/moe_utils.py `RouterGatingLinearFunction`, with any layer spec;
    TE's `general_gemm` takes the same workspace as TE's linears): a local-spec MoE job makes one.
    """
    model, one = job.model, te_cublas_workspace(job.device)
    if model.transformer_impl != "transformer_engine":
        return one if model.num_experts and _router_runs_te_gemm() else 0
    grouped = bool(model.num_experts) and model.moe_grouped_gemm  # TEGroupedMLP's GroupedLinear
    ub = TE_UB_STREAMS if job.training.tp_comm_overlap else 0
    return one * (1 + (TE_GROUPED_STREAMS if grouped else 0) + ub)


def _router_runs_te_gemm() -> bool:
    """Return whether megatron's router GEMM is TE's here (megatron-core and the TE stand-in)."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "te_general_gemm", None) is not None


def _persistent(traces: Sequence[Trace]) -> tuple[tuple[str, int], ...]:
    """Return the buffers the chunks' runs keep: each chunk's own, and once per rank what a
    process keeps for all its chunks: megatron's global memory buffers, at the largest size any
    chunk asked for (grown on demand), and Transformer Engine's placeholder weight gradients
    (one per shape and dtype)."""
    def shared_by_chunks(where: str) -> bool:
        return GLOBAL_BUFFER in where or where.startswith(DUMMY_WGRAD)

    own = [item for trace in traces for item in trace.persistent if not shared_by_chunks(item[0])]
    shared: dict[str, int] = {}
    for trace in traces:
        for where, size in trace.persistent:
            if shared_by_chunks(where):
                shared[where] = max(shared.get(where, 0), size)
    return tuple(own) + tuple(shared.items())


def step_key(job: Job, stage: int, shapes: Sequence[ChunkShape]) -> Hashable:
    """Return what a stage's optimizer step depends on: two stages with equal keys run it alike.

    The step sees the stage's parameters as DDP lays them into buffers: per chunk, the pieces
    megatron put there (embedding, output layer, MTP) and each layer's kind (dense or MoE), in
    order, the parameter names being local to the chunk (`decoder.layers.{i}`); and whether DDP
    buckets them (megatron's DDP buckets only on pipeline rank 0). The simulated rank of every
    stage sits at data-parallel index 0, so its shards are the same; the stage's own number
    reaches megatron's optimizer only as a checkpoint key (`data_parallel_group_idx`).
    """
    model = job.model
    return stage == 0, tuple(
        (shape.embedding, shape.output, shape.mtp, tuple(map(model.is_moe_layer, shape.layers)))
        for shape in shapes
    )


def chunk_shapes(built: Any) -> tuple[ChunkShape, ...]:
    """Return what megatron put on each chunk of a built stage (world.build.BuiltStage)."""
    return tuple(
        ChunkShape(chunk.layers, chunk.has_embedding, chunk.has_output, chunk.mtp_layers)
        for chunk in built.chunks
    )


@dataclass(frozen=True)
class JobRuns:
    """What the engine found for each stage a command shows, or why it did not run."""

    runs: dict[int, RunMemory]  # by stage
    not_run: str | None = None  # why not (the activations then come from the formulas)


@dataclass(frozen=True)
class StageShapes:
    """A stage's chunks as megatron would build them, known without building it (a plan's split:
    plan/confirm.py)."""

    stage: int
    shapes: tuple[ChunkShape, ...]


def run_job(job: Job, stages: Sequence[Any], cache: Cache | None = None,
            steps: Steps | None = None) -> JobRuns:  # fmt: skip
    """Run every stage a micro-batch, sharing the small chunks: built stages
    (world.build.BuiltStage) or their shapes alone (`StageShapes`). `cache` and `steps`: the
    small chunks' traces and the optimizer steps of other runs that share them (plan/confirm.py)."""
    reason = not_runnable(job)
    if reason is not None:
        return JobRuns({}, reason)
    cache = {} if cache is None else cache
    steps = {} if steps is None else steps
    return JobRuns(
        {
            built.stage: run_memory(
                job,
                built.stage,
                built.shapes if isinstance(built, StageShapes) else chunk_shapes(built),
                cache,
                steps=steps,
            )
            for built in stages
        }
    )


def not_runnable(job: Job) -> str | None:
    """Return why the engine cannot run the job, or None when it can."""
    reason = engine_gap(job)
    if reason is not None and job.model.fp8_format is not None:  # the closed forms know no fp8
        reason += " (16-bit activations; fp8 weight copies and fp8 saved inputs not counted)"
    return reason


def engine_gap(job: Job) -> str | None:
    """Return what of the job the engine cannot run, or None.

    The command line admits no such job today: TE's context-parallel attention runs only in
    fp16/bf16 (it needs flash/fused attention, the auto backend's choice in 16 bits only); this guards
    a job built otherwise."""
    model = job.model
    if model.transformer_impl == "transformer_engine" and job.layout.cp > 1:
        if not (model.bf16 or model.fp16):
            return "Transformer Engine's 32-bit context-parallel attention (TE has none) is not run"
    return None
