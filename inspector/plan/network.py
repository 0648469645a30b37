"""Where a layout's groups run, and the expert-parallel all-to-all priced over the links it uses.

A group whose ranks span at most one node (the GPU's NVLink domain, `--gpus-per-node`) talks over
NVLink, otherwise over InfiniBand (`Network.link`). Over NVLink a collective moves at the bus
bandwidth NCCL measures there, not the line rate (job/hardware.py `nccl_intra`: 370 of 450 GB/s
on H100), and an all-reduce of 5 to 8 ranks at NVLink SHARP's (`nvls_intra`, up to 480 GB/s)
unless NCCL_ALGO leaves NVLS out (`nvls_allowed`; NCCL user guide, "Environment Variables":
NCCL_ALGO lists the algorithms NCCL may use, a leading `^` the ones it may not). The MoE token
exchange is priced per link class instead (`expert_alltoall`): megatron's all-to-all dispatcher
calls `torch.distributed.all_to_all_single` with split sizes (tensor_parallel/mappings.py
`_AllToAll`), which PyTorch runs as one NCCL group of a send and a receive per peer (torch/csrc/cuda/nccl.cpp
`all2all_single_unequal_split`); NCCL lets the calls of a group progress independently (NCCL user
guide, "Point-to-point communication": all-to-all as grouped ncclSend/ncclRecv) and schedules them
as rounds over node and local-rank offsets (src/init.cc `p2pSchedule`), spread over its p2p
channels (src/enqueue.cc `scheduleP2pTasksToPlan`), so the sends to peers on the same node go over
NVLink while those to other nodes go over InfiniBand, at the same time.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import inspector.caches as caches
from inspector.job.dims import ModelDims
from inspector.job.hardware import Gpu
from inspector.job.layout import Layout


def collective(count: float, elements: float, nbytes: int, ranks: int, link: tuple[float, float]) -> float:
    """Return `count` ring collectives of `elements` each over `ranks` ranks."""
    if ranks <= 1 or count == 0:
        return 0.0
    alpha, bandwidth = link
    return count * (alpha + elements * nbytes * (ranks - 1) / ranks / bandwidth)


@dataclass(frozen=True)
class Network:
    """Where the groups of a layout run: NVLink inside a node, InfiniBand across nodes."""

    gpu: Gpu
    gpus_per_node: int
    nvls: bool = True  # NCCL_ALGO allows NVLink SHARP (NCCL's default where the NVSwitch has it)

    @property
    def nvlink(self) -> float:
        """Return the bus bandwidth NCCL's collectives reach over NVLink (bytes/s, one way)."""
        return self.gpu.nccl_intra or self.gpu.intra

    def link(self, span: int, all_reduce: int = 0) -> tuple[float, float]:
        """Return (alpha, bandwidth) for a group whose ranks span `span` consecutive ranks;
        `all_reduce`: the group's ranks when it all-reduces (NVLink SHARP's figures)."""
        if span > self.gpus_per_node:
            return self.gpu.alpha_inter, self.gpu.inter
        bandwidth = self.nvlink
        if all_reduce and self.nvls:
            bandwidth = max(bandwidth, dict(self.gpu.nvls_intra).get(all_reduce, 0.0))
        return self.gpu.alpha_intra, bandwidth

    def tensor_link(self, lay: Layout) -> tuple[float, float]:
        """Return the tensor-parallel group's link: all-reduces without sequence parallelism,
        all-gathers and reduce-scatters with it (Korthikanti et al. 2022, Section 4.2.2)."""
        return self.link(lay.tp, 0 if lay.sequence_parallel else lay.tp)


def nvls_allowed(nccl_algo: str | None) -> bool:
    """Return whether NCCL may run an all-reduce as NVLink SHARP under NCCL_ALGO: unset, its
    default (NVLS where the NVSwitch has it); else the list for all-reduces (NCCL's
    src/graph/tuning.cc `parseList`: `A,B` only those, `^A,B` all but those, `list;allreduce:list`
    one list for every collective and one per collective)."""
    chosen = None
    for part in (nccl_algo or "").lower().split(";"):
        prefix, _, items = part.rpartition(":")
        if prefix in ("", "allreduce") and items.strip() and (chosen is None or prefix):
            chosen = items.strip()
    if chosen is None:
        return True
    names = {name.strip() for name in chosen.lstrip("^").split(",")}
    return "nvls" not in names if chosen.startswith("^") else "nvls" in names


@caches.memo(maxsize=1024)
def expert_peers_on_node(ep: int, expert_tp: int, world: int, gpus_per_node: int) -> tuple[int, ...]:
    """Return how many members of an expert-parallel group share a node with a member, over
    every group and node (the member itself counted): the distinct counts, ascending.

    megatron-core's expert RankGenerator (parallel_state.py, order "tp-cp-ep-dp-pp" with cp 1)
    numbers a rank etp_index + etp (ep_index + ep (edp_index + edp pp_index)): an ep group is
    ep ranks at stride etp in a block of etp x ep consecutive ranks, and node n holds ranks
    n x gpus_per_node to (n + 1) x gpus_per_node - 1. The pattern repeats every
    lcm(etp x ep, gpus_per_node) ranks, so the blocks of that span give every count.
    """
    block = expert_tp * ep
    span = min(world, math.lcm(block, gpus_per_node))
    counts: set[int] = set()
    for start in range(0, span, block):
        for offset in range(expert_tp):
            members = (start + offset + expert_tp * j for j in range(ep))
            counts.update(Counter(rank // gpus_per_node for rank in members).values())
    return tuple(sorted(counts))


def tensor_seconds(dims: ModelDims, lay: Layout, net: Network, tokens: float, count: int,
                   full: bool, dgrads: tuple[tuple[int, float], ...] = ()) -> float:  # fmt: skip
    """Return `count` tensor-parallel collectives of a layer's rows (`tokens` x h elements). With
    sequence parallelism multi-latent attention's gather and its backward reduce-scatter (and the
    gather again under full recomputation) move its latents instead (ModelDims.mla_gathered: the
    up projections' inputs and RoPE's key part), a collective each; and the column-parallel
    linears of `dgrads` gather their input again in backward (`regather_seconds`)."""
    act, link = dims.activation_bytes, net.tensor_link(lay)
    mla = (3 if full else 2) if dims.multi_latent_attention and lay.sequence_parallel else 0
    return collective(count - mla, tokens * dims.hidden_size, act, lay.tp, link) + sum(
        collective(mla, tokens * width, act, lay.tp, link) for width in dims.mla_gathered(bool(mla))
    ) + regather_seconds(dims, lay, net, tokens, dgrads)


def regather_seconds(dims: ModelDims, lay: Layout, net: Network, tokens: float,
                     dgrads: tuple[tuple[int, float], ...]) -> float:  # fmt: skip
    """Return what the weight gradients' all-gathers of sequence-parallel column-parallel linears
    take beyond the data-gradient GEMMs they run beside: `dgrads`, each linear's input width and
    data-gradient seconds.

    The forward saves the rank's T / t rows, not the gathered input, so the backward gathers them
    again for the weight-gradient GEMM, launched asynchronously before the data-gradient GEMM and
    waited for after it (Transformer Engine 2.11 module/linear.py `_Linear.backward`:
    `backward_input_needs_gather`, `gather_along_first_dim(..., async_op=True)` "overlapped with
    dgrad GEMM"; layernorm_linear.py the same for `ln_out`; megatron-core's own
    tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward too).
    """
    if not lay.sequence_parallel or lay.tp <= 1:
        return 0.0
    act, link = dims.activation_bytes, net.tensor_link(lay)
    return sum(max(0.0, collective(1, tokens * width, act, lay.tp, link) - dgrad)
               for width, dgrad in dgrads)


def expert_alltoall(count: int, elements: float, nbytes: int, lay: Layout, net: Network) -> float:
    """Return `count` expert-parallel all-to-alls of `elements` per rank (bytes of `nbytes` each).

    A rank whose group has g members on its node sends (g - 1) / ep of its elements over NVLink
    and (ep - g) / ep over InfiniBand at once (module docstring): it takes the longer of
    alpha_intra + bytes (g - 1) / ep / nvlink (NCCL's bus bandwidth there) and
    alpha_inter + bytes (ep - g) / ep / inter (a
    class it does not use costs nothing), and the all-to-all the longest of its ranks'. A group
    inside one node is then alpha + bytes (ep - 1) / ep over NVLink, the ring formula.
    """
    ep = lay.ep
    if ep <= 1 or count == 0:
        return 0.0
    gpu, data = net.gpu, elements * nbytes
    slowest = 0.0
    for g in expert_peers_on_node(ep, lay.expert_tp, lay.world_size, net.gpus_per_node):
        intra = gpu.alpha_intra + data * (g - 1) / ep / net.nvlink if g > 1 else 0.0
        inter = gpu.alpha_inter + data * (ep - g) / ep / gpu.inter if g < ep else 0.0
        slowest = max(slowest, intra, inter)
    return count * slowest


def fsdp_seconds(
    strategy: str, compute: float, grads: int, params: int, d: int, link: tuple[float, float]
) -> tuple[float, float]:
    """Return Megatron-FSDP's exposed (once per iteration, per micro-batch) seconds.

    `grads`, `params`: the rank's bytes (a shard where the strategy shards them: the gathered
    size is d times). megatron_fsdp.py: with optim_grads and optim_grads_params gradients are
    reduce-scattered after every backward (`grad_reduce_every_bprop`), otherwise once, on the
    last micro-batch; optim_grads_params gathers each layer's parameters before its forward and
    again before its backward (resharded in between), prefetching the next layer, so only what
    a micro-batch's gathers take beyond its forward (a third of its compute) and its gathers
    and reduce-scatters beyond its backward (two thirds) are exposed; the other strategies
    gather the updated parameters once after the step, as the distributed optimizer does.
    """
    backward = compute * 2 / 3
    full_grads = grads * d if strategy in ("optim_grads", "optim_grads_params") else grads
    full_params = params * d if strategy == "optim_grads_params" else params
    rs = collective(1, full_grads, 1, d, link)
    ag = collective(1, full_params, 1, d, link)
    if strategy == "no_shard":
        return max(0.0, 2 * rs - backward), 0.0
    if strategy == "optim":
        return max(0.0, rs - backward) + max(0.0, ag - compute / 3), 0.0
    if strategy == "optim_grads":
        return max(0.0, ag - compute / 3), max(0.0, rs - backward)
    return 0.0, max(0.0, ag - compute / 3) + max(0.0, ag + rs - backward)
