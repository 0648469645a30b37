"""A Megatron-LM training log, as `inspect-model check LOG` reads it: the memory report lines and
the iteration times.

The lines come from Megatron-LM (tag core_v0.16.1):
  - megatron/training/utils.py `report_memory`, printed by every rank of data-parallel rank 0
    after iteration 1 and 2 (and every --log-memory-interval):
      [Rank 0] (after 2 iterations) memory (MB) | allocated: 6577.72 | max allocated: 14970.03 |
      reserved: 15598.00 | max reserved: 15598.00   (one line)
    MB there is MiB (torch.cuda.memory_allocated() / 1024 / 1024); `max allocated` is the peak
    since the start of the process, so the last report of a rank holds its peak.
  - megatron/training/training.py `training_log`, printed by the last rank at iteration 1 and
    every --log-interval iterations, the mean over the interval:
      [2026-12-06 05:12:01.123456] iteration       10/     100 | consumed samples: ... |
      elapsed time per iteration (ms): 391.3 | ...   (one line)
    (later releases print `elapsed time per iteration (ms): 391.3/395.0`, the second the running
    mean; the first number is read.)
Anything before a match (a launcher's `0: ` or a timestamp) and every other line is skipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inspector.errors import InputError

# a number as Megatron-LM prints it ({:.1f}): digits, one optional fraction, then no letter, digit
# or dot (a '1e400' or '1.2.3' is not read as 1 or refused by float() with a traceback)
_NUMBER = r"(\d+(?:\.\d+)?)(?![\w.])"
MEMORY_LINE = re.compile(
    rf"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: {_NUMBER} \| "
    rf"max allocated: {_NUMBER} \| reserved: {_NUMBER} \| max reserved: {_NUMBER}"
)
ITERATION_LINE = re.compile(
    rf"iteration\s+(\d+)/\s*(?:\d+|infinity) \|.*?elapsed time per iteration \(ms\): {_NUMBER}"
)
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryLine:
    """One `report_memory` line: a rank's allocator after an iteration (bytes)."""

    rank: int
    iteration: int
    allocated: int
    max_allocated: int
    reserved: int
    max_reserved: int


@dataclass(frozen=True)
class TrainingLog:
    """What a training log says: each rank's last memory report, and each logged iteration time."""

    memory: tuple[MemoryLine, ...]  # the last report of each rank, by rank
    iterations: tuple[tuple[int, float], ...]  # (iteration, seconds per iteration), in log order
    cut: bool = False  # the file was longer than what was read

    def times_after(self, warmup: int) -> tuple[float, ...]:
        """Return the logged seconds per iteration of iterations after the first `warmup`."""
        return tuple(seconds for iteration, seconds in self.iterations if iteration > warmup)


def _bytes(mib: str) -> int:
    return round(float(mib) * MIB)


def parse_training_log(text: str, source: str, cut: bool = False) -> TrainingLog:
    """Return the memory reports and iteration times in a log's text, or raise InputError naming
    `source` when it holds neither."""
    last: dict[int, MemoryLine] = {}
    iterations: list[tuple[int, float]] = []
    for line in text.splitlines():
        if found := MEMORY_LINE.search(line):
            rank, iteration = int(found[1]), int(found[2])
            sizes = [_bytes(found[i]) for i in range(3, 7)]
            if rank not in last or iteration >= last[rank].iteration:
                last[rank] = MemoryLine(rank, iteration, *sizes)
        elif found := ITERATION_LINE.search(line):
            iterations.append((int(found[1]), float(found[2]) / 1000))
    if not last and not iterations:
        raise InputError(
            f"{source} has no Megatron-LM memory report (`[Rank R] (after N iterations) memory "
            "(MB) | allocated: ...`) and no `elapsed time per iteration (ms)` line"
        )
    return TrainingLog(tuple(last[r] for r in sorted(last)), tuple(iterations), cut)
