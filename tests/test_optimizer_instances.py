"""`--num-distributed-optimizer-instances N`: megatron shards the distributed optimizer within each
instance's dp x cp / N consecutive data-parallel ranks (parallel_state's partial data-parallel
groups) and all-reduces the gradients across instances (param_and_grad_buffer.py).

Re-derived from megatron-core's source: a rank's shard of each bucket is cut by the size of the
group it shards over (distrib_optimizer.py `_build_model_gbuf_range`, the buffer's
`data_parallel_world_size`), so dp 8 with 2 instances holds what dp 4 with one holds.
"""

from __future__ import annotations

import json

import pytest

MODEL = ("--model", "llama3-8b", "--num-layers", "2", "--tp", "2", "--bf16",
         "--seq-length", "1024", "--use-distributed-optimizer")  # fmt: skip


def _stage(cli, *flags: str) -> dict:
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def test_state_per_rank_is_one_over_dp_over_n(cli):
    # was: "--num-distributed-optimizer-instances 2 is not modelled"
    two = _stage(cli, "--dp", "8", "--num-distributed-optimizer-instances", "2")
    four = _stage(cli, "--dp", "8", "--num-distributed-optimizer-instances", "4")
    one = _stage(cli, "--dp", "8")
    assert two["optimizer"] == _stage(cli, "--dp", "4")["optimizer"]
    assert four["optimizer"] == _stage(cli, "--dp", "2")["optimizer"]
    assert one["optimizer"] < two["optimizer"] < four["optimizer"]
    # bf16 parameters: 12 bytes (fp32 master and two moments) per element, over dp / N ranks
    assert two["optimizer"] == pytest.approx(12 * two["parameters"] / 4, rel=1e-3)
    assert (two["weights"], two["gradients"]) == (one["weights"], one["gradients"])


def test_owners_are_ranks_of_one_instance(cli):
    result = cli("params", "--model", "llama3-8b", "--num-layers", "2", "--bf16", "--dp", "8",
                 "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                 "--partitioning", "distopt", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    owners = {o for p in json.loads(result.out)["parameters"] for o in p["partitioning_ranks"]}
    assert owners == {0, 1, 2, 3}  # positions in the instance's group of dp / N = 4 ranks


@pytest.mark.parametrize(("flags", "said"), [
    # megatron-core DistributedDataParallel
    (("--dp", "4", "--num-distributed-optimizer-instances", "2"),
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer (megatron-core "
     "DistributedDataParallel: \"Partial DistOpt cannot be used without DistOpt\")"),
    # parallel_state.initialize_model_parallel
    (("--dp", "6", "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "4"),
     "--num-distributed-optimizer-instances 4 does not divide the data-parallel size with context "
     "parallel (6 x 1 = 6; 6 % 4 = 2; parallel_state: \"Data parallel size should be divisible by "
     "partial DistOpt shard factor\")"),
    (("--dp", "4", "--num-distributed-optimizer-instances", "0"),
     "--num-distributed-optimizer-instances must be at least 1, got 0"),
])  # fmt: skip
def test_what_megatron_refuses(cli, flags, said):
    result = cli("memory", "--model", "llama3-8b", "--num-layers", "2", "--bf16",
                 "--micro-batch-size", "1", *flags)  # fmt: skip
    assert result.code == 2
    assert result.err.strip() == f"Error: {said}", result.err


@pytest.mark.parametrize("command", [
    ("plan", "--gpus", "8", "--global-batch-size", "8"),
    ("workload", "--dp", "8", "--micro-batch-size", "1", "--gpu-tflops", "989", "--stage", "0"),
])  # fmt: skip
def test_plan_and_workload_say_they_do_not_price_instances(cli, command):
    # plan searches (and workload writes the collectives of) one instance: never silently
    result = cli(*command, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                 "4", "--vocab-size", "1000", "--seq-length", "32", "--max-position-embeddings",
                 "32", "--bf16", "--use-distributed-optimizer",
                 "--num-distributed-optimizer-instances", "2")  # fmt: skip
    assert result.code == 2
    assert "--num-distributed-optimizer-instances" in result.err.splitlines()[-1], result.err
    assert result.err.startswith(f"Error: {command[0]} "), result.err
