"""megatron's DDP buffer arithmetic, a run of equal parameters at a time.

  megatron-core `_ParamAndGradBuffer.__init__` (distributed/param_and_grad_buffer.py): one buffer
  per (param dtype, grad dtype), expert-parallel parameters (allreduce=False, only when ep > 1)
  in buffers of their own; parameters taken in reverse order; with the distributed optimizer each
  starts at a multiple of 64, a `shared_embedding` parameter gets a bucket of its own, and each
  bucket ends at a multiple of lcm(dp x cp, 128) (expert buffers: the expert data-parallel size);
  a bucket closes once it holds `bucket_size` elements — only on stage 0, chunk 0 with
  --overlap-grad-reduce (Megatron-LM's get_model and DDP disable bucketing elsewhere).

The buffers become shards.BufferLayout records, so memory.state_bytes prices them exactly as
`memory` does; tests/test_plan.py proves composed = `memory` stage by stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from inspector.memory.compose.pieces import Run, joined
from inspector.world.shards import BucketLayout, BufferLayout, ParamShards, owned_numel

Spans = list[tuple[int, int, int]]  # (start, end, bucket) of parameters side by side
Buckets = list[tuple[int, int, int]]  # (offset, end padded, unpadded numel)
Group = tuple[tuple[bool, Any], tuple[Run, ...]]  # (expert?, dtype) and the buffer's runs


def buffer_groups(runs: Sequence[Run]) -> tuple[Group, ...]:
    """Return the runs of each buffer: one per (expert, dtype), dense buffers first."""
    grouped: dict[tuple[bool, Any], list[Run]] = {}
    for run in runs:
        grouped.setdefault((run[0].expert, run[0].buffer_dtype), []).append(run)
    return tuple(
        (key, joined([members])) for key, members in sorted(grouped.items(), key=lambda kv: kv[0][0])
    )


def pad(n: int, d: int) -> int:
    """Return n rounded up to a multiple of d."""
    return -(-n // d) * d


def place(runs: Sequence[Run], distributed: bool, dp: int, bucket_size: int | None,
          packed: list[int] | None = None) -> tuple[Spans, Buckets]:  # fmt: skip
    """Reimplement `_ParamAndGradBuffer`'s index arithmetic for one buffer, a run at a time:
    equal parameters start a step (numel, padded to 64 with the distributed optimizer) apart
    until a bucket closes; side by side they are one span (all `owned_numel` depends on).
    `packed`, where given, gets each bucket's padded end in the NVFP4 buffer (`_packed_end`)."""
    divisor = math.lcm(dp, 128)
    spans: Spans = []
    buckets: Buckets = []
    start = bucket_start = in_bucket = end = cursor = 0  # cursor: in the packed buffer

    def close(param_end: int) -> int:
        nonlocal bucket_start, in_bucket, cursor
        padded = pad(param_end, divisor) if distributed else param_end
        buckets.append((bucket_start, padded, param_end - bucket_start))
        bucket_start, in_bucket = padded, 0
        if packed is not None:
            cursor = pad(cursor, divisor) if distributed else cursor
            packed.append(cursor)
        return padded

    for param, count in reversed(runs):
        shared = param.shared_embedding and distributed
        step = pad(param.numel, 64) if distributed else param.numel
        while count:
            start = pad(start, 64) if distributed else start
            if shared:  # a bucket of its own
                start = close(start) if in_bucket else start
                take, closes = 1, True
            else:
                take, closes = _placed_before_close(
                    start - bucket_start, param.numel, step, count, bucket_size)
            end = start + (take - 1) * step + param.numel
            cursor = _packed_end(cursor, param, take, distributed) if packed is not None else 0
            _add_spans(spans, start, take, step, param.numel, len(buckets))
            in_bucket, count = in_bucket + take, count - take
            start = close(end) if closes else end
    if in_bucket:
        close(end)
    return spans, buckets


def _packed_end(cursor: int, param: Any, take: int, distributed: bool) -> int:
    """Return the NVFP4 param buffer's end after `take` more of `param` (megatron-core 0.18+
    `_compute_nvfp4_packed_layout`: the same buckets, an NVFP4 weight at half its elements, each
    padded to 64 with the distributed optimizer)."""
    half = param.numel // 2 if param.nvfp4 else param.numel
    align = 64 if distributed else 1
    return pad(cursor, align) + (take - 1) * pad(half, align) + half


def buffer_layout(
    spans: Spans, buckets: Buckets, expert: bool, dtype: Any, grad_dtype: Any,
    distributed: bool, dp: int, kept: int = 0, shared: bool = False,
) -> BufferLayout:
    """Return one placed buffer as a BufferLayout, each rank's optimizer shard counted."""
    numel = buckets[-1][1]
    owned = (numel,) * dp
    if distributed:
        shards = [
            ParamShards("", 0, b, s, e, buckets[b][0], (buckets[b][1] - buckets[b][0]) // dp)
            for s, e, b in spans
        ]
        owned = owned_numel(shards, dp)
    return BufferLayout(
        expert=expert,
        param_dtype=dtype,
        grad_dtype=grad_dtype,
        dp_size=dp,
        numel=numel,
        numel_unpadded=sum(b[2] for b in buckets),
        buckets=tuple(BucketLayout(o, e - o, u) for o, e, u in buckets),
        owned_numel=owned,
        kept=kept,
        shared=shared,
    )


def _placed_before_close(
    offset: int, numel: int, step: int, count: int, bucket_size: int | None
) -> tuple[int, bool]:
    """Return how many of `count` equal parameters the open bucket takes, and whether it closes.

    The first starts `offset` elements into the bucket, the i-th (from 0) ends at offset + i x
    step + numel; the bucket closes after the first whose end reaches `bucket_size`.
    """
    if bucket_size is None:
        return count, False
    need = bucket_size - offset - numel
    if need <= 0:
        return 1, True
    if step == 0:  # empty parameters never fill a bucket
        return count, False
    first_full = -(-need // step)
    return (first_full + 1, True) if first_full < count else (count, False)


def _add_spans(
    spans: list[tuple[int, int, int]], start: int, count: int, step: int, numel: int, bucket: int
) -> None:
    """Append `count` parameters starting `step` apart, merging those that touch."""
    for index in range(1 if step == numel else count):
        first = start + index * step
        last = first + (count * numel if step == numel else numel)
        if spans and spans[-1][2] == bucket and spans[-1][1] == first:
            spans[-1] = (spans[-1][0], last, bucket)
        else:
            spans.append((first, last, bucket))
