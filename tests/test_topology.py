"""`inspect-model topology`: the rank map agrees with megatron's parallel_state rank by rank."""

from __future__ import annotations

import re

import pytest

from inspector.job.layout import Layout
from inspector.world import ranks
from inspector.world import setup as world_setup

SHAPES = [
    Layout(tp=2, pp=2, dp=2),
    Layout(tp=1, pp=4, dp=2),
    Layout(tp=4, pp=1, dp=2),
    Layout(tp=1, pp=1, dp=4),
    Layout(tp=2, pp=3, dp=1),
    Layout(tp=2, pp=2, dp=2, cp=2),
    Layout(tp=1, pp=2, dp=4, ep=2),
    Layout(tp=8, pp=1, dp=1),
]


def megatron_view(layout: Layout, rank: int) -> dict:
    """Initialise megatron's parallel_state as `rank` and read back what it reports."""
    m = world_setup.megatron()
    ps = m.parallel_state
    world_size = layout.world_size
    # destroy_model_parallel() leaves _EMBEDDING_GLOBAL_RANKS behind from the previous rank
    ps._EMBEDDING_GLOBAL_RANKS = None
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=rank, world_size=world_size)
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            create_gloo_process_groups=False,
            order=layout.rank_order,  # Megatron-LM's initialize.py: tp-cp-ep-pp-dp with the mapping
        )
        ranks = m.dist.get_process_group_ranks
        return {
            "pipe": ps.get_pipeline_model_parallel_rank(),
            "data": ps.get_data_parallel_rank(),
            "context": ps.get_context_parallel_rank(),
            "model": ps.get_tensor_model_parallel_rank(),
            "tensor_group": tuple(ranks(ps.get_tensor_model_parallel_group())),
            "pipeline_group": tuple(ranks(ps.get_pipeline_model_parallel_group())),
            "data_group": tuple(ranks(ps.get_data_parallel_group())),
            "embedding_group": tuple(ps._EMBEDDING_GLOBAL_RANKS or ()),
            "expert": ps.get_expert_model_parallel_rank(),
            "expert_group": tuple(ranks(ps.get_expert_model_parallel_group()))
            if layout.ep > 1
            else None,
            "expert_data": ps.get_expert_data_parallel_rank() if layout.ep > 1 else 0,
        }
    finally:
        ps.destroy_model_parallel()
        m.dist.destroy_process_group()


# Megatron-LM's --use-tp-pp-dp-mapping: initialize_model_parallel(order="tp-cp-ep-pp-dp")
MAPPED = [
    Layout(tp=2, pp=2, dp=2, use_tp_pp_dp_mapping=True),
    Layout(tp=1, pp=4, dp=2, use_tp_pp_dp_mapping=True),
    Layout(tp=2, pp=2, dp=2, cp=2, etp=4, use_tp_pp_dp_mapping=True),
    Layout(tp=1, pp=2, dp=2, cp=2, ep=2, use_tp_pp_dp_mapping=True),
    Layout(tp=2, pp=2, dp=2, ep=2, etp=1, use_tp_pp_dp_mapping=True),
    Layout(tp=1, pp=1, dp=4, ep=2, use_tp_pp_dp_mapping=True),
]


@pytest.mark.parametrize("layout", SHAPES + MAPPED, ids=str)
def test_coords_match_parallel_state(layout):
    coords = ranks.rank_coords(layout)
    assert [c.rank for c in coords] == list(range(layout.world_size))
    for c in coords:
        expected = megatron_view(layout, c.rank)
        got = {key: getattr(c, key) for key in expected}
        assert got == expected, f"rank {c.rank}"


@pytest.mark.parametrize("layout", SHAPES + MAPPED, ids=str)
def test_group_structure(layout):
    coords = ranks.rank_coords(layout)
    by_rank = {c.rank: c for c in coords}
    for c in coords:
        key = (c.pipe, c.data, c.context, c.model)
        for name, varying in (
            ("tensor_group", "model"),
            ("pipeline_group", "pipe"),
            ("data_group", "data"),
        ):
            group = getattr(c, name)
            assert c.rank in group
            for other in group:  # members differ from c only in the group's own coordinate
                o = by_rank[other]
                fields = {"pipe": o.pipe, "data": o.data, "context": o.context, "model": o.model}
                mine = dict(zip(("pipe", "data", "context", "model"), key))
                assert {k: v for k, v in fields.items() if k != varying} == {
                    k: v for k, v in mine.items() if k != varying
                }
        assert len(c.tensor_group) == layout.tp
        assert len(c.pipeline_group) == layout.pp
        assert len(c.data_group) == layout.dp
    assert len({(c.pipe, c.data, c.context, c.model) for c in coords}) == layout.world_size


def test_topology_line_pp2_dp2_tp2(cli):
    result = cli("topology", "--pp", "2", "--dp", "2", "--tp", "2")
    assert result.code == 0
    entries = re.findall(r"ProcessCoord\(pipe=(\d), data=(\d), model=(\d)\): (\d)", result.out)
    assert len(entries) == 8
    # model fastest, then data, pipe slowest
    assert [tuple(map(int, e)) for e in entries] == [
        (p, d, m, 4 * p + 2 * d + m) for p in range(2) for d in range(2) for m in range(2)
    ]


@pytest.mark.parametrize(
    "name, args",
    [
        ("topology_pp2_dp2_tp2.txt", ["--pp", "2", "--dp", "2", "--tp", "2"]),
        ("topology_default.txt", []),
        ("topology_pp4_tp1_dp2.txt", ["--pp", "4", "--dp", "2"]),
        ("topology_cp2.txt", ["--pp", "2", "--tp", "2", "--context-parallel-size", "2"]),
        (
            "topology_table_pp2_dp2_tp2.txt",
            ["--pp", "2", "--dp", "2", "--tp", "2", "--format", "table"],
        ),
    ],
)
def test_topology_golden(cli, golden, name, args):
    result = cli("topology", *args)
    assert result.code == 0, result.err
    golden(name, result.out)


def test_context_axis_only_when_cp_gt_1(cli):
    assert "context=" not in cli("topology", "--tp", "2").out
    line = cli("topology", "--tp", "2", "--context-parallel-size", "2").out
    assert line.count("context=") == 4


LARGE_SHAPES = SHAPES + [
    Layout(tp=4, pp=3, dp=5),
    Layout(tp=2, pp=2, dp=6, cp=3),
    Layout(tp=2, pp=3, dp=4, ep=4, etp=1),
    Layout(tp=4, pp=2, dp=4, ep=2, etp=2),
]


@pytest.mark.parametrize("layout", LARGE_SHAPES, ids=str)
def test_large_world_path_equals_rank_generator(layout, monkeypatch):
    """Above RANK_GENERATOR_LIMIT the coordinates are computed directly; they equal megatron's."""
    from_megatron = ranks.rank_coords(layout)
    positions = ranks.rank_positions(layout)
    monkeypatch.setattr(ranks, "RANK_GENERATOR_LIMIT", 0)
    assert ranks.rank_coords(layout) == from_megatron
    assert (
        ranks.rank_positions(layout)
        == positions
        == [(c.pipe, c.data, c.context, c.model) for c in from_megatron]
    )


def test_topology_needs_only_what_a_rank_map_needs(cli):
    """The default model's 12 layers do not split over 8 stages; a rank map does not care."""
    result = cli("topology", "--pp", "8", "--tp", "5")
    assert result.code == 0, result.err
    assert result.out.count("ProcessCoord(") == 40
    assert cli("params", "--pp", "8").code == 2  # building the model still needs the split


PAIR_SHAPES = LARGE_SHAPES + [
    Layout(tp=2, pp=2, dp=8, cp=2, ep=4, etp=1),
    Layout(tp=4, pp=1, dp=6, ep=3, etp=2),
    Layout(tp=1, pp=2, dp=12, cp=2, ep=8, etp=1),
    Layout(tp=2, pp=1, dp=4, cp=2, ep=16, etp=1),
]


@pytest.mark.parametrize("layout", PAIR_SHAPES, ids=str)
def test_stage_shard_pairs_equal_rank_generators(layout):
    """The planner's (data, expert data) pairs, from strides alone, are megatron's, on each stage."""
    coords = ranks.rank_coords(layout)
    assert layout.world_size <= ranks.RANK_GENERATOR_LIMIT  # megatron's RankGenerator gave them
    for stage in range(layout.pp):
        expected = sorted({(c.data, c.expert_data) for c in coords if c.pipe == stage})
        assert list(ranks.stage_shard_pairs(layout)) == expected, stage
