"""A `plan` candidate's step time, given its memory (price.py): each distinct stage's passes
per micro-batch priced once (cost.stage_work, in `_TIME`), then with its state's data-parallel
and optimizer time (cost.with_state), the step from cost.step_time; and `time_floors`, the least
step any recomputation of a setting can take, which search.py reads before pricing its memory.
Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import inspector.caches as caches
from inspector.formulas.flops import iteration_flops
from inspector.formulas.hybrid_flops import hybrid_stage_flops
from inspector.formulas.optimizer import OptimizerStep
from inspector.job.dims import ModelDims
from inspector.job.hardware import Gpu
from inspector.job.job import Job
from inspector.job.layout import Layout
from inspector.memory.compose.stage_activations import recompute_recipe
from inspector.memory.measure import job_optimizer_bytes
from inspector.plan.cost import StageTime, stage_work, step_time, with_state
from inspector.plan.flex import exchange_sm_share
from inspector.plan.host import graphed_layers, host_syncs
from inspector.plan.layouts import unsplit_layout
from inspector.plan.network import Network, nvls_allowed
from inspector.plan.overlap import merged_share, stage_alone
from inspector.plan.price import (
    Placed,
    Plan,
    StagePlan,
    job_dims,
    pair_layout,
    price_memory,
    sharding_of,
    split_stages,
)
from inspector.plan.request import Request
from inspector.plan.split import Split
from inspector.world.environment import te_fuses_bf16_moments


def _overlap(
    job: Job, dims: ModelDims, stage: int, chunk_layers: Sequence[Sequence[int]], gpu: Gpu
) -> tuple[float, bool, float, tuple[tuple[bool, bool, float], ...]]:
    """Return cost.stage_work's `overlap` for the stage: merged share, delayed weight grads,
    the share of the GPU's SMs the exchange kernels hold (flex.exchange_sm_share), the layer
    passes run alone inside merged steps (overlap.stage_alone)."""
    training, lay, m = job.training, job.layout, job.schedule().num_microbatches
    if not training.ep_overlap:
        return 0.0, False, 0.0, ()
    alone = stage_alone(dims, stage, lay.pp, m, chunk_layers)
    share = merged_share(stage, lay.pp, m, lay.chunks)
    return share, training.delay_wgrad, exchange_sm_share(training, gpu), alone


def _step_setup(job: Job, dims: ModelDims) -> OptimizerStep:
    """Return what the optimizer step runs on (precision-aware: the declared TE's FusedAdam)."""
    each, training = job_optimizer_bytes(job), job.training
    fused = dims.fused_kernels or each.precision.precision_aware
    return OptimizerStep(dims.activation_bytes, 4, fused, job.model.fp16, each,
                         training.log_params_norm, training.log_num_zeros_in_grad,
                         te_fuses_bf16_moments())


def evaluate(job: Job, split: Split, req: Request) -> Plan:
    """Price one candidate as the search does: exact state bytes per stage, activations, time."""
    return timed(job, split, req, *price_memory(job, split))


def timed(
    job: Job, split: Split, req: Request, placed: Placed, stages: tuple[StagePlan, ...]
) -> Plan:
    """Return the plan with its step time (cost.py), given its memory."""
    lay, training, schedule, dims = job.layout, job.training, job.schedule(), job_dims(job)
    net = Network(req.gpu, req.gpus_per_node, nvls_allowed(req.nccl_algo))
    scope, works = _passes(job, split, req, dims, net)
    # grad_bytes: read from each stage's buffers by cost.optimizer_seconds
    step_setup, distributed = _step_setup(job, dims), sharding_of(training)
    times = [_stage_time(scope, work, st, lay, net, distributed, step_setup)
             for work, st in zip(works, stages, strict=True)]
    step = step_time(times, schedule.num_microbatches, lay.chunks)
    flops = _iteration_flops(dims, schedule.global_batch_size)
    if job.model.is_hybrid_model:  # Megatron-LM's hybrid branch, as `memory` counts it
        depths = dims.mtp_num_layers if dims.mtp_symbols else 0
        flops = round(hybrid_stage_flops(job.model, dims, dims.layer_symbols + dims.mtp_symbols * depths,
                                         schedule.global_batch_size, 1 + depths))
    return Plan(job, split, stages, step, flops, req.gpu)


def time_floors(job: Job, split: Split, req: Request) -> tuple[float, float]:
    """Return two step times, without the job's memory: what no recomputation of its layout,
    split and micro-batch size beats, and what no other split of its layers on these stages
    beats (0.0 under --overlap-moe-expert-parallel-comm, whose merged passes depend on the split).

    The first is the pipeline of the stages' passes at the job's own recomputation (search.py
    gives the least) on the GPU alone: each term of a stage's passes (compute, tensor, context,
    expert, p2p) only grows with recomputation, and the step adds the host's wait, FSDP,
    data-parallel and optimizer time. The second puts every stage at their mean: their sum is
    the same for every split (a layer's cost reads its kind, not its place), and the pipeline
    is least when no stage is slower than another (tests/test_plan_floor.py checks both against
    every plan a search prices)."""
    net = Network(req.gpu, req.gpus_per_node, nvls_allowed(req.nccl_algo))
    scope, works = _passes(job, split, req, job_dims(job), net)
    gpu = [replace(scope[work], wait=0.0) for work in works]
    m, chunks = job.schedule().num_microbatches, job.layout.chunks
    floor = step_time(gpu, m, chunks).seconds
    if job.training.ep_overlap:
        return floor, 0.0
    mean = sum(each.per_microbatch for each in gpu) / len(gpu)
    return floor, step_time([StageTime(mean, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)] * len(gpu), m, chunks).seconds


def _passes(
    job: Job, split: Split, req: Request, dims: ModelDims, net: Network
) -> tuple[dict[tuple[Any, ...], StageTime], list[tuple[Any, ...]]]:
    """Return the scope of `_TIME` the job's stages are priced in, and each stage's key there:
    its passes per micro-batch (cost.stage_work), priced once per distinct stage."""
    lay, training, mbs = job.layout, job.training, job.schedule().micro_batch_size
    stages_of = split_stages(job.model, dims, split, lay.pp, lay.chunks)
    flex = training.moe_token_dispatcher_type == "flex"
    host = (host_syncs(training), graphed_layers(training))
    # a stage's passes read no optimizer setting: `distributed` is in its time's key (_stage_time)
    scope = _TIME.setdefault(
        (dims, pair_layout(lay), lay.pp, net, req.efficiency, mbs, training.recompute,
         training.recompute_modules, flex, host), {},
    )
    works = []
    for s, layers in enumerate(stages_of.placed):
        has_output, recipe = s == lay.pp - 1, recompute_recipe(training, layers)
        work = (stages_of.signature_keys[s], has_output, recipe,
                _overlap(job, dims, s, layers, req.gpu), s == 0)
        if work not in scope:
            granularity, method, n = recipe
            scope[work] = stage_work(
                dims, unsplit_layout(lay), net, req.efficiency, mbs, granularity, layers,
                has_output, method, n, training.recompute_modules, work[3], flex, s == 0, host,
            )
        works.append(work)
    return scope, works


def _stage_time(scope: dict[Any, Any], work: tuple[Any, ...], st: StagePlan, lay: Layout,
                net: Network, distributed: Any, step_setup: Any) -> Any:  # fmt: skip
    """Return a stage's time: its passes (`scope[work]`) with its state's communication and step."""
    held = st.state
    key = (*work, held.gradients, held.all_gather_bytes, held.kept, held.elements, held.total,
           step_setup, distributed)
    if key not in scope:
        # the all-gather moves the param buffers (fp8 ones 1 byte an element), not TE's
        # transposes; an element's gradient bytes from the buffers
        grad_bytes = held.gradients // held.elements if held.elements else None
        scope[key] = with_state(
            scope[work], lay, net, (held.gradients, held.all_gather_bytes), held.total - held.kept,
            distributed, step_setup, grad_bytes,
        )
    return scope[key]


# (dims, ranks, pp, network, efficiency, mbs, recompute, modules, flex, host) -> (signature,
# output?) -> the stage's work per micro-batch, and (..., gradients, weights, state, distopt) -> its time
_TIME: dict[tuple[Any, ...], dict[tuple[Any, ...], StageTime]] = caches.table()


@caches.memo(maxsize=256)
def _iteration_flops(dims: ModelDims, global_batch_size: int) -> int:
    return iteration_flops(dims, global_batch_size)
