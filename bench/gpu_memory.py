"""The engine against the GPU: predicted vs measured memory of every probed rank.

    .venv/bin/python bench/gpu_memory.py [PATH/TO/shared/gpu]

Two sets of runs, each Megatron-LM's pretrain_gpt.py with one process per rank: shared/gpu's
memory-h200.json (its launch scripts in shared/gpu/jobs, on an H200) and this repository's
bench/gpu-h100/memory-h100.json (the launch scripts in bench/gpu_jobs, run by shared/gpu's harness
on an H100; bench/RESULTS.md says how). For each run that finished: the static memory after an iteration (weights, grads and optimizer state from megatron's
DDP buffers for the rank's shard, plus what the engine finds persisting and the cuBLAS
workspaces) against `memory_allocated` after step 3, and the peak (static plus the engine's
schedule peak) against `max_memory_allocated`, both as `memory` reports what torch.cuda counts
(memory/segments.py `torch_counts`: the caching allocator's set-up block tails included). Run it
from the repository root with PYTHONPATH=. to measure this checkout. `make bench` appends the table to RESULTS.md.
Nothing here is fitted to these numbers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GPU = HERE.parent.parent / "shared" / "gpu"
H100 = (HERE / "gpu-h100" / "memory-h100.json", HERE / "gpu_jobs")


def probed_ranks(records: Path, jobs: Path) -> Iterator[tuple[dict[str, Any], Any, int, Any]]:
    """Yield each finished run's record, its job (read from its launch script), the pipeline
    stage of its probed rank, and that stage built (world/build.py's BuiltJob)."""
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job
    from inspector.world.build import View, build

    for run in json.loads(records.read_text())["runs"]:
        if run["rc"] != 0:
            continue
        script = str(jobs / f"{run['job']}.sh")
        job = make_job(merge_sources(Sources(script=script), ("model", "layout", "training")).args)
        layout = job.layout
        stage = run["rank"] // (layout.tp * layout.cp * layout.dp)
        yield run, job, stage, build(job, View((stage,)), expert_ranks=(0,))


def rows(records: Path, jobs: Path) -> list[str]:
    """Return one markdown row per probed rank."""
    from inspector.memory.measure import Hardware, job_optimizer_bytes, measure, state_bytes
    from inspector.memory.segments import torch_counts

    out = []
    for run, job, stage, built in probed_ranks(records, jobs):
        buffers = [b for chunk in built.chunks for b in chunk.buffers()]
        state = state_bytes(buffers, job.training.use_distributed_optimizer, 0, 0,
                            job_optimizer_bytes(job))  # fmt: skip
        memory = measure(built, Hardware()).stages[0]
        assert memory.run is not None, f"{run['job']}: the engine did not run"
        # what torch.cuda counts, as `memory` and `check LOG` report it (memory/segments.py)
        static, peak = torch_counts(memory, state)
        last = run["probes"][-1]
        out.append(
            f"| {run['job']} | {run['rank']} | {stage} | {_gib(static)} | {_gib(last['allocated'])} "
            f"| {static / last['allocated']:.4f} | {_gib(peak)} | {_gib(last['max_allocated'])} "
            f"| {peak / last['max_allocated']:.4f} | {memory.run.peak.moment} |"
        )
    return out


def table(gpu: Path = GPU) -> str:
    """Return the comparisons as markdown: the H200 runs (where shared/gpu is), the H100 runs."""
    head = [
        "| job | rank | stage | static predicted GiB | static measured GiB | ratio "
        "| peak predicted GiB | peak measured GiB | ratio | moment of the peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    out = []
    if (gpu / "memory-h200.json").exists():
        out += ["Memory, the engine against the H200 (shared/gpu/memory-h200.json, bench/gpu_memory.py):",
                "", *head, *rows(gpu / "memory-h200.json", gpu / "jobs"), ""]  # fmt: skip
    out += ["Memory, the engine against the H100 (bench/gpu-h100/memory-h100.json, bench/gpu_memory.py):",
            "", *head, *rows(*H100)]  # fmt: skip
    return "\n".join(out) + "\n"


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


if __name__ == "__main__":
    sys.stdout.write(table(Path(sys.argv[1]) if len(sys.argv) > 1 else GPU))
