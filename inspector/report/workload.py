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

Sizes: activations travel as a (s/c, b, h) tensor of `activation_bytes` elements; with
sequence parallelism megatron gathers/scatters it around each tensor-parallel region, without
it megatron all-reduces it (Korthikanti et al. 2022, Section 4.2.2). SimAI wants the whole
collective buffer (SIMAI-NOTES.md), i.e. the full (s/c, b, h) tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from math import comb

from inspector.errors import ConfigError
from inspector.formulas.flops import GEMM_FACTOR, layer_flops, logit_flops, mla_up_flops
from inspector.formulas.fp8_ops import expert_padding
from inspector.formulas.routing import block_hit
from inspector.job.dims import ModelDims
from inspector.report.simai import NONE, Header, Record, per_microbatch, render_workload
from inspector.report.simai_groups import (
    check_groups,
    context_group,
    expert_grad_group,
    pipeline_send,
    simai_dp,
    tokens_gather_group,
)
from inspector.report.workload_fsdp import (
    fsdp_layer_records,
    fsdp_microbatch_end,
    fsdp_step_records,
)
from inspector.report.workload_inputs import ComputeProfile, ComputeRate, Context, StageInput

CROSS_ENTROPY_ALLREDUCES = 3  # max logit, target logit, sum of exp: fp32 (s, b) each
OPTIMIZER_ALLREDUCES = 4  # AICB's optimizer1..4 (generator lines 825-839)
TOKENS_PER_EXPERT_BYTES = 8  # int64 counts gathered by the all-to-all dispatcher's preprocess


@dataclass(frozen=True)
class _Phases:
    """Per-rank compute (ns) of one record's forward, input-grad and weight-grad phases."""

    fwd: int = 0
    ig: int = 0
    wg: int = 0


def _gemm(job: Context, flops: float, te: bool = True) -> _Phases:
    """Split a GEMM's 6-factor FLOPs (flops.py) evenly: forward, data grad, weight grad.

    `te`: a Transformer Engine linear of the layer, at the fp8 peak in an fp8 job (megatron's
    output layer and MTP projection are not: `te` False).
    """
    if not isinstance(job.compute, ComputeRate):
        return _Phases()
    t = job.compute.ns(flops / 3, te and job.dims.fp8 is not None)
    return _Phases(t, t, t)


def _recompute(
    job: Context, phases: _Phases, core: int = 0, modules: tuple[str, ...] = ()
) -> _Phases:
    """Add recomputation to the input-grad phase: the whole forward (full), or under selective
    the core attention's (`core`, core_attn) and the record's forward once for each of its
    `modules` among --recompute-modules (formulas/ops.py RECOMPUTED: mlp, moe, shared_experts;
    layernorm and moe_act re-run no GEMM). Shared experts under both moe and shared_experts run
    twice more: the MoE layer's recomputed forward checkpoints them again."""
    mode = job.training.recompute
    extra = phases.fwd if mode == "full" else 0
    if mode == "selective":
        asked = job.training.recompute_modules
        extra = core if "core_attn" in asked else 0
        extra += phases.fwd * sum(m in asked for m in modules)
    return _Phases(phases.fwd, phases.ig + extra, phases.wg)


def _recomputes_up_proj(job: Context) -> bool:
    """Return whether `--recompute-modules mla_up_proj` checkpoints this MLA layer's up
    projections (multi_latent_attention.py `recompute_up_proj`)."""
    return (job.dims.multi_latent_attention and job.training.recompute == "selective"
            and "mla_up_proj" in job.training.recompute_modules)


def _tp_pair(
    job: Context, name: str, width: int, first: _Phases, second: _Phases, column: int = 0
) -> list[Record]:
    """Return the column/row records of one tensor-parallel region of `width` x activation.

    With sequence parallelism the column gathers its input (backward: reduce-scatter) and the
    row reduce-scatters its output (backward: all-gather); without it the row all-reduces its
    output and the column all-reduces its input gradient, in one `NAME_layer` record as AICB.
    `column`, when given, is the bytes the column gathers (MLA gathers latents, not h).
    """
    tp = job.par.tp > 1
    n = job.activation * width if tp else 0
    c = (column or n) if tp else 0
    if not job.par.sequence_parallel:
        comm = "ALLREDUCE" if tp else NONE
        fwd, ig, wg = (first.fwd + second.fwd, first.ig + second.ig, first.wg + second.wg)
        return [Record(f"{name}_layer", fwd, comm, n, ig, comm, c, wg)]
    gather, scatter = ("ALLGATHER", "REDUCESCATTER") if tp else (NONE, NONE)
    return [
        Record(f"{name}_column", first.fwd, gather, c, first.ig, scatter, c, first.wg),
        Record(f"{name}_row", second.fwd, scatter, n, second.ig, gather, n, second.wg),
    ]


def _attention_column(job: Context) -> int:
    """Return the bytes the attention's tensor-parallel input collective moves (0: all of h).

    Multi-latent attention (megatron-core MultiLatentAttention / MLASelfAttention, TE spec)
    projects down with duplicated linears on the sequence-parallel input and gathers only what
    its column-parallel up projections read: q's latent (h without one), kv's latent and, with
    sequence parallelism, the shared RoPE key (`get_query_key_value_tensors`). DeepSeek-V3:
    1536 + 512 + 64 = 2112 of 7168. Without sequence parallelism the up projections all-reduce
    the gradients of their inputs, the q and kv latents.
    """
    dims = job.dims
    if not dims.multi_latent_attention:
        return 0
    width = (dims.q_lora_rank or dims.hidden_size) + dims.kv_lora_rank
    width += dims.qk_pos_emb_head_dim if job.par.sequence_parallel else 0
    return dims.activation_bytes * job.tokens * width


def _attention(job: Context, layer: int, prefix: str = "") -> list[Record]:
    """Return the attention records of one layer (with the context-parallel KV exchange)."""
    dims, par = job.dims, job.par
    flops = layer_flops(dims, layer, job.training.micro_batch_size)
    split = par.tp * par.cp
    a, g = dims.num_attention_heads, dims.query_groups
    qkv_share = (a + 2 * g) / (2 * a + 2 * g)  # h d (a + 2g) of h d (a + 2g) + a d h
    if isinstance(job.compute, ComputeRate):
        core_fwd = job.compute.ns(flops.core_attention / split / 3)
        core = _Phases(core_fwd, 2 * core_fwd, 0)  # no weights: both backward GEMMs are dgrad
        qkv = _gemm(job, flops.attention * qkv_share / split)
        out = _gemm(job, flops.attention * (1 - qkv_share) / split)
        first = _Phases(qkv.fwd + core.fwd, qkv.ig + core.ig, qkv.wg)
    else:
        # AICB halves the measured attention time between the column and the row record and
        # writes it to all three phases (generator lines 388-398, 350-360).
        half = job.compute.attention // 2
        core_fwd = job.compute.flash
        first = out = _Phases(half, half, half)
    first = _recompute(job, first, core_fwd)
    if _recomputes_up_proj(job):  # the up projections' forward runs again (ComputeRate only)
        tokens = job.training.micro_batch_size * dims.seq_length
        up = _gemm(job, mla_up_flops(dims, tokens) / split)
        first = _Phases(first.fwd, first.ig + up.fwd, first.wg)
    out = _recompute(job, out)
    records = _tp_pair(job, prefix + "attention", 1, first, out, _attention_column(job))
    if par.cp > 1:
        # K and V of the whole sequence for this rank's g/t groups: megatron's all-gather
        # context parallelism (cp_comm_type a2a/p2p move the same volume); backward returns
        # their gradients. SimAI has no context-parallel group (simai_groups.context_group).
        kv = dims.activation_bytes * job.training.micro_batch_size * dims.seq_length
        kv *= _kv_width(dims) // par.tp
        group = context_group(par)
        records.insert(
            1,
            Record(
                prefix + "attention_cp", 0, "ALLGATHER" + group, kv, 0, "REDUCESCATTER" + group, kv
            ),
        )
    return records


def _kv_width(dims: ModelDims) -> int:
    """Return the K and V channels of all heads: 2 g d, or MLA's a (qk + rope + v) per head."""
    if dims.multi_latent_attention:
        per_head = dims.qk_head_dim + dims.qk_pos_emb_head_dim + dims.v_head_dim
        return dims.num_attention_heads * per_head
    return 2 * dims.query_groups * dims.head_dim


def _dense_mlp(job: Context, layer: int, prefix: str = "", ffn: int | None = None) -> list[Record]:
    """Return the column/row records of a dense (or shared-expert) MLP.

    Recomputed under `mlp` (a dense layer's), or `shared_experts` and `moe` (the shared experts
    inside the checkpointed MoE layer).
    """
    dims = job.dims
    split = job.par.tp * job.par.cp
    if isinstance(job.compute, ComputeRate):
        width = ffn if ffn is not None else dims.ffn
        total = GEMM_FACTOR * job.tokens * job.par.cp * dims.hidden_size * width
        total *= dims.gated_multiplier + 1
        fc1 = _gemm(job, total * dims.gated_multiplier / (dims.gated_multiplier + 1) / split)
        fc2 = _gemm(job, total / (dims.gated_multiplier + 1) / split)
    else:
        half = job.compute.mlp // 2
        fc1 = fc2 = _Phases(half, half, half)
    modules = ("mlp",) if ffn is None else ("moe", "shared_experts")
    fc1, fc2 = _recompute(job, fc1, modules=modules), _recompute(job, fc2, modules=modules)
    return _tp_pair(job, prefix + "mlp", 1, fc1, fc2)


def _moe_mlp(job: Context, layer: int, prefix: str = "") -> list[Record]:
    """Return megatron-core's all-to-all token dispatcher (MoEAlltoAllTokenDispatcher) records.

    Same five records as AICB (generator lines 433-487): token counts gathered, tokens
    dispatched over expert parallel, gathered over expert tensor parallel, experts run and
    reduce-scatter, tokens combined. Token bytes are the real top-k copies of this rank's
    (s/c/t, b) tokens with sequence parallelism.
    """
    dims, par = job.dims, job.par
    ep, etp = par.ep, par.expert_tp
    local = job.tokens // (par.tp if par.sequence_parallel else 1)
    a2a = local * dims.moe_router_topk * dims.hidden_size * dims.activation_bytes
    if dims.fp8 and dims.moe_row_padding == "source":  # --moe-router-padding-for-fp8: the
        # sender's padding rows travel too (formulas/fp8_ops.py expert_padding)
        rows = expert_padding(dims, local, dims.num_experts or 1, par.ep, par.expert_tp, 1,
                              dims.moe_router_topk)[1]  # fmt: skip
        a2a = math.ceil(rows) * dims.hidden_size * dims.activation_bytes
    if job.training.flex:
        return _flex_mlp(job, layer, local, prefix)
    counts = TOKENS_PER_EXPERT_BYTES * (dims.num_experts or 0) * etp * ep
    ep_comm = "ALLTOALL_EP" if ep > 1 else NONE
    gather, scatter = ("ALLGATHER", "REDUCESCATTER") if etp > 1 else (NONE, NONE)
    etp_size = a2a * etp if etp > 1 else 0
    a2a_size = a2a if ep > 1 else 0
    if isinstance(job.compute, ComputeRate):
        width = dims.expert_ffn * dims.moe_router_topk
        total = GEMM_FACTOR * job.tokens * job.par.cp * dims.hidden_size * width
        experts = _gemm(job, total * (dims.gated_multiplier + 1) / (par.tp * par.cp))
    else:
        experts = _Phases(job.compute.mlp, job.compute.mlp, job.compute.mlp)
    experts = _recompute(job, experts, modules=("moe",))
    name = prefix + "mlp_moelayer"
    group = tokens_gather_group(par)
    pre = NONE if group is None else "ALLGATHER" + group
    records = [
        Record(name, 0, pre, counts if pre != NONE else 0),
        Record(name, 0, ep_comm, a2a_size, 0, ep_comm, a2a_size),
        Record(name, 0, gather, etp_size, 0, scatter, etp_size),
        Record(name, experts.fwd, scatter, etp_size, experts.ig, gather, etp_size, experts.wg),
        Record(name, 0, ep_comm, a2a_size, 0, ep_comm, a2a_size),
    ]
    if dims.shared_expert_ffn:
        records += _dense_mlp(job, layer, prefix + "shared_", dims.shared_expert_ffn)
    return records


def flex_token_bytes(job: Context, local: int) -> int:
    """Return the bytes a rank's flex dispatch (or combine) moves: each of its `local` tokens once
    per expert-tp x ep rank holding one of its top-k experts (DeepEP's `is_token_in_rank`; the
    rank itself counted, as an all-to-all's size counts its own share), under balanced routing:
    etp ep (1 - C(E - E/ep, k) / C(E, k)) copies (plan/flex.py `token_copies`); under
    node-limited routing etp x the sum of each ep rank's chance (formulas/routing.py)."""
    dims, par = job.dims, job.par
    experts, k = dims.num_experts or 0, dims.moe_router_topk
    per, record = experts // par.ep, local * dims.hidden_size * dims.activation_bytes * par.expert_tp
    if dims.moe_router_group_topk and dims.moe_router_num_groups:
        groups, picked = dims.moe_router_num_groups, dims.moe_router_group_topk
        return round(record * sum(block_hit(experts, k, groups, picked, r * per, (r + 1) * per)
                                  for r in range(par.ep)))  # fmt: skip
    hit = 1 - comb(experts - per, k) / comb(experts, k)
    return round(local * dims.hidden_size * dims.activation_bytes * par.expert_tp * par.ep * hit)


def _flex_mlp(job: Context, layer: int, local: int, prefix: str) -> list[Record]:
    """Return the flex dispatcher's records (MoEFlexTokenDispatcher): the dispatch, the experts,
    the combine. SimAI has no collective that sends a token once per node and forwards it inside
    (DeepEP's and HybridEP's kernels), so each exchange is an ALLTOALL_EP of the bytes the
    dispatcher moves (`flex_token_bytes`), with no token-count gather or expert-tp collectives:
    the flex group already spans expert tp x ep."""
    dims, par = job.dims, job.par
    size = flex_token_bytes(job, local) if par.ep * par.expert_tp > 1 else 0
    comm = "ALLTOALL_EP" if size else NONE
    if isinstance(job.compute, ComputeRate):
        width = dims.expert_ffn * dims.moe_router_topk
        total = GEMM_FACTOR * job.tokens * par.cp * dims.hidden_size * width
        experts = _gemm(job, total * (dims.gated_multiplier + 1) / (par.tp * par.cp))
    else:
        experts = _Phases(job.compute.mlp, job.compute.mlp, job.compute.mlp)
    experts = _recompute(job, experts, modules=("moe",))
    name = prefix + "mlp_moelayer"
    records = [
        Record(name, 0, comm, size, 0, comm, size),
        Record(name, experts.fwd, NONE, 0, experts.ig, NONE, 0, experts.wg),
        Record(name, 0, comm, size, 0, comm, size),
    ]
    if dims.shared_expert_ffn:
        records += _dense_mlp(job, layer, prefix + "shared_", dims.shared_expert_ffn)
    return records


def layer_records(job: Context, layer: int, prefix: str = "") -> list[Record]:
    """Return the records of 0-based global transformer `layer` for one micro-batch."""
    mlp = _moe_mlp if job.dims.is_moe_layer(layer) else _dense_mlp
    return _attention(job, layer, prefix) + mlp(job, layer, prefix)


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
        phases = _gemm(job, flops, te=False)
    else:
        phases = _Phases(job.compute.logits, job.compute.logits, job.compute.logits)
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


def _mtp(job: Context, depth: int) -> list[Record]:
    """Return one multi-token-prediction layer: embedding, eh_proj, a layer, output and loss."""
    prefix = f"mtp{depth + 1}_"
    last = job.dims.num_layers - 1  # MTP layers take the decoder's last layer spec
    h = job.dims.hidden_size
    proj = _gemm(job, GEMM_FACTOR * job.tokens * 2 * h * h / job.par.tp)  # (2h -> h) on s/c tokens
    eh = _tp_pair(job, prefix + "eh_proj", 2, proj, _Phases())[:1]
    return (
        [_embedding(job, prefix + "embedding")]
        + eh
        + layer_records(job, last, prefix)
        + _output(job, prefix)
    )


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
        params = sum(b.numel * b.param_bytes for b in buffers)
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
    for chunk in stage.chunks:
        for layer in chunk:
            before, after = fsdp_layer_records(job, stage, layer)
            records += before + layer_records(job, layer) + after
    if stage.has_output:
        records += _output(job)
        for depth in range(stage.mtp_layers):
            records += _mtp(job, depth)
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
