"""inspector.world.groups: megatron reports the same groups, ranks and sizes with and without the shortcut.

For each layout and rank, megatron's parallel_state is set up twice in the same fake world: once as
megatron does it (every group of the world made), once inside groups.scoped_groups (only the groups
this rank is in). Everything parallel_state then holds and reports must be identical: each group's
member ranks, this rank's position and the group size, torch's name for the group, the rank lists,
and megatron's public getters (every global of parallel_state holding state, e.g. 0.16's list of
the rank's groups, is compared).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from inspector.job.layout import Layout
from inspector.world import groups
from inspector.world import setup as world_setup

# (layout, virtual pipeline size, ranks to check: None = all)
CASES = [
    (Layout(tp=2, pp=2, dp=2), None, None),
    (Layout(tp=1, pp=4, dp=2), 2, None),
    (Layout(tp=2, pp=3, dp=1), None, None),
    (Layout(tp=2, pp=2, dp=2, cp=2), None, None),
    (Layout(tp=1, pp=2, dp=4, ep=2), None, None),
    (Layout(tp=2, pp=2, dp=4, ep=4, etp=1), None, None),
    (Layout(tp=2, pp=1, dp=4, ep=2, etp=2), None, None),
    (Layout(tp=8, pp=16, dp=1), 2, [0, 7, 8, 63, 120, 127]),
    (Layout(tp=4, pp=4, dp=8, ep=8, etp=1), None, [0, 5, 33, 64, 127]),
]

GETTERS = [
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_virtual_pipeline_model_parallel_world_size",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_context_parallel_rank",
    "get_context_parallel_world_size",
    "get_expert_model_parallel_rank",
    "get_expert_model_parallel_world_size",
    "get_expert_tensor_parallel_rank",
    "get_expert_tensor_parallel_world_size",
    "get_expert_data_parallel_rank",
    "get_expert_data_parallel_world_size",
    "get_tensor_model_parallel_src_rank",
    "get_pipeline_model_parallel_first_rank",
    "get_pipeline_model_parallel_last_rank",
    "get_pipeline_model_parallel_next_rank",
    "get_pipeline_model_parallel_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
]


def _describe(m: Any, value: Any) -> Any:
    """A comparable view of one parallel_state global."""
    dist = m.dist
    if isinstance(value, dist.ProcessGroup):
        return (
            "group",
            tuple(dist.get_process_group_ranks(value)),
            dist.get_rank(value),
            dist.get_world_size(value),
            value.group_name,
        )
    if isinstance(value, (list, tuple)):
        return tuple(_describe(m, item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _describe(m, v)) for k, v in value.items()))
    if isinstance(value, (int, str, bool, type(None))):
        return value
    return type(value).__name__


def _is_state(m: Any, value: Any) -> bool:
    """Whether a parallel_state global is state set up by initialize_model_parallel."""
    kinds = (m.dist.ProcessGroup, list, tuple, dict, int, str, bool, type(None))
    return isinstance(value, kinds)


def megatron_report(layout: Layout, vpp: int | None, rank: int, scope: Callable[..., Any]) -> dict:
    """Set up megatron's parallel_state as `rank` of the full world; return what it holds."""
    m = world_setup.megatron()
    ps = m.parallel_state
    ps._EMBEDDING_GLOBAL_RANKS = None  # destroy_model_parallel() leaves it behind
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        with scope(m.dist, ps):
            ps.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=vpp,
                context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp,
                create_gloo_process_groups=False,
            )
        report = {
            name: _describe(m, value)
            for name, value in vars(ps).items()
            if not name.startswith("__") and _is_state(m, value) and "MEMORY_BUFFER" not in name
        }
        for getter in GETTERS:
            if hasattr(ps, getter):
                report[getter] = getattr(ps, getter)()
        return report
    finally:
        ps.destroy_model_parallel()
        m.dist.destroy_process_group()


def _unscoped(dist: Any, parallel_state: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _case_id(case: tuple[Layout, int | None, list[int] | None]) -> str:
    layout, vpp, _ = case
    return f"tp{layout.tp}-pp{layout.pp}-dp{layout.dp}-cp{layout.cp}-ep{layout.ep}-etp{layout.etp}-vpp{vpp}"


@pytest.mark.parametrize(("layout", "vpp", "ranks"), CASES, ids=[_case_id(c) for c in CASES])
def test_same_groups_with_and_without_shortcut(layout, vpp, ranks):
    for rank in ranks if ranks is not None else range(layout.world_size):
        expected = megatron_report(layout, vpp, rank, _unscoped)
        got = megatron_report(layout, vpp, rank, groups.scoped_groups)
        assert got == expected, f"rank {rank}"
        # the rank is really in groups (the comparison is not between two empty reports)
        assert expected["_TENSOR_MODEL_PARALLEL_GROUP"][0] == "group"


def test_shortcut_makes_only_member_groups():
    m = world_setup.megatron()
    layout = Layout(tp=8, pp=16, dp=1)
    made = []
    real = m.dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        group = real(*args, **kwargs)
        made.append(group != m.dist.GroupMember.NON_GROUP_MEMBER)
        return group

    m.dist.new_group = counting
    try:
        megatron_report(layout, None, 9, groups.scoped_groups)
    finally:
        m.dist.new_group = real
    assert made and all(made)  # every group actually made holds the rank
    assert m.dist.new_group is real  # and the stand-in is gone after the block
