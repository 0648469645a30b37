"""How many layers each pipeline stage gets: a dynamic program, and the Megatron-LM flags for it.

A split is one layer count per virtual stage, in megatron's virtual-stage order (virtual stage
i = chunk x pp + pipeline rank; chunk 0 of every rank first), so layers are contiguous along it.
`balance` is the structure of Alpa's stage construction (Zheng et al. 2022, Section 5.2): a
dynamic program over contiguous layer ranges that minimises the slowest stage, here on computed
costs (the time model's per-layer seconds, the embedding on the first virtual stage and the
output layer and loss on the last, as megatron's --account-for-embedding/loss-in-pipeline-split
count them) instead of GPU profiles, with a per-stage memory cap on the layer count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import inspector.caches as caches
from inspector.job.pipeline_layout import expand_layout

Split = tuple[int, ...]


def even_split(layers: int, stages: int) -> Split | None:
    """Return the even split, or None when the layers do not divide."""
    return (layers // stages,) * stages if layers % stages == 0 else None


def accounted_split(layers: int, stages: int, embedding: bool, loss: bool) -> Split | None:
    """Return megatron's --account-for-embedding/loss split: each counts as one layer.

    The first (last) virtual stage may hold the embedding (output layer and loss) alone, as in
    Llama 3's 405B run; megatron builds such a chunk with no transformer layer.
    """
    counted = layers + embedding + loss
    if counted % stages:
        return None
    each = counted // stages
    split = [each] * stages
    split[0] -= embedding
    split[-1] -= loss
    inner = split[1:-1] if stages > 1 else split
    return tuple(split) if min(split) >= 0 and min(inner, default=1) >= 1 else None


@caches.memo(maxsize=4096)
def balance(
    layers: int, stages: int, first: float, last: float, caps: tuple[int, ...] | None = None
) -> Split | None:
    """Return the split minimising the slowest virtual stage, in units of one layer's cost.

    `first` / `last`: the extra cost of the first / last virtual stage (embedding; output layer
    and loss). `caps`: the most layers each virtual stage may hold (memory). DP over (stage j,
    layers placed i): best[j][i] = min over n of max(best[j-1][i-n], cost_j(n)).
    """
    inf = float("inf")
    # No stage of an optimal split holds more than the even split's slowest stage costs.
    most = min(layers, math.ceil(layers / stages + first + last))
    caps = tuple(min(c, most) for c in caps) if caps else (most,) * stages
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    choice = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        extra = (first if j == 1 else 0.0) + (last if j == stages else 0.0)
        before, row, picks, cap = best[j - 1], best[j], choice[j], caps[j - 1]
        costs = [n + extra for n in range(cap + 1)]
        for i in range(j, layers - (stages - j) + 1):
            # ties: the least n (later stages fuller: earlier stages hold more in flight)
            value_i, pick_i = inf, 0
            for n in range(1, min(cap, i - (j - 1)) + 1):
                cost = costs[n]
                if cost >= value_i - 1e-12:  # this n and every larger one cost no less
                    break
                prev = before[i - n]
                value = prev if prev > cost else cost
                if value < value_i - 1e-12:
                    value_i, pick_i = value, n
            row[i], picks[i] = value_i, pick_i
    if best[stages][layers] == inf:
        return None
    split, i = [], layers
    for j in range(stages, 0, -1):
        n = choice[j][i]
        split.append(n)
        i -= n
    return tuple(reversed(split))


def split_flags(
    split: Sequence[int], layers: int, pp: int, vpp: int, mtp: int = 0
) -> dict[str, object]:
    """Return the Megatron-LM arguments that give `split` (layout string as the fallback).

    `mtp`: the model's MTP depth; a layout string places that many `m` with the loss, as
    megatron's PipelineParallelLayerLayout requires of an MTP model.
    """
    flags: dict[str, object] = {}
    stages = pp * vpp
    if vpp > 1:
        flags["num_virtual_stages_per_pipeline_rank"] = vpp
    if tuple(split) == even_split(layers, stages):
        return flags
    for emb, loss in ((True, True), (True, False), (False, True)):
        if tuple(split) == accounted_split(layers, stages, emb, loss):
            if emb:
                flags["account_for_embedding_in_pipeline_split"] = True
            if loss:
                flags["account_for_loss_in_pipeline_split"] = True
            return flags
    middle = split[1:-1]
    if vpp == 1 and pp > 2 and len(set(middle)) == 1:
        if split[0] != middle[0]:
            flags["decoder_first_pipeline_num_layers"] = split[0]
        if split[-1] != middle[0]:
            flags["decoder_last_pipeline_num_layers"] = split[-1]
        return flags
    flags.pop("num_virtual_stages_per_pipeline_rank", None)
    parts = ["t" * n for n in split]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "m" * mtp + "L"
    flags["pipeline_model_parallel_layout"] = "|".join(parts)
    return flags


# Megatron-LM's flags that fix the layer split; `plan` keeps what the user gave (request.PIN)
PIN_FLAGS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "pipeline_model_parallel_layout",
)


def pinned_split(pin: Mapping[str, Any], layers: int, pp: int, vpp: int) -> Split | None:
    """Return the split megatron-core makes of the pinned flags at pp x vpp (None: it refuses).

    A layout string gives each virtual stage's `t`s; --decoder-first/last-pipeline-num-layers
    the end ranks' layers, the rest even over the middle ranks, each rank's layers even over its
    chunks (TransformerConfig's uneven-pipeline rules); the account flags count the embedding
    and the loss as a layer each (`accounted_split`).
    """
    text = pin.get("pipeline_model_parallel_layout")
    if text is not None:
        stages = expand_layout(text)
        return tuple(s.count("t") for s in stages) if len(stages) == pp * vpp else None
    first = pin.get("decoder_first_pipeline_num_layers")
    last = pin.get("decoder_last_pipeline_num_layers")
    if first is None and last is None:
        return accounted_split(
            layers, pp * vpp, bool(pin.get("account_for_embedding_in_pipeline_split")),
            bool(pin.get("account_for_loss_in_pipeline_split")),
        )
    middle = pp - (first is not None) - (last is not None)
    rest = layers - (first or 0) - (last or 0)
    if middle < 0 or rest < 0 or (middle == 0) != (rest == 0) or (middle and rest % middle):
        return None
    ranks = [rest // middle if middle else 0] * pp
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    if any(n % vpp for n in ranks):
        return None
    return tuple(ranks[r] // vpp for _ in range(vpp) for r in range(pp))


def chunk_layers(split: Sequence[int], pp: int, vpp: int) -> list[list[list[int]]]:
    """Return, per pipeline rank, each chunk's 0-based global layers."""
    out: list[list[list[int]]] = [[[] for _ in range(vpp)] for _ in range(pp)]
    start = 0
    for index, n in enumerate(split):
        chunk, rank = divmod(index, pp)
        out[rank][chunk] = list(range(start, start + n))
        start += n
    return out
