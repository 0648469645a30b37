"""`plan`: search the layouts Megatron-LM accepts for a job and rank them by estimated step time.

Every candidate is a real `Job` (job.py validates it with megatron's rules), priced with exact
state memory (plan_memory.py, composed from megatron builds), activations from activations.py at
the schedule's micro-batches in flight (formulas.py replays megatron's schedules), and the time
model of plan_cost.py. Per pipeline size the layer split comes from even / accounted splits and
plan_split.balance, once on time alone and once with memory caps (`_capped_split`). Each distinct
stage is priced once (its state, activations and time depend on its own shape only), memory before
time, and micro-batch sizes stop growing once a smaller one fits nowhere. Each layout takes the
least recomputation that fits: none, selective, full with `--recompute-method block` and the
fewest checkpointed layers per chunk, then full for every layer (`_first_fit`). Nothing here prints.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Any

from inspector.errors import ConfigError
from inspector.job.job import Job, Training
from inspector.job.layout import Layout, validate_layout
from inspector.job.model import ModelConfig
from inspector.plan.memory import ChunkShape
from inspector.plan.price import (  # noqa: F401 (Plan, StagePlan, evaluate: the public API)
    Placed,
    Plan,
    Request,
    StagePlan,
    _activation_layout,
    _first_of_kind,
    _layer_bytes,
    _live_points,
    _pair_layout,
    _price_memory,
    _stage_state,
    _state_scope,
    _timed,
    evaluate,
    job_dims,
    megatron_flags,
    model_token,
    state_scope_key,
)
from inspector.plan.split import (
    Split,
    accounted_split,
    balance,
    chunk_layers,
    even_split,
    split_flags,
)

# (--recompute-granularity, --recompute-method, --recompute-num-layers), least recomputation
# first; N 0: the fewest layers per chunk that fit (`_fewest_checkpointed`)
Recipe = tuple[str, str, int]
RECOMPUTES: tuple[Recipe, ...] = (("none", "uniform", 1), ("selective", "uniform", 1),
                                  ("full", "block", 0))


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
        # + 2: an accounted split may leave the embedding (output layer) a chunk of its own
        if req.model.num_layers + 2 >= pp * v and m % pp == 0 and m >= pp:
            out.append(v)
    return out


def layout_for(lay: Layout, model: ModelConfig, split: Split, vpp: int) -> Layout | None:
    """Return the Layout megatron would get from the split's flags (None if they are invalid)."""
    return _layout_for(lay, model.num_layers, model.mtp_num_layers or 0, split, vpp)


@lru_cache(maxsize=65536)
def _layout_for(lay: Layout, num_layers: int, mtp: int, split: Split, vpp: int) -> Layout | None:
    flags = split_flags(split, num_layers, lay.pp, vpp, mtp)
    if mtp and "pipeline_model_parallel_layout" in flags and not _mtp_in_layouts():
        return None
    values: dict[str, Any] = {"vpp": vpp if vpp > 1 else None}
    for name, value in flags.items():
        if name == "num_virtual_stages_per_pipeline_rank":
            continue
        values[name] = value
    if "pipeline_model_parallel_layout" in flags:
        values["vpp"] = vpp if vpp > 1 else None
    return replace(lay, **values)


@cache
def _mtp_in_layouts() -> bool:
    """Return whether the installed megatron-core builds MTP from a layout string (0.14+; 0.13's
    PipelineParallelLayerLayout raises "MTP layer is not supported for flexible pipeline layout").
    Read from the package metadata, which imports no megatron."""
    from importlib import metadata

    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return True
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) >= (0, 14)


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
    pp, m, dims = base.pp, job.schedule().num_microbatches, job_dims(job)
    pairs_of = _pair_layout(job.layout)
    kinds = _first_of_kind(dims)  # kind: its first layer, the last layer's kind first
    terms = state_scope_key(job, pairs_of)
    if terms not in _STATE_TERMS:
        _STATE_TERMS[terms] = _state_terms(job, pairs_of, tuple(kinds))
    one, ends, per_layer_state = _STATE_TERMS[terms]
    layer = max(_layer_bytes(dims, _activation_layout(pairs_of, pp), i, mbs, "none", flash)
                for i in kinds.values())
    flights = _flights(pp, m, v)
    if flights is None:  # megatron's interleaved schedule refuses this m
        return None
    caps = [0] * (pp * v)
    for s, flight in enumerate(flights):
        fixed = (ends - 2 * one) if s in (0, pp - 1) else 0
        budget = (req.memory - fixed) / v
        for c in range(v):
            caps[c * pp + s] = max(1, int(budget // (per_layer_state + layer * flight[c])))
    return balance(req.model.num_layers, pp * v, round(first, 2), round(last, 2), tuple(caps))


_STATE_TERMS: dict[tuple[Any, ...], tuple[int, int, int]] = {}


def _state_terms(job: Job, pairs_of: Layout, kinds: tuple[bool, ...]) -> tuple[int, int, int]:
    """Return a rank's state with one layer, with one layer on each end stage (embedding,
    output), and the most one more layer of a kind adds: what _capped_split's caps need."""
    scope = _state_scope(job, pairs_of)

    def state(*shapes: ChunkShape) -> int:
        return int(_stage_state(job, 1, shapes, pairs_of, scope).total)

    k = kinds[0]
    one = state(ChunkShape((k,), False, False))
    ends = state(ChunkShape((k,), True, False), ChunkShape((k,), False, True))
    per_layer_state = max(  # the heavier kind where the model mixes MoE and dense layers
        state(ChunkShape((kind, kind), False, False)) - state(ChunkShape((kind,), False, False))
        for kind in kinds
    )
    return one, ends, per_layer_state


@lru_cache(maxsize=4096)
def _flights(pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...] | None:
    """Return per rank the most micro-batches each chunk keeps in flight at any point (None:
    megatron's interleaved schedule refuses m)."""
    flights = []
    for s in range(pp):
        try:
            points = _live_points(s, pp, m, v) if v > 1 else ((min(pp - s, m),),)
        except ConfigError:
            return None
        flights.append(tuple(max(p[c] for p in points) for c in range(v)))
    return tuple(flights)


def _extras(job: Job, req: Request) -> tuple[float, float]:
    """Return the embedding and output-layer costs in units of one layer (time model)."""
    dims = job.dims()
    from inspector.formulas.flops import layer_flops, logit_flops, mtp_flops

    layer = layer_flops(dims, 0, 1).total
    # The embedding has no FLOPs, but the first stage holds the most micro-batches in flight;
    # megatron's --account-for-embedding-in-pipeline-split counts it as a layer: so do we
    # for memory, not time (0 in time). The last stage adds the output layer and the MTP block.
    return 0.0, (logit_flops(dims, 1) + mtp_flops(dims, 1)) / layer


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
    recomputes = _recipes(req)
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
                        if plan is None and recomputes[-1][0] == "full":
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


def _recipes(req: Request) -> list[Recipe]:
    """Return the recomputation settings to try, least recomputation first, as the user fixed them.

    A fixed --recompute-method / --recompute-num-layers is used as given (block without N: the
    fewest layers that fit); --recompute-granularity full alone leaves block N and uniform open.
    """
    fixed = req.fixed
    if "recompute_method" in fixed or "recompute_num_layers" in fixed:
        method = fixed.get("recompute_method", "uniform")
        return [("full", method, fixed.get("recompute_num_layers", 0 if method == "block" else 1))]
    if "recompute" in fixed:
        granularity = fixed["recompute"]
        return [next(r for r in RECOMPUTES if r[0] == granularity)]
    return list(RECOMPUTES)


Priced = tuple[Job, Placed, tuple[StagePlan, ...], int]


def _first_fit(
    req: Request, lay: Layout, split: Split, mbs: int, distopt: bool, flash: bool,
    recomputes: list[Recipe],
) -> tuple[int, Plan | None, tuple[Job, int]] | None:
    """Return (candidates priced, the plan with the least recomputation that fits, the least
    memory seen); memory first, time only for the plan that fits. None: megatron refuses all."""
    tried = 0
    least: tuple[Job, int] | None = None

    def price(recipe: Recipe) -> Priced | None:
        nonlocal tried, least
        granularity, method, n = recipe
        job = _job(req, lay, mbs, granularity, distopt, flash, method, n)
        if job is None:
            return None
        try:
            placed, stages = _price_memory(job, split)  # state shared by recipes (_state_scope)
        except ConfigError:
            return None
        tried += 1
        peak = max(st.total for st in stages)
        if least is None or peak < least[1]:
            least = (job, peak)
        return job, placed, stages, peak

    for recipe in recomputes:
        if recipe[1:] == ("block", 0):
            found = _fewest_checkpointed(req, lay, split, recipe, price)
        else:
            found = price(recipe)
        if found is not None and found[3] <= req.memory:
            job, placed, stages, peak = found
            return tried, _timed(job, split, req, placed, stages), (job, peak)
    return None if least is None else (tried, None, least)


def _fewest_checkpointed(
    req: Request, lay: Layout, split: Split, recipe: Recipe,
    price: Callable[[Recipe], Priced | None],
) -> Priced | None:
    """Return block recomputation with the fewest layers per chunk N that fits, else the most.

    megatron-core `TransformerBlock._checkpointed_forward` with `block` checkpoints the first N
    layers of each chunk one by one and keeps all activations of the rest. Each step of N trades
    a layer's activations for its input, on every chunk that long and every micro-batch in
    flight, while the rebuild buffer holds one layer throughout (it can only grow where an MoE
    layer outweighs a dense one): memory falls as N grows, and a binary search over
    1 .. (longest chunk - 1) finds the least N, or at worst an N that fits. N = the longest chunk
    checkpoints every layer, which is `uniform` 1 (the fallback, priced first) unless the user
    fixed `block`.
    """
    most = max(len(c) for chunks in chunk_layers(split, lay.pp, lay.chunks) for c in chunks)
    fixed_block = req.fixed.get("recompute_method") == "block"
    top = price(("full", "block", most) if fixed_block else ("full", "uniform", 1))
    if top is None or top[3] > req.memory:
        return top
    best, lo, hi = top, 1, most  # invariant: hi fits (hi = most: `top`)
    while lo < hi:
        mid = (lo + hi) // 2
        found = price((recipe[0], "block", mid))
        if found is not None and found[3] <= req.memory:
            best, hi = found, mid
        else:
            lo = mid + 1
    return best


def _job(
    req: Request, lay: Layout, mbs: int, recompute: str, distopt: bool, flash: bool,
    method: str = "uniform", num_layers: int = 1,
) -> Job | None:
    """Return the candidate's Job, or None where megatron's rules (job.py) refuse it."""
    key = (model_token(req.model), lay)
    if key not in _REFUSED:
        _REFUSED[key] = _layout_refused(req.model, lay)
    if _REFUSED[key]:  # Job would raise the same, whatever the training
        return None
    asked = (*key, req.training, req.global_batch_size, mbs, recompute, distopt, flash, method,
             num_layers)
    if asked not in _JOBS:  # _capped_split and _first_fit ask for some of the same
        _JOBS[asked] = _new_job(req, lay, mbs, recompute, distopt, flash, method, num_layers)
    return _JOBS[asked]


_JOBS: dict[tuple[Any, ...], Job | None] = {}


def _new_job(
    req: Request, lay: Layout, mbs: int, recompute: str, distopt: bool, flash: bool,
    method: str, num_layers: int,
) -> Job | None:
    training = replace(
        req.training,
        micro_batch_size=mbs,
        global_batch_size=req.global_batch_size,
        recompute=recompute,  # type: ignore[arg-type]
        recompute_method=method,
        recompute_num_layers=num_layers,
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


_REFUSED: dict[tuple[int, Layout], bool] = {}


def _layout_refused(model: ModelConfig, lay: Layout) -> bool:
    """Return whether topology.validate_layout, which every Job runs, refuses this layout.

    A search asks for each layout once per micro-batch size, recomputation and optimizer; a
    split megatron refuses (a layout string without the model's MTP) is refused once.
    """
    try:
        validate_layout(model, lay)
    except ConfigError:
        return True
    return False


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
    "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
}


def make_request(
    args: dict[str, Any], gpus: int, gpu_name: str, gpu_memory: float | None,
    gpus_per_node: int, gpu_tflops: float | None, intra: float | None, inter: float | None,
    efficiency: float | None, top: int,
) -> Request:
    """Check the plan flags and return the search request."""
    from inspector.job.job import make_training
    from inspector.job.model import make_model_config
    from inspector.plan.cost import get_gpu

    for flag, value in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--top", top)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if efficiency is not None and not 0 < efficiency <= 1:
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
    asked = make_training(args)  # Megatron-LM's rules for the flags a plan keeps as given
    training = Training(
        fp32_grads=asked.fp32_grads,
        attention_dropout=asked.attention_dropout,
        hidden_dropout=asked.hidden_dropout,
    )
    return Request(
        model=make_model_config(args), gpus=gpus, gpu=gpu, memory=round(memory_gib * (1 << 30)),
        global_batch_size=batch, gpus_per_node=gpus_per_node, efficiency=efficiency,
        fixed=fixed, top=top, training=training,
    )
