"""Megatron-FSDP's unsharded gradient buckets in one backward, from megatron's own reduce queue.

From optim_grads on, a rank keeps only its shard of the main gradients; the backward writes each
parameter's gradient into an unsharded bucket that `DataParallelBuffer.fetch_bucket` allocates
when the first of its parameters asks for its main_grad (megatron_fsdp.py `_grad_acc`, or TE's
fused wgrad through `get_main_grad`). Once every parameter of a bucket group has its gradient,
`GradReducePipeline.reduce_gradients` reduce-scatters the group into a fresh shard
(`torch.empty_like(grad_shard)`) and queues it; a queued bucket is freed only when the queue
holds more than `suggested_RS_queue_capacity` elements (at least 1e9 with Megatron-LM's
defaults) or at the root's post-backward `reset`. Under optim (and no_shard) the buffer is
unsharded and persistent, and the buckets are reduced on the last micro-batch only.

Here megatron's own `GradReducePipeline` and `DataParallelBuffer.fetch_bucket` /
`free_bucket_storage` run on meta tensors (megatron_fsdp/param_and_grad_buffer.py, megatron-core
0.16.1), with the layout megatron computed (world/fsdp.py), the gradients arriving from the last
parameter to the first. Simulated, the smallest piece: the CUDA streams and events (a stream
waits on nothing, an event is complete) and the collectives (they write in place, allocate
nothing). The allocator's count of what the run allocates, over the rank's persistent shards, is
the answer: the largest amount of unsharded gradient buckets and shards alive at once.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch

from inspector.memory.engine.allocator import Event, Tracker
from inspector.memory.engine.cuda import cuda_on_meta
from inspector.memory.engine.microbatch import Trace
from inspector.world.ddp import META_STREAM


def gradient_buckets_peak(layout: Any, sharded: bool) -> int:
    """Return the most bytes of gradient buckets a rank allocates at once in the last backward.

    Args:
        layout: the chunk's FsdpLayout (world/fsdp.py), megatron's buckets and their indices.
        sharded: the strategy shards the main gradients (optim_grads and optim_grads_params).
    """
    profile = gradient_profile(layout, sharded)
    return profile[-1] if profile else 0


def gradient_profile(layout: Any, sharded: bool) -> tuple[int, ...]:
    """Return, after each parameter's gradient in the backward's order (`layout.backward`), the
    most bytes of gradient buckets allocated at once so far (the last: the backward's most)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from inspector.world.fsdp import buffer_module

    buffers = buffer_module()
    # megatron's _free_storage asks torch.distributed._functional_collectives, which nothing
    # else may have imported yet (megatron-core 0.13's build)
    importlib.import_module("torch.distributed._functional_collectives")
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=layout.strategy)
    with cuda_on_meta(), _no_streams_or_collectives(buffers):
        groups = [_group(buffers, config, i, b, sharded) for i, b in enumerate(layout.buckets)]
        stub = SimpleNamespace(
            num_buckets=len(groups), parameter_groups=groups, ddp_config=config,
            param_to_param_group={p: i for i, g in enumerate(groups) for p in g.params},
            param_to_name={p: f"{i}.{j}" for i, g in enumerate(groups) for j, p in enumerate(g.params)},
            bucket_to_bucket_group={i: list(group) for i, group in enumerate(layout.groups)},
            dist_index=SimpleNamespace(use_hybrid_fsdp=False),
            mp_policy=getattr(buffers, "MixedPrecisionPolicy", lambda: None)(),  # 0.19: defaults
        )  # fmt: skip
        pipeline = buffers.GradReducePipeline(stub, rs_stream=None)
        profile = []
        with Tracker() as tracker:
            for bucket_id, item in layout.backward:
                group = groups[bucket_id]
                group.main_grad_buffer.fetch_bucket()  # the parameter's main_grad
                pipeline.reduce_gradients(
                    [group.params[item]], suggested_queue_capacity=layout.capacity
                )
                profile.append(tracker.peak)
            pipeline.reset()  # the root's post-backward hook
    return tuple(profile)


BUCKETS = "Megatron-FSDP's unsharded gradient buckets"
# a backward label's module: a composed layer ("layer 17 mlp.linear_fc1: ..."), a chunk's own
# ("decoder.layers.3.mlp: ...") or a module outside the layers ("embedding.word_embeddings: ...")
_MODULE = re.compile(r"^(?:layer (\d+)|decoder\.layers\.(\d+)|([A-Za-z_][\w.]*))[ .:]?")


def with_gradient_buckets(trace: Trace, layout: Any, profile: Sequence[int],
                          layers: Sequence[int]) -> Trace:  # fmt: skip
    """Return `trace` with Megatron-FSDP's gradient buckets allocated in its backward as the
    parameters' gradients arrive, and freed at its end (the root's post-backward `reset`).

    A backward step in a module counts every bucket allocated up to that module's last parameter
    in the backward's order (`profile`, from megatron's own GradReducePipeline); `layers`: the
    chunk's 0-based global layer numbers, which composed labels use."""
    last: dict[str, int] = {}
    for index, name in enumerate(layout.backward_names):
        parts = name.split(".")
        for end in range(1, len(parts)):
            last[".".join(parts[:end])] = index
    local = {number: k for k, number in enumerate(layers)}
    events: list[Event] = []
    held = 0  # the queue frees nothing before the reset (its capacity: at least 1e9 elements)
    for event in trace.backward:
        at = _last_parameter(event.where, last, local)
        if at is not None and profile[at] > held:
            grow, held = profile[at] - held, profile[at]
            events.append(Event(grow, event.allocated - event.bytes + held,
                                f"{event.where}: {BUCKETS}"))  # fmt: skip
        events.append(Event(event.bytes, event.allocated + held, event.where, event.origin))
    if held:
        events.append(Event(-held, events[-1].allocated - held, f"backward: {BUCKETS} reset"))
    return replace(trace, backward=tuple(events))


def _last_parameter(where: str, last: dict[str, int], local: dict[int, int]) -> int | None:
    """Return the backward index of the last parameter of the module `where` names, if any."""
    match = _MODULE.match(where)
    if match is None:
        return None
    composed, own, outside = match.groups()
    if composed is not None:
        layer = local.get(int(composed))
        return None if layer is None else last.get(f"decoder.layers.{layer}")
    if own is not None:
        return last.get(f"decoder.layers.{own}")
    module = outside.rstrip(".")
    while module:
        if module in last:
            return last[module]
        module = module.rpartition(".")[0]
    return None


def _group(buffers: Any, config: Any, bucket_id: int, bucket: Any, sharded: bool) -> Any:
    """Return megatron's ParameterGroup holding the main grad buffer for `bucket`, made by
    megatron's DataParallelBuffer on the bucket's index (rank 0 of its `dp` ranks)."""
    dtype = torch.float32 if bucket.grad_itemsize == 4 else torch.bfloat16
    items, index, shard = bucket.index
    params = [torch.nn.Parameter(torch.empty(size, device="meta")) for _, size in bucket.items]
    made = buffers.DataParallelBuffer
    given = dict(item_index_map=items, bucket_index=index, shard_bucket_index=shard)
    takes = inspect.signature(made.__init__).parameters
    sharded = sharded and bucket.dp > 1
    group = SimpleNamespace(rank=lambda: 0, size=lambda: bucket.dp)  # rank 0 of its dp (0.13 asks)
    with mock.patch.object(torch.distributed, "get_rank", lambda *args, **kwargs: 0), \
            mock.patch.object(torch.distributed, "get_world_size", lambda *a, **k: bucket.dp):
        gbuf = made(
            config, params, sharded, bucket_id, dtype=dtype, device=torch.device("meta"),
            data_parallel_group=group, temporary_bucket_allocator=buffers.TemporaryBucketAllocator(),
            **{name: value for name, value in given.items() if name in takes},
        )  # fmt: skip
    gbuf.__dict__.update(given)  # megatron-core 0.13 builds its own: the layout's is the same
    if getattr(gbuf, "data", None) is None:  # 0.13 allocated it in __init__
        gbuf.init_data(torch.empty(gbuf.data_size, dtype=dtype, device="meta"))  # persistent
    return buffers.ParameterGroup(
        params, requires_grad=True, fsdp_unit_id=bucket.unit, main_grad_buffer=gbuf
    )


@contextlib.contextmanager
def _no_streams_or_collectives(buffers: Any) -> Iterator[None]:
    """Run the queue's streams, events and collectives as no-ops that allocate nothing."""
    stream = META_STREAM
    with contextlib.ExitStack() as stack:
        for owner, name, value in (
            (torch.cuda, "current_stream", lambda *args, **kwargs: stream),
            (torch.cuda, "stream", lambda *args, **kwargs: contextlib.nullcontext()),
            (torch.distributed, "reduce_scatter_tensor", lambda *args, **kwargs: None),
            (torch.distributed, "all_reduce", lambda *args, **kwargs: None),
            (buffers, "_coalescing_manager", lambda *args, **kwargs: contextlib.nullcontext(stream)),
        ):
            stack.enter_context(mock.patch.object(owner, name, value))
        yield


def fsdp_traces(job: Any, stage: int, shapes: Sequence[Any],
                traces: Sequence[Trace]) -> tuple[Trace, ...]:  # fmt: skip
    """Return the chunks' traces with Megatron-FSDP's gradient buckets in their backwards
    (`with_gradient_buckets`), from the layouts megatron makes of the stage's chunks."""
    from inspector.world.build import View, build
    from inspector.world.fsdp import buckets_each_backward

    if not buckets_each_backward(job.training.sharding_strategy):
        return tuple(traces)
    built = build(job, View((stage,)), expert_ranks=(0,)).stages[0]
    out = []
    for trace, chunk, shape in zip(traces, built.chunks, shapes, strict=True):
        layout = chunk.fsdp()
        profile = gradient_profile(layout, True)
        out.append(with_gradient_buckets(trace, layout, profile, shape.layers))
    return tuple(out)
