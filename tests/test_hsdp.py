"""HSDP: `--use-megatron-fsdp` with `--num-distributed-optimizer-instances N`.

Re-derived from megatron-core's source: mcore_fsdp_adapter.py `_init_dist_index` (0.14+; 0.13's
custom_fsdp the same) gives Megatron-FSDP, when `num_distributed_optimizer_instances > 1`, the
intra partial data-parallel group `get_data_parallel_group(with_context_parallel=True,
partial_data_parallel=True)` to shard over (and, 0.17+, the partial expert data-parallel group),
the inter-instance group only to all-reduce the gradients across: its buffers
(`_init_each_parameter_group_buffers`, `data_parallel_group=main_buf_dp_group`, the FSDP group
with the default --outer-dp-sharding-strategy no_shard) are cut by dp x cp / N ranks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from inspector.job.versions import hsdp_expert_groups
from tests.test_fsdp import F, P, strategy


def _partial_sizes(world: int, instances: int, ep: int = 1) -> tuple[int, int]:
    """Return megatron's intra partial (dense, expert) data-parallel group sizes in a fake world."""
    import torch
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=ep,
                                     num_distributed_optimizer_instances=instances,
                                     create_gloo_process_groups=False)  # fmt: skip
        dense = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
        expert = ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
        return dense.size(), expert.size()
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_each_rank_holds_one_over_dp_over_n_of_every_buffer():
    # was: "--num-distributed-optimizer-instances 2 with --use-megatron-fsdp (HSDP) is not modelled"
    inner, _ = _partial_sizes(8, 2)
    assert inner == 4
    hsdp = strategy("optim_grads_params", 8, "--num-distributed-optimizer-instances", "2")
    four = strategy("optim_grads_params", inner)
    held = ("weights", "gradients", "optimizer", "buffers", "total")
    assert [hsdp[k] for k in held] == [four[k] for k in held]  # dp 8 in 2 instances: dp 4's
    # by hand: each bucket (the parameters outside the layers, one per TransformerLayer) padded
    # to a multiple of the 4 ranks x its longest row (F): a rank holds P / 4 plus under F each
    for key, size in (("weights", 2), ("gradients", 4), ("optimizer", 12)):
        elements = hsdp[key] / size
        assert P / inner <= elements < P / inner + 3 * F, (key, elements)
    assert hsdp["weights"] > strategy("optim_grads_params", 8)["weights"]


def _moe_job(instances: int) -> Any:
    from inspector.job.job import make_job

    return make_job(dict(
        transformer_impl="local", num_layers=2, hidden_size=64, num_attention_heads=4,
        seq_length=32, vocab_size=1000, bf16=True, data_parallel_size=8, num_experts=4,
        moe_router_topk=2, expert_model_parallel_size=2, disable_bias_linear=True,
        use_megatron_fsdp=True,
        use_distributed_optimizer=True, ckpt_format="fsdp_dtensor",
        data_parallel_sharding_strategy="optim_grads_params",
        num_distributed_optimizer_instances=instances,
    ))  # fmt: skip


def test_buckets_shard_over_megatrons_partial_groups():
    from inspector.errors import ConfigError
    from inspector.world.build import build, select_view

    if not hsdp_expert_groups():  # megatron-core 0.14-0.16: its HSDP mesh has no expert group
        with pytest.raises(ConfigError, match="HSDP device mesh has no expert data-parallel"):
            _moe_job(2)
        return
    dense, expert = _partial_sizes(8, 2, ep=2)
    job = _moe_job(2)
    (chunk,) = build(job, select_view(job)).chunks
    sizes = {bucket.expert: bucket.dp for bucket in chunk.fsdp().buckets}
    assert sizes == {False: dense, True: expert} == {False: 4, True: 2}


def test_what_megatron_refuses():
    from tests.conftest import run_cli
    from tests.test_fsdp import MFSDP, TINY

    # parallel_state.initialize_model_parallel: the partial groups must divide dp x cp
    result = run_cli("memory", *TINY, *MFSDP, "--dp", "6", "--num-distributed-optimizer-instances", "4")
    assert result.code == 2
    assert result.err.strip() == (
        "Error: --num-distributed-optimizer-instances 4 does not divide the data-parallel size "
        "with context parallel (6 x 1 = 6; 6 % 4 = 2; parallel_state: \"Data parallel size "
        "should be divisible by partial DistOpt shard factor\")"
    ), result.err


@pytest.mark.parametrize("name", ["no_shard", "optim_grads_params"])
def test_owners_are_positions_in_one_instance(name):
    from tests.conftest import run_cli
    from tests.test_fsdp import MFSDP, TINY

    flags = ("--dp", "8", "--num-distributed-optimizer-instances", "2")
    result = run_cli("params", *TINY[:-3], "--bf16", *MFSDP, *flags, "--partitioning", "distopt",
                     "--data-parallel-sharding-strategy", name, "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    owners = {o for p in json.loads(result.out)["parameters"] for o in p["partitioning_ranks"]}
    assert owners == {0, 1, 2, 3}  # the intra partial group of dp / N = 4 ranks
