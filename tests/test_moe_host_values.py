"""The MoE engine's host values (memory/engine/moe.py): the shortcuts keep megatron's numbers."""

from __future__ import annotations

import torch

from inspector.memory.engine.moe import _HostValues, balanced_map


def _gathered(mode: _HostValues, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-gather of a balanced routing map over `copies` ranks, as megatron's dispatcher
    gathers it (token_dispatcher.py MoEAllGatherTokenDispatcher), on meta with host values."""
    routing = torch.empty(12, 8, dtype=torch.bool, device="meta")
    mode.set(routing, balanced_map(12, 8, 2, None, False))
    output = torch.empty(12 * copies, 8, dtype=torch.bool, device="meta")
    mode._all_gather(lambda out, inp: None, (output, routing), {})
    return routing, output


def test_gathered_sum_comes_from_the_copies_and_equals_the_whole_sum() -> None:
    mode = _HostValues()
    routing, output = _gathered(mode, 4)
    assert output in mode.values.stacked  # the shortcut is taken
    with mode:
        counts = output.sum(dim=0)
        selected = torch.masked_select(torch.ones(48, 8, device="meta"), output)
    whole = mode.values[output].sum(dim=0)
    assert torch.equal(mode.values[counts], whole)
    assert torch.equal(whole, torch.full((8,), 12))  # 12 tokens x top-2 / 8 experts x 4 ranks
    assert selected.shape == (96,)


def test_local_experts_columns_come_from_one_copy_and_equal_the_whole_maps() -> None:
    """The allgather dispatcher keeps its local experts' columns of the gathered map
    (`routing_map[:, first:last + 1].contiguous()`), casts and sums them: each op acts on every
    copy alike, so it runs on one, and the gathered map is never made whole (`_Values`)."""
    mode = _HostValues()
    routing, output = _gathered(mode, 4)
    with mode:
        local = output[:, 2:5].contiguous()
        counts = local.sum(dim=0).long()
        picked = torch.masked_select(torch.ones(48, 3, device="meta"), local)
    assert output not in mode.values.full  # never made whole (masked_select made `local` so)
    whole = mode.values[routing].repeat(4, 1)[:, 2:5]
    assert torch.equal(mode.values[local], whole)
    assert torch.equal(mode.values[counts], whole.sum(dim=0))
    assert picked.shape == (int(whole.sum()),)


def test_a_gathered_map_written_in_place_is_summed_afresh() -> None:
    """The copies record must go when an op writes the gathered map: its sum is then zero."""
    mode = _HostValues()
    _, output = _gathered(mode, 4)
    with mode:
        output.zero_()
        counts = output.sum(dim=0)
    assert output not in mode.values.stacked
    assert torch.equal(mode.values[counts], torch.zeros(8, dtype=torch.long))


def test_a_float_gather_is_summed_whole() -> None:
    """Float sums are not exact under reordering: no shortcut for them."""
    mode = _HostValues()
    probs = torch.empty(12, 8, device="meta")
    mode.set(probs, torch.rand(12, 8))
    output = torch.empty(48, 8, device="meta")
    mode._all_gather(lambda out, inp: None, (output, probs), {})
    assert output not in mode.values.full  # kept as copies, as a map is
    with mode:
        local = output[:, 2:5].contiguous()  # the dispatcher's local experts' probs: one copy
        assert output not in mode.values.full
        total = output.sum(dim=0)
    assert output in mode.values.full  # made whole for the sum
    assert torch.equal(mode.values[total], mode.values[probs].repeat(4, 1).sum(dim=0))
    assert torch.equal(mode.values[local], mode.values[probs].repeat(4, 1)[:, 2:5])
