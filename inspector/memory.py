"""What each rank holds in memory for its parameters: weights, gradients and Adam state, exactly.

Megatron-LM's mixed-precision training keeps, per parameter element on a rank:
- weights in the parameter dtype (bf16/fp16: 2 bytes, fp32: 4);
- gradients in megatron's grad buffer: fp32 when `--bf16` (Megatron-LM sets
  accumulate_allreduce_grads_in_fp32 for bf16), else the parameter dtype;
- Adam: two fp32 moments (8 bytes), plus an fp32 master copy (4 bytes) of 16-bit parameters.
With `--use-distributed-optimizer` the weight and grad buffers are megatron's own padded buffers
(every rank allocates them whole), and the master weights and moments cover only the elements
of the rank's shard (`owned_numel`, from megatron's DistributedDataParallel layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_MOMENTS = 8  # exp_avg + exp_avg_sq, fp32
MASTER_COPY = 4  # fp32 main params of 16-bit model params


@dataclass(frozen=True)
class StateBytes:
    """One rank's parameter-related memory, in bytes."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        """Return the sum of the three."""
        return self.weights + self.gradients + self.optimizer

    def __add__(self, other: StateBytes) -> StateBytes:
        return StateBytes(
            self.weights + other.weights,
            self.gradients + other.gradients,
            self.optimizer + other.optimizer,
        )


NOTHING = StateBytes(0, 0, 0)


def grad_bytes(dtype: str) -> int:
    """Return the bytes of one gradient element as Megatron-LM keeps it for this param dtype."""
    return 4 if dtype in ("bfloat16", "float32") else ELEMENT_BYTES[dtype]


def optimizer_bytes(dtype: str) -> int:
    """Return Adam's bytes per parameter element: moments, plus a master copy for 16-bit params."""
    return ADAM_MOMENTS + (MASTER_COPY if dtype != "float32" else 0)


def replicated_state(numels_by_dtype: dict[str, int]) -> StateBytes:
    """Return the state of a rank holding these parameters whole (no distributed optimizer)."""
    state = NOTHING
    for dtype, numel in numels_by_dtype.items():
        state += StateBytes(
            numel * ELEMENT_BYTES[dtype], numel * grad_bytes(dtype), numel * optimizer_bytes(dtype)
        )
    return state


def sharded_state(buffers: Sequence[object], shard_index: int) -> StateBytes:
    """Return the state one rank holds for megatron's distributed-optimizer buffers.

    `buffers` are distopt.BufferLayout objects; weights and grads are the whole padded buffers,
    the optimizer state covers this rank's owned elements only.
    """
    state = NOTHING
    for buffer in buffers:
        param = str(buffer.param_dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        grad = str(buffer.grad_dtype).removeprefix("torch.")  # type: ignore[attr-defined]
        numel = buffer.numel  # type: ignore[attr-defined]
        owned = buffer.owned_numel[shard_index]  # type: ignore[attr-defined]
        state += StateBytes(
            numel * ELEMENT_BYTES[param],
            numel * ELEMENT_BYTES[grad],
            owned * optimizer_bytes(param),
        )
    return state
