"""The plain records commands produce from built stages: module trees and parameters.

No torch, no megatron: the table writer and reader, diff and the renderers import these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleNode:
    """One module of the tree: its class name and its children in registration order."""

    class_name: str
    children: tuple[tuple[str, ModuleNode], ...]


@dataclass(frozen=True)
class ParamRecord:
    """One parameter as one rank of its stage holds it."""

    stage: int
    chunk: int
    local_name: str  # megatron's named_parameters() name: local layer / expert indices
    name: str  # global layer and expert numbers: unique across the whole model
    module: str  # the owning module's one-line description
    shape: tuple[int, ...]  # local shape on one rank (after tensor/expert sharding)
    global_shape: tuple[int, ...]
    dtype: str
    tensor_parallel: bool
    partition_dim: int | None
    tied: bool  # the last stage's copy of word embeddings tied to the output layer
    embedding: bool  # a word/position embedding table (or its tied copy): no preconditioner
    layer: int | None  # 0-based global layer number, None outside the transformer layers
    expert: int | None  # global expert number
    expert_rank: int | None  # expert-parallel rank holding it (None for non-expert parameters)
    # a Transformer Engine quantized weight (fp8 / MXFP8 parameters): the bytes of the tensors it
    # stores (data, transposes, scales; world/te/float8_tensor.py `stored_bytes`), else None
    stored: int | None = None
    # False for a parameter that needs no gradient (LoRA's frozen model, world/lora.py): no grad
    # buffer, no optimizer work, so no owner and no preconditioner
    trainable: bool = True

    @property
    def numel(self) -> int:
        """Return the number of elements on one rank."""
        count = 1
        for d in self.shape:
            count *= d
        return count


@dataclass(frozen=True)
class StageTree:
    """One stage's (one chunk's) module tree, and whether it is shown under a `# stage` line."""

    stage: int
    chunk: int | None  # None without a virtual pipeline
    root: ModuleNode
    headed: bool  # False when the whole model is this one tree (pp 1, no chunks)


@dataclass(frozen=True)
class MemoryPass:
    """One pass of a rank's iteration as the engine replays it (memory/engine/timeline.py).

    A forward or backward of one micro-batch of one chunk, or a phase after them (the optimizer
    step): the allocator's events while it runs, above the static memory and the activations
    other micro-batches in flight hold beneath it.
    """

    label: str  # "forward of micro-batch 0 (chunk 1)", "backward of micro-batch 0"
    owner: tuple[int, int]  # (chunk, micro-batch) whose allocations these are; (-1, n) for a phase
    held: int  # bytes other micro-batches in flight hold beneath the pass
    steps: tuple[tuple[int, int, str], ...]  # (bytes, allocated after, where): bytes < 0 frees
