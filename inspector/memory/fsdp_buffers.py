"""What one rank holds under Megatron-FSDP or PyTorch FSDP2, from the chunks' bucket layouts.

Megatron-FSDP (world/fsdp.py lays out the buckets with megatron's code): per bucket, a rank holds
  - weights: the model-weight buffer, its shard under optim_grads_params, else the whole padded
    bucket; with no_shard there is no such buffer and the parameters keep their own storage;
  - gradients: the main grad buffer (fp32 unless --grad-reduce-in-bf16 on bf16), its shard from
    optim_grads on, else the whole bucket;
  - optimizer: the fp32 main-weight buffer (`preserve_fp32_weights`, megatron's default), its
    shard from optim on, and Adam's two fp32 moments of the parameter elements in that shard
    (the optimizer's parameters are the shard's pieces, `_init_distributed_params`).
With --fp8-param-gather the TE weights' buckets are uint8 (one byte an element; an MXFP8 bucket a
row-wise and a column-wise buffer, the forward gathering the first, the backward the second), and
each rank keeps the weights' scales whole (world/fsdp.py `_fp8_bucket`).
Buffers in flight (the peak, on top of the state): parameters sharded under optim_grads_params
are all-gathered one bucket group (a TransformerLayer, or a bucket outside the layers) at a time,
the next one prefetched (`AllGatherPipeline`, two slots with --fsdp-double-buffer:
`FixedPoolAllocator(size=2)`): the largest pair of neighbouring groups' gathered parameters.
Gradients: the unsharded buckets the backward fills and megatron's reduce-scatter queue keeps
(`GradReducePipeline`, run by engine/fsdp_grads.py), at their most at once; added to the pair.

PyTorch FSDP2 (world/fsdp.py `fsdp2_layout`): every unit's parameters and gradients (in the
parameters' dtype: megatron passes no mixed-precision policy) are sharded by rows; megatron's
Float16OptimizerWithFloat16Params keeps an fp32 copy of a 16-bit model's local rows, Adam its two
moments. In flight: the same pairs, a unit gathered while the next is prefetched (FSDP2 reshards
after the forward, megatron's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from inspector.job.optimizer_precision import ADAM_MOMENTS, MASTER_COPY
from inspector.memory.engine.fsdp_grads import gradient_buckets_peak
from inspector.world.fsdp import SHARDED, buckets_each_backward


def fsdp_state(
    layouts: Sequence[Any], dense_index: int, expert_index: int, moments: int = ADAM_MOMENTS
) -> tuple[int, int, int]:
    """Return one rank's (weights, gradients, optimizer) bytes from its chunks' FsdpLayouts;
    `moments`: Adam's bytes per updated element (--exp-avg-dtype and --exp-avg-sq-dtype with the
    precision-aware optimizer, whose FusedAdam keeps no master weights under Megatron-FSDP)."""
    weights = gradients = optimizer = 0
    for layout in layouts:
        if layout.strategy == "fsdp2":
            for unit in layout.buckets:
                weights += unit.shard_numel * unit.param_itemsize
                gradients += unit.shard_numel * unit.grad_itemsize
                master = MASTER_COPY if unit.param_itemsize < MASTER_COPY else 0
                optimizer += unit.owned_numel[dense_index] * (master + ADAM_MOMENTS)
            continue
        params, main, grads = SHARDED[layout.strategy]
        for bucket in layout.buckets:
            whole, shard = bucket.numel, bucket.shard_numel
            if layout.strategy == "no_shard":
                weights += bucket.parameters * bucket.param_itemsize
            else:  # an MXFP8 bucket's column-wise buffer is sharded as its row-wise one
                copies = 2 if bucket.transpose else 1
                weights += (shard if params else whole) * bucket.param_itemsize * copies
            weights += bucket.kept
            gradients += (shard if grads else whole) * bucket.grad_itemsize
            # under HSDP a bucket shards over dp / N ranks: a rank's place there is index % (dp / N)
            index = (expert_index if bucket.expert else dense_index) % bucket.dp
            updated = bucket.owned_numel[index] if main else bucket.parameters
            optimizer += (shard if main else whole) * MASTER_COPY + updated * moments
    return weights, gradients, optimizer


def fsdp_in_flight(layouts: Sequence[Any], gradients: bool = True) -> int:
    """Return the bytes of gathered parameters and unsharded gradients a rank holds at once.

    `gradients` False leaves out Megatron-FSDP's gradient buckets made in every backward
    (`buckets_each_backward`): where the engine runs, they are allocated in its backward as the
    gradients arrive (engine/fsdp_grads.py `with_gradient_buckets`), not beside the forward."""
    most = 0
    for layout in layouts:
        params, _, grads = SHARDED[layout.strategy]
        groups = _groups(layout.buckets)
        weights = [sum(b.numel * b.param_itemsize for b in g) for g in groups] if params else []
        # a Float8Tensor bucket's backward transpose, of the group in use only
        transposes = [sum(b.numel for b in g if getattr(b, "backward_transpose", False))
                      for g in groups] if params else []  # fmt: skip
        if layout.strategy == "fsdp2":
            grad = _pair([sum(b.numel * b.grad_itemsize for b in g) for g in groups])
        elif not gradients and buckets_each_backward(layout.strategy):
            grad = 0
        else:
            grad = gradient_buckets_peak(layout, grads)
        most = max(most, _pair(weights, transposes) + grad)
    return most


def _groups(buckets: Iterable[Any]) -> list[list[Any]]:
    """Return the buckets gathered together, in order: one FSDP unit's, or one bucket alone."""
    groups: list[list[Any]] = []
    units: dict[int, list[Any]] = {}
    for bucket in buckets:
        if bucket.unit is None:
            groups.append([bucket])
        elif bucket.unit in units:
            units[bucket.unit].append(bucket)
        else:
            units[bucket.unit] = [bucket]
            groups.append(units[bucket.unit])
    return groups


def _pair(sizes: Sequence[int], extra: Sequence[int] = ()) -> int:
    """Return the largest sum of two neighbours (the one in use and the one prefetched), each
    pair with the larger of its two `extra` (what the group in use adds: a backward transpose)."""
    more = list(extra) or [0] * len(sizes)
    if len(sizes) < 2:
        return sum(sizes) + sum(more)
    return max(a + b + max(x, y) for a, b, x, y in zip(sizes, sizes[1:], more, more[1:], strict=False))
