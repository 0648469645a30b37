"""The caching allocator's blocks beyond megatron's set-up requests (inspector/memory/segments.py).

Each rule is c10/cuda/CUDACachingAllocator.cpp's, re-derived here by hand: a segment of the
request rounded up to 2 MiB above 10 MiB (20 MiB under), a block split only where more than
1 MiB remains (512 bytes with expandable segments), best fit among cached free blocks, frees
merged with free neighbours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.memory.segments import LargePool, setup_tails, tail_bytes

MiB = 1 << 20


def test_a_large_request_keeps_a_segment_tail_of_at_most_one_mib() -> None:
    pool = LargePool()
    grads = 89_511_936  # the tp2 pp2 case's last-stage fp32 grad buffer (85.37 MiB)
    block = pool.allocate(grads)
    assert block is not None and block.size == 86 * MiB  # rounded up to 2 MiB, not split
    assert tail_bytes([(block, grads)]) == 86 * MiB - grads == 665_600


def test_a_remainder_over_one_mib_is_split_off() -> None:
    pool = LargePool()
    weight = 25_216 * 512 * 2  # 25,821,184 B: a 26 MiB segment, 1,441,792 B left
    block = pool.allocate(weight)
    assert block is not None and block.size == weight
    assert tail_bytes([(block, weight)]) == 0


def test_expandable_segments_and_the_small_pool_keep_no_tail() -> None:
    expandable = LargePool(expandable=True)
    block = expandable.allocate(89_511_936)
    assert block is not None and block.size == 89_511_936
    assert LargePool().allocate(MiB) is None  # at most 1 MiB: the small pool, split to 512 B


def test_requests_under_ten_mib_share_a_20_mib_segment_and_its_last_block() -> None:
    pool = LargePool()
    blocks = [pool.allocate(3 * MiB // 2) for _ in range(13)]
    assert pool.segments == 1
    # 12 x 1.5 MiB leave 2 MiB; the 13th leaves 0.5 MiB, not split off: a 2 MiB block
    assert [b.size for b in blocks if b is not None][-2:] == [3 * MiB // 2, 2 * MiB]


def test_frees_merge_and_the_smallest_free_block_that_fits_serves() -> None:
    pool = LargePool()
    big, small = pool.allocate(40 * MiB), pool.allocate(12 * MiB)
    pool.free(small)
    pool.free(big)
    assert sorted(b.size for b in pool.blocks if b.free) == [12 * MiB, 40 * MiB]
    again = pool.allocate(11 * MiB)  # best fit: the 12 MiB segment, 1 MiB left stays in it
    assert again is not None and again.segment == 1 and again.size == 12 * MiB
    pool.free(again)
    a, b = pool.allocate(5 * MiB), pool.allocate(5 * MiB)  # both in the freed 12 MiB segment
    assert a is not None and b is not None and (a.segment, b.segment) == (1, 1)
    pool.free(a)
    pool.free(b)  # merged back with its neighbours: the whole segment free again
    assert sorted(b.size for b in pool.blocks if b.free) == [12 * MiB, 40 * MiB]


def hand_made_job(folder: Path) -> Path:
    """Write the tp2 pp2 GPT job (12 layers, hidden 512, tied embeddings, bf16, no distributed
    optimizer) whose last stage's tails are re-derived by hand below; run it with --dp 2."""
    config = folder / "job.yaml"
    config.write_text(
        "MODEL_ARGS:\n  --num-layers: 12\n  --hidden-size: 512\n  --num-attention-heads: 8\n"
        "  --seq-length: 1024\n  --max-position-embeddings: 1024\n  --micro-batch-size: 4\n"
        "  --global-batch-size: 32\n  --tensor-model-parallel-size: 2\n"
        "  --pipeline-model-parallel-size: 2\n  --bf16: true\n"
        "  --transformer-impl: transformer_engine\n"
    )
    return config


LAST_STAGE_TAILS = 665_600 + 786_432  # the fp32 grad buffer's and the output layer's main copy's


@pytest.mark.slow
def test_megatrons_setup_keeps_the_grad_buffer_and_main_copy_tails(tmp_path) -> None:
    """The last stage of a tp2 pp2 GPT (12 layers, hidden 512, tied embeddings) without the
    distributed optimizer: its 16-bit parameters keep their own storage (the output layer's,
    25,821,184 B, splits), the fp32 grad buffer keeps 665,600 B, and the output layer's fp32
    main copy (51,642,368 B in a 50 MiB segment) keeps 786,432 B."""
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job
    from inspector.world.build import View, build

    config = hand_made_job(tmp_path)
    args = merge_sources(Sources(config_file=str(config), flags={"data_parallel_size": 2}),
                         ("model", "layout", "training")).args  # fmt: skip
    job = make_job(args)
    chunks = build(job, View((1,))).stages[0].chunks
    grads = sum(b.numel * b.grad_dtype.itemsize for c in chunks for b in c.buffers())
    assert grads == 89_511_936
    assert setup_tails(chunks, distributed=False) == LAST_STAGE_TAILS
    assert setup_tails(chunks, distributed=False, expandable=True) == 0


@pytest.mark.slow
def test_memory_reports_what_torch_cuda_counts_tails_included(cli, tmp_path, monkeypatch) -> None:
    """`memory` gives torch.cuda's two figures beside the requested bytes: the last stage's
    static and peak plus the tails derived by hand above (no bytes outside PyTorch's allocator,
    no CUDA graphs, fp32 main grads: nothing else between them); with expandable segments none."""
    config = str(hand_made_job(tmp_path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    result = cli("memory", "--config", config, "--dp", "2", "--format", "json")
    assert result.code == 0, result.err
    last = json.loads(result.out)["stages"][1]
    assert last["torch_allocated"] == {
        "after_step": last["static"] + LAST_STAGE_TAILS, "max": last["total"] + LAST_STAGE_TAILS,
        "block_tails": LAST_STAGE_TAILS, "expandable_segments": False}  # fmt: skip
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8,expandable_segments:True")
    result = cli("memory", "--config", config, "--dp", "2")
    assert result.code == 0, result.err
    line = next(x for x in result.out.splitlines() if x.startswith("Stage 1: torch.cuda"))
    assert line.endswith("; PYTORCH_CUDA_ALLOC_CONF's expandable segments size every block to its "
                         "request."), line  # fmt: skip
