"""One `plan` candidate priced: its records, exact state memory, activations, step time.

`evaluate(job, split, req)` prices a candidate as plan.py's search does: each stage's state from
plan_memory.stage_state (megatron's DDP buffers, composed from small builds), its activations at
the micro-batches megatron's schedule keeps in flight (formulas.live_microbatches), and its time
(plan_cost.stage_work, then with_state); the step from plan_cost.step_time. A stage's numbers
depend only on its own shape (layers per chunk, embedding / output, position in the schedule),
never on the other stages, so each distinct stage is priced once per process (`_STATE`, `_ACT`,
`_TIME`): a search over thousands of candidates prices a few thousand stages. Nothing here prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, cast

from inspector.formulas.activations import (
    embedding_activations,
    layer_activations,
    mtp_activations,
    mtp_recompute,
    output_activations,
    recompute_buffer,
    recompute_plan,
)
from inspector.formulas.flops import iteration_flops
from inspector.job.dims import ModelDims, live_microbatches
from inspector.job.job import Job, Recompute, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.plan.cost import Gpu, Network, StageTime, StepTime, stage_work, step_time, with_state
from inspector.plan.memory import ChunkShape, piece_key, stage_state
from inspector.plan.split import Split, chunk_layers, split_flags


@dataclass(frozen=True)
class Request:
    """What the user asked: the model, the cluster, the batch, and any dimension they fixed."""

    model: ModelConfig
    gpus: int
    gpu: Gpu
    memory: int  # bytes per GPU
    global_batch_size: int
    gpus_per_node: int = 8
    efficiency: float | None = None  # None: the measured kernel tables (formulas/kernels.py)
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


@lru_cache(maxsize=256)
def _first_of_kind(dims: ModelDims) -> dict[bool, int]:
    """Return the first layer of each kind (True: MoE); layers of one kind cost the same."""
    return {dims.is_moe_layer(i): i for i in reversed(range(dims.num_layers))}


def _chunk_bytes(
    dims: ModelDims, par: Layout, groups: list[tuple[Sequence[int], Recompute]], mbs: int,
    flash: bool,
) -> float:
    """Return one micro-batch's bytes of a chunk's layer groups (activations.recompute_plan):
    a checkpointed group keeps its first layer's input, any other layer its own activations;
    layers of one kind and mode cost the same."""
    counts: dict[tuple[Recompute, bool], int] = {}
    for group, mode in groups:
        for i in group[:1] if mode == "full" else group:
            key = (mode, dims.is_moe_layer(i))
            counts[key] = counts.get(key, 0) + 1
    first = _first_of_kind(dims)
    return sum(
        n * _layer_bytes(dims, par, first[kind], mbs, mode, flash)
        for (mode, kind), n in counts.items()
    )


def stage_activation_bytes(
    dims: ModelDims, par: Layout, stage: int, chunks: Sequence[Sequence[int]], mbs: int, m: int,
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
    first = _first_of_kind(dims)

    def rebuilt(i: int) -> float:  # a layer's bytes without recomputation (one per kind)
        return _layer_bytes(dims, par, first[dims.is_moe_layer(i)], mbs, "none", flash)

    total += recompute_buffer(plan, rebuilt)
    return math.ceil(total), best


@lru_cache(maxsize=1024)
def _shard_pairs(lay: Layout) -> tuple[tuple[int, int], ...]:
    from inspector.world.ranks import stage_shard_pairs

    return stage_shard_pairs(lay)


# what stages share (model pieces, pp, optimizer, buckets, ranks) -> (shapes, first?) -> state
_STATE: dict[tuple[Any, ...], dict[int, Any]] = {}


@lru_cache(maxsize=4096)
def _pair_layout(lay: Layout) -> Layout:
    """Return the layout whose ranks' (data, expert data) indices every stage shares."""
    return replace(lay, pp=1, vpp=None, decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None,
                   account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False,
                   pipeline_model_parallel_layout=None)


def _state_scope(job: Job, pairs_of: Layout) -> dict[int, Any]:
    """Return the stage states of every job sharing this one's pieces, pp, optimizer and ranks."""
    return _STATE.setdefault(state_scope_key(job, pairs_of), {})


def state_scope_key(job: Job, pairs_of: Layout) -> tuple[Any, ...]:
    """Return what a stage's state depends on besides its shape: pieces, pp, optimizer, ranks."""
    lay, training = job.layout, job.training
    return (model_token(job.model), *piece_key(job)[1:], lay.pp,
            training.use_distributed_optimizer, training.overlap_grad_reduce,
            training.ddp_bucket_size, pairs_of)


_DIMS: dict[tuple[Any, ...], ModelDims] = {}


def job_dims(job: Job) -> ModelDims:
    """Return job.dims(), once per what it reads: the model, tp (vocab padding), dropout on/off."""
    training = job.training
    key = (model_token(job.model), job.layout.tp, training.attention_dropout > 0,
           training.hidden_dropout > 0, training.flash_attention)
    if key not in _DIMS:
        _DIMS[key] = job.dims()
    return _DIMS[key]


_MODELS: dict[ModelConfig, int] = {}
_LAST_MODEL: list[Any] = [None, -1]  # the config asked last, and its token


def model_token(model: ModelConfig) -> int:
    """Return a small int standing for the model in cache keys, one per distinct config.

    A frozen ModelConfig hashes its ~40 fields on every lookup; a search asks about one config
    object hundreds of thousands of times.
    """
    if model is not _LAST_MODEL[0]:
        _LAST_MODEL[:] = [model, _MODELS.setdefault(model, len(_MODELS))]
    return int(_LAST_MODEL[1])


def _stage_state(
    job: Job, stage: int, shapes: tuple[ChunkShape, ...], pairs_of: Layout,
    scope: dict[int, Any] | None = None, key: int | None = None,
) -> Any:
    """Return plan_memory.stage_state, computed once per distinct stage (mbs, recompute apart).

    `key`: the stage's `_number`, where the caller has it.
    """
    if scope is None:
        scope = _state_scope(job, pairs_of)
    if key is None:
        key = _number(_STAGE_NUMBERS, (shapes, stage == 0))
    if key not in scope:
        scope[key] = stage_state(job, stage, shapes, _shard_pairs(pairs_of))[0]
    return scope[key]


_STAGE_NUMBERS: dict[tuple[tuple[ChunkShape, ...], bool], int] = {}  # (shapes, first stage?)
_SIGNATURE_NUMBERS: dict[tuple[Any, ...], int] = {}


def _number(numbers: dict[Any, int], value: Any) -> int:
    """Return the small int that stands for `value` in cache keys (hashed once per split)."""
    return numbers.setdefault(value, len(numbers))


def _signature(dims: ModelDims, chunks: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """Return what a stage's layers cost depends on: counts, or each layer's kind with MoE.

    The formulas read a layer's index only through `dims.is_moe_layer` (activations.py,
    flops.py, plan_cost.py), and sum a chunk's layers kind by kind in the order kinds appear.
    """
    if dims.num_experts is None:
        return tuple(len(c) for c in chunks)
    return tuple(tuple(dims.is_moe_layer(i) for i in c) for c in chunks)


Placed = tuple[tuple[tuple[int, ...], ...], ...]  # per pipeline rank, each chunk's layers


@dataclass(frozen=True)
class _Stages:
    """A split's stages: each rank's chunks' layers, ChunkShapes and cost signature, and the
    numbers that stand for (shapes, first stage?) and signatures in cache keys."""

    placed: Placed
    shapes: tuple[tuple[ChunkShape, ...], ...]
    signatures: tuple[tuple[Any, ...], ...]
    state_keys: tuple[int, ...]
    signature_keys: tuple[int, ...]


_STAGES: dict[tuple[Any, ...], _Stages] = {}


def _stages_of(model: ModelConfig, dims: ModelDims, split: Split, pp: int, v: int) -> _Stages:
    """Return a split's stages, once per split (every layout with this pp and v shares them).

    `dims` is the model's: a layer's kind is the same in both.
    """
    key = (model_token(model), split, pp, v)
    if key not in _STAGES:
        _STAGES[key] = _split_stages(model, dims, split, pp, v)
    return _STAGES[key]


def _split_stages(model: ModelConfig, dims: ModelDims, split: Split, pp: int, v: int) -> _Stages:
    placed = tuple(
        tuple(tuple(c) for c in chunks) for chunks in chunk_layers(split, pp, v)
    )
    shapes = tuple(
        tuple(
            ChunkShape.of(model, c, s == 0 and k == 0, s == pp - 1 and k == v - 1)
            for k, c in enumerate(chunks)
        )
        for s, chunks in enumerate(placed)
    )
    signatures = tuple(_signature(dims, chunks) for chunks in placed)
    return _Stages(
        placed, shapes, signatures,
        tuple(_number(_STAGE_NUMBERS, (each, s == 0)) for s, each in enumerate(shapes)),
        tuple(_number(_SIGNATURE_NUMBERS, each) for each in signatures),
    )


def evaluate(job: Job, split: Split, req: Request) -> Plan:
    """Price one candidate: exact state bytes per stage, activations, time."""
    return _timed(job, split, req, *_price_memory(job, split))


def _price_memory(job: Job, split: Split) -> tuple[Placed, tuple[StagePlan, ...]]:
    """Return each rank's chunks' layers and its memory: exact state, activation peak.

    A stage's state depends on no recomputation setting: the candidates of one layout share it
    (`_state_scope`).
    """
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job_dims(job)
    v = lay.chunks
    stages_of = _stages_of(job.model, dims, split, lay.pp, v)
    pairs_of = _pair_layout(lay)
    states = _state_scope(job, pairs_of)
    m = schedule.num_microbatches
    par = _activation_layout(pairs_of, lay.pp)
    acts = _ACT.setdefault(
        (dims, par, schedule.micro_batch_size, m if v > 1 else None, training.recompute,
         training.flash_attention), {},
    )
    stages = []
    for s, layers in enumerate(stages_of.placed):
        state = _stage_state(job, s, stages_of.shapes[s], pairs_of, states, stages_of.state_keys[s])
        position = s if v > 1 else min(lay.pp - s, m)  # 1F1B: only min(p - s, m) matters
        recipe = _recompute(training, layers)
        key = (s == 0, s == lay.pp - 1, position, stages_of.signature_keys[s], recipe)
        if key not in acts:
            granularity, method, n = recipe
            acts[key] = stage_activation_bytes(
                dims, par, s, layers, schedule.micro_batch_size, m, granularity,
                training.flash_attention, method, n,
            )
        act, flight = acts[key]
        stages.append(StagePlan(s, layers, state.total, state.weights, state.gradients,
                                state.optimizer, act, flight))
    return stages_of.placed, tuple(stages)


def _timed(
    job: Job, split: Split, req: Request, placed: Placed, stages: tuple[StagePlan, ...]
) -> Plan:
    """Return the plan with its step time (plan_cost), given its memory."""
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job_dims(job)
    net = Network(req.gpu, req.gpus_per_node)
    mbs, distributed = schedule.micro_batch_size, training.use_distributed_optimizer
    signatures = _stages_of(job.model, dims, split, lay.pp, lay.chunks).signature_keys
    scope = _TIME.setdefault(
        (dims, _pair_layout(lay), lay.pp, net, req.efficiency, mbs, training.recompute,
         distributed), {},
    )
    times = []
    for st in stages:
        has_output = st.stage == lay.pp - 1
        recipe = _recompute(training, placed[st.stage])
        work = (signatures[st.stage], has_output, recipe)
        if work not in scope:
            granularity, method, n = recipe
            scope[work] = stage_work(
                dims, lay, net, req.efficiency, mbs, granularity, placed[st.stage], has_output,
                method, n,
            )
        key = (*work, st.gradients, st.weights, st.state)
        if key not in scope:
            scope[key] = with_state(
                scope[work], lay, net, (st.gradients, st.weights), st.state, distributed
            )
        times.append(scope[key])
    step = step_time(times, schedule.num_microbatches, lay.chunks)
    return Plan(job, split, stages, step, _iteration_flops(dims, schedule.global_batch_size),
                req.gpu)


# (dims, activation sizes, mbs, m where interleaved, recompute, flash) -> stage -> (bytes, flight)
_ACT: dict[tuple[Any, ...], dict[tuple[Any, ...], tuple[int, tuple[int, ...]]]] = {}
# (dims, ranks, pp, network, efficiency, mbs, recompute, distopt) -> (signature, output?) -> the
# stage's work per micro-batch, and (signature, output?, gradients, weights, state) -> its time
_TIME: dict[tuple[Any, ...], dict[tuple[Any, ...], StageTime]] = {}


@lru_cache(maxsize=256)
def _iteration_flops(dims: ModelDims, global_batch_size: int) -> int:
    return iteration_flops(dims, global_batch_size)


def _recompute(training: Training, chunks: Sequence[Sequence[int]]) -> tuple[str, str, int]:
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


@lru_cache(maxsize=4096)
def _activation_layout(pairs_of: Layout, pp: int) -> Layout:
    """Return the sizes activations.py reads (tp, cp, SP, expert tp, pp): dp and ep set to 1.

    Layouts that differ in dp or ep keep the same activations (tests check it), so they share
    one cache entry.
    """
    return replace(pairs_of, pp=pp, dp=1, ep=1, etp=pairs_of.expert_tp)
