"""The planner's time model: one training iteration of a layout on a named GPU, from formulas.

Each term and its source (symbols of inspector/job/dims.py; m micro-batches, v virtual stages):
  - compute: each kernel a layer runs on the rank (formulas/ops.py: GEMMs by m, n, k, flash or
    unfused attention, norms, activations, dropout, residual adds, rotary, MoE routing and
    permutation; the output layer and loss; the word embedding) priced from the measured kernel table
    (formulas/kernels.py), plus the forward recomputation repeats (full: each checkpointed
    layer's, all of them or, with `--recompute-method block` N, the first N of each chunk;
    selective: core attention's). With `--efficiency` instead: Megatron-LM's FLOPs (flops.py)
    split over tp x cp ranks at `peak x efficiency`, recomputation adding a third of what it repeats
    (`compute_seconds`);
  - tensor parallel: per layer and micro-batch 4 collectives forward and 4 backward (all-gather /
    reduce-scatter with sequence parallelism, all-reduce pairs without; Korthikanti et al. 2022,
    Section 4.2.2, equal volumes; an MoE layer with expert TP 1 and no shared experts runs
    attention's 2 and 2 only: moe_layer.py) of s b h / c activation elements (multi-latent
    attention's gather and reduce-scatter: of its latents, network.py `tensor_seconds`), each
    priced alpha + bytes x (t - 1) / t / bandwidth (ring, Thakur et al. 2005; over NVLink the bus bandwidth
    NCCL measures, NVLink SHARP's for an all-reduce of 5-8 ranks: plan/network.py); not
    overlapped (Megatron's default; --tp-comm-overlap: beside their GEMMs, plan/userbuffers.py);
    full recomputation repeats the forward's 4, `--recompute-modules mlp` (shared_experts) the
    MLP's (shared expert's) 2, `mla_up_proj` with sequence parallelism one gather of the latents
    the up projections read (q_lora + kv_lora wide); with sequence parallelism the column-parallel
    linears' backward gathers of their input for the weight gradient, beyond the data-gradient
    GEMM they overlap (network.py `regather_seconds`); the first stage's embedding sum;
  - context parallel: ring attention (Liu et al. 2023; TE's P2P implementation, `ring_attention`)
    passes K and V blocks c - 1 times forward and K, V and their gradients c - 1 times backward,
    each transfer overlapped with one step's attention kernel: only the excess is exposed;
  - expert parallel: 4 exchanges (dispatch, combine; forward and backward) per MoE layer: the
    all-to-all of s b k h / (c t) elements priced per link class (plan/network.py
    `expert_alltoall`: NVLink and InfiniBand shares at once, the slower class wins), the flex
    dispatcher's (DeepEP, HybridEP) by the copies each link carries (plan/flex.py
    `flex_exchange`: a token once per remote node over InfiniBand); under
    --overlap-moe-expert-parallel-comm a merged pass exposes what its layer pair takes beyond
    its compute (plan/overlap.py: megatron's combined 1F1B replayed on two streams, a flex
    exchange's SMs taken from the compute beside it);
  - pipeline: a point-to-point send per chunk boundary and micro-batch, forward and backward;
    stage time t_s per micro-batch; iteration m max_s t_s + (sum_s t_s - max_s t_s) / v, the
    1F1B / interleaved critical path (Narayanan et al. 2021, Section 2.2: bubble (p - 1) / (v m)
    for equal stages; Alpa, Zheng et al. 2022, eq. 2, for unequal ones);
  - data parallel: gradient reduce-scatter and parameter all-gather (distributed optimizer) or
    all-reduce of the stage's real DDP buffers, over dp x cp ranks; --overlap-grad-reduce hides it
    behind the last micro-batch's backward, --overlap-param-gather behind the first forward (the
    plan's flags turn both on): only the excess is exposed; Megatron-FSDP's (`fsdp_seconds`) too;
  - optimizer step: the passes over memory megatron's mixed-precision optimizer and its inner Adam
    make over the elements the rank updates (formulas/optimizer.py: TE or apex FusedAdam with the
    job's fused kernels, torch's foreach AdamW without them), each at the measured copy bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import inspector.caches as caches
from inspector.formulas.flops import LayerFlops, layer_flops, logit_flops, mla_up_flops, mtp_flops
from inspector.formulas.kernels import ops_seconds
from inspector.formulas.ops import Shard, layer_seconds, linear
from inspector.formulas.optimizer import OptimizerStep
from inspector.job.dims import ModelDims
from inspector.job.hardware import Gpu
from inspector.job.job import Recompute
from inspector.job.layout import Layout
from inspector.memory.closed.activations import mtp_recompute
from inspector.plan.context import ring_attention
from inspector.plan.flex import moe_exchange
from inspector.plan.host import HostWork, edge_units, kind_segments, merge
from inspector.plan.hybrid import gdn_layer_ops, hybrid_layer_time, mtp_depth_time
from inspector.plan.kernel_seconds import (
    column_dgrads,
    compute_seconds,
    core_seconds,
    embedding_time,
    kernel_seconds,
    layer_kernels,
    optimizer_step_seconds,
    output_seconds,
    stage_kinds,
)
from inspector.plan.network import Network, collective, fsdp_seconds, tensor_seconds
from inspector.plan.overlap import merged_times
from inspector.plan.userbuffers import GATHERED, paired

# merged share, delayed weight grads, the SMs' share an exchange holds (overlap.py), passes alone
Overlap = tuple[float, bool, float, tuple[tuple[bool, bool, float], ...]]


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
    fsdp: float = 0.0  # exposed FSDP gathers and reduce-scatters, per micro-batch
    host: HostWork = HostWork()  # the host's launches per micro-batch (plan/host.py)
    wait: float = 0.0  # the GPU's wait for a slower host per micro-batch (`host.wait()`)

    @property
    def per_microbatch(self) -> float:
        """Return the stage's time for one micro-batch through all of its chunks."""
        return self.compute + self.tensor + self.context + self.expert + self.p2p + self.fsdp + self.wait


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
            for key in ("compute", "tensor", "context", "expert", "p2p", "wait")
        }
        out["host"] = out.pop("wait")  # the GPU waiting for the host's launches
        out["bubble"] = self.pipeline - self.busy
        out["data"] = max(s.data for s in self.stages)
        out["optimizer"] = max(s.optimizer for s in self.stages)
        return out

    def host_bound(self) -> tuple[int, float, float] | None:
        """Return the busiest stage (the most time per micro-batch) with its host's and GPU's
        seconds per micro-batch where the host's are the more (plan/host.py), else None."""
        busiest = max(self.stages, key=lambda s: s.per_microbatch)
        host, gpu = busiest.host.host(), busiest.per_microbatch - busiest.wait
        return (self.stages.index(busiest), host, gpu) if host > gpu else None


def compute_rate(net: Network, efficiency: float | None) -> float:
    """Return the FLOP/s --efficiency prices every FLOP at (the 16-bit peak x it), or 0.0 when
    it is not given: the compute term then prices each kernel from the measured tables. Every
    dtype is priced at the dense 16-bit peak (a float32 plan too; job/hardware.py has the rest)."""
    return net.gpu.tflops_16bit * 1e12 * efficiency if efficiency else 0.0


def stage_work(
    dims: ModelDims,
    lay: Layout,
    net: Network,
    efficiency: float | None,
    mbs: int,
    recompute: str,
    chunk_layers: Sequence[Sequence[int]],
    has_output: bool,
    recompute_method: str = "uniform", recompute_num_layers: int = 1,
    recompute_modules: tuple[str, ...] = ("core_attn",), overlap: Overlap = (0.0, False, 0.0, ()),
    flex: bool = False, has_embedding: bool = False, host: tuple[bool, bool] = (True, False),
) -> StageTime:  # fmt: skip
    """Return a rank's time per micro-batch (compute, TP, CP, EP, P2P), its state's left at 0.
    With full recomputation, `recompute_method` / `recompute_num_layers` say which layers repeat
    their forward (activations.recompute_plan: `block` N, the first N of each chunk); `overlap` under
    --overlap-moe-expert-parallel-comm; `flex`: flex dispatcher; `has_embedding`: stage 0; `host`: as
    `_host_work` takes it."""
    rate, mode = compute_rate(net, efficiency), cast(Recompute, recompute)
    kinds = dict(stage_kinds(dims, tuple(map(tuple, chunk_layers)), mode, recompute_method,
                             recompute_num_layers))  # fmt: skip
    total, layers = [0.0, 0.0, 0.0, 0.0], []  # compute, tensor, context, expert; each kind's
    for (how, moe), (i, count) in kinds.items():
        shares = overlap[:3] if moe is True else (0.0, False, 0.0)
        one = (hybrid_layer_time if dims.layer_symbols else _layer_time)(  # plan/hybrid.py
            dims, lay, net, rate, mbs, how, i, recompute_modules, *shares, flex)
        _add(total, one, count)
        layers.append((how, i, sum(one), count))
    total[3] += _alone(dims, lay, net, rate, mbs, kinds, recompute_modules, overlap, flex)
    if has_output:
        _add_output(total, dims, lay, net, rate, mbs, mtp_recompute(mode, recompute_method))
    _add(total, embedding_time(dims, lay, net, rate, mbs) if has_embedding else (), 1)
    p2p = _p2p_seconds(dims, lay, net, mbs, len(chunk_layers))
    work = _host_work(dims, _shard(lay, mbs), layers, sum(total) + p2p, (has_output, has_embedding),
                      recompute_modules, host)  # fmt: skip
    return StageTime(total[0], total[1], total[2], total[3], p2p, 0.0, 0.0, host=work, wait=work.wait())


def _p2p_seconds(dims: ModelDims, lay: Layout, net: Network, mbs: int, chunks: int) -> float:
    """Return a stage's pipeline sends per micro-batch: one per chunk boundary, forward and backward."""
    boundary = dims.seq_length * mbs / lay.cp * dims.hidden_size / lay.tp * dims.activation_bytes
    alpha, bw = net.link(lay.world_size)
    return 2 * chunks * (alpha + boundary / bw) if lay.pp > 1 else 0.0


def _host_work(dims: ModelDims, shard: Shard, layers: Sequence[tuple[str, int, float, int]],
               gpu: float, edges: tuple[bool, bool], modules: tuple[str, ...],
               host: tuple[bool, bool]) -> HostWork:  # fmt: skip
    """Return the stage's host work per micro-batch (plan/host.py): each kind of layer's (how it is
    recomputed, a layer of it, its GPU seconds, how many) segments, the rest of the stage's `gpu`
    seconds and the output layer's and embedding's launches (`edges`: the stage has them) in one
    more; `host`: whether MoE layers synchronise the host, whether CUDA graphs capture the layers
    (`host_syncs`, `graphed_layers`)."""
    segments = [seg for how, i, seconds, count in layers
                for seg in kind_segments(dims, shard, how, i, seconds, count, modules, *host)]
    rest = gpu - sum(seg.gpu * seg.count for seg in segments)
    return merge(segments, rest, edge_units(dims, shard, *edges))


def _alone(dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int,
           kinds: dict[tuple[Recompute, bool | str], tuple[int, int]], modules: tuple[str, ...],
           overlap: Overlap, flex: bool) -> float:  # fmt: skip
    """Return what MoE passes alone inside merged steps (overlap.alone_passes) take beyond the
    half pair each was priced at; `kinds`: the stage's (recompute, MoE) -> (a layer, count)."""
    kind = next(((how, layer) for (how, moe), (layer, _) in kinds.items() if moe is True), None)
    if kind is None or not overlap[3]:
        return 0.0
    args = (dims, lay, net, rate, mbs, *kind, modules)
    pair, alone_f, alone_b, busy = _pair_times(*args, overlap[1], overlap[2], flex)
    return sum(passes * ((alone_f if forward else alone_b) - max(pair, busy) / 2)
               for moe, forward, passes in overlap[3] if moe)  # dense passes are unmerged already


def _add(total: list[float], terms: Sequence[float], times: int) -> None:
    """Add `times` x each of (compute, tensor, context, expert) to `total`."""
    for index, term in enumerate(terms):
        total[index] += term * times


def _add_output(
    total: list[float], dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int,
    mtp_mode: str,
) -> None:
    """Add the output layer and loss, and the MTP block megatron puts beside them."""
    shard = _shard(lay, mbs)

    def output(d: Gpu) -> float:  # never recomputed
        return output_seconds(dims, shard, d)

    total[0] += compute_seconds(logit_flops(dims, mbs), output, lay, net, rate)
    if dims.mtp_num_layers:
        depth, final = dims.mtp_num_layers, dims.num_layers - 1
        last = (mtp_depth_time(dims, lay, net, rate, mbs, mtp_mode) if dims.mtp_symbols
                else _layer_time(dims, lay, net, rate, mbs, mtp_mode, final))
        own = mtp_flops(dims, mbs) - depth * layer_flops(dims, final, mbs).total
        tokens = dims.seq_length * mbs // lay.cp
        eh_proj = linear("eh_proj", tokens, 2 * dims.hidden_size, dims.hidden_size // lay.tp,
                         fp8=dims.fp8 is not None)  # a TE linear, in fp8 under --fp8-format
        total[0] += depth * last[0] + compute_seconds(  # eh_proj and the logits, each depth
            own, lambda d: depth * (ops_seconds(eh_proj, d) + output(d)), lay, net, rate)
        for index in (1, 2, 3):
            total[index] += depth * last[index]


def with_state(
    work: StageTime, lay: Layout, net: Network, dp_bytes: tuple[int, int], state_bytes: int,
    sharding: bool | str, step: OptimizerStep, grad_bytes: int | None = None,
) -> StageTime:
    """Return `work` with the rank's exposed data-parallel and optimizer time for its state.

    `dp_bytes`: the rank's (gradient, weight) bytes; `state_bytes`: those plus its optimizer state;
    `sharding`: the distributed optimizer on or off, or a Megatron-FSDP strategy;
    `step`: the optimizer's set-up (its `grad_bytes` is read from `dp_bytes` here, unless
    `grad_bytes` gives it: with fp8 parameters the weights are not all of one element size).
    """
    compute = work.compute
    grads, params = dp_bytes
    d = lay.dp * lay.cp
    dp_link = net.link(lay.tp * lay.cp * lay.dp)
    backward = compute * 2 / 3
    fsdp = 0.0
    if isinstance(sharding, str):
        data, fsdp = fsdp_seconds(sharding, compute, grads, params, d, dp_link)
    elif sharding:
        rs = collective(1, grads, 1, d, dp_link)
        ag = collective(1, params, 1, d, dp_link)
        data = max(0.0, rs - backward) + max(0.0, ag - compute / 3)
    else:
        data = max(0.0, collective(2, grads, 1, d, net.link(lay.tp * lay.cp * lay.dp, d)) - backward)
    optimizer = optimizer_seconds(net, dp_bytes, state_bytes, step, grad_bytes)
    return replace(work, data=data, optimizer=optimizer, fsdp=fsdp)


def optimizer_seconds(
    net: Network, dp_bytes: tuple[int, int], state_bytes: int, step: OptimizerStep,
    grad_bytes: int | None = None,
) -> float:
    """Return the rank's optimizer step: formulas/optimizer.py's passes over the elements it
    updates (its optimizer bytes over the state an element keeps), on the network's GPU."""
    grads, params = dp_bytes
    updated = (state_bytes - grads - params) // step.state_per_element
    if grad_bytes is None:
        grad_bytes = grads * step.param_bytes // params if params else step.grad_bytes
    return optimizer_step_seconds(updated, replace(step, grad_bytes=grad_bytes), net.gpu)


@caches.memo(maxsize=4096)
def _layer_time(
    dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int, recompute: str, i: int,
    modules: tuple[str, ...] = ("core_attn",), merged: float = 0.0, delay_wgrad: bool = False,
    taken: float = 0.0, flex: bool = False,
) -> tuple[float, float, float, float]:
    """Return one layer's compute, TP, exposed CP and EP seconds for one micro-batch; selective
    recomputation repeats the forward of `modules` (formulas/ops.py RECOMPUTED); `merged`: the
    share of passes run merged under the MoE all-to-all overlap (plan/overlap.py); `flex`: the
    exchange is the flex dispatcher's (plan/flex.py `flex_exchange`); `taken`: the share of the
    SMs its kernels hold beside a merged pair's compute (plan/flex.py `exchange_sm_share`)."""
    act, tokens, shard = dims.activation_bytes, dims.seq_length * mbs / lay.cp, _shard(lay, mbs)
    f, moe, gdn = layer_flops(dims, i, mbs), dims.is_moe_layer(i), dims.is_gdn_layer(i)
    extra = f.total / 3 if recompute == "full" else (
        _recomputed_flops(dims, f, moe, modules, mbs) if recompute == "selective" else 0)
    compute = compute_seconds(f.total + extra, lambda d: _kernels(
        dims, shard, moe, gdn, d, recompute, modules), lay, net, rate)  # fmt: skip
    tensor = _tensor_time(dims, lay, net, rate, shard, moe, gdn, recompute, modules)
    if recompute == "selective" and "mla_up_proj" in modules and lay.sequence_parallel:
        latents = sum(dims.mla_gathered(False))  # q's and kv's (the checkpoint's inputs)
        tensor += collective(1, tokens * latents, act, lay.tp, net.link(lay.tp))  # a gather
    context = 0.0
    if lay.cp > 1:
        forwards = 2 if recompute == "full" or (recompute == "selective" and "core_attn" in modules) else 1
        attention = compute_seconds(  # forward and backward: 3 forwards, ring_attention's convention
            f.core_attention, lambda d: 3 * core_seconds(dims, shard, moe, d),
            lay, net, rate,
        )
        context = ring_attention(dims, lay, net, tokens, attention, forwards)
    expert = moe_exchange(dims, lay, net, tokens, flex) if moe else 0.0
    if expert and merged:  # a merged pair exposes what it takes beyond the layer's compute
        pair = _pair_times(dims, lay, net, rate, mbs, recompute, i, modules, delay_wgrad, taken, flex)[0]
        expert = merged * max(0.0, pair - compute - tensor) + (1 - merged) * expert
    return compute, tensor, context, expert


def _tensor_time(dims: ModelDims, lay: Layout, net: Network, rate: float, shard: Shard, moe: bool,
                 gdn: bool, recompute: str, modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return a layer's tensor-parallel seconds a micro-batch (--tp-comm-overlap: userbuffers.py)."""
    # attention's 2 forward, the MLP's unless an MoE layer has neither shared experts nor expert TP
    forward = 2 + (2 if not moe or dims.shared_expert_ffn or lay.expert_tp > 1 else 0)
    collectives = forward * (3 if recompute == "full" else 2)
    if recompute == "selective":  # a recomputed MLP re-runs fc1's gather and fc2's reduction
        mlps = ("mlp",) if not moe else ("shared_experts",) if dims.shared_expert_ffn else ()
        collectives += 2 * sum(m in modules for m in mlps)  # its 2 of the forward's 4
    pairs, taken = paired(dims, lay, net, shard, moe, gdn, rate, recompute, modules)  # the rest here
    dgrads = () if gdn else column_dgrads(dims, shard, moe, net.gpu, rate, GATHERED if taken else ())
    return pairs + tensor_seconds(dims, lay, net, dims.seq_length * shard.micro_batch / lay.cp,
                                  collectives - taken, recompute == "full", dgrads)


def _kernels(dims: ModelDims, shard: Shard, moe: bool, gdn: bool, d: Gpu, recompute: str,
             modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return a layer's kernel seconds: a GPT layer's, or with a gated delta net in place of its
    attention (plan/gdn_ops.py)."""
    if gdn:
        return layer_seconds(gdn_layer_ops(dims, shard, moe), d, recompute, modules)
    return kernel_seconds(dims, shard, moe, d, recompute, modules)


@caches.memo(maxsize=4096)
def _pair_times(
    dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int, recompute: str, i: int,
    modules: tuple[str, ...], delay_wgrad: bool, taken: float, flex: bool,
) -> tuple[float, float, float, float]:
    """Return MoE layer `i`'s merged pair, forward and backward alone (`merged_times`), compute + TP."""
    compute, tensor, _, expert = _layer_time(dims, lay, net, rate, mbs, recompute, i, modules, flex=flex)
    return *merged_times(layer_kernels(dims, _shard(lay, mbs), True), net.gpu, recompute,
                         modules, (compute, tensor), expert / 4, delay_wgrad, bool(rate), taken,
                         1.0 if lay.expert_tp == 1 else 0.5), compute + tensor  # fmt: skip


def _recomputed_flops(dims: ModelDims, f: LayerFlops, moe: bool, modules: tuple[str, ...],
                      mbs: int = 1) -> float:  # fmt: skip
    """Return the forward FLOPs selective recomputation of `modules` repeats (a third of each
    part's forward and backward): core attention, a dense layer's MLP, an MoE layer's shared
    experts (their share of `f.mlp`, flops.py's width k f_e + f_s), MLA's up projections
    (`mla_up_proj`, over the micro-batch's `mbs` sequences)."""
    extra = f.core_attention / 3 if "core_attn" in modules else 0.0
    if dims.multi_latent_attention and "mla_up_proj" in modules:
        extra += mla_up_flops(dims, dims.seq_length * mbs) / 3
    if not moe and "mlp" in modules:
        extra += f.mlp / 3
    if moe and "shared_experts" in modules and dims.shared_expert_ffn:
        width = dims.expert_ffn * dims.moe_router_topk + dims.shared_expert_ffn
        extra += f.mlp * dims.shared_expert_ffn / width / 3
    return extra


def _shard(lay: Layout, mbs: int) -> Shard:
    """Return how a rank of `lay` cuts a layer (formulas/ops.py)."""
    return Shard(lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.sequence_parallel, mbs)


def step_time(stages: Sequence[StageTime], num_microbatches: int, chunks: int) -> StepTime:
    """Return the iteration: m max t_s + (sum t_s - max t_s) / v, plus DP and optimizer."""
    per = [s.per_microbatch for s in stages]
    slowest = max(per)
    pipeline = num_microbatches * slowest + (sum(per) - slowest) / chunks
    busy = num_microbatches * sum(per) / len(per)
    tail = max(s.data + s.optimizer for s in stages)
    return StepTime(pipeline + tail, pipeline, busy, tuple(stages))
