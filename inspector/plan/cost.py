"""The planner's time model: one training iteration of a layout on a named GPU, from formulas.

Each term and its source (symbols of inspector/job/dims.py; m micro-batches, v virtual stages):
  - compute: Megatron-LM's FLOPs (flops.py) of a stage's layers and logits for one micro-batch,
    split over its tp x cp ranks, at `peak x efficiency`; recomputation adds the forward it
    repeats (full: a third of each checkpointed layer, all of them or, with `--recompute-method
    block` N, the first N of each chunk; selective: a third of core attention);
  - tensor parallel: per layer and micro-batch 4 collectives forward and 4 backward (all-gather /
    reduce-scatter with sequence parallelism, all-reduce pairs without; Korthikanti et al. 2022,
    Section 4.2.2, equal volumes) of s b h / c activation elements, each priced alpha + bytes x
    (t - 1) / t / bandwidth (ring, Thakur et al. 2005); not overlapped (Megatron-LM's default);
  - context parallel: ring attention (Liu et al. 2023; Transformer Engine's P2P implementation,
    see `ring_attention`) passes K and V blocks c - 1 times forward and K, V and their
    gradients c - 1 times backward, each transfer overlapped with one step's attention kernel:
    only what a step's transfer takes beyond its kernel is exposed, step by step;
  - expert parallel: 4 all-to-alls (dispatch, combine; forward and backward) of s b k h / (c t)
    elements x (ep - 1) / ep per MoE layer;
  - pipeline: a point-to-point send per chunk boundary and micro-batch, forward and backward;
    stage time t_s per micro-batch; iteration m max_s t_s + (sum_s t_s - max_s t_s) / v, the
    1F1B / interleaved critical path (Narayanan et al. 2021, Section 2.2: bubble (p - 1) / (v m)
    for equal stages; Alpa, Zheng et al. 2022, eq. 2, for unequal ones);
  - data parallel: gradient reduce-scatter and parameter all-gather (distributed optimizer) or
    all-reduce of the stage's real DDP buffers, over dp x cp ranks; --overlap-grad-reduce hides it
    behind the last micro-batch's backward, --overlap-param-gather behind the first forward
    (Megatron-LM's overlap, which the plan's flags turn on): only the excess is exposed;
  - optimizer step: Adam reads and writes its state once, bound by HBM bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from inspector.errors import ConfigError
from inspector.formulas.activations import mtp_recompute, recompute_plan
from inspector.formulas.flops import layer_flops, logit_flops, mtp_flops
from inspector.job.dims import ModelDims
from inspector.job.job import Recompute
from inspector.job.layout import Layout


@dataclass(frozen=True)
class Gpu:
    """A GPU and its links: dense 16-bit peak, HBM and per-GPU network bandwidth (bytes/s)."""

    name: str
    tflops: float
    memory_gib: float
    hbm: float
    intra: float  # NVLink, one direction
    inter: float  # InfiniBand, one direction, per GPU
    alpha_intra: float = 5e-6
    alpha_inter: float = 10e-6


GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16 (1,979 with sparsity),
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 each way); DGX H100: 8 x 400 Gb/s
    # ConnectX-7 InfiniBand, one per GPU (50 GB/s).
    "h100": Gpu("h100", 989.0, 80, 3.35e12, 450e9, 50e9),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink
    # 900 GB/s; 400 Gb/s InfiniBand per GPU as on DGX H200.
    "h200": Gpu("h200", 989.0, 141, 4.8e12, 450e9, 50e9),
    # NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s dense BF16, HBM2e 2,039 GB/s, NVLink 600 GB/s
    # (300 each way); DGX A100 / Selene (Narayanan et al. 2021): 8 x 200 Gb/s HDR InfiniBand
    # per node, one per GPU (25 GB/s).
    "a100-80gb": Gpu("a100-80gb", 312.0, 80, 2.039e12, 300e9, 25e9),
}
DEFAULT_EFFICIENCY = 0.65  # fraction of peak a large GEMM-bound layer reaches (see docs/plan-a-cluster.md)


def get_gpu(name: str) -> Gpu:
    """Return a named GPU profile or raise ConfigError naming the choices."""
    if name not in GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; choose one of: {', '.join(GPUS)}")
    return GPUS[name]


@dataclass(frozen=True)
class Network:
    """Where the groups of a layout run: NVLink inside a node, InfiniBand across nodes."""

    gpu: Gpu
    gpus_per_node: int

    def link(self, span: int) -> tuple[float, float]:
        """Return (alpha, bandwidth) for a group whose ranks span `span` consecutive ranks."""
        if span <= self.gpus_per_node:
            return self.gpu.alpha_intra, self.gpu.intra
        return self.gpu.alpha_inter, self.gpu.inter


@dataclass(frozen=True)
class StageTime:
    """One pipeline rank's seconds per micro-batch (all its chunks) and per iteration."""

    compute: float
    tensor: float
    context: float
    expert: float
    p2p: float
    data: float  # exposed data-parallel communication, once per iteration
    optimizer: float  # once per iteration

    @property
    def per_microbatch(self) -> float:
        """Return the stage's time for one micro-batch through all of its chunks."""
        return self.compute + self.tensor + self.context + self.expert + self.p2p


@dataclass(frozen=True)
class StepTime:
    """One iteration's estimated time and where it goes."""

    seconds: float
    pipeline: float  # the pipelined forward/backward part
    busy: float  # m x mean stage time: the pipeline without bubbles
    stages: tuple[StageTime, ...]

    @property
    def bubble(self) -> float:
        """Return the share of the iteration the average stage idles in the pipeline."""
        return (self.pipeline - self.busy) / self.seconds

    def shares(self) -> dict[str, float]:
        """Return the iteration's seconds by cause, for 'what bounds it'."""
        m = self.busy / max(sum(s.per_microbatch for s in self.stages) / len(self.stages), 1e-30)
        n = len(self.stages)
        out = {
            key: m * sum(getattr(s, key) for s in self.stages) / n
            for key in ("compute", "tensor", "context", "expert", "p2p")
        }
        out["bubble"] = self.pipeline - self.busy
        out["data"] = max(s.data for s in self.stages)
        out["optimizer"] = max(s.optimizer for s in self.stages)
        return out


def _collective(count: float, elements: float, nbytes: int, ranks: int, link: tuple[float, float]) -> float:
    """Return `count` ring collectives of `elements` each over `ranks` ranks."""
    if ranks <= 1 or count == 0:
        return 0.0
    alpha, bandwidth = link
    return count * (alpha + elements * nbytes * (ranks - 1) / ranks / bandwidth)


def stage_work(
    dims: ModelDims,
    lay: Layout,
    net: Network,
    efficiency: float,
    mbs: int,
    recompute: str,
    chunk_layers: Sequence[Sequence[int]],
    has_output: bool,
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
) -> StageTime:
    """Return a rank's time per micro-batch (compute, TP, CP, EP, P2P), its state's left at 0.

    With full recomputation, `recompute_method` / `recompute_num_layers` say which layers repeat
    their forward (activations.recompute_plan: `block` N, the first N of each chunk).
    """
    rate = net.gpu.tflops * 1e12 * efficiency
    split = lay.tp * lay.cp
    act = dims.activation_bytes
    tokens = dims.seq_length * mbs / lay.cp
    compute = tensor = context = expert = 0.0
    mode = cast(Recompute, recompute)
    plan = recompute_plan(0, chunk_layers, mode, recompute_method, recompute_num_layers)
    kinds: dict[tuple[Recompute, bool], list[int]] = {}  # (recomputed or not, MoE) -> layers
    for group, how in (pair for groups in plan for pair in groups):
        for i in group:
            kinds.setdefault((how, dims.is_moe_layer(i)), []).append(i)
    for (how, _), members in kinds.items():
        one = _layer_time(dims, lay, net, rate, mbs, how, members[0])
        compute += one[0] * len(members)
        tensor += one[1] * len(members)
        context += one[2] * len(members)
        expert += one[3] * len(members)
    if has_output:  # the output layer and loss, and the MTP block megatron puts beside them
        compute += logit_flops(dims, mbs) / split / rate
        if dims.mtp_num_layers:
            depth, final = dims.mtp_num_layers, dims.num_layers - 1
            last = _layer_time(dims, lay, net, rate, mbs, mtp_recompute(mode, recompute_method), final)
            own = mtp_flops(dims, mbs) - depth * layer_flops(dims, final, mbs).total
            compute += depth * last[0] + own / split / rate
            tensor += depth * last[1]
            context += depth * last[2]
            expert += depth * last[3]
    boundary = tokens * dims.hidden_size / lay.tp * act
    alpha, bw = net.link(lay.world_size)
    p2p = 2 * len(chunk_layers) * (alpha + boundary / bw) if lay.pp > 1 else 0.0
    return StageTime(compute, tensor, context, expert, p2p, 0.0, 0.0)


def with_state(
    work: StageTime, lay: Layout, net: Network, dp_bytes: tuple[int, int], state_bytes: int,
    distributed: bool,
) -> StageTime:
    """Return `work` with the rank's exposed data-parallel and optimizer time for its state."""
    compute = work.compute
    grads, params = dp_bytes
    d = lay.dp * lay.cp
    dp_link = net.link(lay.tp * lay.cp * lay.dp)
    backward = compute * 2 / 3
    if distributed:
        rs = _collective(1, grads, 1, d, dp_link)
        ag = _collective(1, params, 1, d, dp_link)
        data = max(0.0, rs - backward) + max(0.0, ag - compute / 3)
    else:
        data = max(0.0, _collective(2, grads, 1, d, dp_link) - backward)
    optimizer = 2 * state_bytes / net.gpu.hbm
    return StageTime(work.compute, work.tensor, work.context, work.expert, work.p2p, data, optimizer)


@lru_cache(maxsize=4096)
def _layer_time(
    dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int, recompute: str, i: int
) -> tuple[float, float, float, float]:
    """Return one layer's compute, TP, exposed CP and EP seconds for one micro-batch."""
    split = lay.tp * lay.cp
    act = dims.activation_bytes
    tokens = dims.seq_length * mbs / lay.cp
    f = layer_flops(dims, i, mbs)
    if recompute == "full":
        extra = f.total / 3
    else:
        extra = f.core_attention / 3 if recompute == "selective" else 0
    compute = (f.total + extra) / split / rate
    collectives = 12 if recompute == "full" else 8
    tensor = _collective(collectives, tokens * dims.hidden_size, act, lay.tp, net.link(lay.tp))
    context = expert = 0.0
    if lay.cp > 1:
        forwards = 2 if recompute in ("full", "selective") else 1  # both recompute core attention
        context = ring_attention(dims, lay, net, tokens, f.core_attention / split / rate, forwards)
    if dims.is_moe_layer(i) and lay.ep > 1:
        routed = tokens * dims.moe_router_topk * dims.hidden_size / lay.tp
        expert = _collective(4, routed, act, lay.ep, net.link(lay.ep * lay.expert_tp))
    return compute, tensor, context, expert


def ring_attention(
    dims: ModelDims, lay: Layout, net: Network, tokens: float, attention: float, forwards: int
) -> float:
    """Return the exposed seconds of ring attention's K/V exchange, one layer and micro-batch.

    Megatron-core's context parallelism runs Transformer Engine's `AttnFuncWithCPAndKVP2P`
    (`cp_comm_type` "p2p", the default; transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py): the sequence is cut in 2c chunks, each rank holding two (causal load
    balance), and attention runs in c steps. At each of the first c - 1 steps a rank sends the
    K and V block it holds to the next rank of the ring and receives the previous rank's, while
    its kernel computes attention on the block in hand: only what a transfer takes beyond one
    step's kernel (1/c of the rank's core attention) is exposed. Backward circulates K, V and
    their gradients (twice the bytes) against the backward kernels (two thirds of the core
    attention FLOPs, Megatron-LM's 3x GEMM accounting). A K or V block is (s/c) b (g/t) d
    elements. The ring's hops cross nodes as soon as t x c ranks span more than a node
    (megatron orders tp, cp, dp, pp: the cp group strides over t ranks), and a ring step waits
    for its slowest hop. `forwards`: 2 when recomputation repeats the forward.
    """
    c = lay.cp
    block = 2 * tokens * max(dims.query_groups // lay.tp, 1) * dims.head_dim * dims.activation_bytes
    alpha, bandwidth = net.link(lay.tp * lay.cp)
    step_forward = attention / 3 / c
    forward = (c - 1) * max(0.0, alpha + block / bandwidth - step_forward)
    backward = (c - 1) * max(0.0, alpha + 2 * block / bandwidth - 2 * step_forward)
    return forwards * forward + backward


def step_time(stages: Sequence[StageTime], num_microbatches: int, chunks: int) -> StepTime:
    """Return the iteration: m max t_s + (sum t_s - max t_s) / v, plus DP and optimizer."""
    per = [s.per_microbatch for s in stages]
    slowest = max(per)
    pipeline = num_microbatches * slowest + (sum(per) - slowest) / chunks
    busy = num_microbatches * sum(per) / len(per)
    tail = max(s.data + s.optimizer for s in stages)
    return StepTime(pipeline + tail, pipeline, busy, tuple(stages))
