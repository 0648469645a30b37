"""What the commands ask for: resolve the arguments, validate, build the stages, walk them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inspector.config import ModelConfig, make_model_config
from inspector.errors import ConfigError
from inspector.topology import Layout, RankCoord, check_buildable, make_layout, validate_layout


@dataclass(frozen=True)
class Target:
    """A resolved model and layout: everything that determines what gets built."""

    model: ModelConfig
    layout: Layout


def resolve(args: Mapping[str, Any]) -> Target:
    """Turn merged Megatron-LM arguments into a validated model and layout."""
    model = make_model_config(args)
    layout = make_layout(dict(args))
    validate_layout(model, layout)
    return Target(model, layout)


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


def coords(layout: Layout) -> list[RankCoord]:
    """Return every rank's coordinates, as megatron lays them out."""
    from inspector import world

    return world.rank_coords(layout)


def positions(layout: Layout) -> list[tuple[int, int, int, int]]:
    """Return every rank's (pipe, data, context, model), as megatron lays them out."""
    from inspector import world

    return world.rank_positions(layout)


def rank_shard_indices(layout: Layout) -> list[tuple[int, int, int]]:
    """Return every rank's (pipe, data, expert data), the indices of its optimizer shards."""
    from inspector import world

    return world.rank_shard_indices(layout)


def build(target: Target, stages: Sequence[int] | None = None, expert_rank: int = 0) -> list[Any]:
    """Build the given pipeline stages (all by default); return their StageModels in order."""
    from inspector import world

    layout = target.layout
    check_buildable(layout)
    wanted = range(layout.pp) if stages is None else stages
    built = []
    for stage in wanted:
        built.extend(world.build_stage(target.model, layout, stage, expert_rank))
    return built
