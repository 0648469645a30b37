"""Which layers recompute, and how: megatron-core's activation checkpointing rules.

`recompute_plan` groups each model chunk's layers as `TransformerBlock._checkpointed_forward`
does, `recompute_buffer` sizes what backward rebuilds at once, `mtp_recompute` gives the
multi-token-prediction layers' mode. activations.py and the planner's pricing both read them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inspector.errors import ConfigError
from inspector.job.job import Recompute


def recompute_buffer(
    plan: list[list[tuple[Sequence[int], Recompute]]], layer_bytes: Callable[[int], float]
) -> float:
    """Return the bytes backward rebuilds at once: one checkpointed group, for one micro-batch.

    `layer_bytes(i)`: layer i's bytes without recomputation.
    """
    rebuilt = (
        sum(layer_bytes(i) for i in group) for chunk in plan for group, mode in chunk if mode == "full"
    )
    return max(rebuilt, default=0.0)


def mtp_recompute(recompute: Recompute, method: str) -> Recompute:
    """Return how the multi-token-prediction layers recompute.

    megatron-core `MultiTokenPredictionLayer._checkpointed_forward`: with `--recompute-method
    block` it warns "block is not supported for MTP yet. Skipping recompute." and runs the layer
    normally; `uniform` checkpoints it.
    """
    return "none" if recompute == "full" and method == "block" else recompute


def recompute_plan(
    stage: int,
    chunk_layers: Sequence[Sequence[int]],
    recompute: Recompute,
    method: str,
    num_layers: int,
) -> list[list[tuple[Sequence[int], Recompute]]]:
    """Return each chunk's layer groups and how each group keeps its activations.

    megatron-core `TransformerBlock._checkpointed_forward`, per model chunk of L layers:
    `uniform` checkpoints the input of every group of N consecutive layers (L must be a multiple
    of N: a partial group indexes past the chunk); `block` checkpoints layers 0..N-1 one at a time
    and runs the rest normally, keeping all their activations. Other modes: one group per layer.
    """
    if recompute != "full":
        return [[((i,), recompute) for i in chunk] for chunk in chunk_layers]
    plan: list[list[tuple[Sequence[int], Recompute]]] = []
    for index, chunk in enumerate(chunk_layers):
        layers = list(chunk)
        if method == "block":
            plan.append([((i,), "full" if k < num_layers else "none") for k, i in enumerate(layers)])
            continue
        if len(layers) % num_layers:
            raise ConfigError(
                f"--recompute-method uniform --recompute-num-layers {num_layers} does not divide "
                f"the {len(layers)} layers of stage {stage} chunk {index}: megatron-core "
                "checkpoints groups of N layers per chunk and fails on a partial group"
            )
        plan.append(
            [(layers[k : k + num_layers], "full") for k in range(0, len(layers), num_layers)]
        )
    return plan
