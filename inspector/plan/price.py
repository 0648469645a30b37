"""One `plan` candidate priced: its records, exact state memory, activations, step time.

A candidate is priced as search.py prices it (timing.py `evaluate`): each stage's state from
memory.stage_state (megatron's DDP buffers, composed from small builds), its activations at the
micro-batches megatron's schedule keeps in flight (activations.py), and its time (timing.py:
cost.stage_work, then with_state; the step from cost.step_time). A stage's numbers depend only
on its own shape (layers per chunk, embedding / output, position in the schedule), never on the
other stages, so each distinct stage is priced once per process (`_STATE`, `_ACT`,
`_CHUNK_BYTES`, timing.py's `_TIME`, in caches.py's care): a search over thousands of
candidates prices a few thousand stages. Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import inspector.caches as caches
from inspector.job.dims import ModelDims
from inspector.job.ep_overlap import extra_warmup
from inspector.job.hardware import Gpu
from inspector.job.hybrid_model import layer_symbols, mamba_shape, mtp_symbols
from inspector.job.job import Job, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.memory.compose.pieces import piece_key
from inspector.memory.compose.stage_activations import (
    ChunkBytes,
    activation_layout,
    recompute_recipe,
    stage_chunk_bytes,
    stage_peak,
)
from inspector.memory.compose.stage_state import ChunkKinds, stage_state
from inspector.memory.measure import StageBytes
from inspector.plan.cost import StepTime
from inspector.plan.flags import megatron_flags
from inspector.plan.layouts import unsplit_layout
from inspector.plan.split import Split, chunk_layers


@dataclass(frozen=True, kw_only=True)
class StagePlan(StageBytes):
    """One pipeline rank of a plan: memory's stage record (layers, its most loaded rank's state
    composed by memory/compose), and the activations at the micro-batches in flight."""

    activations: int
    in_flight: tuple[int, ...]  # micro-batch passes in flight, per chunk
    # of the activations, what the GPU holds outside PyTorch's allocator (what, bytes): DeepEP's
    # buffers, where megatron's engine confirmed the plan (memory/engine/run.py `outside_allocator`)
    outside: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        """Return the rank's bytes."""
        return self.state.total + self.activations + self.fsdp_in_flight


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
        return self.flops / (self.time.seconds * gpus * self.gpu.tflops_16bit * 1e12)

    @property
    def tflops_per_gpu(self) -> float:
        """Return the achieved model TFLOP/s per GPU."""
        return self.mfu * self.gpu.tflops_16bit

    def bound(self) -> str:
        """Return what limits the plan most besides compute."""
        shares = self.time.shares()
        shares.pop("compute")
        return max(shares, key=lambda k: shares[k])

    def flags(self) -> list[str]:
        """Return the Megatron-LM flags that reproduce this plan."""
        return megatron_flags(self.job, self.split)


@caches.memo(maxsize=1024)
def _shard_pairs(lay: Layout) -> tuple[tuple[int, int], ...]:
    from inspector.world.ranks import stage_shard_pairs

    return stage_shard_pairs(lay)


# what stages share (model pieces, pp, optimizer, buckets, ranks) -> (shapes, first?) -> state
_STATE: dict[tuple[Any, ...], dict[int, Any]] = caches.table()


@caches.memo(maxsize=4096)
def pair_layout(lay: Layout) -> Layout:
    """Return the layout whose ranks' (data, expert data) indices every stage shares."""
    return replace(unsplit_layout(lay), pp=1)


def state_scope(job: Job, pairs_of: Layout) -> dict[int, Any]:
    """Return the stage states of every job sharing this one's pieces, pp, optimizer and ranks."""
    return _STATE.setdefault(state_scope_key(job, pairs_of), {})


def state_scope_key(job: Job, pairs_of: Layout) -> tuple[Any, ...]:
    """Return what a stage's state depends on besides its shape: pieces, pp, optimizer, ranks."""
    lay, training = job.layout, job.training
    return (model_token(job.model), *piece_key(job)[1:], lay.pp,
            sharding_of(training), training.overlap_grad_reduce,
            training.ddp_bucket_size, pairs_of)


_DIMS: dict[tuple[Any, ...], ModelDims] = caches.table()


def job_dims(job: Job) -> ModelDims:
    """Return job.dims(), once per what it reads: the model, tp (vocab padding), dropout on/off."""
    training = job.training
    key = (model_token(job.model), job.layout.tp, training.attention_dropout > 0,
           training.hidden_dropout > 0, training.flash_attention, training.moe_token_dispatcher_type,
           training.moe_flex_backend, training.moe_router_padding, training.deterministic_mode,
           training.unfused, training.tp_comm_overlap)
    if key not in _DIMS:
        _DIMS[key] = job.dims()
        if job.model.hybrid:  # each layer priced by its kind (plan/hybrid.py)
            _DIMS[key] = replace(_DIMS[key], layer_symbols=layer_symbols(job.model),
                                 mamba=mamba_shape(job.model), mtp_symbols=mtp_symbols(job.model))
    return _DIMS[key]


_MODELS: dict[ModelConfig, int] = caches.table()
_LAST_MODEL: dict[str, Any] = caches.table()  # the config asked last, and its token


def model_token(model: ModelConfig) -> int:
    """Return a small int standing for the model in cache keys, one per distinct config.

    A frozen ModelConfig hashes its ~40 fields on every lookup; a search asks about one config
    object hundreds of thousands of times.
    """
    if model is not _LAST_MODEL.get("model"):
        _LAST_MODEL.update(model=model, token=_MODELS.setdefault(model, len(_MODELS)))
    return int(_LAST_MODEL["token"])


def sharding_of(training: Training) -> bool | str:
    """Return the plan's optimizer dimension: distributed optimizer on/off, or an FSDP strategy."""
    return training.sharding_strategy if training.megatron_fsdp else training.use_distributed_optimizer


def cached_stage_state(
    job: Job, stage: int, shapes: tuple[ChunkKinds, ...], pairs_of: Layout,
    scope: dict[int, Any] | None = None, key: int | None = None,
) -> Any:
    """Return memory.stage_state, computed once per distinct stage (mbs, recompute apart).

    `key`: the stage's `_number`, where the caller has it.
    """
    if scope is None:
        scope = state_scope(job, pairs_of)
    if key is None:
        key = _number(_STAGE_NUMBERS, (shapes, stage == 0))
    if key not in scope:
        scope[key] = stage_state(job, stage, shapes, _shard_pairs(pairs_of))[0]
    return scope[key]


_STAGE_NUMBERS: dict[tuple[tuple[ChunkKinds, ...], bool], int] = caches.table()  # (shapes, first?)
_SIGNATURE_NUMBERS: dict[tuple[Any, ...], int] = caches.table()


def _number(numbers: dict[Any, int], value: Any) -> int:
    """Return the small int that stands for `value` in cache keys (hashed once per split)."""
    return numbers.setdefault(value, len(numbers))


def _signature(dims: ModelDims, chunks: Sequence[Sequence[int]]) -> tuple[Any, ...]:
    """Return what a stage's layers cost depends on: counts, or each layer's kind with MoE.

    The formulas read a layer's index only through `dims.layer_kind` (activations.py,
    flops.py, cost.py), and sum a chunk's layers kind by kind in the order kinds appear.
    """
    if dims.num_experts is None and not dims.layer_symbols:
        return tuple(len(c) for c in chunks)
    return tuple(tuple(dims.layer_kind(i) for i in c) for c in chunks)


Placed = tuple[tuple[tuple[int, ...], ...], ...]  # per pipeline rank, each chunk's layers


@dataclass(frozen=True)
class _Stages:
    """A split's stages: each rank's chunks' layers, ChunkKinds and cost signature, and the
    numbers that stand for (shapes, first stage?) and signatures in cache keys."""

    placed: Placed
    shapes: tuple[tuple[ChunkKinds, ...], ...]
    signatures: tuple[tuple[Any, ...], ...]
    state_keys: tuple[int, ...]
    signature_keys: tuple[int, ...]


_STAGES: dict[tuple[Any, ...], _Stages] = caches.table()


def split_stages(model: ModelConfig, dims: ModelDims, split: Split, pp: int, v: int) -> _Stages:
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
            ChunkKinds.of(model, c, s == 0 and k == 0, s == pp - 1 and k == v - 1)
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


def price_memory(job: Job, split: Split) -> tuple[Placed, tuple[StagePlan, ...]]:
    """Return each rank's chunks' layers and its memory: exact state, activation peak.

    A stage's state depends on no recomputation setting: the candidates of one layout share it
    (`state_scope`); its activations, on its place in the schedule only through the peak.
    """
    lay, training, schedule, dims = job.layout, job.training, job.schedule(), job_dims(job)
    v, m = lay.chunks, schedule.num_microbatches
    stages_of = split_stages(job.model, dims, split, lay.pp, v)
    pairs_of = pair_layout(lay)
    states = state_scope(job, pairs_of)
    par = activation_layout(pairs_of, lay.pp)
    mbs, flash, modules = schedule.micro_batch_size, training.flash_attention, training.recompute_modules
    by_stage, by_chunk = _CHUNK_BYTES.setdefault(
        (dims, par, mbs, training.recompute, flash, modules), ({}, {}))
    acts = _ACT.setdefault(
        (dims, par, mbs, m if v > 1 else None, training.recompute, flash, modules,
         training.ep_overlap), {},
    )
    stages = []
    for s, layers in enumerate(stages_of.placed):
        state = cached_stage_state(job, s, stages_of.shapes[s], pairs_of, states, stages_of.state_keys[s])
        position = s if v > 1 else min(lay.pp - s, m)  # 1F1B: only min(p - s, m) matters
        recipe = recompute_recipe(training, layers)
        shape = (s == 0, s == lay.pp - 1, stages_of.signature_keys[s], recipe)
        key = (*shape, position)
        if key not in acts:
            if shape not in by_stage:  # the same at every place in the schedule
                by_stage[shape] = stage_chunk_bytes(
                    dims, par, s, layers, mbs, recipe, flash, modules, by_chunk,
                    [(each, recipe) for each in stages_of.signatures[s]])
            acts[key] = stage_peak(by_stage[shape], s, lay.pp, m, extra_warmup(training))
        act, flight = acts[key]
        stages.append(StagePlan(stage=s, layers=layers, state=state, activations=act,
                                in_flight=flight, fsdp_in_flight=getattr(state, "gathered", 0)))
    return stages_of.placed, tuple(stages)


# (dims, activation sizes, mbs, m where interleaved, recompute, flash, modules, overlap) ->
# (first?, last?, signature, recipe, position) -> (bytes, flight)
_ACT: dict[tuple[Any, ...], dict[tuple[Any, ...], tuple[int, tuple[int, ...]]]] = caches.table()
# (dims, activation sizes, mbs, recompute, flash, modules) -> ((first?, last?, signature,
# recipe) -> a micro-batch's bytes per chunk, and the rebuild (activations.stage_chunk_bytes);
# (a chunk's signature, recipe) -> its own bytes and rebuild)
_CHUNK_BYTES: dict[tuple[Any, ...], tuple[dict[Any, ChunkBytes], dict[Any, Any]]] = caches.table()
