"""Build a Job: every pipeline stage, virtual chunk and expert-parallel rank it needs, once.

`build(job, view)` runs megatron-core's own code (world.py) for each stage of the view and keeps
the built modules with their parameter records (walk.py). Every command that needs megatron's
modules reads a BuiltJob: `tree` its module trees, `params` its records, `memory` its modules
wrapped in megatron's DDP. Nothing here renders or prints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from inspector.job.build_limits import check_expert_builds
from inspector.job.job import Job
from inspector.job.layout import RankCoord, check_buildable
from inspector.records import ParamRecord, StageTree

if TYPE_CHECKING:
    from inspector.world.fsdp import FsdpLayout
    from inspector.world.shards import BufferLayout
    from inspector.world.stage import StageModel


@dataclass(frozen=True)
class View:
    """Which part of the job a command shows: some stages, or what one global rank holds."""

    stages: tuple[int, ...]
    coord: RankCoord | None = None  # set for a --rank view

    @property
    def expert_rank(self) -> int:
        """Return the expert-parallel rank whose experts a one-rank view shows."""
        return self.coord.expert if self.coord is not None else 0


def select_view(job: Job, stage: int | None = None, rank: int | None = None) -> View:
    """Return the view `--stage S` or `--rank R` asks for (every stage when neither is given)."""
    from inspector.errors import ConfigError
    from inspector.world.ranks import check_rank, check_stage, rank_coords

    layout = job.layout
    if stage is not None and rank is not None:
        raise ConfigError("--stage and --rank select the same thing two ways; pass one of them")
    if stage is not None:
        check_stage(layout, stage)
        return View((stage,))
    if rank is not None:
        check_rank(layout, rank)
        coord = rank_coords(layout)[rank]
        return View((coord.pipe,), coord)
    return View(tuple(range(layout.pp)))


@dataclass
class BuiltChunk:
    """One virtual chunk of a stage (the whole stage without interleaving), as megatron built it."""

    job: Job = field(repr=False)
    stage: int
    chunk: int
    models: tuple[StageModel, ...]  # one per simulated expert-parallel rank, in rank order
    _buffers: tuple[BufferLayout, ...] | None = field(default=None, init=False, repr=False)

    @property
    def module(self) -> Any:
        """Return the first simulated rank's GPTModel (every rank's dense part is the same)."""
        return self.models[0].module

    @property
    def layers(self) -> tuple[int, ...]:
        """Return the 0-based global numbers of the chunk's transformer layers."""
        return tuple(n - 1 for n in self.models[0].layer_numbers)

    @property
    def has_embedding(self) -> bool:
        """Return whether megatron put the embedding on this chunk."""
        return self.models[0].has_embedding

    @property
    def has_output(self) -> bool:
        """Return whether megatron put the output layer (and the loss) on this chunk."""
        return self.models[0].has_output

    @property
    def mtp_layers(self) -> int:
        """Return how many multi-token-prediction layers megatron built on this chunk."""
        mtp = getattr(self.module, "mtp", None)
        return len(mtp.layers) if mtp is not None else 0

    @property
    def mtp_depths(self) -> int:
        """Return how many multi-token-prediction depths megatron runs on this chunk: one per
        layer, or --mtp-num-layers of its one layer with --mtp-use-repeated-layer
        (MultiTokenPredictionBlock.forward, multi_token_prediction.py)."""
        mtp = getattr(self.module, "mtp", None)
        if mtp is not None and getattr(mtp, "mtp_use_repeated_layer", False):
            return int(mtp.config.mtp_num_layers)
        return self.mtp_layers

    @cached_property
    def records(self) -> tuple[ParamRecord, ...]:
        """Return one record per parameter, every expert once, in megatron's order."""
        from inspector.world.walk import walk_params

        layout = self.job.layout
        walks = [list(walk_params(m, layout.tp, layout.expert_tp)) for m in self.models]
        return tuple(merge_expert_ranks(walks))


    def fsdp(self) -> FsdpLayout:
        """Return the chunk's Megatron-FSDP buckets (or FSDP2 units) as megatron makes them."""
        return self.fsdp_of(self.module)

    def fsdp_of(self, module: Any) -> FsdpLayout:
        """Return FSDP's layout of `module`, one expert-parallel rank's build of this chunk."""
        from inspector.world.fsdp import fsdp2_layout, fsdp_layout
        from inspector.world.shards import resolve_bucket_size

        job = self.job
        layout, training = job.layout, job.training
        dp_cp = layout.dp * layout.cp
        if training.torch_fsdp2:
            return fsdp2_layout(module, dp_cp, job.model.transformer_impl == "local")
        # Megatron-LM get_model: the default bucket size, None without --overlap-grad-reduce;
        # MegatronFSDP drops it for chunks after the first (disable_bucketing)
        size = resolve_bucket_size(
            training.ddp_bucket_size, overlap_grad_reduce=training.overlap_grad_reduce,
            dp_cp_size=dp_cp,
        )  # fmt: skip
        fp32 = training.fp32_grads if training.fp32_grads is not None else job.model.bf16
        # HSDP (N optimizer instances): mcore_fsdp_adapter.py `_init_dist_index` shards over the
        # intra partial groups, parallel_state's dp x cp / N and expert dp / N
        instances = layout.num_distributed_optimizer_instances
        from inspector.world.setup import on_job_gpu

        with on_job_gpu(job.device):  # an fp8 bucket's backward transposes: Hopper's only
            return fsdp_layout(
                module, training.sharding_strategy, dp_cp // instances, layout.expert_dp // instances,
                None if self.chunk > 0 else size, fp32,
            )  # fmt: skip

    def frozen_bytes(self) -> int:
        """Return the bytes of the chunk's parameters that need no gradient: megatron's DDP lays
        out only those that do (distributed_data_parallel.py `if not param.requires_grad:
        continue`); the others stay the tensors the model built (LoRA's frozen model,
        world/lora.py), Transformer Engine's quantized weights the bytes they store."""
        from inspector.world.te.float8_tensor import stored_bytes

        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        return sum(stored_bytes(p) or p.numel() * p.element_size() for p in frozen)

    def buffers(self) -> tuple[BufferLayout, ...]:
        """Return the chunk's grad buffers as megatron's DDP lays them out for this job."""
        if self._buffers is None:
            from inspector.world.ddp import distopt_layout
            from inspector.world.shards import DistOptSettings

            training = self.job.training
            settings = DistOptSettings.for_job(
                self.job,
                grad_reduce_in_fp32=training.fp32_grads,
                use_distributed_optimizer=training.use_distributed_optimizer,
            )
            layout = distopt_layout(self.module, settings, pipeline_rank=self.stage, chunk=self.chunk)
            self._buffers = layout.buffers
        return self._buffers


@dataclass
class BuiltStage:
    """One pipeline stage: its chunks in order."""

    stage: int
    chunks: tuple[BuiltChunk, ...]

    @property
    def parameters(self) -> int:
        """Return the parameter elements one rank of the stage holds (its first simulated rank)."""
        return sum(p.numel() for chunk in self.chunks for p in chunk.module.parameters())

    @property
    def checkpoint(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """Return megatron's checkpoint view of every rank and chunk built for the stage."""
        return {
            key: size
            for chunk in self.chunks
            for model in chunk.models
            for key, size in model.checkpoint.items()
        }


@dataclass
class BuiltJob:
    """The stages a view needs, built by megatron-core, with the job they were built from."""

    job: Job
    view: View
    stages: tuple[BuiltStage, ...]
    expert_ranks: tuple[int, ...]

    @property
    def interleaved(self) -> bool:
        """Return whether stages hold several virtual chunks."""
        return any(len(stage.chunks) > 1 for stage in self.stages)

    @property
    def chunks(self) -> list[BuiltChunk]:
        """Return every built chunk, stage by stage."""
        return [chunk for stage in self.stages for chunk in stage.chunks]


def build(
    job: Job,
    view: View,
    expert_ranks: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BuiltJob:
    """Build the view's stages on the given expert-parallel ranks (all of them by default).

    Args:
        job: the validated job.
        view: which stages to build (select_view).
        expert_ranks: which expert-parallel ranks of each stage to simulate; their experts
            differ, everything else is the same on each.
        progress: called with (built, total) stage builds before each build and once at the end.
    """
    from inspector.world import stage as world

    layout = job.layout
    check_buildable(job.model, layout)
    ranks = tuple(range(layout.ep)) if expert_ranks is None else tuple(expert_ranks)
    check_expert_builds(job.model, layout, len(ranks))
    total, done = len(view.stages) * len(ranks), 0
    stages = []
    for stage in view.stages:
        per_rank = []
        for e in ranks:
            if progress is not None:
                progress(done, total)
            per_rank.append(_build_stage(world.build_stage, job, stage, e))
            done += 1
        chunks = tuple(
            BuiltChunk(job, stage, index, tuple(models[index] for models in per_rank))
            for index in range(len(per_rank[0]))
        )
        stages.append(BuiltStage(stage, chunks))
    if progress is not None:
        progress(done, total)
    return BuiltJob(job, view, tuple(stages), ranks)


_BUILT: OrderedDict[tuple[Any, ...], list[StageModel]] = OrderedDict()
_KEPT = 64  # stages kept per process: a planner or a test suite asks for the same ones again


def _build_stage(builder: Any, job: Job, stage: int, expert_rank: int) -> list[StageModel]:
    """Build one stage on one expert-parallel rank, or return the same stage built before.

    The data-parallel size changes nothing megatron builds (setup.simulated_dp), so it is not
    part of the key; the builder is, so a replaced builder never sees another's results; so is
    what the world reads of the GPU (Transformer Engine keeps no fp8 parameter transposes on
    Blackwell: te/float8_tensor.py), which the build runs on.
    """
    from inspector.world.setup import on_job_gpu

    key = (builder, job.model, replace(job.layout, dp=1), stage, expert_rank, job.device.world)
    if key in _BUILT:
        _BUILT.move_to_end(key)
        return _BUILT[key]
    with on_job_gpu(job.device):
        built = _BUILT[key] = builder(job.model, job.layout, stage, expert_rank)
    if len(_BUILT) > _KEPT:
        _BUILT.popitem(last=False)
    return built


def merge_expert_ranks(walks: list[list[ParamRecord]]) -> list[ParamRecord]:
    """Merge the walks of a stage's expert-parallel ranks: every expert once, in rank order.

    Rank 0's rows come in megatron's order; after the last expert row of each layer, the other
    ranks' experts of that layer follow, rank by rank.
    """
    if len(walks) == 1:
        return walks[0]
    others: dict[str, list[ParamRecord]] = {}
    for walk in walks[1:]:
        for record in walk:
            if record.expert_rank is not None:
                others.setdefault(_expert_block(record), []).append(record)
    merged = []
    base = walks[0]
    for index, record in enumerate(base):
        merged.append(record)
        following = base[index + 1] if index + 1 < len(base) else None
        is_last_expert = record.expert_rank is not None and (
            following is None
            or following.expert_rank is None
            or _expert_block(following) != _expert_block(record)
        )
        if is_last_expert:
            merged.extend(others.pop(_expert_block(record), []))
    return merged


def _expert_block(record: ParamRecord) -> str:
    """Return the layer an expert row belongs to, by name (decoder or multi-token prediction)."""
    return record.name.split(".mlp.experts.", 1)[0]


def stage_trees(built: BuiltJob) -> list[StageTree]:
    """Return the module tree of every built stage and chunk (docs/what-rank-holds.md)."""
    from inspector.world import walk

    chunks = built.chunks
    headed = not (built.job.layout.pp == 1 and len(chunks) == 1)
    return [
        StageTree(
            chunk.stage,
            chunk.chunk if built.interleaved else None,
            walk.module_tree(chunk.module),
            headed,
        )
        for chunk in chunks
    ]
