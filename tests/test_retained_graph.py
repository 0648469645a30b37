"""What a layer's module keeps of its last forward with the autograd graph behind it.

megatron-core's token dispatchers keep the last forward's routing probabilities (a tensor with
its grad_fn). Under full recomputation that forward is the one CheckpointFunction.backward reran
on a detached copy of the layer's input, so the graph holds the input (AccumulateGrad keeps the
leaf) and the gradient written into its `.grad` until the layer's next forward replaces the
attribute (microbatch.py `_retained`, schedule.py `replay_passes` / `freeing`).
"""

from __future__ import annotations

import pytest

from inspector.memory.engine.allocator import Event
from inspector.memory.engine.microbatch import Trace
from inspector.memory.engine.schedule import freeing, iteration_peak, replay_passes
from tests.test_engine import _MOE_TP1, _job

_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _trace(**flags):
    from inspector.memory.engine.stage import trace_stage
    from inspector.world.setup import megatron

    megatron()
    job = _job(**{**_MOE_TP1, **flags}, num_layers=2, pipeline_model_parallel_size=1,
               data_parallel_size=1, global_batch_size=2)  # fmt: skip
    return trace_stage(job, 0)[0]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_a_recomputed_moe_layer_keeps_its_input_and_its_gradient(dispatcher):
    """Each layer keeps, beyond the probabilities any MoE layer keeps, its input [s, b, h] and
    that input's gradient (bf16: 32 x 2 x 64 x 2 bytes each) until its next forward; the
    micro-batch's events keep them (its backward ends above where it began)."""
    plain = _trace(moe_token_dispatcher_type=dispatcher)
    full = _trace(moe_token_dispatcher_type=dispatcher, **_FULL)
    activation = 32 * 2 * 64 * 2
    assert [layer for layer, _ in full.retained] == ["decoder.layers.0", "decoder.layers.1"]
    for (_, kept), (_, probs) in zip(full.retained, plain.retained, strict=True):
        assert 0 < probs < activation
        assert kept == 2 * activation + probs
    assert full.backward[-1].allocated == sum(size for _, size in full.retained)


def test_a_dense_layer_keeps_nothing_of_its_graph():
    assert _trace(num_experts=None, **_FULL).retained == ()


def _synthetic(retained: int) -> Trace:
    """One chunk of two layers: the forward holds 10 (its input 4 among it), the backward ends
    with `retained` left."""
    forward = (Event(4, 4, "layer 0"), Event(6, 10, "layer 1"))
    backward = (Event(5, 15, "layer 1"), Event(-15 + retained, retained, "layer 0"))
    kept = (("layer 0", retained // 2), ("layer 1", retained - retained // 2))
    return Trace(forward, backward, (), retained=kept if retained else ())


def test_the_next_forward_frees_what_the_last_backward_left():
    trace = _synthetic(8)
    # layer 0's 4 freed where its forward begins, layer 1's 4 where its own does
    assert [e.allocated for e in freeing(trace)] == [-4, 0, -4, 2]
    # a backward after a backward: its recomputed forwards replace what the last one left
    assert [e.allocated for e in freeing(trace, forward=False)] == [6, 11, 7, 0]
    passes = list(replay_passes((trace,), 0, 1, 2))
    # F0 frees the iteration before's 8; B0 leaves 8; F1 frees them; B1 leaves them again
    assert [(p.forward, p.held, p.frees) for p in passes] == [
        (True, 0, 8), (False, -8, 0), (True, 0, 8), (False, -8, 0)]  # fmt: skip
    # with two micro-batches in flight the second backward replaces what the first left
    passes = list(replay_passes((trace,), 0, 2, 2))
    assert [(p.forward, p.frees) for p in passes] == [(True, 8), (True, 0), (False, 0), (False, 8)]
    assert passes[3].held == passes[2].held - 10 + 8  # the first micro-batch's 10 gone, its 8 left


def test_what_is_left_is_counted_once_not_beneath_every_pass():
    """What a backward leaves is static memory (after the step it is there): the peak above
    it is 8 lower, the same bytes in all, not 8 more."""
    left, none = iteration_peak((_synthetic(8),), 0, 1, 2), iteration_peak((_synthetic(0),), 0, 1, 2)
    assert (left.bytes + 8, left.moment) == (none.bytes, none.moment) == (15, "backward of micro-batch 0: layer 1")
