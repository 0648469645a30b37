"""Megatron-FSDP jobs as SimAI workloads (issue #29): each strategy's collectives, groups and bytes.

The bytes are worked out here from the model's shapes (tests/test_fsdp.py's hand list) and
megatron-core 0.16.1's padding (param_and_grad_buffer.py `_pad_if_needed`: a bucket's elements
rounded up to a multiple of dp x its longest row, fc2's F elements in a layer's bucket, H in the
embedding's). Every file is read back by the strict reader of SimAI's rules, and every
collective's group is sized as SimAI-Analytical sizes it (test_simai_groups.simai_size).
"""

from __future__ import annotations

import math

import pytest

from inspector.inputs.versions import megatron_core_version
from inspector.report.simai import NONE, Header, Record, parse_workload
from tests.conftest import run_cli
from tests.test_fsdp import FSDP2, LAYER, MFSDP, TINY, F, H, P, S, V
from tests.test_simai_groups import simai_size

GA = 2  # --global-batch-size 8 over dp 4 at micro-batch 1
JOB = [*TINY, *MFSDP, "--gpu-tflops", "100"]
NOTE = ("Note: SimAI runs Megatron-FSDP's parameter all-gathers and gradient reduce-scatters in "
        "the weight-gradient column, adds them up and overlaps none of them: megatron prefetches "
        "the next unit's all-gather behind the current unit's compute and reduce-scatters behind "
        "the backward (docs/simai.md)\n")  # fmt: skip


def pad(elements: int, row: int, dp: int = 4) -> int:
    """Return a bucket's padded elements: megatron-core 0.16 pads to a multiple of dp x its
    longest row, 0.13 (custom_fsdp) to a multiple of lcm(dp, 128) (test_fsdp.py checks both)."""
    from megatron.core import __version__

    old = tuple(int(p) for p in __version__.split(".")[:2]) < (0, 16)
    multiple = math.lcm(dp, 128) if old else dp * row
    return -(-elements // multiple) * multiple


LAYER_N = sum(rows * row for rows, row in LAYER)  # one TransformerLayer unit
OUTSIDE = V * H + S * H + 2 * H  # embeddings and the final LayerNorm (the output layer is tied)


def workload(*args: str, batch: int = 8, stage: int = 0) -> tuple[Header, list[Record]]:
    result = run_cli("workload", *JOB, "--global-batch-size", str(batch), *args, "--stage",
                     str(stage))  # fmt: skip
    assert result.code == 0, result.err
    assert result.err.startswith(NOTE)  # an MoE job's dispatcher note follows (test_simai_groups)
    return parse_workload(result.out)


def data_parallel(header: Header, records: list[Record]) -> list[tuple[str, str, int]]:
    """Return (name, collective, bytes) of every weight-gradient collective, in file order."""
    found = []
    for record in records:
        if record.wg_comm != NONE:
            # SimAI-Analytical sizes forward and input-gradient groups as tp or ep (Layer.cc
            # 576-587): data-parallel collectives go in the weight-gradient column alone
            assert (record.fwd_comm, record.ig_comm) == (NONE, NONE)
            found.append((record.name, record.wg_comm, record.wg_bytes))
    return found


def test_no_shard_all_reduces_the_unpadded_gradients_once():
    header, records = workload("--dp", "4", "--data-parallel-sharding-strategy", "no_shard")
    assert (header.ga, header.all_gpus) == (GA, 4)
    # no parameter gather; fp32 gradients, no padding under no_shard
    assert data_parallel(header, records) == [("grad_param_comm", "ALLREDUCE", 4 * P)]
    assert simai_size(header, "ALLREDUCE", "wg") == 4  # dp x cp


def test_optim_gathers_and_reduce_scatters_once():
    header, records = workload("--dp", "4", "--data-parallel-sharding-strategy", "optim")
    whole = pad(P, F)  # one bucket (no --overlap-grad-reduce), fc2's rows the longest
    assert data_parallel(header, records) == [
        ("grad_gather", "ALLGATHER", 2 * whole),
        ("grad_param_comm", "REDUCESCATTER", 4 * whole),
    ]


def test_optim_grads_reduce_scatters_every_micro_batch():
    header, records = workload("--dp", "4", "--data-parallel-sharding-strategy", "optim_grads")
    whole = pad(P, F)
    assert data_parallel(header, records) == [
        ("grad_gather", "ALLGATHER", 2 * whole),
        *[("fsdp_grad_reduce", "REDUCESCATTER", 4 * whole)] * GA,
    ]


def test_optim_grads_params_gathers_each_layer_twice_per_micro_batch():
    header, records = workload("--dp", "4", "--data-parallel-sharding-strategy",
                               "optim_grads_params")  # fmt: skip
    unit = pad(LAYER_N, F)
    layer = [("fsdp_param_gather", "ALLGATHER", 2 * unit),
             ("fsdp_param_regather", "ALLGATHER", 2 * unit),
             ("fsdp_grad_reduce", "REDUCESCATTER", 4 * unit)]  # fmt: skip
    outside = pad(OUTSIDE, H)  # gathered once per step, kept until the step
    block = [*layer, *layer, ("fsdp_grad_reduce", "REDUCESCATTER", 4 * outside)]
    assert data_parallel(header, records) == [("grad_gather", "ALLGATHER", 2 * outside),
                                              *block * GA]  # fmt: skip
    # each layer's gather just before its records, the backward's gather and reduce just after
    names = [r.name for r in records]
    start = names.index("embedding_layer")
    assert names[start:start + 6] == ["embedding_layer", "fsdp_param_gather", "attention_layer",
                                      "mlp_layer", "fsdp_param_regather", "fsdp_grad_reduce"]  # fmt: skip


def test_context_parallel_ranks_share_the_dense_buckets():
    # megatron shards dense buckets over dp x cp (mcore_fsdp_adapter dp_cp_group); SimAI's DP
    # group is all_gpus / (tp pp) = dp x cp: cp 2 x dp 2 moves what dp 4 moves, on 4 ranks
    args = ("--tp", "2", "--sequence-parallel", "--data-parallel-sharding-strategy",
            "optim_grads_params", "--transformer-impl", "transformer_engine")  # fmt: skip
    header, records = workload("--dp", "2", "--context-parallel-size", "2", *args, batch=4)
    fsdp = data_parallel(header, records)
    assert fsdp == data_parallel(*workload("--dp", "4", *args))
    assert len(fsdp) == 1 + (2 * 3 + 1) * GA
    assert {simai_size(header, comm, "wg") for _, comm, _ in fsdp} == {4}


def test_expert_buckets_run_on_the_expert_data_parallel_group():
    # ep 2 of dp 4: megatron shards expert buckets over tp cp dp / (ep etp) = 2 ranks, SimAI's
    # DP_EP group holds all_gpus / (tp pp) / ep = 2; two local experts of (F, H) + (H, F) each
    header, records = workload("--dp", "4", "--num-experts", "4", "--ep", "2",
                               "--disable-bias-linear", "--data-parallel-sharding-strategy",
                               "optim_grads_params")  # fmt: skip
    experts = pad(2 * 2 * H * F, F, dp=2)  # a multiple of 2 x F (and of 128): no padding
    assert experts == 2 * 2 * H * F
    moe = [r for r in data_parallel(header, records) if r[0].startswith("moe_")]
    layer = [("moe_fsdp_param_gather", "ALLGATHER_DP_EP", 2 * experts),
             ("moe_fsdp_param_regather", "ALLGATHER_DP_EP", 2 * experts),
             ("moe_fsdp_grad_reduce", "REDUCESCATTER_DP_EP", 4 * experts)]  # fmt: skip
    assert moe == [layer[0], layer[1], layer[2]] * 2 * GA
    assert simai_size(header, "ALLGATHER_DP_EP", "wg") == 2


def test_one_data_parallel_rank_writes_no_collective():
    header, records = workload("--dp", "1", "--data-parallel-sharding-strategy",
                               "optim_grads_params", batch=2)  # fmt: skip
    assert data_parallel(header, records) == []


def test_torch_fsdp2_gathers_and_reduces_every_unit_every_micro_batch():
    # megatron's TorchFullyShardedDataParallel: `no_sync` does nothing (data_parallel_base.py),
    # so FSDP2 reduce-scatters every backward, and reshards after every forward
    # (reshard_after_forward=True); gradients in the parameters' dtype (no mixed-precision
    # policy). Units with the local spec: each layer, the embedding, the root (final LayerNorm
    # and the untied output layer). Every row count divides by 4: no padding.
    result = run_cli("workload", *TINY, *FSDP2, "--untie-embeddings-and-output-weights", "--dp",
                     "4", "--global-batch-size", "8", "--gpu-tflops", "100", "--stage", "0")  # fmt: skip
    assert result.code == 0, result.err
    assert result.err == NOTE.replace("Megatron-FSDP", "FSDP2")
    header, records = parse_workload(result.out)

    def unit(elements: int) -> list[tuple[str, str, int]]:
        return [("fsdp_param_gather", "ALLGATHER", 2 * elements),
                ("fsdp_param_regather", "ALLGATHER", 2 * elements),
                ("fsdp_grad_reduce", "REDUCESCATTER", 2 * elements)]  # fmt: skip

    block = [*unit(LAYER_N), *unit(LAYER_N), *unit(2 * H + V * H), *unit(V * H + S * H)]
    assert data_parallel(header, records) == block * GA
    assert simai_size(header, "ALLGATHER", "wg") == 4


def test_refusals_name_the_flags():
    # an expert layout no SimAI group matches stays refused
    result = run_cli("workload", *JOB, "--num-experts", "4", "--disable-bias-linear", "--tp", "2",
                     "--sequence-parallel", "--ep", "4", "--dp", "4",
                     "--expert-tensor-parallel-size", "1", "--global-batch-size", "16",
                     "--stage", "0")  # fmt: skip
    # megatron reduces expert gradients over 2 x 4 / (4 x 1) = 2 ranks; SimAI's DP_EP holds
    # 4 / 4 = 1, its DP 4
    assert result.code == 2
    assert result.err.startswith("Error: workload cannot write --expert-tensor-parallel-size 1")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_every_strategy_keeps_the_compute_records(strategy):
    # FSDP adds records, never changes the layers': the same compute as the distributed optimizer
    _, fsdp = workload("--dp", "4", "--data-parallel-sharding-strategy", strategy)
    result = run_cli("workload", *TINY, "--use-distributed-optimizer", "--dp", "4",
                     "--global-batch-size", "8", "--gpu-tflops", "100", "--stage", "0")  # fmt: skip
    _, ddp = parse_workload(result.out)
    assert [r for r in fsdp if not r.name.startswith(("fsdp", "grad"))] == [
        r for r in ddp if not r.name.startswith("grad")
    ]


@pytest.mark.skipif(megatron_core_version() >= (0, 14),
                    reason="Megatron-FSDP runs pp > 1 on megatron-core 0.13 only (job/versions.py)")
def test_each_virtual_chunks_layers_are_gathered_where_they_run():
    # pp 2 with two chunks per stage: stage 1 runs layers 1 and 3 (one per chunk); each layer's
    # gather comes right before its records, its regather and reduce-scatter right after
    header, records = workload("--num-layers", "4", "--dp", "2", "--pp", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1",
                               "--data-parallel-sharding-strategy", "optim_grads_params",
                               stage=1)  # fmt: skip
    names = [r.name for r in records]
    gathers = [i for i, name in enumerate(names) if name == "fsdp_param_gather"]
    assert (header.vpp, len(gathers)) == (2, 2 * header.ga)
    # the last stage's copy of the tied output weight: its fp32 gradients every micro-batch
    assert data_parallel(header, records).count(
        ("fsdp_grad_reduce", "REDUCESCATTER", 4 * V * H)) == header.ga
    for i in gathers:
        assert names[i:i + 5] == ["fsdp_param_gather", "attention_layer", "mlp_layer",
                                  "fsdp_param_regather", "fsdp_grad_reduce"]  # fmt: skip
