"""What one pipeline stage runs in one training iteration, as SimAI workload records.

The stage's content comes from megatron (the caller builds each stage and fills a StageInput:
which global layers each virtual chunk holds, embedding, output layer, MTP layers, the DDP grad
buffers); this module only turns it into records. One file per pipeline stage: a pipeline rank
runs all its virtual chunks, and SimAI divides the bubble by `vpp` itself (Layer.cc 737).

File layout (names kept from AICB's SimAI_training_workload_generator.py, HEAD 23eec3c, so
tools keyed on them keep working; notes/simai.md compares the two record by record):
  data-parallel records, once: `grad_gather` (parameter all-gather, distributed optimizer
  only), `grad_param_comm` (gradient reduce-scatter, or all-reduce without it),
  `grad_param_compute`, then `moe_grad_norm1/2`, the same over `_DP_EP` for expert buffers.
  SimAI issues weight-grad collectives in reverse file order at the end of the backward pass
  (Workload.cc 829-862), so the reduce-scatter runs before the all-gather, as in megatron.
  then `ga` micro-batch blocks: `embedding_layer` where megatron placed the embedding, each
  chunk's layers in order, MTP layers, `final_column` and `cross_entropy1..3` where the stage
  holds the output layer (megatron computes the loss per micro-batch);
  then `optimizer1..4` once (4-byte all-reduces of the optimizer step, as AICB writes them).
Under Megatron-FSDP or FSDP2 the data-parallel records are FSDP's (workload_fsdp.py): once per
step under the same names, and per micro-batch around each layer's records and after the block.

Each transformer layer's records come from workload_layers.py (sizes and compute explained there).
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.formulas.flops import GEMM_FACTOR, logit_flops
from inspector.report.simai import NONE, Header, Record, per_microbatch, render_workload
from inspector.report.simai_groups import (
    check_groups,
    expert_grad_group,
    pipeline_send,
    simai_dp,
)
from inspector.report.workload_fsdp import (
    fsdp_layer_records,
    fsdp_microbatch_end,
    fsdp_step_records,
)
from inspector.report.workload_inputs import ComputeProfile, ComputeRate, Context, StageInput
from inspector.report.workload_layers import layer_records
from inspector.report.workload_tp import Phases, gemm, tp_pair

CROSS_ENTROPY_ALLREDUCES = 3  # max logit, target logit, sum of exp: fp32 (s, b) each
OPTIMIZER_ALLREDUCES = 4  # AICB's optimizer1..4 (generator lines 825-839)


def _embedding(job: Context, name: str = "embedding_layer") -> Record:
    """Return the word-embedding record: its output all-reduce or reduce-scatter.

    LanguageModelEmbedding (megatron-core) reduce-scatters the vocab-parallel lookup straight
    into the sequence-parallel layout when there is no learned position embedding; otherwise
    it all-reduces, adds positions and scatters, whose backward all-gathers the gradient.
    """
    if job.par.tp == 1:
        fwd = bwd = NONE
    elif not job.par.sequence_parallel:
        fwd, bwd = "ALLREDUCE", NONE  # the all-reduce's backward is the identity
    else:
        fwd = "ALLREDUCE" if job.training.learned_positions else "REDUCESCATTER"
        bwd = "ALLGATHER"
    size = job.activation
    fwd_ns = job.compute.embedding if isinstance(job.compute, ComputeProfile) else 0
    return Record(name, fwd_ns, fwd, size if fwd != NONE else 0, 0, bwd, size if bwd != NONE else 0)


def _output(job: Context, prefix: str = "") -> list[Record]:
    """Return the output layer and the vocab-parallel cross entropy's three all-reduces."""
    par = job.par
    if isinstance(job.compute, ComputeRate):
        flops = logit_flops(job.dims, job.training.micro_batch_size) / (par.tp * par.cp)
        phases = gemm(job, flops, te=False)
    else:
        phases = Phases(job.compute.logits, job.compute.logits, job.compute.logits)
    tp = par.tp > 1
    size = job.activation if tp else 0
    if par.sequence_parallel:
        fwd, bwd = ("ALLGATHER", "REDUCESCATTER") if tp else (NONE, NONE)
        column = Record(
            prefix + "final_column", phases.fwd, fwd, size, phases.ig, bwd, size, phases.wg
        )
    else:
        bwd = "ALLREDUCE" if tp else NONE  # copy_to_tensor_model_parallel_region's backward
        column = Record(
            prefix + "final_column", phases.fwd, NONE, 0, phases.ig, bwd, size, phases.wg
        )
    loss = 4 * job.tokens  # fp32 (s/c, b) per all-reduce
    comm, loss = ("ALLREDUCE", loss) if tp else (NONE, 0)
    entropy = [
        Record(f"{prefix}cross_entropy{i + 1}", 0, comm, loss, 0, NONE, 0, 0)
        for i in range(CROSS_ENTROPY_ALLREDUCES)
    ]
    return [column] + entropy


def _mtp(job: Context, depth: int, symbols: tuple[str, ...] = ()) -> list[Record]:
    """Return one multi-token-prediction layer: embedding, eh_proj, its layer (a GPT model's:
    the decoder's last layer spec) or a hybrid model's layers of the MTP pattern (`symbols`,
    HybridModel's MultiTokenPredictionBlock), output and loss."""
    prefix = f"mtp{depth + 1}_"
    last = job.dims.num_layers - 1
    h = job.dims.hidden_size
    proj = gemm(job, GEMM_FACTOR * job.tokens * 2 * h * h / job.par.tp)  # (2h -> h) on s/c tokens
    eh = tp_pair(job, prefix + "eh_proj", 2, proj, Phases())[:1]
    layers = [r for s in symbols or ("",) for r in layer_records(job, last, prefix, symbol=s)]
    return [_embedding(job, prefix + "embedding")] + eh + layers + _output(job, prefix)


def _data_parallel(job: Context, stage: StageInput) -> list[Record]:
    """Return the once-per-iteration gradient and parameter collectives of the stage's buffers."""
    if job.training.sharding is not None:
        return fsdp_step_records(job, stage, _step(job))
    records: list[Record] = []
    dense = "" if simai_dp(job.par) > 1 else None
    for expert, (gather_name, reduce_name), suffix in (
        (False, ("grad_gather", "grad_param_comm"), dense),
        (True, ("moe_grad_norm1", "moe_grad_norm2"), expert_grad_group(job.par)),
    ):
        buffers = [b for b in stage.buffers if b.expert == expert]
        params = sum(b.gathered_bytes for b in buffers)
        grads = sum(b.numel * b.grad_bytes for b in buffers)
        if not buffers or suffix is None:  # nothing to reduce, or over one rank
            if not expert:  # AICB always writes the dense pair; keep the names, empty
                records += [Record("grad_gather"), Record("grad_param_comm")]
                records += [Record("grad_param_compute", ig_compute=_step(job))] if buffers else []
            continue
        if job.training.distributed_optimizer:
            records.append(Record(gather_name, wg_comm="ALLGATHER" + suffix, wg_bytes=params))
            records.append(Record(reduce_name, wg_comm="REDUCESCATTER" + suffix, wg_bytes=grads))
        else:
            records.append(Record(reduce_name, wg_comm="ALLREDUCE" + suffix, wg_bytes=grads))
        if not expert:
            records.append(Record("grad_param_compute", ig_compute=_step(job)))
    return records


def _step(job: Context) -> int:
    """Return the optimizer step's measured time (ns), 0 with FLOPs estimates."""
    return job.compute.optimizer if isinstance(job.compute, ComputeProfile) else 0


def microbatch_records(job: Context, stage: StageInput) -> list[Record]:
    """Return the records of one micro-batch through `stage`: what its ranks run, in order."""
    records = [_embedding(job)] if stage.has_embedding else []
    symbols = iter(stage.symbols)
    for chunk in stage.chunks:
        for layer in chunk:
            before, after = fsdp_layer_records(job, stage, layer)
            records += before + layer_records(job, layer, symbol=next(symbols, "")) + after
    if stage.has_output:
        records += _output(job)
        for depth in range(stage.mtp_layers):
            records += _mtp(job, depth, stage.mtp_symbols)
    return records + fsdp_microbatch_end(job, stage)


def stage_records(job: Context, stage: StageInput) -> list[Record]:
    """Return every record of `stage`'s file: data parallel, ga micro-batches, optimizer."""
    check_stage(job, stage)
    block = microbatch_records(job, stage)
    # At tp 1 SimAI's group for them has one rank (inf); megatron's runs over pp, which SimAI
    # cannot name: 4 bytes each, left out as AICB leaves out one-rank collectives.
    optimizer = [
        Record(f"optimizer{i + 1}", 0, "ALLREDUCE", 4, 0, NONE, 0, 0)
        for i in range(OPTIMIZER_ALLREDUCES if job.par.tp > 1 else 0)
    ]
    return _data_parallel(job, stage) + per_microbatch(block, job.training.num_microbatches) + optimizer


def stage_header(job: Context) -> Header:
    """Return the header every stage's file carries.

    `vpp` is the real number of virtual chunks: SimAI multiplies the file's per-micro-batch
    work by (pp - 1) / (ga vpp) for the bubble (Layer.cc 737), the 1F1B and interleaved
    bubbles of Narayanan et al. 2021. `pp_comm` is one pipeline send, (s/c, b, h)/t with
    sequence parallelism (megatron's p2p tensor shape).
    """
    par = job.par
    send = pipeline_send(job.dims, par, job.training.micro_batch_size)
    return Header(
        tp=par.tp,
        ep=par.ep,
        pp=par.pp,
        vpp=par.chunks,
        ga=job.training.num_microbatches,
        all_gpus=job.training.world_size,
        pp_comm=send,
    )


def check_stage(job: Context, stage: StageInput) -> None:
    """Raise ConfigError where a StageInput contradicts the job, or SimAI cannot hold the job."""
    check_groups(job.dims, job.par)
    if not 0 <= stage.stage < job.par.pp:
        raise ConfigError(f"--stage {stage.stage} is not a pipeline stage of --pp {job.par.pp}")
    if len(stage.chunks) != job.par.chunks:
        raise ConfigError(
            f"stage {stage.stage} has {len(stage.chunks)} chunks, the layout {job.par.chunks}"
        )
    bad = [layer for layer in stage.layers if not 0 <= layer < job.dims.num_layers]
    if bad:
        raise ConfigError(f"stage {stage.stage} holds layers {bad} outside --num-layers")


def render_stage(job: Context, stage: StageInput) -> str:
    """Return the SimAI workload file of one pipeline stage."""
    return render_workload(stage_header(job), stage_records(job, stage))
