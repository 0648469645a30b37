"""NVLink collectives at the bus bandwidth NCCL measures on H100/H200, not the 450 GB/s line rate.

NVIDIA/nccl#1455 (8 H100 SXM, all_reduce_perf at 2-4 GB): NCCL_ALGO=Ring 365-370 GB/s busBw for
2 to 8 GPUs; NVLS (NVLink SHARP, NCCL's default) the same up to 4 GPUs, then 420, 440, 460, 480
GB/s for 5 to 8. NVIDIA/nccl-tests#212: 370 GB/s is also what every non-all-reduce collective
reaches. NCCL_ALGO's grammar: NCCL's src/graph/tuning.cc `parseList`.
"""

from __future__ import annotations

import pytest

from inspector.job.hardware import GPUS, with_overrides
from inspector.job.layout import Layout
from inspector.plan.network import Network, collective, nvls_allowed


def test_h100_and_h200_nvlink_collectives_run_at_nccls_370_gb_s() -> None:
    for name in ("h100", "h200"):
        net = Network(GPUS[name], 8)
        assert net.gpu.intra == 450e9  # the datasheet's line rate stays the GPU's figure
        assert net.link(4) == (5e-6, 370e9)  # a ring, all-gather, reduce-scatter, send
        assert net.link(8, all_reduce=4) == (5e-6, 370e9)  # NVLS is Ring's speed up to 4 GPUs
        assert net.link(16) == (10e-6, 50e9)  # across nodes: InfiniBand, unchanged


@pytest.mark.parametrize(("ranks", "busbw"), [(5, 420e9), (6, 440e9), (7, 460e9), (8, 480e9)])
def test_an_all_reduce_of_5_to_8_ranks_runs_at_nvlink_sharps_bus_bandwidth(ranks, busbw) -> None:
    assert Network(GPUS["h100"], 8).link(8, all_reduce=ranks) == (5e-6, busbw)
    # NCCL_ALGO=Ring (what deterministic mode's functional tests set) keeps the ring's
    assert Network(GPUS["h100"], 8, nvls=False).link(8, all_reduce=ranks) == (5e-6, 370e9)


def test_a_tensor_parallel_group_all_reduces_only_without_sequence_parallelism() -> None:
    net = Network(GPUS["h100"], 8)
    assert net.tensor_link(Layout(tp=8, sequence_parallel=False)) == (5e-6, 480e9)
    assert net.tensor_link(Layout(tp=8, sequence_parallel=True)) == (5e-6, 370e9)


def test_the_ring_formula_at_370_gb_s_prices_a_7b_layers_tensor_collective() -> None:
    # 7B, tp 4, 4,096 tokens x 4,096 hidden in bf16 = 32 MiB: 5 us + 32 MiB x 3/4 / 370 GB/s
    link = Network(GPUS["h100"], 8).link(4)
    got = collective(1, 4096 * 4096, 2, 4, link)
    assert got == pytest.approx(5e-6 + 4096 * 4096 * 2 * 3 / 4 / 370e9, rel=1e-12)
    assert got > collective(1, 4096 * 4096, 2, 4, (5e-6, 450e9)) * 1.19  # 450 / 370 = 1.22 less alpha


def test_other_gpus_keep_the_line_rate_and_a_given_bandwidth_prices_everything() -> None:
    for name in ("a100-80gb", "b200", "gb200", "b300", "gb300"):  # no published NCCL figure here
        gpu = GPUS[name]
        assert Network(gpu, gpu.gpus_per_node).link(8, all_reduce=8) == (5e-6, gpu.intra)
    given = with_overrides(GPUS["h100"], intra_node_bandwidth=300.0)  # --intra-node-bandwidth 300
    assert Network(given, 8).link(8, all_reduce=8) == (5e-6, 300e9)


@pytest.mark.parametrize(("algo", "allowed"), [
    (None, True), ("", True), ("Ring", False), ("Tree", False), ("NVLS", True), ("ring,nvls", True),
    ("^NVLS", False), ("^Tree", True), ("^nvls,tree", False), ("NVLSTree", False),
    ("ring;allreduce:nvls", True), ("nvls;allreduce:ring", False), ("tree;broadcast:nvls", False),
])
def test_nccl_algo_allows_nvls_as_nccl_parses_it(algo, allowed) -> None:
    assert nvls_allowed(algo) is allowed
