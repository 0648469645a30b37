"""Megatron-FSDP's (and FSDP2's) parameter all-gathers and gradient reductions as SimAI records.

What megatron-core 0.16.1 runs (distributed/fsdp/src/megatron_fsdp/, with Megatron-LM's schedule:
`no_sync` around every micro-batch but the last), per bucket of world/fsdp.py's layout, each
collective moving the whole padded bucket (`fetch_bucket`: parameters in their dtype, gradients
in the main-grad dtype), dense buckets over dp x cp ranks, expert buckets over the expert
data-parallel group (mcore_fsdp_adapter.py `dp_cp_group`, `expt_dp_group`):

  no_shard            no parameter gather (`all_gather_and_wait_parameters_ready` returns);
                      gradients all-reduced on the last micro-batch
  optim               every bucket gathered once per step; reduce-scatter, last micro-batch
  optim_grads         every bucket gathered once per step; reduce-scatter, every micro-batch
  optim_grads_params  each TransformerLayer unit gathered before its forward and again before
                      its backward, every micro-batch, the other buckets once per step;
                      reduce-scatter, every micro-batch

Gradients: `GradReducePipeline._bucket_group_gradient_reduce` (all-reduce under no_shard, else
reduce-scatter), on every backward for optim_grads and optim_grads_params
(`grad_reduce_every_bprop`), else on the last micro-batch. Parameters: the buckets start each step
empty (`AllGatherPipeline.reset` in `finish_grad_sync` / `start_param_sync`) and a forward
pre-hook gathers each (`async_bucket_gather`); only unit buckets are released, after the unit's
forward (`_post_forward`) and backward (`_post_backward_release_module`), so under
optim_grads_params a unit is gathered twice per micro-batch and the rest once per step.

PyTorch FSDP2 under megatron (torch_fully_sharded_data_parallel.py, torch 2.13's _fully_shard):
every `fully_shard` unit, the root's parameters included (megatron passes reshard_after_forward
True, so the root reshards too), is gathered before its forward and its backward and
reduce-scattered after its backward in every micro-batch (`no_sync` is data_parallel_base.py's
no-op); gradients in the parameters' dtype (no mixed-precision policy). world/fsdp.py's
Fsdp2Unit sizes each unit's gathered buffer (rows padded to a multiple of the ranks).

Where SimAI runs them: in the weight-gradient column. SimAI-Analytical (aliyun/SimAI cef83f9d,
Layer.cc 576-587) times a forward or input-gradient collective over tp ranks whatever its suffix
(`_DP_EP` too: over tp ranks on the DP_EP links, 0 ns at tp 1), and a weight-gradient one over
its data-parallel group, all_gpus / (tp pp) = dp x cp ranks (`_DP_EP`: / ep), megatron's dense
FSDP group exactly; expert buckets take the expert-gradient group of simai_groups.py. SimAI adds
them up as exposed data-parallel time (`-dp_o` 0) and leaves them out of the pipeline-bubble
term; megatron prefetches the next unit's gather under the current unit's compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from inspector.report.simai import NONE, Record
from inspector.report.simai_groups import expert_grad_group, simai_dp
from inspector.report.workload_inputs import Context, FsdpBucketInput, StageInput

GATHERED_EACH_STEP = ("optim", "optim_grads")  # every bucket; optim_grads_params: outside units
REDUCED_EACH_STEP = {"no_shard": "ALLREDUCE", "optim": "REDUCESCATTER"}  # on the last micro-batch
PER_UNIT = ("optim_grads_params", "fsdp2")  # units gathered twice, reduced once per micro-batch


def _group(job: Context, expert: bool) -> str | None:
    """Return the weight-grad suffix of a bucket's collectives, None where its group has one rank."""
    if expert:
        return expert_grad_group(job.par)
    return "" if simai_dp(job.par) > 1 else None


def _records(
    job: Context, name: str, kind: str, buckets: Sequence[FsdpBucketInput], grads: bool
) -> list[Record]:
    """Return one record per group kind (dense, expert) of `buckets`: `kind` of their bytes."""
    records = []
    for expert in (False, True):
        chosen = [b for b in buckets if b.expert == expert]
        group = _group(job, expert)
        if not chosen or group is None:
            continue
        size = sum(b.numel * (b.grad_bytes if grads else b.param_bytes) for b in chosen)
        label = f"moe_{name}" if expert else name
        records.append(Record(label, wg_comm=kind + group, wg_bytes=size))
    return records


def fsdp_step_records(job: Context, stage: StageInput, step: int) -> list[Record]:
    """Return the once-per-step records, under AICB's names as the DDP writer's.

    `grad_gather` (dense) and `moe_grad_norm1` (expert): the parameter all-gather of the buckets
    gathered once per step; `grad_param_comm` / `moe_grad_norm2`: the gradient reduction on the
    last micro-batch; `grad_param_compute`: the optimizer step (`step` ns).
    """
    strategy = job.training.sharding
    once = [b for b in stage.fsdp if strategy in GATHERED_EACH_STEP or b.unit is None]
    if strategy in ("no_shard", "fsdp2"):
        once = []
    reduce = REDUCED_EACH_STEP.get(str(strategy))
    records = []
    for expert, (gather_name, reduce_name) in (
        (False, ("grad_gather", "grad_param_comm")),
        (True, ("moe_grad_norm1", "moe_grad_norm2")),
    ):
        buckets = [b for b in stage.fsdp if b.expert == expert]
        group = _group(job, expert)
        if not buckets or group is None:
            if not expert:  # AICB always writes the dense pair; keep the names, empty
                records += [Record("grad_gather"), Record("grad_param_comm")]
                records += [Record("grad_param_compute", ig_compute=step)] if buckets else []
            continue
        gathered = [b for b in once if b.expert == expert]
        params = sum(b.numel * b.param_bytes for b in gathered)
        grads = sum(b.numel * b.grad_bytes for b in buckets) if reduce else 0
        pair = [
            Record(gather_name, wg_comm="ALLGATHER" + group if params else NONE, wg_bytes=params),
            Record(reduce_name, wg_comm=reduce + group if reduce else NONE, wg_bytes=grads),
        ]
        if expert:  # the expert pair only where it moves something
            records += [r for r in pair if r.wg_comm != NONE]
        else:
            records += [*pair, Record("grad_param_compute", ig_compute=step)]
    return records


def fsdp_layer_records(
    job: Context, stage: StageInput, layer: int
) -> tuple[list[Record], list[Record]]:
    """Return the records before and after `layer`'s own, one micro-batch (optim_grads_params).

    Before: its unit's parameter all-gather for the forward; after: the all-gather again for the
    backward, then the gradient reduce-scatter.
    """
    if job.training.sharding not in PER_UNIT:
        return [], []
    unit = [b for b in stage.fsdp if b.unit is not None and b.layer == layer]
    before = _records(job, "fsdp_param_gather", "ALLGATHER", unit, grads=False)
    after = _records(job, "fsdp_param_regather", "ALLGATHER", unit, grads=False)
    after += _records(job, "fsdp_grad_reduce", "REDUCESCATTER", unit, grads=True)
    return before, after


def fsdp_microbatch_end(job: Context, stage: StageInput) -> list[Record]:
    """Return the per-micro-batch records of the buckets outside the layers' units.

    optim_grads: every bucket's gradient reduce-scatter; optim_grads_params: those of the buckets
    outside units, and an MTP layer's unit (gathered twice, reduce-scattered); FSDP2: each unit
    outside the layers (the root's parameters, the embedding, the output layer), gathered twice
    and reduce-scattered.
    """
    strategy = job.training.sharding
    if strategy not in ("optim_grads", *PER_UNIT):
        return []
    records = []
    if strategy in PER_UNIT:
        mtp = sorted({b.unit for b in stage.fsdp if b.unit is not None and b.layer is None})
        for unit in mtp:
            buckets = [b for b in stage.fsdp if b.unit == unit]
            records += _records(job, "fsdp_param_gather", "ALLGATHER", buckets, grads=False)
            records += _records(job, "fsdp_param_regather", "ALLGATHER", buckets, grads=False)
            records += _records(job, "fsdp_grad_reduce", "REDUCESCATTER", buckets, grads=True)
    outside = [b for b in stage.fsdp if strategy == "optim_grads" or b.unit is None]
    for bucket in reversed(outside):  # the backward fills the last bucket first
        records += _records(job, "fsdp_grad_reduce", "REDUCESCATTER", [bucket], grads=True)
    return records
