"""The layer-wise optimizer's parameter layout (megatron-core 0.18+ `--optimizer dist_muon`, and
`--optimizer muon --use-distributed-optimizer`, without --no-use-layer-wise-param-layout): which
rank owns which whole matrix, the DDP buffers' sizes and padding, each rank's optimizer bytes.
Run with /work/venvs/mc-0.19.2/bin/python -m pytest tests/test_muon_layout.py (0.16 and 0.13 skip
all but the version checks).

The expectations are re-derived here from megatron-core 0.19.2's source, not read from the tool:
Megatron-LM's training.py `wrap_model_chunks_with_ddp` tags each parameter
(layer_wise_optimizer.py `is_managed_by_layer_wise_optimizer`: 2-D and not the word embeddings or
output layer), which puts the matrices in a buffer of their own, and lays that buffer out with
`LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`: walking the parameters in
reverse, a bucket closes once it holds max(bucket size, 0.9 x dp x its largest matrix) elements;
its matrices, largest first, go each whole to the least loaded of dp shards (starts aligned to 64
elements), and every shard is padded to the largest, a multiple of lcm(64, lcm(dp, 128) / dp).
The other parameters get the DistributedOptimizer's layout (distrib_optimizer.py
`_compute_per_buffer_param_layout`: reverse order, starts aligned to 64, a bucket closed at the
bucket size and padded to a multiple of lcm(dp, 128), rank r updating the r-th of dp equal
slices). Per element a rank updates: the fp32 master copy of a bf16 weight (4 bytes), and Muon's
momentum (4) or Adam's two moments (8).
"""

from __future__ import annotations

import math

import pytest

from inspector.job.versions import megatron_version, muon_registry
from tests.test_muon import MODEL, _memory, _muon_taken, _params

needs_layout = pytest.mark.skipif(not muon_registry(), reason="megatron-core 0.18+'s layout")
MOE = ("--num-experts", "4", "--ep", "2", "--moe-ffn-hidden-size", "128", "--swiglu",
       "--disable-bias-linear")  # fmt: skip
_matrix = _muon_taken  # the same predicate: layer_wise_optimizer.py is_managed_by_layer_wise_optimizer


def _pad(value: int, divisor: int) -> int:
    return math.ceil(value / divisor) * divisor


def _matrix_layout(numels: list[int], dp: int, bucket: int | None) -> tuple[list[int], int]:
    """Return each matrix's shard (forward order) and the buffer's elements."""
    owner, end, chunk = [0] * len(numels), 0, []
    divisor = math.lcm(64, math.lcm(dp, 128) // dp)

    def emit() -> int:
        cursors = [0] * dp
        for i in sorted(chunk, key=lambda i: -numels[i]):  # reverse order kept among equals
            shard = cursors.index(min(cursors))
            owner[i] = shard
            cursors[shard] = _pad(cursors[shard], 64) + numels[i]
        return dp * _pad(max(cursors), divisor)

    for i in reversed(range(len(numels))):
        chunk.append(i)
        largest = max(numels[j] for j in chunk)
        if bucket is not None and sum(numels[j] for j in chunk) >= max(bucket, int(dp * largest * 0.9)):
            end, chunk = end + emit(), []
    if chunk:
        end += emit()
    return owner, end


def _adam_layout(numels: list[int], dp: int) -> tuple[list[int], int]:
    """Return each rank's elements of the DistributedOptimizer's one bucket, and its size."""
    spans, start = [], 0
    for numel in reversed(numels):
        start = _pad(start, 64)
        spans.append((start, start + numel))
        start += numel
    size = _pad(start, math.lcm(dp, 128))
    shard = size // dp
    owned = [sum(max(0, min(b, (r + 1) * shard) - max(a, r * shard)) for a, b in spans)
             for r in range(dp)]  # fmt: skip
    return owned, size


@needs_layout
@pytest.mark.parametrize("bucket", [None, 20000])
def test_each_matrix_is_whole_in_the_shard_megatron_packs_it_in(cli, bucket):
    # was: "--optimizer dist_muon is not modelled on this megatron-core without
    # --no-use-layer-wise-param-layout"
    dp = 4
    flags = ("--dp", str(dp), "--optimizer", "dist_muon")
    if bucket is not None:  # Megatron-LM buckets only with --overlap-grad-reduce
        flags += ("--overlap-grad-reduce", "--ddp-bucket-size", str(bucket))
    rows = _params(cli, *flags)
    matrices = [r for r in rows if _matrix(r)]
    owners, _ = _matrix_layout([r["numel"] for r in matrices], dp, bucket)
    assert [r["partitioning_ranks"] for r in matrices] == [[o] for o in owners]
    assert len(set(owners)) == dp  # every rank updates some matrix
    embedding = next(r for r in rows if r["name"] == "embedding.word_embeddings.weight")
    assert embedding["partitioning_ranks"] == list(range(dp))  # Adam's, cut into dp slices


@needs_layout
def test_the_buffers_and_each_ranks_optimizer_bytes(cli):
    dp = 4
    rows = _params(cli, "--dp", str(dp), "--optimizer", "dist_muon")
    matrices = [r["numel"] for r in rows if _matrix(r)]
    owners, matrix_buffer = _matrix_layout(matrices, dp, None)
    adam_owned, adam_buffer = _adam_layout([r["numel"] for r in rows if not _matrix(r)], dp)
    stage = _memory(cli, "--dp", str(dp), "--optimizer", "dist_muon")
    # bf16 weights in DDP's param buffers, fp32 gradients (Megatron-LM's default for bf16)
    assert stage["weights"] == 2 * (matrix_buffer + adam_buffer)
    assert stage["gradients"] == 4 * (matrix_buffer + adam_buffer)
    expected = {str(r): 12 * adam_owned[r] + 8 * sum(n for n, o in zip(matrices, owners) if o == r)
                for r in range(dp)}  # fmt: skip
    assert stage["optimizer_by_rank"] == expected
    assert stage["optimizer"] == max(expected.values())
    # every element is updated by one rank: Muon's 8 bytes, Adam's 12
    total = 8 * sum(matrices) + 12 * sum(r["numel"] for r in rows if not _matrix(r))
    assert sum(expected.values()) == total


@needs_layout
def test_megatrons_layer_wise_optimizer_gives_each_rank_the_matrices_of_its_shards(cli):
    # the optimizer megatron builds on those buffers (get_megatron_optimizer: a chain of
    # LayerWiseDistributedOptimizer, whose `_shard_params_from_layout` reads the layout, and the
    # DistributedOptimizer of the rest) agrees with the buffers the params table reads
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job
    from inspector.memory.engine.muon_stage import stage_muon

    flags = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                 max_position_embeddings=32, vocab_size=1000, bf16=True, data_parallel_size=4,
                 optimizer="dist_muon")  # fmt: skip
    args = merge_sources(Sources(flags=flags), ("model", "layout", "training")).args
    found = stage_muon(make_job(args), 0)
    rows = _params(cli, "--dp", "4", "--optimizer", "dist_muon")
    taken = {p.name: p.owner for p in found if p.muon}
    assert taken == {r["local_name"]: r["partitioning_ranks"][0] for r in rows if _matrix(r)}
    assert all(p.owner is None for p in found if not p.muon)  # the DistributedOptimizer's shards


@needs_layout
def test_expert_matrices_are_packed_over_the_expert_data_parallel_ranks(cli):
    # compute_full_param_layout: expert buffers are laid out over the expert data-parallel size
    rows = _params(cli, "--dp", "4", *MOE, "--optimizer", "dist_muon")
    experts = [r for r in rows if r["expert"] is not None]
    dense = [r for r in rows if r["expert"] is None and _matrix(r)]
    assert experts and all(len(r["partitioning_ranks"]) == 1 for r in experts)
    assert {r["partitioning_ranks"][0] for r in experts} == {0, 1}  # 4 / ep 2
    assert {r["partitioning_ranks"][0] for r in dense} == {0, 1, 2, 3}


@needs_layout
def test_muon_with_the_distributed_optimizer_is_the_same_job(cli):
    # core_v0.19.2 arguments.py validate_args: muon with --use-distributed-optimizer, and dist_muon
    # with or without it, are muon with use_layer_wise_distributed_optimizer (Megatron-LM's
    # functional test gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon_param_layout)
    # was: "--optimizer muon with --use-distributed-optimizer is not modelled on this megatron-core"
    dist = ("--dp", "4", "--optimizer", "dist_muon")
    spelled = ("--dp", "4", "--optimizer", "muon", "--use-distributed-optimizer")
    assert _memory(cli, *spelled) == _memory(cli, *dist)
    assert _params(cli, *spelled) == _params(cli, *dist)
    assert _params(cli, *dist, "--use-distributed-optimizer") == _params(cli, *dist)


@needs_layout
def test_the_layout_shards_more_than_the_legacy_deal(cli):
    # the legacy path (--no-use-layer-wise-param-layout) keeps every parameter whole, each on one
    # rank, in unpadded buffers without a param buffer; the layout shards Adam's parameters too
    dp = 4
    layout = _memory(cli, "--dp", str(dp), "--optimizer", "dist_muon")
    legacy = _memory(cli, "--dp", str(dp), "--optimizer", "dist_muon", "--no-use-layer-wise-param-layout")
    assert layout["gradients"] >= legacy["gradients"]  # the same elements, and padding
    assert max(layout["optimizer_by_rank"].values()) < max(legacy["optimizer_by_rank"].values())


@needs_layout
def test_memory_says_which_optimizer_runs(cli):
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--dp", "2", "--optimizer", "dist_muon")
    assert result.code == 0, result.err
    assert "Muon, layer-wise (each matrix whole in one rank's shard of DDP's buffers; a " \
        "distributed optimizer's Adam for the rest)" in result.out
    assert "optimizer state " in result.out and "on data-parallel rank" not in result.out


@needs_layout
def test_the_param_all_gather_may_overlap(cli):
    # core_v0.19.2 validate_args: "--overlap-param-gather only supported with distributed
    # optimizer, megatron fsdp, or dist_muon"; the layout all-gathers DDP's param buffers
    plain = _memory(cli, "--dp", "2", "--optimizer", "dist_muon", "--overlap-grad-reduce")
    overlapped = _memory(cli, "--dp", "2", "--optimizer", "dist_muon", "--overlap-grad-reduce",
                         "--overlap-param-gather")  # fmt: skip
    assert overlapped["optimizer_by_rank"] == plain["optimizer_by_rank"]


@needs_layout
def test_several_optimizer_instances_are_refused(cli):
    # core_v0.19.2 layer_wise_optimizer.py LayerWiseDistributedOptimizer.__init__ asserts it
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--dp", "4", "--optimizer", "muon",
                 "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2")  # fmt: skip
    assert result.code == 2
    assert result.err.strip() == (
        "Error: --num-distributed-optimizer-instances 2 with the layer-wise optimizer (--optimizer "
        "muon) is refused by megatron-core (layer_wise_optimizer.py: \"LayerWiseDistributedOptimizer "
        "does not support num_distributed_optimizer_instances > 1.\")"), result.err


@pytest.mark.skipif(megatron_version() not in ((0, 16), (0, 17)), reason="0.16-0.17")
def test_releases_before_the_layout_deal_whole_matrices(cli):
    # core_v0.16.1 / core_v0.17.1 layer_wise_optimizer.py: no layout, shard_params' ping-pong deal
    rows = _params(cli, "--dp", "4", "--optimizer", "dist_muon")
    assert all(len(r["partitioning_ranks"]) == 1 for r in rows)  # Adam's parameters too
