"""What each rank needs to train: state bytes from megatron's own buffers, formula activations, FLOPs.

Weights, gradients and optimizer state are exact. Each stage (each virtual chunk) is built as
for `params`, then wrapped in megatron-core's own DistributedDataParallel on the meta device
(distopt.py), as Megatron-LM wraps every model chunk. Its grad buffers give, per rank:
  - weights: every parameter in its dtype; with the distributed optimizer the parameters live in
    a param buffer of the padded size (`_ParamAndGradBuffer.param_data`);
  - gradients: the grad buffer, `numel` elements (padding included) in megatron's grad dtype
    (fp32 for bf16 models, as Megatron-LM forces --accumulate-allreduce-grads-in-fp32);
  - optimizer: Adam's two fp32 moments (8 bytes) plus, for 16-bit parameters, the fp32 master
    copy (4 bytes) of every element the rank's optimizer updates: all of them without the
    distributed optimizer (megatron's Float16OptimizerWithFloat16Params), or only the elements
    in the rank's shard of each bucket (DistributedOptimizer's `shard_fp32_from_float16_groups`,
    padding excluded). That is Megatron-LM's 18 bytes per parameter, and 6 + 12/d with it
    (`theoretical_memory_usage.py`), but counted on the real parameters and shards. With
    --use-precision-aware-optimizer the moments and master weight are in the flags' dtypes
    (job/optimizer_precision.py: Transformer Engine's FusedAdam), e.g. 6 bytes with bf16 moments.
Ranks of a stage hold the same parameter shapes; with the distributed optimizer their shards
differ (the last ones hold the padding), so each stage reports its most loaded rank.

Activations, temporaries and the buffers megatron keeps come from running it: one call into
the engine (inspector/memory/engine, docs/how-memory-is-computed.md) runs each stage's forward and
backward on meta tensors and replays the pipeline schedule into the rank's peak and its moment.
Where the engine cannot run the job yet (`memory.engine.run.not_runnable`), the activations come from
the closed forms in activations.py (Korthikanti et al. 2022) on the layers megatron placed on the
stage, times the micro-batches in flight there. FLOPs from Megatron-LM's throughput formula
(flops.py). The tails of the caching allocator's blocks beyond megatron's set-up requests come
from segments.py. Not counted: the CUDA context, NCCL buffers, fragmentation between blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from inspector.errors import ConfigError
from inspector.formulas.flops import (
    check_mfu,
    check_peak,
    iteration_flops,
    rank_flops,
    seconds_for,
    stage_flops,
)
from inspector.formulas.hybrid_flops import hybrid_stage_flops
from inspector.job.dims import ModelDims
from inspector.job.dsa import check_dsa_run
from inspector.job.hardware import GIB, check_positive, get_gpu
from inspector.job.job import Job, Schedule, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.job.optimizer_precision import OptimizerBytes
from inspector.job.optimizers import MUON, muon_bytes_per_element
from inspector.memory.closed.activations import StageActivations, stage_activations

if TYPE_CHECKING:
    from inspector.memory.engine.run import RunMemory
    from inspector.world.build import BuiltJob, BuiltStage

DEFAULT_ADAM = OptimizerBytes()  # Megatron-LM's default Adam: fp32 master and moments


@dataclass(frozen=True)
class Hardware:
    """What the user's GPUs offer: memory (bytes), peak TFLOP/s and the MFU to expect."""

    memory: int | None = None
    tflops: float | None = None
    mfu: float = 1.0


@dataclass(frozen=True)
class StateBytes:
    """One rank's weights, gradients and optimizer state, in bytes."""

    weights: int
    gradients: int
    optimizer: int
    # of the weights, what Transformer Engine keeps beside fp8 parameters (never gathered)
    kept: int = 0
    elements: int = 0  # the buffers' elements (padding included); 0 where not counted
    # the bf16 param views inside grad buffers shared with MXFP8 weights (BufferLayout.shared)
    shared_view: int = 0
    frozen: int = 0  # of the weights, parameters in no buffer (LoRA's frozen model): never gathered

    @property
    def total(self) -> int:
        """Return the rank's state bytes."""
        return self.weights + self.gradients + self.optimizer

    @property
    def all_gather_bytes(self) -> int:
        """Return the bytes the parameter all-gather moves: the param buffers, not what TE
        keeps beside them; an MXFP8 buffer's bf16 view of its grad buffer instead."""
        return self.weights - self.kept - self.frozen + self.shared_view


@dataclass(frozen=True, kw_only=True)
class StageBytes:
    """One pipeline stage's most loaded rank: the one stage-memory record, which `memory`
    (StageMemory, from the built job) and `plan` (plan/price.py's StagePlan, composed) extend."""

    stage: int
    layers: tuple[tuple[int, ...], ...]  # 0-based global layers of each chunk
    state: StateBytes
    # FSDP's gathered parameters and unsharded gradients (memory/fsdp_buffers.py)
    fsdp_in_flight: int = 0


@dataclass(frozen=True, kw_only=True)
class StageMemory(StageBytes):
    """One pipeline stage as `memory` measures it: its most loaded rank's bytes, and the stage's
    FLOPs."""

    rank: int  # the lowest global rank holding the most bytes
    parameters: int  # parameter elements on one rank of the stage
    # Muon: every rank's optimizer bytes (global rank, bytes), and which rank's optimizer holds
    # the word embeddings and output layer (local name, data-parallel rank); () otherwise
    optimizer_by_rank: tuple[tuple[int, int], ...] = ()
    largest_held_by: tuple[tuple[str, int], ...] = ()
    activations: StageActivations  # the closed forms (the answer only where run is None)
    flops: int  # one iteration, all of the stage's ranks together
    run: RunMemory | None = None  # megatron run on meta tensors (inspector/memory/engine)
    # --perform-rl-step: the rollout engine's context (KV cache, tables) kept on the GPU through
    # the training step (job/rollout.py, engine/inference_context.py)
    rollout: int = 0
    block_tails: int = 0  # the set-up's blocks beyond their requests (segments.py `stage_tails`)

    @property
    def activation_bytes(self) -> int:
        """Return the peak above static memory: the run's, else the formulas' rounded up."""
        if self.run is not None:
            return self.run.peak.bytes
        return math.ceil(self.activations.total)

    @property
    def buffers(self) -> int:
        """Return the bytes the run keeps besides the state (persistent buffers, workspaces; FSDP's
        buffers in flight); the run's are 0 where the engine did not run (`buffers_counted`)."""
        return (self.run.static if self.run is not None else 0) + self.fsdp_in_flight + self.rollout

    @property
    def buffers_counted(self) -> bool:
        """Return whether the buffers were counted: only megatron running finds them."""
        return self.run is not None

    @property
    def static(self) -> int:
        """Return the bytes the rank holds all through the iteration: state and buffers."""
        return self.state.total + self.buffers

    @property
    def total(self) -> int:
        """Return the rank's peak bytes: state, buffers and the peak above them."""
        return self.state.total + self.buffers + self.activation_bytes


@dataclass(frozen=True)
class MemoryReport:
    """Every stage's memory and FLOPs, and what they mean on the given hardware."""

    job: Job
    schedule: Schedule
    hardware: Hardware
    stages: tuple[StageMemory, ...]
    iteration_flops: int
    not_run: str | None = None  # why the engine did not run: activations from the formulas
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF's (segments.py)

    @property
    def model(self) -> ModelConfig:
        """Return the job's model."""
        return self.job.model

    @property
    def layout(self) -> Layout:
        """Return the job's parallel layout."""
        return self.job.layout

    @property
    def training(self) -> Training:
        """Return the job's training settings."""
        return self.job.training

    @property
    def worst(self) -> StageMemory:
        """Return the stage whose rank needs the most bytes (the first of equals)."""
        return max(self.stages, key=lambda s: (s.total, -s.stage))

    @property
    def seconds(self) -> float | None:
        """Return one iteration's time at the given TFLOP/s and MFU (None without --gpu-tflops).

        MFU (Chowdhery et al. 2022, PaLM, Appendix B) is model FLOPs per second over the peak of
        all GPUs, so time = FLOPs / (GPUs x peak x MFU); bubbles and communication are inside it.
        """
        if self.hardware.tflops is None:
            return None
        return seconds_for(
            self.iteration_flops, self.layout.world_size, self.hardware.tflops, self.hardware.mfu
        )

    def flops_per_rank(self, stage: StageMemory) -> float:
        """Return one rank's share of the stage's FLOPs per iteration."""
        return rank_flops(stage.flops, self.layout)

    def spare(self, stage: StageMemory) -> int | None:
        """Return --gpu-memory minus the stage's bytes (negative: over; None: not given)."""
        if self.hardware.memory is None:
            return None
        return self.hardware.memory - stage.total

    def fits(self, stage: StageMemory) -> bool | None:
        """Return whether the stage's rank fits in --gpu-memory (None when it was not given)."""
        spare = self.spare(stage)
        return None if spare is None else spare >= 0


def make_hardware(
    gpu_memory: float | None, gpu_tflops: float | None, mfu: float | None,
    gpu: str | None = None, dtype_name: str = "float32",
) -> Hardware:
    """Check the hardware flags; --gpu-memory is in GiB, as nvidia-smi and torch count.

    `gpu`: a --gpu type (job/hardware.py) whose memory and peak for the model's dtype fill in
    what --gpu-memory and --gpu-tflops leave out.
    """
    if gpu_memory is not None:
        check_positive("--gpu-memory", gpu_memory, "GiB")
    if mfu is not None:
        check_mfu(mfu)
        if gpu_tflops is None and gpu is None:
            raise ConfigError("--mfu needs --gpu-tflops (the peak it is a fraction of)")
    if gpu_tflops is not None:
        check_peak(gpu_tflops)
    if gpu is not None:
        named = get_gpu(gpu)
        gpu_memory = named.memory_gib if gpu_memory is None else gpu_memory
        gpu_tflops = named.peak_tflops(dtype_name) if gpu_tflops is None else gpu_tflops
    memory = None if gpu_memory is None else round(gpu_memory * GIB)
    return Hardware(memory, gpu_tflops, 1.0 if mfu is None else mfu)


def optimizer_bytes_per_element(buffer: Any, optimizer: OptimizerBytes = DEFAULT_ADAM) -> int:
    """Return the optimizer bytes of one element a rank updates: Adam's moments, and the fp32
    master copy of a 16-bit parameter (or, with the precision-aware optimizer, the dtypes of
    job/optimizer_precision.py); Muon's for the layer-wise layout's matrices."""
    if buffer.layer_wise:
        return muon_bytes_per_element(buffer.param_dtype.itemsize)
    return optimizer.per_element(buffer.param_dtype.itemsize)


def job_optimizer_bytes(job: Job) -> OptimizerBytes:
    """Return the job's optimizer bytes per updated element, by parameter size."""
    model = job.model
    return job.training.optimizer_precision.for_model(
        model.bf16, model.fp8_format, model.fp8_recipe
    )


def state_bytes(
    buffers: Sequence[Any], distributed: bool, dense_index: int, expert_index: int,
    optimizer: OptimizerBytes = DEFAULT_ADAM, *, frozen: int = 0,
) -> StateBytes:
    """Return one rank's state bytes from its chunks' megatron grad buffers (distopt.BufferLayout).

    `distributed`: --use-distributed-optimizer. `dense_index` is the rank's position in the
    data-parallel group, `expert_index` in the expert data-parallel group: they pick its shard of
    the dense and expert buffers. Without the distributed optimizer megatron asserts that a buffer
    has no padding, so `numel` counts the parameters themselves. `frozen`: the bytes of the
    parameters that need no gradient (LoRA's frozen model), which no buffer holds.
    """
    weights, gradients, held, view = frozen, 0, 0, 0
    for buffer in buffers:
        # an MXFP8 buffer's param_data is a bf16 view of its grad buffer (`shared`): numel
        # bf16 elements (param_and_grad_buffer.py 786-792), no bytes of its own
        view += 2 * buffer.numel if buffer.shared else 0
        weights += buffer.param_buffer_bytes + buffer.kept
        gradients += buffer.numel * buffer.grad_dtype.itemsize
        index = expert_index if buffer.expert else dense_index
        # with N optimizer instances a rank shards among dp / N: its index there is index % (dp / N)
        updated = buffer.owned_numel[index % len(buffer.owned_numel)] if distributed else buffer.numel
        held += updated * optimizer_bytes_per_element(buffer, optimizer)
    kept = sum(buffer.kept for buffer in buffers)
    return StateBytes(weights, gradients, held, kept, sum(b.numel for b in buffers), view, frozen)


def measure(built: BuiltJob, hardware: Hardware, expandable_segments: bool = False) -> MemoryReport:
    """Size every stage (built on expert-parallel rank 0) with megatron's DDP and return the report."""
    from inspector.memory.engine.run import run_job
    from inspector.memory.segments import stage_tails
    from inspector.world.ranks import rank_shard_indices

    job = built.job
    check_dsa_run(job.model, "rope_fusion" not in job.training.unfused)
    schedule = job.schedule()
    ranks_of: list[list[tuple[int, int, int]]] = [[] for _ in range(job.layout.pp)]
    for rank, (pipe, data, expert) in enumerate(rank_shard_indices(job.layout)):
        ranks_of[pipe].append((rank, data, expert))
    dims = job.dims()
    # The formulas first: they name a job megatron would refuse to run (a partial group of
    # full recomputation) before the engine runs into it.
    formulas = [
        _stage_memory(job, dims, schedule, stage, ranks_of[stage.stage]) for stage in built.stages
    ]
    engine = run_job(job, built.stages)
    extra = [m for m in job.training.recompute_modules if m != "core_attn"]
    if engine.not_run is not None and job.training.recompute == "selective" and extra:
        raise ConfigError(
            f"--recompute-modules {' '.join(extra)} is measured by the engine only, and it cannot "
            f"run this job yet ({engine.not_run}); the formulas count core_attn alone"
        )
    stages = tuple(replace(_with_run(job, s, engine.runs.get(s.stage), b),
                           block_tails=stage_tails(job.training, b.chunks, expandable_segments))
                   for s, b in zip(formulas, built.stages, strict=True))  # fmt: skip
    if job.training.rollout is not None:
        stages = tuple(replace(s, rollout=_rollout_bytes(job, b))
                       for s, b in zip(stages, built.stages, strict=True))  # fmt: skip
    return MemoryReport(
        job=job,
        schedule=schedule,
        hardware=hardware,
        stages=stages,
        iteration_flops=sum(s.flops for s in stages) if job.model.is_hybrid_model
        else iteration_flops(dims, schedule.global_batch_size),
        not_run=engine.not_run,
        expandable_segments=expandable_segments,
    )


def _rollout_bytes(job: Job, built: BuiltStage) -> int:
    """Return what megatron-core's dynamic inference context allocates on a rank of the stage
    for the GRPO rollouts, with the stage's own TransformerConfig (job/rollout.py)."""
    from inspector.memory.engine.inference_context import context_bytes

    if job.model.is_hybrid_model:
        raise ConfigError("--perform-rl-step with a hybrid model is not modelled: its rollout "
                          "context holds Mamba states beside the KV cache")  # fmt: skip
    assert job.training.rollout is not None
    module = built.chunks[0].module
    layers = tuple(len(chunk.module.decoder.layers) for chunk in built.chunks)
    return context_bytes(module.config, job.training.rollout, job.layout, built.stage,
                         module.vocab_size, layers).total


def _with_run(job: Job, memory: StageMemory, run: RunMemory | None,
              built: BuiltStage) -> StageMemory:  # fmt: skip
    """Return the stage's memory with megatron's run; Megatron-FSDP's gradient buckets are then
    in the run's backward (engine/fsdp_grads.py), not among the buffers in flight."""
    if run is not None and job.training.megatron_fsdp:
        from inspector.memory.fsdp_buffers import fsdp_in_flight

        gathered = fsdp_in_flight([chunk.fsdp() for chunk in built.chunks], gradients=False)
        return replace(memory, run=run, fsdp_in_flight=gathered)
    return replace(memory, run=run)


def _stage_memory(
    job: Job,
    dims: ModelDims,
    schedule: Schedule,
    built: BuiltStage,
    ranks: Sequence[tuple[int, int, int]],
) -> StageMemory:
    """Return one stage's memory: its chunks' buffers, its most loaded rank, its activations."""
    training, stage, chunks = job.training, built.stage, built.chunks
    in_flight = 0
    muon: dict[str, Any] = {}
    if training.megatron_fsdp or training.torch_fsdp2:
        from inspector.memory.fsdp_buffers import fsdp_in_flight, fsdp_state

        layouts = [chunk.fsdp() for chunk in chunks]
        moments = job_optimizer_bytes(job).precision.moments()
        by_shard = {(d, e): StateBytes(*fsdp_state(layouts, d, e, moments)) for _, d, e in ranks}
        in_flight = fsdp_in_flight(layouts)
    else:
        buffers = [buffer for chunk in chunks for buffer in chunk.buffers()]
        distributed = training.use_distributed_optimizer or training.layer_wise_param_layout
        each = job_optimizer_bytes(job)
        frozen = sum(chunk.frozen_bytes() for chunk in chunks)
        by_shard = {(d, e): state_bytes(buffers, distributed, d, e, each, frozen=frozen)
                    for _, d, e in ranks}  # fmt: skip
        if training.layer_wise_param_layout:  # each rank's shards of the buffers (world/ddp.py)
            muon = {"optimizer_by_rank": tuple((r, by_shard[(d, e)].optimizer) for r, d, e in ranks)}
        elif training.optimizer in MUON:  # megatron's Muon: whole matrices per rank (engine/muon.py)
            from inspector.memory.engine.muon import LARGEST
            from inspector.memory.engine.muon_stage import stage_muon

            params = stage_muon(job, stage)
            by_shard = {shard: replace(held, optimizer=sum(
                p.optimizer_bytes for p in params if p.owned_by(*shard)))
                for shard, held in by_shard.items()}  # fmt: skip
            muon = {
                "optimizer_by_rank": tuple((r, by_shard[(d, e)].optimizer) for r, d, e in ranks),
                "largest_held_by": tuple((p.name, p.owner) for p in params
                                         if p.name in LARGEST and p.owner is not None),
            }  # fmt: skip
    rank, data, expert = max(ranks, key=lambda r: (by_shard[r[1:]].total, -r[0]))
    layers = tuple(chunk.layers for chunk in chunks)
    activations = formula_activations(job, built, dims, schedule)
    flops = stage_flops(
        dims,
        (i for chunk in layers for i in chunk),
        schedule.global_batch_size,
        any(chunk.has_output for chunk in chunks),
        has_mtp=any(chunk.mtp_layers for chunk in chunks),
    )
    if job.model.is_hybrid_model:  # Megatron-LM's hybrid branch of its FLOPs formula
        symbols = [s for c in chunks for s in c.models[0].symbols + c.models[0].mtp_symbols * c.mtp_layers]
        # the loss's stage computes the MTP depths' logits too (process_mtp_loss)
        logits = any(c.has_output for c in chunks) * (1 + (job.model.mtp_num_layers or 0))
        flops = round(hybrid_stage_flops(job.model, dims, symbols, schedule.global_batch_size, logits))
    return StageMemory(
        stage=stage,
        layers=layers,
        rank=rank,
        parameters=built.parameters,
        state=by_shard[(data, expert)],
        activations=activations,
        flops=flops,
        fsdp_in_flight=in_flight,
        **muon,
    )


def formula_activations(
    job: Job, built: BuiltStage, dims: ModelDims | None = None, schedule: Schedule | None = None
) -> StageActivations:
    """Return the stage's peak activations by the closed forms (memory/closed/activations.py) for its
    built chunks: the answer where the engine cannot run, a cross-check in tests elsewhere."""
    training, chunks = job.training, built.chunks
    dims = job.dims() if dims is None else dims
    schedule = job.schedule() if schedule is None else schedule
    return stage_activations(
        dims,
        job.layout,
        built.stage,
        tuple(chunk.layers for chunk in chunks),
        schedule.micro_batch_size,
        schedule.num_microbatches,
        training.recompute,
        training.flash_attention,
        mtp_chunks=tuple(chunk.mtp_layers for chunk in chunks),
        recompute_method=training.recompute_method,
        recompute_num_layers=training.recompute_num_layers,
        group_size=training.microbatch_group_size,
        extra=1 if training.ep_overlap else 0,  # job/ep_overlap.py
    )
