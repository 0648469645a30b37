"""The bytes the CUDA caching allocator counts beyond what megatron's set-up asked for.

torch.cuda.memory_allocated (Megatron-LM's `mem-allocated-bytes`) sums the sizes of the blocks
in use, and a block can be larger than the request it serves (c10/cuda/CUDACachingAllocator.cpp):

- a request of more than 1 MiB (`kSmallSize`) comes from the large pool: the smallest cached free
  block that holds it (`get_free_block`, best fit), else a new segment of 20 MiB (`kLargeBuffer`)
  for requests under 10 MiB (`kMinLargeAlloc`) and of the request rounded up to 2 MiB
  (`kRoundLarge`) above (`get_allocation_size`);
- the block is split only where more than 1 MiB would remain (`should_split`: `remaining >
  kSmallSize` for the large pool): a remainder of at most 1 MiB stays in the block and is counted
  (`alloc_found_block`: `allocated_bytes` grows by `block->size`); requests of at most 1 MiB
  (the small pool) split down to 512 bytes, and with `expandable_segments:True` every block
  splits down to 512 bytes, so neither keeps a remainder;
- a freed block merges with its free neighbours in the same segment (`free_block`).

Megatron's set-up runs before any activation exists, in an order its code fixes, so the
allocator's state through it is known: the model's parameters as the model builds them; each
grad buffer megatron's DDP allocates (`_ParamAndGradBuffer.__init__`: the param buffer under
the distributed optimizer, then the grad buffer), the parameters' own storage freed once copied
into a param buffer; then, without the distributed optimizer, each 16-bit parameter's fp32 main
copy (`Float16OptimizerWithFloat16Params`: `param.detach().clone().float()`, the 16-bit clone
freed), dense parameter groups before expert ones, weight-decayed before the rest
(optimizer/__init__.py `_get_param_groups`, keys sorted None first). A block's size is fixed
when it is allocated, so what the set-up keeps stays true however the iteration reuses the
cache; what the first iteration allocates for good (Adam's moments, the distributed
optimizer's main shards) lands in blocks its activations left, not simulated here.

`torch_counts` is the one place the `memory` command, `check LOG` and bench/ci_goldens.py take
what torch.cuda.memory_allocated (Megatron-LM's `mem-allocated-bytes`, the log's `allocated`)
and max_memory_allocated (`mem-max-allocated-bytes`, `max allocated`) report from. The set-up's
tails are in both: its blocks live through the iteration. The blocks the iteration itself
allocates keep tails too while they live, but which cached block serves each request depends on
every earlier free, the schedule's interleaving included, which the engine does not replay
through this pool: not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inspector.memory.engine.allocator import BLOCK, rounded

if TYPE_CHECKING:
    from inspector.job.job import Training

SMALL_SIZE = 1 << 20  # kSmallSize: at most this comes from the small pool
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


@dataclass(eq=False)  # a block is itself: the pool finds it by identity (list.index, remove)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


@dataclass
class LargePool:
    """The caching allocator's large pool, one stream, as c10 allocates from it."""

    expandable: bool = False
    blocks: list[_Block] = field(default_factory=list)  # by (segment, offset)
    segments: int = 0

    def allocate(self, size: int) -> _Block | None:
        """Return the block serving a request of `size` bytes (None: the small pool's)."""
        size = rounded(size)
        if size <= SMALL_SIZE:
            return None
        fits = [b for b in self.blocks if b.free and b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment, b.offset))
        else:
            whole = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_LARGE) * ROUND_LARGE
            block = _Block(self.segments, 0, whole)
            self.segments += 1
            self.blocks.append(block)
        remaining = block.size - size
        if remaining >= BLOCK if self.expandable else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining)
            block.size = size
            self.blocks.insert(self.blocks.index(block) + 1, rest)
        block.free = False
        return block

    def free(self, block: _Block | None) -> None:
        """Free `block`, merged with its free neighbours in its segment."""
        if block is None:
            return
        block.free = True
        at = self.blocks.index(block)
        after = self.blocks[at + 1] if at + 1 < len(self.blocks) else None
        if after is not None and after.free and after.segment == block.segment:
            block.size += after.size
            self.blocks.remove(after)
        before = self.blocks[at - 1] if at > 0 else None
        if before is not None and before.free and before.segment == block.segment:
            before.size += block.size
            self.blocks.remove(block)


def tail_bytes(kept: Iterable[tuple[_Block | None, int]]) -> int:
    """Return what the kept blocks hold beyond their requests (each request rounded to 512)."""
    return sum(block.size - rounded(size) for block, size in kept if block is not None)


def setup_tails(chunks: Sequence[Any], distributed: bool, expandable: bool = False) -> int:
    """Return the bytes a rank's blocks hold beyond what megatron's set-up asked for, for a
    stage's built chunks (world/build.py BuiltChunk) under megatron's DDP.

    `distributed`: --use-distributed-optimizer (param buffers; its main shards not simulated);
    `expandable`: PYTORCH_CUDA_ALLOC_CONF's expandable_segments:True.
    """
    pool = LargePool(expandable)
    params = [(chunk, p) for chunk in chunks for p in chunk.module.parameters()]
    own = {id(p): (pool.allocate(_nbytes(p)), _nbytes(p)) for _, p in params}  # the build
    kept: list[tuple[_Block | None, int]] = []
    for chunk in chunks:  # DistributedDataParallel, chunk by chunk, buffer by buffer
        trained = [p for p in chunk.module.parameters() if p.requires_grad]
        for buffer in chunk.buffers():
            moved = distributed and buffer.param_buffer_bytes > 0
            if moved:
                kept.append((pool.allocate(buffer.param_buffer_bytes), buffer.param_buffer_bytes))
            grads = buffer.numel * buffer.grad_dtype.itemsize
            kept.append((pool.allocate(grads), grads))
            for p in trained if moved else ():  # copied into the param buffer, then freed
                if _is_expert(p) == buffer.expert and p.dtype == buffer.param_dtype:
                    pool.free(own.pop(id(p))[0])
    if not distributed:
        for p in _optimizer_order(params):  # each 16-bit parameter's fp32 main copy
            clone = pool.allocate(_nbytes(p))
            kept.append((pool.allocate(p.numel() * 4), p.numel() * 4))
            pool.free(clone)
    return tail_bytes([*own.values(), *kept])


def expandable_segments(conf: str | None) -> bool:
    """Return whether a PYTORCH_CUDA_ALLOC_CONF value turns on expandable segments (c10's
    CUDAAllocatorConfig reads `expandable_segments:True` from the comma-separated options)."""
    return "expandable_segments:True" in (conf or "").replace(" ", "").split(",")


def stage_tails(training: Training, chunks: Sequence[Any], expandable: bool) -> int:
    """Return the set-up's tails on a rank of the stage whose built chunks are `chunks` (the same
    on every rank of it: whole buffers, whole parameters); none under Megatron-FSDP or FSDP2,
    whose sharded buffers this replay does not follow."""
    if training.megatron_fsdp or training.torch_fsdp2:
        return 0
    return setup_tails(chunks, training.use_distributed_optimizer, expandable)


def torch_counts(stage: Any, state: Any = None) -> tuple[int, int]:
    """Return what torch.cuda.memory_allocated after the step and max_memory_allocated report on
    the rank of a stage (measure.py StageMemory; on one holding `state`, a StateBytes of another
    rank of the stage): the requests as the run counts them (RunMemory.torch_reports: not what
    is held outside PyTorch's allocator nor a captured CUDA graphs' pool), FSDP's gathered
    buffers released by the end of the iteration (in the peak only), plus the set-up's block
    tails. Without the run: static (FSDP's buffers released) and total."""
    held = (stage.state if state is None else state).total + stage.buffers - stage.fsdp_in_flight
    after, peak = (held, held + stage.activation_bytes) if stage.run is None else (
        stage.run.torch_reports(held))  # fmt: skip
    return after + stage.block_tails, peak + stage.fsdp_in_flight + stage.block_tails


def _nbytes(param: Any) -> int:
    return int(param.numel()) * int(param.element_size())


def _is_expert(param: Any) -> bool:
    """Return whether DDP puts `param` among the expert-parallel ones (`not param.allreduce`)."""
    return not getattr(param, "allreduce", True)


def _optimizer_order(params: Sequence[tuple[Any, Any]]) -> list[Any]:
    """Return the trained 16-bit parameters in the order Float16OptimizerWithFloat16Params copies
    them: the dense optimizer's before the expert one's, in each the weight-decayed group (no
    override) before the rest (biases and 1-D parameters), each group in the chunks' order."""
    names = {id(p): name for chunk in {id(c): c for c, _ in params}.values()
             for name, p in chunk.module.named_parameters()}  # fmt: skip

    def group(p: Any) -> tuple[bool, bool]:
        return _is_expert(p), names.get(id(p), "").endswith(".bias") or p.dim() == 1

    wanted = [p for _, p in params
              if p.requires_grad and p.is_floating_point() and p.element_size() == 2]  # fmt: skip
    return sorted(wanted, key=group)
