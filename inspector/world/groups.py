"""Process-group set-up that costs what one simulated rank needs, not what the whole world has.

megatron-core's `initialize_model_parallel` (0.13-0.16) enumerates every group of the world with its
`RankGenerator` and calls `torch.distributed.new_group(ranks=...)` for each of them, on every rank
(`create_group` in parallel_state): a real cluster needs every rank to enter every `new_group`. In
one simulated rank that is several hundred calls per pipeline stage, of which a dozen or so make a
group the rank belongs to. Two things make it cheap without changing what megatron decides:

- `new_group` for a group that does not contain this rank returns what torch itself returns there,
  `GroupMember.NON_GROUP_MEMBER`, and advances torch's group counter as torch would (so the groups
  this rank is in keep torch's own names); groups this rank is in are made by torch's real
  `new_group`. megatron still enumerates and tests membership of every group itself. Its
  `create_group` wrapper is likewise skipped for such groups once it has run once.
- megatron's `generate_masked_orthogonal_rank_groups` (pure arithmetic over the world's sizes) is
  computed once per set of sizes and handed out as fresh lists, instead of once per stage.
- megatron's `is_torch_min_version`, which `create_group` calls for every group (parsing torch's
  version string each time), answers from a cache: it depends only on its arguments and the
  installed torch.

Both are installed only inside `scoped_groups()`. tests/test_groups.py checks that every group, rank
and size megatron reports for the simulated rank is identical with and without them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

# megatron's generate_masked_orthogonal_rank_groups(world_size, parallel_size, mask) results.
_RANK_GROUPS: dict[tuple[Any, ...], list[list[int]]] = {}


def _member_only_new_group(real: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    """Return a `new_group` that makes only the groups this rank is a member of."""
    c10d = dist.distributed_c10d
    rank = dist.get_rank()  # the simulated rank: the block runs inside one init_process_group

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        local_sync = kwargs.get("use_local_synchronization", args[3] if len(args) > 3 else False)
        if ranks is None or local_sync or rank in ranks:
            return real(ranks, *args, **kwargs)
        # torch's new_group names a non-member's group too (the name is the group count), then
        # finds the rank is not in it and hands back the non-member marker.
        c10d._world.group_count += 1
        return c10d.GroupMember.NON_GROUP_MEMBER

    return new_group


def _member_only_create_group(real: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    """Return megatron's `create_group`, skipped for groups this rank is not in after the first.

    megatron's wrapper (parallel_state.create_group) builds torch's arguments, calls `new_group`
    and records the groups the rank is in. For a group the rank is not in, its only effects are
    torch's (the group counter) and, on its first call, starting its list of groups; so until one
    call has run in full, calls go to megatron, and later ones only advance torch's counter, as
    `new_group` would.
    """
    c10d = dist.distributed_c10d
    rank = dist.get_rank()
    ran = False

    def create_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        nonlocal ran
        local_sync = kwargs.get("use_local_synchronization", args[3] if len(args) > 3 else False)
        if not ran or ranks is None or local_sync or rank in ranks:
            ran = True
            return real(ranks, *args, **kwargs)
        c10d._world.group_count += 1
        return c10d.GroupMember.NON_GROUP_MEMBER

    return create_group


def _shared_rank_groups(real: Callable[..., Any]) -> Callable[..., Any]:
    """Return megatron's rank-group enumeration, computed once per set of sizes."""

    def generate(world_size: int, parallel_size: Any, mask: Any) -> list[list[int]]:
        key = (world_size, tuple(parallel_size), tuple(mask))
        if key not in _RANK_GROUPS:
            _RANK_GROUPS[key] = [list(group) for group in real(world_size, parallel_size, mask)]
        return [list(group) for group in _RANK_GROUPS[key]]

    return generate


_CACHED: dict[Callable[..., Any], Callable[..., Any]] = {}


def _cached(function: Callable[..., Any]) -> Callable[..., Any]:
    """Return `function` memoised (one memo per function, kept across stages)."""
    if function not in _CACHED:
        _CACHED[function] = functools.cache(function)
    return _CACHED[function]


@contextlib.contextmanager
def scoped_groups(dist: Any, parallel_state: Any) -> Iterator[None]:
    """Inside the block, megatron makes only this rank's process groups (see the module notes)."""
    new_group = dist.new_group
    generate = parallel_state.generate_masked_orthogonal_rank_groups
    min_version = getattr(parallel_state, "is_torch_min_version", None)
    create_group = getattr(parallel_state, "create_group", None)
    dist.new_group = _member_only_new_group(new_group, dist)
    if create_group is not None:
        parallel_state.create_group = _member_only_create_group(create_group, dist)
    parallel_state.generate_masked_orthogonal_rank_groups = _shared_rank_groups(generate)
    if min_version is not None:
        parallel_state.is_torch_min_version = _cached(min_version)
    try:
        yield
    finally:
        dist.new_group = new_group
        parallel_state.generate_masked_orthogonal_rank_groups = generate
        if min_version is not None:
            parallel_state.is_torch_min_version = min_version
        if create_group is not None:
            parallel_state.create_group = create_group
