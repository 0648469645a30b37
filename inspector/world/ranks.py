"""Rank coordinates: where each global rank sits in megatron's parallel layout, and its groups.

Up to RANK_GENERATOR_LIMIT ranks the coordinates come from megatron's own RankGenerator, the code
`initialize_model_parallel` builds its groups with (tests check both agree rank by rank), in the
job's order (Layout.rank_order: Megatron-LM's --use-tp-pp-dp-mapping puts pipeline stages before
data-parallel replicas). Larger worlds use the same layout computed directly: megatron's default
order "tp-cp-ep-dp-pp" is a mixed radix, tensor fastest (tests check it equals RankGenerator); the
tp-pp-dp order is refused there.
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.job.layout import Layout, RankCoord
from inspector.world.setup import megatron


def check_stage(layout: Layout, stage: int) -> None:
    """Raise ConfigError unless `stage` is a pipeline stage of this layout."""
    if not 0 <= stage < layout.pp:
        raise ConfigError(
            f"--stage {stage} is out of range for --pp {layout.pp} (stages 0-{layout.pp - 1})"
        )


def check_rank(layout: Layout, rank: int) -> None:
    """Raise ConfigError unless `rank` is a global rank of this layout's world."""
    world = layout.world_size
    if not 0 <= rank < world:
        sizes = f"--tp {layout.tp} x --dp {layout.dp} x --pp {layout.pp}"
        if layout.cp > 1:
            sizes += f" x --context-parallel-size {layout.cp}"
        raise ConfigError(
            f"--rank {rank} is out of range for a world of {world} ranks ({sizes}; ranks 0-{world - 1})"
        )


# megatron's RankGenerator is pure Python over the whole world: ~0.9 s per axis at 131072 ranks.
RANK_GENERATOR_LIMIT = 8192


def rank_coords(layout: Layout) -> list[RankCoord]:
    """Return every rank's coordinates and groups, as megatron's parallel_state lays them out.

    Up to RANK_GENERATOR_LIMIT ranks they come from megatron's own RankGenerator, the code
    `initialize_model_parallel` builds its groups with (tests check both agree rank by rank).
    Larger worlds use the same layout computed directly: megatron's default order
    "tp-cp-ep-dp-pp" is a mixed radix, tensor fastest (tests check it equals RankGenerator).
    """
    if layout.world_size <= RANK_GENERATOR_LIMIT:
        return _coords_from_rank_generator(layout)
    _check_direct(layout)
    return _coords_by_order(layout)


def _check_direct(layout: Layout) -> None:
    """Raise ConfigError where a world too large for RankGenerator is not in the default order,
    the only one computed directly."""
    if layout.use_tp_pp_dp_mapping:
        raise ConfigError(
            f"--use-tp-pp-dp-mapping is modelled up to {RANK_GENERATOR_LIMIT} ranks (megatron's "
            f"RankGenerator lays them out); this world has {layout.world_size}"
        )


def rank_positions(layout: Layout) -> list[tuple[int, int, int, int]]:
    """Return every rank's (pipe, data, context, model), the topology line's coordinates, in rank order."""
    if layout.world_size <= RANK_GENERATOR_LIMIT:
        return [(c.pipe, c.data, c.context, c.model) for c in rank_coords(layout)]
    _check_direct(layout)
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    stage_size = tp * cp * dp
    return [
        (rank // stage_size, rank // (tp * cp) % dp, rank // tp % cp, rank % tp)
        for rank in range(layout.world_size)
    ]


def rank_shard_indices(layout: Layout) -> list[tuple[int, int, int]]:
    """Return every rank's (pipe, data, expert data): which optimizer shards it holds."""
    if layout.world_size <= RANK_GENERATOR_LIMIT:
        return [(c.pipe, c.data, c.expert_data) for c in rank_coords(layout)]
    _check_direct(layout)
    return [
        (pipe, data, _expert_data_index(layout, rank))
        for rank, (pipe, data, _, _) in enumerate(rank_positions(layout))
    ]


def stage_shard_pairs(layout: Layout) -> tuple[tuple[int, int], ...]:
    """Return the distinct (data, expert data) indices of one pipeline stage's ranks, sorted.

    Every stage's ranks hold the same pairs. In megatron's "tp-cp-ep-dp-pp" order a rank's data
    index is rank // (tp x cp) % dp and its expert data index rank // (expert tp x ep) % expert
    dp (rank_shard_indices' direct path), so the pair changes only at multiples of one of the two
    strides: those ranks give every pair without visiting the others. Tests check the pairs
    equal those of megatron's RankGenerator, stage by stage.
    """
    if layout.ep == 1:
        return tuple((data, 0) for data in range(layout.dp))
    if layout.use_tp_pp_dp_mapping:  # megatron's RankGenerator in that order
        return tuple(sorted({(c.data, c.expert_data) for c in rank_coords(layout) if c.pipe == 0}))
    dense, expert = layout.tp * layout.cp, layout.expert_tp * layout.ep
    stage = dense * layout.dp
    edges = set(range(0, stage, dense)) | set(range(0, stage, expert))
    return tuple(sorted({(rank // dense, rank // expert) for rank in edges}))


def _expert_data_index(layout: Layout, rank: int) -> int:
    """Return the rank's position in its expert data-parallel group (megatron's mixed radix)."""
    if layout.ep == 1:
        return 0
    return rank // (layout.expert_tp * layout.ep) % layout.expert_dp


def _coords_from_rank_generator(layout: Layout) -> list[RankCoord]:
    ps = megatron().parallel_state
    gen = ps.RankGenerator(
        tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=layout.rank_order
    )
    world = layout.world_size
    groups = {token: _group_of(gen.get_ranks(token), world) for token in ("tp", "pp", "dp", "cp")}
    expert_groups = expert_data = None
    if layout.ep > 1:
        expert_gen = ps.RankGenerator(
            tp=layout.expert_tp, ep=layout.ep, dp=layout.expert_dp, pp=layout.pp, cp=1,
            order=layout.rank_order,
        )  # fmt: skip
        expert_groups = _group_of(expert_gen.get_ranks("ep"), world)
        expert_data = _group_of(expert_gen.get_ranks("dp"), world)
    embedding: dict[tuple[int, ...], tuple[int, ...]] = {}
    coords = []
    for rank in range(world):
        pp_group, pipe = groups["pp"][rank]
        if pp_group not in embedding:
            embedding[pp_group] = tuple(ps.default_embedding_ranks(list(pp_group)))
        coords.append(
            RankCoord(
                rank=rank,
                pipe=pipe,
                data=groups["dp"][rank][1],
                context=groups["cp"][rank][1],
                model=groups["tp"][rank][1],
                tensor_group=groups["tp"][rank][0],
                pipeline_group=pp_group,
                data_group=groups["dp"][rank][0],
                embedding_group=embedding[pp_group] if rank in embedding[pp_group] else (),
                expert_group=expert_groups[rank][0] if expert_groups else None,
                expert=expert_groups[rank][1] if expert_groups else 0,
                expert_data=expert_data[rank][1] if expert_data else 0,
            )
        )
    return coords


def _coords_by_order(layout: Layout) -> list[RankCoord]:
    """Return the coordinates of megatron's "tp-cp-ep-dp-pp" order directly (large worlds)."""
    world = _OrderedWorld(layout, megatron().parallel_state)
    return [world.coord(rank) for rank in range(layout.world_size)]


class _OrderedWorld:
    """Megatron's "tp-cp-ep-dp-pp" order as a mixed radix, tensor fastest; each group a tuple
    made once and shared by all its ranks."""

    def __init__(self, layout: Layout, parallel_state: Any) -> None:
        self.layout, self.parallel_state = layout, parallel_state
        self.tp, self.cp, self.dp, self.world = layout.tp, layout.cp, layout.dp, layout.world_size
        self.stage_size = self.tp * self.cp * self.dp
        self.made: dict[tuple[str, int], tuple[int, ...]] = {}

    def group(self, kind: str, start: int, stop: int, step: int) -> tuple[int, ...]:
        """Return the ranks start, start + step, ... below stop: the `kind` group from `start`."""
        key = (kind, start)
        if key not in self.made:
            self.made[key] = tuple(range(start, stop, step))
        return self.made[key]

    def embedding(self, offset: int, pp_group: tuple[int, ...]) -> tuple[int, ...]:
        """Return megatron's embedding ranks of the pipeline group at stage offset `offset`."""
        key = ("embedding", offset)
        if key not in self.made:
            self.made[key] = tuple(self.parallel_state.default_embedding_ranks(list(pp_group)))
        return self.made[key]

    def coord(self, rank: int) -> RankCoord:
        """Return one rank's coordinates and groups."""
        tp, cp, dp, stage_size = self.tp, self.cp, self.dp, self.stage_size
        model, context = rank % tp, rank // tp % cp
        data, offset = rank // (tp * cp) % dp, rank % stage_size
        pp_group = self.group("pp", offset, self.world, stage_size)
        embedding = self.embedding(offset, pp_group)
        data_base = rank - data * tp * cp
        # RankCoord's fields in order (positional: this runs once per rank of up to 2**20).
        return RankCoord(
            rank, rank // stage_size, data, context, model,
            self.group("tp", rank - model, rank - model + tp, 1),
            pp_group,
            self.group("dp", data_base, data_base + stage_size, tp * cp),
            embedding if rank in embedding else (),
            *self.expert_fields(rank),
        )  # fmt: skip

    def expert_fields(self, rank: int) -> tuple[tuple[int, ...] | None, int, int]:
        """Return the rank's expert group, its place in it and in its expert data group."""
        etp, ep = self.layout.expert_tp, self.layout.ep
        if ep == 1:
            return None, 0, _expert_data_index(self.layout, rank)
        expert = rank // etp % ep
        base = rank - expert * etp
        return self.group("ep", base, base + ep * etp, etp), expert, _expert_data_index(self.layout, rank)


def _group_of(groups: list[list[int]], world: int) -> list[tuple[tuple[int, ...], int]]:
    """Index a list of rank groups by rank: (the rank's group, its position in the group)."""
    by_rank: list[tuple[tuple[int, ...], int]] = [((), 0)] * world
    for group in groups:
        members = tuple(group)
        for position, rank in enumerate(group):
            by_rank[rank] = (members, position)
    return by_rank
