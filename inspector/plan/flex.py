"""The flex token dispatcher (`--moe-token-dispatcher-type flex`): its exchange priced by the bytes
each link class carries (megatron's rules for it: job/flex.py; HybridEP's buffers: job/hybrid_ep.py).

megatron-core's MoEFlexTokenDispatcher (transformer/moe/token_dispatcher.py, 0.16.1) hands a
rank's tokens to fused dispatch and combine kernels over one group of expert-tp x ep ranks
(`tp_ep_group`): DeepEP's (`_DeepepManager`, fused_a2a.py `fused_dispatch` / `fused_combine`)
or HybridEP's (`_HybridEPManager`, `hybrid_ep_dispatch` / `hybrid_ep_combine`), chosen by
`--moe-flex-dispatcher-backend` (0.16; before it `--moe-enable-deepep`, DeepEP only). Each
backward is the other direction (FusedDispatch.backward runs `buffer.combine`,
FusedCombine.backward `buffer.dispatch`): four exchanges per MoE layer and micro-batch, as the
all-to-all dispatcher's.

What travels (DeepEP's README, "Normal kernels with NVLink and RDMA forwarding", and
csrc/kernels/internode.cu): a token is sent ONCE to each rank that holds one of its experts
(`is_token_in_rank`), not once per expert; across nodes it crosses InfiniBand once per
destination node (to the GPU of the same local index there, `num_tokens_per_rdma_rank`) and is
forwarded inside that node over NVLink to the GPUs that need it; the combine reduces a node's
partial outputs before they cross back, so it carries the same bytes. A token record over RDMA
is `get_num_bytes_per_rdma_token`: the hidden state, a SourceMeta of 8 bytes, top-k indices and
weights of 4 bytes each, aligned to 16 bytes. HybridEP's hierarchical design (DeepEP hybrid-ep
branch, docs: "Inter-node Communication: RDMA ... Intra-node Communication: NVLink") is priced
the same way. The hidden states travel in bf16 (fp16) as the layer holds them: megatron-core
0.16.1 never asks for fp8 dispatch (fused_a2a.py: `get_hidden_bytes` of the tensor it passes;
`init_hybrid_ep_buffer`: "HybridEP dispatcher does not support fp8 dispatch now").

Under balanced routing (the plan's assumption; `--moe-router-force-load-balancing` draws random
logits, moe_utils.py `apply_random_logits`) a token's top-k is a uniform k-subset of the E
experts, placed in ep-rank order, E/ep per rank. The SMs the kernels occupy (megatron's defaults
`--moe-deepep-num-sms` 20, `moe_hybridep_num_sms` 16 of the H100's 132, transformer_config.py)
are taken from the compute beside an overlapped exchange (`exchange_sm_share`, overlap.py; the
NCCL all-to-all's are not modelled).

Node-limited routing (`--moe-router-num-groups G --moe-router-group-topk M`, moe_utils.py
`group_limited_topk`): the E experts form G groups of E/G consecutive experts; a token picks M
groups, then its top-k among their M E/G experts. Balanced, the M groups are a uniform M-subset
and the k experts a uniform k-subset of theirs (`block_hit`). A node holds the consecutive experts
of its ep ranks, so where G is not a multiple of the nodes a group straddles two nodes and the
nodes differ: each sender is priced on its own (`sender_copies`), the slowest setting the time.
The all-to-all dispatcher sends each of a token's k copies to its expert's rank; every expert is
still picked with probability k/E, so its bytes per link class do not change (network.py).
"""

from __future__ import annotations

from math import comb, prod
from typing import Any

import inspector.caches as caches
from inspector.formulas import routing
from inspector.formulas.fp8_ops import expert_padding
from inspector.job.dims import ModelDims
from inspector.job.flex import check_flex_group, runs_deepep
from inspector.job.hardware import Gpu
from inspector.job.hybrid_ep import HYBRIDEP_NUM_SMS, check_hybridep_dtype
from inspector.job.job import Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.plan.network import Network, expert_alltoall, expert_peers_on_node

SOURCE_META_BYTES = 8  # internode.cu SourceMeta: src_rdma_rank, is_token_in_nvl_rank_bits
TOPK_ENTRY_BYTES = 4 + 4  # an int index and a float weight per top-k entry
# NCCL's p2p channels, each a thread block of its send/receive kernel (`comm->p2pnChannels`,
# src/init.cc), as NCCL's init log reports them on NVSwitch nodes, H100 and GB200 NVL72 alike:
# "32 p2p channels, 32 p2p channels per peer"
NCCL_P2P_CHANNELS = 32


def missed(experts: float, held: float, topk: int) -> float:
    """Return the chance that none of a uniform top-k of `experts` falls in `held` of them:
    C(E - h, k) / C(E, k) as a product, so that `held` may be a fraction of an even spread."""
    return prod((experts - held - i) / (experts - i) for i in range(topk))


def expected_remote_nodes(experts: int, topk: int, nodes: int, groups: int = 0,
                          group_topk: int = 0) -> float:  # fmt: skip
    """Return the expected number of nodes other than the sender's that a token's top-k hit.

    `experts` are spread evenly over `nodes` (megatron places experts in ep-rank order, a node
    holding consecutive ep ranks). Without node-limited routing each node is missed with
    probability C(E - E/nodes, k) / C(E, k). With `--moe-router-num-groups G` and
    `--moe-router-group-topk M` (G a multiple of nodes, so a node holds h = G/nodes whole
    groups of g = E/G experts), a token's M groups are a uniform M-subset and its k experts a
    uniform k-subset of their M g experts: the node is hit unless it holds j of them
    (hypergeometric C(h, j) C(G - h, M - j) / C(G, M)) and all k fall outside:
    C((M - j) g, k) / C(M g, k).
    """
    per_node = experts // nodes
    if not groups:
        return (nodes - 1) * (1 - comb(experts - per_node, topk) / comb(experts, topk))
    held, size = groups // nodes, experts // groups
    hit = 0.0
    for j in range(1, min(held, group_topk) + 1):
        chosen = comb(held, j) * comb(groups - held, group_topk - j) / comb(groups, group_topk)
        hit += chosen * (1 - comb((group_topk - j) * size, topk) / comb(group_topk * size, topk))
    return (nodes - 1) * hit


def token_copies(experts: int, topk: int, ep: int, expert_tp: int, on_node: int) -> tuple[float, float]:
    """Return the expected (InfiniBand, NVLink) copies of one token a dispatch sends, per token.

    The group has r = expert_tp x ep ranks, `on_node` of them on each node it spans (n = r /
    on_node nodes, E/n experts each). A rank is hit when one of its E/ep experts is (p = 1 -
    C(E - E/ep, k) / C(E, k); its expert-tp partners hold the same experts). InfiniBand: one copy
    per remote node hit. NVLink: on every node each hit rank but the one the token enters by
    (the sender itself on its own node, the same local index on the others) gets a copy: (r - n) p.
    """
    ranks = expert_tp * ep
    nodes = ranks / on_node
    node_hit = 1 - missed(experts, experts / nodes, topk)
    rank_hit = 1 - missed(experts, experts / ep, topk)
    return (nodes - 1) * node_hit, (ranks - nodes) * rank_hit


@caches.memo(maxsize=65536)
def block_hit(experts: int, topk: int, groups: int, group_topk: int, lo: int, hi: int) -> float:
    """Return formulas/routing.py's chance that a token reaches experts lo..hi-1, once a block."""
    return routing.block_hit(experts, topk, groups, group_topk, lo, hi)


def sender_copies(experts: int, topk: int, ep: int, expert_tp: int, on_node: int, groups: int = 0,
                  group_topk: int = 0) -> tuple[tuple[float, float], ...]:  # fmt: skip
    """Return the expected (InfiniBand, NVLink) copies one dispatched token costs, for each
    distinct sender of the expert-tp x ep group (`on_node` consecutive ranks a node).

    Without node-limited routing every sender is alike (`token_copies`). With it (`groups`,
    `group_topk`) rank r holds ep index r // expert_tp's E/ep experts and a node its ranks'
    consecutive experts; a sender at local index i on node s sends one InfiniBand copy to each
    other node its token hits, and an NVLink copy to each hit rank that is not an entry rank
    (local index i on every node): sum of P(node hit) over n != s, sum of P(rank hit) less the
    entry ranks'. Each chance is `block_hit`'s.
    """
    if not group_topk:
        return (token_copies(experts, topk, ep, expert_tp, on_node),)
    per_ep, ranks = experts // ep, ep * expert_tp
    nodes = -(-ranks // on_node)

    def block(first: int, last: int) -> float:  # the experts of ranks first..last
        return block_hit(experts, topk, groups, group_topk,
                         first // expert_tp * per_ep, (last // expert_tp + 1) * per_ep)  # fmt: skip

    rank_p = [block(r, r) for r in range(ranks)]
    node_p = [block(n * on_node, min(ranks, (n + 1) * on_node) - 1) for n in range(nodes)]
    senders = set()
    for s in range(nodes):
        for i in range(min(on_node, ranks - s * on_node)):
            entries = sum(rank_p[n * on_node + i] for n in range(nodes) if n * on_node + i < ranks)
            inter = sum(node_p) - node_p[s]
            senders.add((round(inter, 12), round(sum(rank_p) - entries, 12)))
    return tuple(sorted(senders))


def token_record_bytes(hidden: int, element_bytes: int, topk: int) -> int:
    """Return DeepEP's bytes for one token record (internode.cu `get_num_bytes_per_rdma_token`):
    the hidden state at max(element size, 2) bytes (fused_a2a.py `get_hidden_bytes`), its
    SourceMeta and its top-k indices and weights, aligned to 16 bytes."""
    raw = hidden * max(element_bytes, 2) + SOURCE_META_BYTES + topk * TOPK_ENTRY_BYTES
    return -(-raw // 16) * 16


def flex_exchange(count: int, dims: ModelDims, tokens: float, lay: Layout, net: Network) -> float:
    """Return `count` flex exchanges (a dispatch or a combine) of a rank's `tokens` tokens.

    A rank sends its InfiniBand copies through its NIC while the NVLink forwarding runs (DeepEP
    pipelines the two in chunks): an exchange takes the longer of alpha_inter + bytes over
    InfiniBand and alpha_intra + bytes over NVLink, for the rank whose node holds the fewest
    members of its group (megatron's expert rank order: the expert-tp x ep group is consecutive
    ranks, `expert_peers_on_node` with expert tp 1).
    """
    ranks = lay.expert_tp * lay.ep
    experts, topk = dims.num_experts or 0, dims.moe_router_topk
    if ranks <= 1 or count == 0 or not experts:
        return 0.0
    gpu = net.gpu
    record = tokens * token_record_bytes(dims.hidden_size, dims.activation_bytes, topk * lay.expert_tp)
    slowest = 0.0
    for on_node in expert_peers_on_node(ranks, 1, lay.world_size, net.gpus_per_node):
        for inter, intra in sender_copies(experts, topk, lay.ep, lay.expert_tp, on_node,
                                          dims.moe_router_num_groups or 0,
                                          dims.moe_router_group_topk or 0):  # fmt: skip
            seconds = max(gpu.alpha_inter + record * inter / gpu.inter if inter > 0 else 0.0,
                          gpu.alpha_intra + record * intra / gpu.intra if intra > 0 else 0.0)  # fmt: skip
            slowest = max(slowest, seconds)
    return count * slowest


def moe_exchange(dims: ModelDims, lay: Layout, net: Network, tokens: float, flex: bool) -> float:
    """Return an MoE layer's 4 token exchanges (dispatch, combine; forward and backward) for one
    micro-batch (`tokens`: s b / c): the flex dispatcher's, or the all-to-all's (network.py)."""
    if flex:  # the rank's tokens (s b / (c t) with sequence parallelism), each once per rank
        return flex_exchange(4, dims, tokens / lay.tp, lay, net)
    if lay.ep == 1:
        return 0.0
    routed = tokens * dims.moe_router_topk * dims.hidden_size / lay.tp
    if dims.fp8 and dims.moe_row_padding == "source":  # --moe-router-padding-for-fp8: the
        # sender's padding rows travel too (formulas/fp8_ops.py expert_padding)
        routed = dims.hidden_size * expert_padding(
            dims, int(tokens), dims.num_experts or 1, lay.ep, lay.expert_tp, lay.tp,
            dims.moe_router_topk)[1]  # fmt: skip
    return expert_alltoall(4, routed, dims.activation_bytes, lay, net)


def exchange_sm_share(training: Training, gpu: Gpu) -> float:
    """Return the share of the GPU's SMs an exchange kernel holds while it runs, which the
    compute beside it (--overlap-moe-expert-parallel-comm) cannot use.

    DeepEP's normal kernels run on `Buffer.set_num_sms(moe_deepep_num_sms)` SMs (fused_a2a.py
    `set_deepep_num_sms`; DeepEP's README: "they support SM (Streaming Multiprocessors) number
    control"), HybridEP's on `moe_hybridep_num_sms` (token_dispatcher.py `num_sms_dispatch_api`,
    `num_sms_combine_api`). The all-to-all dispatcher's `all_to_all_single` is NCCL's grouped
    sends and receives, one thread block (one SM) per p2p channel (`NCCL_P2P_CHANNELS`). The
    compute beside runs on the rest, at that share of its speed. 0 for the allgather dispatcher
    (megatron refuses the overlap with it) and for a GPU without a cited SM count.
    """
    if not gpu.sms:
        return 0.0
    if training.moe_token_dispatcher_type == "alltoall":
        return min(NCCL_P2P_CHANNELS, gpu.sms) / gpu.sms
    if training.moe_token_dispatcher_type != "flex":
        return 0.0
    sms = training.moe_deepep_num_sms if runs_deepep(training) else HYBRIDEP_NUM_SMS
    return sms / gpu.sms


def check_flex_request(model: ModelConfig, backend: str | None, fixed: dict[str, Any]) -> None:
    """Refuse what the flex dispatcher's backend refuses of every candidate (a fixed ep, dtype)."""
    if backend == "hybridep" and model.num_experts is not None:
        check_hybridep_dtype(model)  # every candidate's: the model's dtype is fixed
    if backend is not None and model.num_experts is not None and "ep" in fixed:
        etp = fixed.get("etp", fixed.get("tp"))  # megatron: expert tp defaults to tp
        if etp is not None:
            check_flex_group(fixed["ep"], etp, backend)
