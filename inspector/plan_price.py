"""One `plan` candidate priced: its records, exact state memory, activations, step time.

`evaluate(job, split, req)` prices a candidate as plan.py's search does: each stage's state from
plan_memory.stage_state (megatron's DDP buffers, composed from small builds), its activations at
the micro-batches megatron's schedule keeps in flight (formulas.live_microbatches), and its time
(plan_cost.stage_time); the step from plan_cost.step_time. A stage's numbers depend only on its own
shape (layers per chunk, embedding / output, position in the schedule), never on the other stages,
so each distinct stage is priced once per process (`_STATE`, `_ACT`, `_TIME`): a search over
thousands of candidates prices a few thousand stages. Nothing here prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, cast

from inspector.activations import (
    Recompute,
    embedding_activations,
    layer_activations,
    mtp_activations,
    mtp_recompute,
    output_activations,
    recompute_buffer,
    recompute_plan,
)
from inspector.config import ModelConfig
from inspector.flops import iteration_flops
from inspector.formulas import ModelDims, live_microbatches
from inspector.job import Job, Training
from inspector.plan_cost import Gpu, Network, StageTime, StepTime, stage_time, step_time
from inspector.plan_memory import ChunkShape, piece_key, stage_state
from inspector.plan_split import Split, chunk_layers, split_flags
from inspector.topology import Layout


@dataclass(frozen=True)
class Request:
    """What the user asked: the model, the cluster, the batch, and any dimension they fixed."""

    model: ModelConfig
    gpus: int
    gpu: Gpu
    memory: int  # bytes per GPU
    global_batch_size: int
    gpus_per_node: int = 8
    efficiency: float = 0.65
    fixed: dict[str, Any] = field(default_factory=dict)  # tp, pp, cp, ep, etp, vpp, mbs, ...
    top: int = 5
    flash_attention: bool | None = None  # None: on in 16-bit (Transformer Engine's kernels)
    training: Training = field(default_factory=Training)  # the user's dropout and grad dtype

    @property
    def flash(self) -> bool:
        """Return whether the candidates run flash attention."""
        if self.flash_attention is None:
            return self.model.dtype_name != "float32"
        return self.flash_attention


@dataclass(frozen=True)
class StagePlan:
    """One pipeline rank of a plan: its layers and its most loaded rank's bytes."""

    stage: int
    layers: tuple[tuple[int, ...], ...]
    state: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    in_flight: tuple[int, ...]

    @property
    def total(self) -> int:
        """Return the rank's bytes."""
        return self.state + self.activations


@dataclass(frozen=True)
class Plan:
    """One candidate layout, priced."""

    job: Job
    split: Split
    stages: tuple[StagePlan, ...]
    time: StepTime
    flops: int
    gpu: Gpu

    @property
    def peak(self) -> int:
        """Return the most bytes any rank needs."""
        return max(s.total for s in self.stages)

    @property
    def mfu(self) -> float:
        """Return model FLOPs per second over the cluster's peak (PaLM, Appendix B)."""
        gpus = self.job.layout.world_size
        return self.flops / (self.time.seconds * gpus * self.gpu.tflops * 1e12)

    @property
    def tflops_per_gpu(self) -> float:
        """Return the achieved model TFLOP/s per GPU."""
        return self.mfu * self.gpu.tflops

    def bound(self) -> str:
        """Return what limits the plan most besides compute."""
        shares = self.time.shares()
        shares.pop("compute")
        return max(shares, key=lambda k: shares[k])

    def flags(self) -> list[str]:
        """Return the Megatron-LM flags that reproduce this plan."""
        return megatron_flags(self.job, self.split)


def megatron_flags(job: Job, split: Split) -> list[str]:
    """Return the launch-script flags of a plan, Megatron-LM's spelling."""
    lay, training, model = job.layout, job.training, job.model
    out = [
        f"--tensor-model-parallel-size {lay.tp}",
        f"--pipeline-model-parallel-size {lay.pp}",
    ]
    if lay.cp > 1:
        out.append(f"--context-parallel-size {lay.cp}")
    if lay.ep > 1:
        out.append(f"--expert-model-parallel-size {lay.ep}")
    if lay.etp is not None:
        out.append(f"--expert-tensor-parallel-size {lay.etp}")
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    mtp = model.mtp_num_layers or 0
    for name, value in split_flags(split, model.num_layers, lay.pp, lay.chunks, mtp).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out.append(f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {value}")
    out += [
        f"--micro-batch-size {training.micro_batch_size}",
        f"--global-batch-size {training.global_batch_size}",
    ]
    if training.recompute != "none":
        out.append(f"--recompute-granularity {training.recompute}")
        if training.recompute == "full":
            out += [f"--recompute-method {training.recompute_method}",
                    f"--recompute-num-layers {training.recompute_num_layers}"]
    if model.dtype_name == "bfloat16":
        out.append("--bf16")
        if training.fp32_grads is False:
            out.append("--grad-reduce-in-bf16")
    elif model.dtype_name == "float16":
        out.append("--fp16")
        if training.fp32_grads:
            out.append("--accumulate-allreduce-grads-in-fp32")
    defaults = Training()
    for name in ("attention_dropout", "hidden_dropout"):
        if getattr(training, name) != getattr(defaults, name):
            out.append(f"--{name.replace('_', '-')} {getattr(training, name)}")
    if training.flash_attention:
        out.append("--use-flash-attn")
    if training.use_distributed_optimizer:
        out += ["--use-distributed-optimizer", "--overlap-param-gather"]
    out.append("--overlap-grad-reduce")
    return out


@lru_cache(maxsize=65536)
def _live_points(stage: int, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Return the schedule's in-flight points that no other point covers chunk by chunk.

    With every chunk's bytes positive, the peak lies on one of them (a covered point holds less).
    """
    frontier: list[tuple[int, ...]] = []
    for point in sorted(set(live_microbatches(stage, pp, m, v)), key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(f, point, strict=True)) for f in frontier):
            frontier.append(point)
    return tuple(sorted(frontier))


@lru_cache(maxsize=65536)
def _layer_bytes(dims: ModelDims, par: Layout, i: int, mbs: int, recompute: str, flash: bool) -> float:
    return layer_activations(dims, par, i, mbs, recompute, flash).total  # type: ignore[arg-type]


def _chunk_bytes(
    dims: ModelDims, par: Layout, groups: list[tuple[Sequence[int], Recompute]], mbs: int,
    flash: bool,
) -> float:
    """Return one micro-batch's bytes of a chunk's layer groups (activations.recompute_plan):
    a checkpointed group keeps its first layer's input, any other layer its own activations;
    layers of one kind and mode cost the same."""
    counts: dict[tuple[Recompute, bool], tuple[int, int]] = {}
    for group, mode in groups:
        for i in group[:1] if mode == "full" else group:
            key = (mode, dims.is_moe_layer(i))
            n, first = counts.get(key, (0, i))
            counts[key] = (n + 1, first)
    return sum(
        n * _layer_bytes(dims, par, i, mbs, mode, flash) for (mode, _), (n, i) in counts.items()
    )


def stage_activation_bytes(
    dims: ModelDims, par: Layout, stage: int, chunks: list[list[int]], mbs: int, m: int,
    recompute: str, flash: bool, method: str = "uniform", num_layers: int = 1,
) -> tuple[int, tuple[int, ...]]:
    """Return activations.stage_activations' peak (rounded up) and in-flight counts, fast.

    `method`, `num_layers`: --recompute-method and --recompute-num-layers with full recompute.
    """
    v = len(chunks)
    mode = cast(Recompute, recompute)
    plan = recompute_plan(stage, chunks, mode, method, num_layers)
    per = [_chunk_bytes(dims, par, groups, mbs, flash) for groups in plan]
    if stage == 0:
        per[0] += embedding_activations(dims, par, mbs).total
    if stage == par.pp - 1:  # the output layer and loss, and the MTP block beside them
        per[-1] += output_activations(dims, par, mbs).total
        per[-1] += mtp_activations(dims, par, mbs, mtp_recompute(mode, method), flash)
    if v == 1:  # 1F1B: the peak is min(p - s, m) micro-batches (formulas.microbatches_in_flight)
        best: tuple[int, ...] = (min(par.pp - stage, m),)
    else:
        points = _live_points(stage, par.pp, m, v)
        best = max(points, key=lambda pt: sum(n * x for n, x in zip(pt, per, strict=True)))
    total = sum(n * x for n, x in zip(best, per, strict=True))
    whole: dict[bool, float] = {}  # a layer's bytes without recomputation, per kind

    def rebuilt(i: int) -> float:
        kind = dims.is_moe_layer(i)
        if kind not in whole:
            whole[kind] = _layer_bytes(dims, par, i, mbs, "none", flash)
        return whole[kind]

    total += recompute_buffer(plan, rebuilt)
    return math.ceil(total), best


@lru_cache(maxsize=1024)
def _shard_pairs(lay: Layout) -> tuple[tuple[int, int], ...]:
    from inspector.ranks import rank_shard_indices

    if lay.ep == 1:
        return tuple((d, 0) for d in range(lay.dp))
    return tuple(sorted({(d, e) for p, d, e in rank_shard_indices(replace(lay, pp=1)) if p == 0}))


_STATE: dict[tuple[Any, ...], tuple[Any, int]] = {}


@lru_cache(maxsize=4096)
def _pair_layout(lay: Layout) -> Layout:
    """Return the layout whose ranks' (data, expert data) indices every stage shares."""
    return replace(lay, pp=1, vpp=None, decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None,
                   account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False,
                   pipeline_model_parallel_layout=None)


def _stage_state(job: Job, stage: int, shapes: tuple[ChunkShape, ...], pairs_of: Layout) -> Any:
    """Return plan_memory.stage_state, computed once per distinct stage (mbs, recompute apart)."""
    lay, training = job.layout, job.training
    key = (piece_key(job), shapes, stage == 0, lay.pp, training.use_distributed_optimizer,
           training.overlap_grad_reduce, training.ddp_bucket_size, pairs_of)
    if key not in _STATE:
        _STATE[key] = stage_state(job, stage, shapes, _shard_pairs(pairs_of))
    return _STATE[key][0]


def _signature(dims: ModelDims, chunks: list[list[int]]) -> tuple[Any, ...]:
    """Return what a stage's layers cost depends on: counts, or the layers when MoE varies."""
    if dims.num_experts is None:
        return tuple(len(c) for c in chunks)
    return tuple(tuple(c) for c in chunks)


def evaluate(job: Job, split: Split, req: Request) -> Plan:
    """Price one candidate: exact state bytes per stage, activations, time."""
    return _timed(job, split, req, *_price_memory(job, split))


Placed = list[list[list[int]]]  # each pipeline rank's chunks' global layers


def stage_states(job: Job, split: Split) -> tuple[Placed, list[Any]]:
    """Return each rank's chunks' layers and exact state (plan_memory), which no recomputation
    setting changes: the candidates of one layout, split and micro-batch size share them."""
    lay = job.layout
    v = lay.chunks
    placed = chunk_layers(split, lay.pp, v)
    pairs_of = _pair_layout(lay)
    states = []
    for s in range(lay.pp):
        shapes = tuple(
            ChunkShape.of(job.model, c, s == 0 and k == 0, s == lay.pp - 1 and k == v - 1)
            for k, c in enumerate(placed[s])
        )
        states.append(_stage_state(job, s, shapes, pairs_of))
    return placed, states


def _price_memory(
    job: Job, split: Split, states: tuple[Placed, list[Any]] | None = None
) -> tuple[Placed, tuple[StagePlan, ...]]:
    """Return each rank's chunks' layers and its memory: exact state, activation peak.

    `states`: `stage_states(job, split)` when the caller has them already.
    """
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job.dims()
    placed, state_of = states or stage_states(job, split)
    pairs_of = _pair_layout(lay)
    stages = []
    for s, state in enumerate(state_of):
        act, flight = _activations(
            dims, pairs_of, lay.pp, s, _signature(dims, placed[s]), placed[s],
            schedule.micro_batch_size, schedule.num_microbatches, _recompute(training, placed[s]),
            training.flash_attention,
        )
        stages.append(StagePlan(s, tuple(tuple(c) for c in placed[s]), state.total, state.weights,
                                state.gradients, state.optimizer, act, flight))
    return placed, tuple(stages)


def _timed(
    job: Job, split: Split, req: Request, placed: Placed,
    stages: tuple[StagePlan, ...],
) -> Plan:
    """Return the plan with its step time (plan_cost), given its memory."""
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job.dims()
    net = Network(req.gpu, req.gpus_per_node)
    pairs_of = _pair_layout(lay)
    times = [
        _time(dims, pairs_of, lay, net, req.efficiency, schedule.micro_batch_size,
              _recompute(training, placed[st.stage]), _signature(dims, placed[st.stage]),
              placed[st.stage],
              st.stage == lay.pp - 1, (st.gradients, st.weights, st.state), training)
        for st in stages
    ]
    step = step_time(times, schedule.num_microbatches, lay.chunks)
    return Plan(job, split, stages, step, _iteration_flops(dims, schedule.global_batch_size),
                req.gpu)


_ACT: dict[tuple[Any, ...], tuple[int, tuple[int, ...]]] = {}
_TIME: dict[tuple[Any, ...], StageTime] = {}


@lru_cache(maxsize=256)
def _iteration_flops(dims: ModelDims, global_batch_size: int) -> int:
    return iteration_flops(dims, global_batch_size)


def _recompute(training: Training, chunks: list[list[int]]) -> tuple[str, str, int]:
    """Return the stage's (granularity, method, N), one spelling per distinct behaviour.

    Method and N matter with full recomputation only; `block` with N past the stage's longest
    chunk checkpoints what N = that length does (every layer: as `uniform` 1 but for MTP, which
    megatron leaves alone under `block`, activations.mtp_recompute).
    """
    recompute, method, n = training.recompute, training.recompute_method, training.recompute_num_layers
    if recompute != "full":
        return recompute, "uniform", 1
    if method == "block":
        return recompute, method, min(n, max(1, max(map(len, chunks), default=0)))
    return recompute, method, n


def _activations(
    dims: ModelDims, pairs_of: Layout, pp: int, stage: int, signature: tuple[Any, ...],
    chunks: list[list[int]], mbs: int, m: int, recompute: tuple[str, str, int], flash: bool,
) -> tuple[int, tuple[int, ...]]:
    """Return stage_activation_bytes, once per distinct stage."""
    position = min(pp - stage, m) if len(chunks) == 1 else stage  # 1F1B: only p - s matters
    key = (dims, pairs_of, pp, stage == 0, stage == pp - 1, position, signature, mbs, m,
           recompute, flash)
    if key not in _ACT:
        par = replace(pairs_of, pp=pp)
        granularity, method, n = recompute
        _ACT[key] = stage_activation_bytes(dims, par, stage, chunks, mbs, m, granularity, flash,
                                           method, n)
    return _ACT[key]


def _time(
    dims: ModelDims, pairs_of: Layout, lay: Layout, net: Network, efficiency: float, mbs: int,
    recompute: tuple[str, str, int], signature: tuple[Any, ...], chunks: list[list[int]],
    has_output: bool, state: tuple[int, int, int], training: Training,
) -> StageTime:
    """Return plan_cost.stage_time, once per distinct stage."""
    key = (dims, pairs_of, lay.pp, net, efficiency, mbs, recompute, signature, has_output,
           state, training.use_distributed_optimizer)
    if key not in _TIME:
        granularity, method, n = recompute
        _TIME[key] = stage_time(
            dims, lay, net, efficiency, mbs, granularity, chunks, has_output, state[:2], state[2],
            training.use_distributed_optimizer, method, n,
        )
    return _TIME[key]
