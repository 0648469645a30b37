"""`plan`: search the layouts Megatron-LM accepts for a job and rank them by estimated step time.

Every candidate is a real `Job` (job.py validates it with megatron's rules), priced with exact
state memory (plan_memory.py, composed from megatron builds), activations from activations.py at
the schedule's micro-batches in flight (formulas.py replays megatron's schedules), and the time
model of plan_cost.py. Per pipeline size the layer split comes from even / accounted splits and
plan_split.balance, once on time alone and once with memory caps (`_capped_split`). Each distinct
stage is priced once (its state, activations and time depend on its own shape only), memory before
time, and micro-batch sizes stop growing once a smaller one fits nowhere. Nothing here prints.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from inspector.activations import embedding_activations, layer_activations, output_activations
from inspector.config import ModelConfig
from inspector.errors import ConfigError
from inspector.flops import iteration_flops
from inspector.formulas import ModelDims, live_microbatches
from inspector.job import Job, Training
from inspector.plan_cost import Gpu, Network, StageTime, StepTime, stage_time, step_time
from inspector.plan_memory import ChunkShape, piece_key, stage_state
from inspector.plan_split import (
    Split,
    accounted_split,
    balance,
    chunk_layers,
    even_split,
    split_flags,
)
from inspector.topology import Layout

RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True)
class Request:
    """What the user asked: the model, the cluster, the batch, and any dimension they fixed."""

    model: ModelConfig
    gpus: int
    gpu: Gpu
    memory: int  # bytes per GPU
    global_batch_size: int
    gpus_per_node: int = 8
    efficiency: float = 0.65
    fixed: dict[str, Any] = field(default_factory=dict)  # tp, pp, cp, ep, etp, vpp, mbs, ...
    top: int = 5
    flash_attention: bool | None = None  # None: on in 16-bit (Transformer Engine's kernels)

    @property
    def flash(self) -> bool:
        """Return whether the candidates run flash attention."""
        if self.flash_attention is None:
            return self.model.dtype_name != "float32"
        return self.flash_attention


@dataclass(frozen=True)
class StagePlan:
    """One pipeline rank of a plan: its layers and its most loaded rank's bytes."""

    stage: int
    layers: tuple[tuple[int, ...], ...]
    state: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    in_flight: tuple[int, ...]

    @property
    def total(self) -> int:
        """Return the rank's bytes."""
        return self.state + self.activations


@dataclass(frozen=True)
class Plan:
    """One candidate layout, priced."""

    job: Job
    split: Split
    stages: tuple[StagePlan, ...]
    time: StepTime
    flops: int
    gpu: Gpu

    @property
    def peak(self) -> int:
        """Return the most bytes any rank needs."""
        return max(s.total for s in self.stages)

    @property
    def mfu(self) -> float:
        """Return model FLOPs per second over the cluster's peak (PaLM, Appendix B)."""
        gpus = self.job.layout.world_size
        return self.flops / (self.time.seconds * gpus * self.gpu.tflops * 1e12)

    @property
    def tflops_per_gpu(self) -> float:
        """Return the achieved model TFLOP/s per GPU."""
        return self.mfu * self.gpu.tflops

    def bound(self) -> str:
        """Return what limits the plan most besides compute."""
        shares = self.time.shares()
        shares.pop("compute")
        return max(shares, key=lambda k: shares[k])

    def flags(self) -> list[str]:
        """Return the Megatron-LM flags that reproduce this plan."""
        return megatron_flags(self.job, self.split)


@dataclass
class SearchResult:
    """The ranked feasible plans, and what the search saw."""

    plans: list[Plan]
    evaluated: int
    seconds: float
    smallest_peak: int | None  # the least memory any candidate needed (when none fits)
    smallest: Plan | None


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_choices(req: Request) -> list[int]:
    m = req.model
    if "tp" in req.fixed:
        return [req.fixed["tp"]]
    return [
        t for t in _powers(req.gpus_per_node)
        if m.num_attention_heads % t == 0 and m.query_groups % t == 0 and req.gpus % t == 0
    ]


def _cp_choices(req: Request, tp: int) -> list[int]:
    if "cp" in req.fixed:
        return [req.fixed["cp"]]
    m = req.model
    if m.transformer_impl != "transformer_engine" or not req.flash:
        return [1]
    return [c for c in _powers(req.gpus // tp) if c == 1 or m.seq_length % (2 * c) == 0][:4]


def _expert_choices(req: Request, tp: int, cp: int, dp: int) -> list[tuple[int, int | None]]:
    experts = req.model.num_experts
    if experts is None:
        return [(1, None)]
    eps = [req.fixed["ep"]] if "ep" in req.fixed else [e for e in _divisors(experts)]
    etps = [req.fixed["etp"]] if "etp" in req.fixed else sorted({1, tp})
    return [
        (e, None if t == tp else t)
        for e in eps for t in etps if (tp * cp * dp) % (e * t) == 0
    ]


def _layouts(req: Request) -> Iterator[Layout]:
    """Yield every parallel size combination (no split yet) that divides the GPUs and batch."""
    m = req.model
    sp_ok = m.transformer_impl == "transformer_engine" or m.use_apex
    for tp in _tp_choices(req):
        for cp in _cp_choices(req, tp):
            if req.gpus % (tp * cp):
                continue
            pps = [req.fixed["pp"]] if "pp" in req.fixed else _divisors(req.gpus // (tp * cp))
            for pp in pps:
                if pp > m.num_layers or req.gpus % (tp * cp * pp):
                    continue
                dp = req.gpus // (tp * cp * pp)
                if req.global_batch_size % dp:
                    continue
                for ep, etp in _expert_choices(req, tp, cp, dp):
                    sp = tp > 1 and sp_ok
                    if m.num_experts is not None and tp > 1 and not sp:
                        continue
                    yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp)


def _vpp_choices(req: Request, pp: int, m: int) -> list[int]:
    if "vpp" in req.fixed:
        return [req.fixed["vpp"]]
    if pp == 1:
        return [1]
    out = [1]
    for v in (2, 3, 4, 6, 8):
        if req.model.num_layers >= pp * v and m % pp == 0 and m >= pp:
            out.append(v)
    return out


def megatron_flags(job: Job, split: Split) -> list[str]:
    """Return the launch-script flags of a plan, Megatron-LM's spelling."""
    lay, training, model = job.layout, job.training, job.model
    out = [
        f"--tensor-model-parallel-size {lay.tp}",
        f"--pipeline-model-parallel-size {lay.pp}",
    ]
    if lay.cp > 1:
        out.append(f"--context-parallel-size {lay.cp}")
    if lay.ep > 1:
        out.append(f"--expert-model-parallel-size {lay.ep}")
    if lay.etp is not None:
        out.append(f"--expert-tensor-parallel-size {lay.etp}")
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    for name, value in split_flags(split, model.num_layers, lay.pp, lay.chunks).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        else:
            out.append(f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {value}")
    out += [
        f"--micro-batch-size {training.micro_batch_size}",
        f"--global-batch-size {training.global_batch_size}",
    ]
    if training.recompute != "none":
        out.append(f"--recompute-granularity {training.recompute}")
        if training.recompute == "full":
            out += ["--recompute-method uniform", "--recompute-num-layers 1"]
    if model.dtype_name == "bfloat16":
        out.append("--bf16")
    elif model.dtype_name == "float16":
        out.append("--fp16")
    if training.flash_attention:
        out.append("--use-flash-attn")
    if training.use_distributed_optimizer:
        out += ["--use-distributed-optimizer", "--overlap-param-gather"]
    out.append("--overlap-grad-reduce")
    return out


def layout_for(lay: Layout, model: ModelConfig, split: Split, vpp: int) -> Layout | None:
    """Return the Layout megatron would get from the split's flags (None if they are invalid)."""
    flags = split_flags(split, model.num_layers, lay.pp, vpp)
    values: dict[str, Any] = {"vpp": vpp if vpp > 1 else None}
    for name, value in flags.items():
        if name == "num_virtual_stages_per_pipeline_rank":
            continue
        values[name] = value
    if "pipeline_model_parallel_layout" in flags:
        values["vpp"] = vpp if vpp > 1 else None
    return replace(lay, **values)


@lru_cache(maxsize=65536)
def _live_points(stage: int, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Return the schedule's in-flight points that no other point covers chunk by chunk.

    With every chunk's bytes positive, the peak lies on one of them (a covered point holds less).
    """
    frontier: list[tuple[int, ...]] = []
    for point in sorted(set(live_microbatches(stage, pp, m, v)), key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(f, point, strict=True)) for f in frontier):
            frontier.append(point)
    return tuple(sorted(frontier))


@lru_cache(maxsize=65536)
def _layer_bytes(dims: ModelDims, par: Layout, i: int, mbs: int, recompute: str, flash: bool) -> float:
    return layer_activations(dims, par, i, mbs, recompute, flash).total  # type: ignore[arg-type]


def _chunk_bytes(
    dims: ModelDims, par: Layout, layers: list[int], mbs: int, recompute: str, flash: bool
) -> float:
    """Return one micro-batch's bytes of a chunk's layers (layers of one kind cost the same)."""
    kinds: dict[bool, list[int]] = {}
    for i in layers:
        kinds.setdefault(dims.is_moe_layer(i), []).append(i)
    return sum(
        len(group) * _layer_bytes(dims, par, group[0], mbs, recompute, flash)
        for group in kinds.values()
    )


def stage_activation_bytes(
    dims: ModelDims, par: Layout, stage: int, chunks: list[list[int]], mbs: int, m: int,
    recompute: str, flash: bool,
) -> tuple[int, tuple[int, ...]]:
    """Return activations.stage_activations' peak (rounded up) and in-flight counts, fast."""
    v = len(chunks)
    per = [_chunk_bytes(dims, par, c, mbs, recompute, flash) for c in chunks]
    if stage == 0:
        per[0] += embedding_activations(dims, par, mbs).total
    if stage == par.pp - 1:
        per[-1] += output_activations(dims, par, mbs).total
    if v == 1:  # 1F1B: the peak is min(p - s, m) micro-batches (formulas.microbatches_in_flight)
        best: tuple[int, ...] = (min(par.pp - stage, m),)
    else:
        points = _live_points(stage, par.pp, m, v)
        best = max(points, key=lambda pt: sum(n * x for n, x in zip(pt, per, strict=True)))
    total = sum(n * x for n, x in zip(best, per, strict=True))
    if recompute == "full":
        total += max(
            (_layer_bytes(dims, par, i, mbs, "none", flash) for c in chunks for i in c), default=0.0
        )
    return math.ceil(total), best


@lru_cache(maxsize=1024)
def _shard_pairs(lay: Layout) -> tuple[tuple[int, int], ...]:
    from inspector.ranks import rank_shard_indices

    if lay.ep == 1:
        return tuple((d, 0) for d in range(lay.dp))
    return tuple(sorted({(d, e) for p, d, e in rank_shard_indices(replace(lay, pp=1)) if p == 0}))


_STATE: dict[tuple[Any, ...], tuple[Any, int]] = {}


@lru_cache(maxsize=4096)
def _pair_layout(lay: Layout) -> Layout:
    """Return the layout whose ranks' (data, expert data) indices every stage shares."""
    return replace(lay, pp=1, vpp=None, decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None,
                   account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False,
                   pipeline_model_parallel_layout=None)


def _stage_state(job: Job, stage: int, shapes: tuple[ChunkShape, ...], pairs_of: Layout) -> Any:
    """Return plan_memory.stage_state, computed once per distinct stage (mbs, recompute apart)."""
    lay, training = job.layout, job.training
    key = (piece_key(job), shapes, stage == 0, lay.pp, training.use_distributed_optimizer,
           training.overlap_grad_reduce, training.ddp_bucket_size, pairs_of)
    if key not in _STATE:
        _STATE[key] = stage_state(job, stage, shapes, _shard_pairs(pairs_of))
    return _STATE[key][0]


def _signature(dims: ModelDims, chunks: list[list[int]]) -> tuple[Any, ...]:
    """Return what a stage's layers cost depends on: counts, or the layers when MoE varies."""
    if dims.num_experts is None:
        return tuple(len(c) for c in chunks)
    return tuple(tuple(c) for c in chunks)


def evaluate(job: Job, split: Split, req: Request) -> Plan:
    """Price one candidate: exact state bytes per stage, activations, time."""
    return _timed(job, split, req, *_price_memory(job, split))


def _price_memory(job: Job, split: Split) -> tuple[list[list[list[int]]], tuple[StagePlan, ...]]:
    """Return each rank's chunks' layers and its memory: exact state, activation peak."""
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job.dims()
    v = lay.chunks
    placed = chunk_layers(split, lay.pp, v)
    pairs_of = _pair_layout(lay)
    stages = []
    for s in range(lay.pp):
        shapes = tuple(
            ChunkShape(len(c), s == 0 and k == 0, s == lay.pp - 1 and k == v - 1)
            for k, c in enumerate(placed[s])
        )
        state = _stage_state(job, s, shapes, pairs_of)
        act, flight = _activations(
            dims, pairs_of, lay.pp, s, _signature(dims, placed[s]), placed[s],
            schedule.micro_batch_size, schedule.num_microbatches, training.recompute,
            training.flash_attention,
        )
        stages.append(StagePlan(s, tuple(tuple(c) for c in placed[s]), state.total, state.weights,
                                state.gradients, state.optimizer, act, flight))
    return placed, tuple(stages)


def _timed(
    job: Job, split: Split, req: Request, placed: list[list[list[int]]],
    stages: tuple[StagePlan, ...],
) -> Plan:
    """Return the plan with its step time (plan_cost), given its memory."""
    lay, training = job.layout, job.training
    schedule = job.schedule()
    dims = job.dims()
    net = Network(req.gpu, req.gpus_per_node)
    pairs_of = _pair_layout(lay)
    times = [
        _time(dims, pairs_of, lay, net, req.efficiency, schedule.micro_batch_size,
              training.recompute, _signature(dims, placed[st.stage]), placed[st.stage],
              st.stage == lay.pp - 1, (st.gradients, st.weights, st.state), training)
        for st in stages
    ]
    step = step_time(times, schedule.num_microbatches, lay.chunks)
    return Plan(job, split, stages, step, _iteration_flops(dims, schedule.global_batch_size),
                req.gpu)


_ACT: dict[tuple[Any, ...], tuple[int, tuple[int, ...]]] = {}
_TIME: dict[tuple[Any, ...], StageTime] = {}


@lru_cache(maxsize=256)
def _iteration_flops(dims: ModelDims, global_batch_size: int) -> int:
    return iteration_flops(dims, global_batch_size)


def _activations(
    dims: ModelDims, pairs_of: Layout, pp: int, stage: int, signature: tuple[Any, ...],
    chunks: list[list[int]], mbs: int, m: int, recompute: str, flash: bool,
) -> tuple[int, tuple[int, ...]]:
    """Return stage_activation_bytes, once per distinct stage."""
    position = min(pp - stage, m) if len(chunks) == 1 else stage  # 1F1B: only p - s matters
    key = (dims, pairs_of, pp, stage == 0, stage == pp - 1, position, signature, mbs, m,
           recompute, flash)
    if key not in _ACT:
        par = replace(pairs_of, pp=pp)
        _ACT[key] = stage_activation_bytes(dims, par, stage, chunks, mbs, m, recompute, flash)
    return _ACT[key]


def _time(
    dims: ModelDims, pairs_of: Layout, lay: Layout, net: Network, efficiency: float, mbs: int,
    recompute: str, signature: tuple[Any, ...], chunks: list[list[int]], has_output: bool,
    state: tuple[int, int, int], training: Training,
) -> StageTime:
    """Return plan_cost.stage_time, once per distinct stage."""
    key = (dims, pairs_of, lay.pp, net, efficiency, mbs, recompute, signature, has_output,
           state, training.use_distributed_optimizer)
    if key not in _TIME:
        _TIME[key] = stage_time(
            dims, lay, net, efficiency, mbs, recompute, chunks, has_output, state[:2], state[2],
            training.use_distributed_optimizer,
        )
    return _TIME[key]


def _splits(req: Request, lay: Layout, v: int, first: float, last: float) -> list[Split]:
    layers, stages = req.model.num_layers, lay.pp * v
    found: list[Split] = []
    if "split" in req.fixed:
        return [req.fixed["split"]]
    for candidate in (
        even_split(layers, stages),
        accounted_split(layers, stages, True, True),
        balance(layers, stages, round(first, 2), round(last, 2)),
    ):
        if candidate is not None and candidate not in found:
            found.append(candidate)
    return found


def _capped_split(
    req: Request, base: Layout, v: int, splits: list[Split], mbs: int, distopt: bool,
    flash: bool, first: float, last: float,
) -> Split | None:
    """Return plan_split.balance with each virtual stage capped at the layers that fit memory.

    Without recomputation, rank s holds each layer's state plus its activations times the
    micro-batches its chunk c keeps in flight (the schedule's replay, the most of any point):
    a rank's budget, less its embedding / output state, is shared evenly by its v chunks. The
    caps are an estimate for the DP only; the split it returns is priced exactly like any other.
    """
    if base.pp == 1 or "split" in req.fixed or not splits:
        return None
    lay = layout_for(base, req.model, splits[0], v)
    job = _job(req, lay, mbs, "none", distopt, flash) if lay else None
    if job is None:
        return None
    pp, m, dims = base.pp, job.schedule().num_microbatches, job.dims()
    pairs_of = _pair_layout(job.layout)
    one, two, ends = (
        _stage_state(job, 1, shapes, pairs_of).total
        for shapes in (
            (ChunkShape(1, False, False),), (ChunkShape(2, False, False),),
            (ChunkShape(1, True, False), ChunkShape(1, False, True)),
        )
    )
    per_layer_state = two - one
    layer = max(_layer_bytes(dims, replace(pairs_of, pp=pp), i, mbs, "none", flash)
                for i in {0, dims.num_layers - 1})
    caps = [0] * (pp * v)
    for s in range(pp):
        try:
            points = _live_points(s, pp, m, v) if v > 1 else ((min(pp - s, m),),)
        except ConfigError:  # megatron's interleaved schedule refuses this m
            return None
        flight = [max(p[c] for p in points) for c in range(v)]
        fixed = (ends - 2 * one) if s in (0, pp - 1) else 0
        budget = (req.memory - fixed) / v
        for c in range(v):
            caps[c * pp + s] = max(1, int(budget // (per_layer_state + layer * flight[c])))
    return balance(req.model.num_layers, pp * v, round(first, 2), round(last, 2), tuple(caps))


def _extras(job: Job, req: Request) -> tuple[float, float]:
    """Return the embedding and output-layer costs in units of one layer (time model)."""
    dims = job.dims()
    from inspector.flops import layer_flops, logit_flops

    layer = layer_flops(dims, 0, 1).total
    # The embedding has no FLOPs, but the first stage holds the most micro-batches in flight;
    # megatron's --account-for-embedding-in-pipeline-split counts it as a layer: so do we
    # for memory, not time (0 in time).
    return 0.0, logit_flops(dims, 1) / layer


def search(req: Request, progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """Return the feasible plans, fastest first (at most `req.top`).

    Args:
        req: the model, cluster and fixed dimensions.
        progress: called with (candidates evaluated, plans feasible) now and then.
    """
    start = time.perf_counter()
    evaluated = 0
    feasible: list[Plan] = []
    smallest: Plan | None = None
    flash = req.flash
    mbs_choices = [req.fixed["mbs"]] if "mbs" in req.fixed else [1, 2, 4, 8]
    recomputes = [req.fixed["recompute"]] if "recompute" in req.fixed else list(RECOMPUTES)
    any_layout = False
    unfit: set[tuple[Any, ...]] = set()  # (layout, vpp, split, distopt) that no recompute fits
    for base in _layouts(req):
        first, last = _extras(Job(req.model, Layout(tp=base.tp)), req)
        for mbs in mbs_choices:  # ascending: what does not fit at b does not fit at 2b
            if req.global_batch_size % (mbs * base.dp):
                continue
            m = req.global_batch_size // (mbs * base.dp)
            for v in _vpp_choices(req, base.pp, m):
                splits = _splits(req, base, v, first, last)
                for distopt in _distopts(req, base):
                    capped = _capped_split(req, base, v, splits, mbs, distopt, flash, first, last)
                    for split in splits + ([capped] if capped and capped not in splits else []):
                        lay = layout_for(base, req.model, split, v)
                        key = (base, v, split, distopt)
                        if lay is None or key in unfit:
                            continue
                        outcome = _first_fit(req, lay, split, mbs, distopt, flash, recomputes)
                        if outcome is None:
                            continue
                        any_layout = True
                        tried, plan, least = outcome
                        evaluated += tried
                        if plan is not None:
                            feasible.append(plan)
                        elif smallest is None or least[1] < smallest.peak:
                            smallest = _timed(least[0], split, req, *_price_memory(least[0], split))
                        if plan is None and recomputes[-1] == "full":
                            unfit.add(key)
                        if progress is not None and evaluated // 500 != (evaluated - tried) // 500:
                            progress(evaluated, len(feasible))
    if not any_layout:
        raise ConfigError(
            f"--gpus {req.gpus} admits no layout Megatron-LM accepts for this model and "
            f"--global-batch-size {req.global_batch_size} (tp x cp x pp x dp must equal the GPUs, "
            "dp must divide the global batch, tp must divide the heads and query groups)"
        )
    feasible.sort(key=lambda p: (p.time.seconds, p.peak))
    return SearchResult(
        feasible[: req.top] if req.top else feasible,
        evaluated,
        time.perf_counter() - start,
        None if feasible else (smallest.peak if smallest else None),
        smallest,
    )


def _distopts(req: Request, base: Layout) -> list[bool]:
    if "distopt" in req.fixed:
        return [req.fixed["distopt"]]
    return [True, False] if base.dp * base.cp > 1 else [False]


def _first_fit(
    req: Request, lay: Layout, split: Split, mbs: int, distopt: bool, flash: bool,
    recomputes: list[str],
) -> tuple[int, Plan | None, tuple[Job, int]] | None:
    """Return (candidates priced, the plan with the least recomputation that fits, the least
    memory seen); memory first, time only for the plan that fits. None: megatron refuses all."""
    tried = 0
    least: tuple[Job, int] | None = None
    for recompute in recomputes:
        job = _job(req, lay, mbs, recompute, distopt, flash)
        if job is None:
            continue
        try:
            placed, stages = _price_memory(job, split)
        except ConfigError:
            continue
        tried += 1
        peak = max(st.total for st in stages)
        if peak <= req.memory:
            return tried, _timed(job, split, req, placed, stages), (job, peak)
        if least is None or peak < least[1]:
            least = (job, peak)
    return None if least is None else (tried, None, least)


def _job(req: Request, lay: Layout, mbs: int, recompute: str, distopt: bool, flash: bool) -> Job | None:
    """Return the candidate's Job, or None where megatron's rules (job.py) refuse it."""
    training = Training(
        micro_batch_size=mbs,
        global_batch_size=req.global_batch_size,
        recompute=recompute,  # type: ignore[arg-type]
        flash_attention=flash,
        use_distributed_optimizer=distopt,
        overlap_grad_reduce=True,
    )
    try:
        job = Job(req.model, lay, training)
        job.schedule()
    except ConfigError:
        return None
    return job


def progress_line(stream: Any = None) -> Callable[[int, int], None] | None:
    """Return a progress callback writing to stderr, or None when stderr is not a terminal."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(evaluated: int, feasible: int) -> None:
        stream.write(f"\rplan: {evaluated} candidates evaluated, {feasible} fit")
        stream.flush()

    return show


FIXED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "num_virtual_stages_per_pipeline_rank": "vpp",
    "micro_batch_size": "mbs",
    "recompute_granularity": "recompute",
}


def make_request(
    args: dict[str, Any], gpus: int, gpu_name: str, gpu_memory: float | None,
    gpus_per_node: int, gpu_tflops: float | None, intra: float | None, inter: float | None,
    efficiency: float, top: int,
) -> Request:
    """Check the plan flags and return the search request."""
    from inspector.config import make_model_config
    from inspector.plan_cost import get_gpu

    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--top", top)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if not 0 < efficiency <= 1:
        raise ConfigError(f"--efficiency must lie in (0, 1], got {efficiency}")
    batch = args.get("global_batch_size")
    if not batch:
        raise ConfigError("--global-batch-size is required: the plan splits it over data parallel")
    gpu = get_gpu(gpu_name)
    overrides: dict[str, float | None] = {
        "tflops": gpu_tflops,
        "intra": None if intra is None else intra * 1e9,
        "inter": None if inter is None else inter * 1e9,
    }
    for name, given in overrides.items():
        if given is not None:
            amount: float = given
            if amount <= 0:
                raise ConfigError(f"--{name} must be positive, got {amount}")
            gpu = replace(gpu, **{name: amount})  # type: ignore[arg-type]
    memory_gib = gpu.memory_gib if gpu_memory is None else gpu_memory
    if memory_gib <= 0:
        raise ConfigError(f"--gpu-memory must be positive (GiB), got {memory_gib}")
    fixed = {short: args[name] for name, short in FIXED.items() if args.get(name) is not None}
    if args.get("use_distributed_optimizer"):
        fixed["distopt"] = True
    return Request(
        model=make_model_config(args), gpus=gpus, gpu=gpu, memory=round(memory_gib * (1 << 30)),
        global_batch_size=batch, gpus_per_node=gpus_per_node, efficiency=efficiency,
        fixed=fixed, top=top,
    )
