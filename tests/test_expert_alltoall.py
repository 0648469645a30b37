"""The MoE token exchange priced per link class: NVLink peers and InfiniBand peers at once."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from inspector.job.hardware import GPUS
from inspector.job.layout import Layout
from inspector.plan.network import Network, expert_alltoall, expert_peers_on_node
from tests.conftest import run_cli

# Qwen3-30B-A3B's dispatch on one rank: s b k h / t = 4096 x 1 x 8 x 2048 / 1 bf16 elements
ELEMENTS, NBYTES = 4096 * 8 * 2048, 2
BYTES = ELEMENTS * NBYTES  # 134,217,728


def old_ring(ep: int, span: int, net: Network) -> float:
    """The price before: the whole (ep - 1) / ep over the one link the group's span reaches."""
    alpha, bandwidth = net.link(span)
    return alpha + BYTES * (ep - 1) / ep / bandwidth


def test_a_group_inside_one_node_is_the_nvlink_ring_as_before() -> None:
    # h100, ep 8 on 8 GPUs: every peer on NVLink, 4 x (5 us + B x 7/8 / 370 GB/s), the bus
    # bandwidth NCCL reaches there (job/hardware.py, NVIDIA/nccl-tests#212)
    net, lay = Network(GPUS["h100"], 8), Layout(dp=8, ep=8, etp=1)
    hand = 4 * (5e-6 + BYTES * 7 / 8 / 370e9)
    assert expert_alltoall(4, ELEMENTS, NBYTES, lay, net) == pytest.approx(hand, rel=1e-12)
    assert hand == pytest.approx(4 * old_ring(8, 8, net), rel=1e-12)  # unchanged inside a node


def test_a_group_over_two_nodes_sends_only_the_other_nodes_share_over_infiniband() -> None:
    # h100, ep 16 over 2 nodes of 8: 7/16 over NVLink and 8/16 over InfiniBand at once; the
    # InfiniBand half is the longer: 10 us + B / 2 / 50 GB/s = 1.35217728 ms
    net, lay = Network(GPUS["h100"], 8), Layout(dp=16, ep=16, etp=1)
    nvlink = 5e-6 + BYTES * 7 / 16 / 370e9
    infiniband = 10e-6 + BYTES * 8 / 16 / 50e9
    assert infiniband == pytest.approx(1.35217728e-3, rel=1e-12) and nvlink < infiniband
    assert expert_alltoall(1, ELEMENTS, NBYTES, lay, net) == pytest.approx(infiniband, rel=1e-12)
    # before: 15/16 at InfiniBand speed, 2.5265824 ms (1.87 x)
    assert old_ring(16, 16, net) == pytest.approx(2.5265824e-3, rel=1e-12)


def test_an_nvl72_domain_prices_its_most_remote_rank() -> None:
    # gb200 (72 GPUs per NVLink domain), ep 128 over 256 ranks: groups 0-127 (72 + 56 per domain)
    # and 128-255 (16 + 72 + 40); the rank with 16 peers on its domain sends 112/128 over
    # InfiniBand, the one with 72 sends 71/128 over NVLink: the all-to-all waits for the former
    net, lay = Network(GPUS["gb200"], 72), Layout(dp=256, ep=128, etp=1)
    assert expert_peers_on_node(128, 1, 256, 72) == (16, 40, 56, 72)
    nvlink = 5e-6 + BYTES * 71 / 128 / 900e9
    infiniband = 10e-6 + BYTES * 112 / 128 / 50e9
    got = expert_alltoall(1, ELEMENTS, NBYTES, lay, net)
    assert got == pytest.approx(max(nvlink, infiniband), rel=1e-12)
    assert got == pytest.approx(infiniband, rel=1e-12)
    assert old_ring(128, 128, net) == pytest.approx(10e-6 + BYTES * 127 / 128 / 50e9, rel=1e-12)
    # ep 64 fits the domain: all NVLink at 900 GB/s, as before
    lay = Layout(dp=64, ep=64, etp=1)
    assert expert_alltoall(1, ELEMENTS, NBYTES, lay, net) == pytest.approx(
        5e-6 + BYTES * 63 / 64 / 900e9, rel=1e-12)


def test_expert_tensor_parallel_of_a_whole_node_leaves_no_nvlink_peer() -> None:
    # etp 8 on 8-GPU nodes: the ep group strides over whole nodes, all (ep - 1)/ep on InfiniBand,
    # the old price exactly
    net, lay = Network(GPUS["h100"], 8), Layout(tp=8, dp=4, ep=4, etp=8)
    assert expert_peers_on_node(4, 8, 32, 8) == (1,)
    assert expert_alltoall(1, ELEMENTS, NBYTES, lay, net) == pytest.approx(
        old_ring(4, 32, net), rel=1e-12)


LAYOUTS = [  # (tp, cp, dp, pp, ep, etp, gpus per node)
    (1, 1, 16, 1, 16, 1, 8),
    (2, 1, 128, 8, 32, 1, 8),  # Qwen3-235B-A22B's Bridge row
    (2, 1, 64, 8, 64, 1, 8),  # DeepSeek-V3's
    (2, 2, 8, 2, 8, 2, 8),
    (4, 1, 8, 1, 4, 2, 8),
    (1, 1, 256, 1, 128, 1, 72),
    (2, 1, 72, 2, 24, 3, 72),
    (1, 2, 12, 1, 6, 1, 4),
]


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp,node", LAYOUTS)
def test_peers_on_a_node_are_those_of_megatrons_expert_groups(tp, cp, dp, pp, ep, etp, node):
    from inspector.world.setup import megatron

    world = tp * cp * dp * pp
    generator = megatron().parallel_state.RankGenerator(
        tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    counts = {n for group in generator.get_ranks("ep")
              for n in Counter(rank // node for rank in group).values()}
    assert expert_peers_on_node(ep, etp, world, node) == tuple(sorted(counts))


QWEN = ("plan --model qwen3-30b-a3b --num-layers 2 --gpus 16 --global-batch-size 16 --seq-length 4096 "
        "--micro-batch-size 1 --tp 1 --pp 1 --cp 1 --ep 16 --expert-tensor-parallel-size 1 --bf16 "
        "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --recompute-granularity none "
        "--gpu h100 --format json").split()  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("node", "one"), [
    (8, 10e-6 + BYTES * 8 / 16 / 50e9),  # two nodes: the InfiniBand half
    (16, 5e-6 + BYTES * 15 / 16 / 370e9),  # one node of 16: all NVLink, at NCCL's 370 GB/s
])
def test_plan_charges_each_moe_layer_four_exchanges_at_the_hand_price(node, one) -> None:
    # one micro-batch per rank (16 / dp 16), 2 MoE layers, 4 all-to-alls each, s k h = the
    # Qwen3-30B dispatch above; before, --gpus-per-node 8 charged 2 x 4 x 2.5265824 ms
    result = run_cli(*QWEN, "--gpus-per-node", str(node))
    assert result.code == 0, result.err
    plan = json.loads(result.out)["plans"][0]
    assert plan["time_shares"]["expert"] == pytest.approx(2 * 4 * one, rel=1e-9)
