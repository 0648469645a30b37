"""One transformer layer's SimAI workload records for one micro-batch (report/workload.py puts
them in a stage's file).

Attention (with MLA's latent gathers and the context-parallel KV exchange), the dense or
shared-expert MLP, and the MoE layer: megatron-core's all-to-all token dispatcher as AICB writes
it (SimAI_training_workload_generator.py, HEAD 23eec3c) or the flex dispatcher's exchanges.
Compute comes from FLOPs at a rate (`ComputeRate`) or a measured profile (`ComputeProfile`),
with the recomputation --recompute-granularity/--recompute-modules add to the backward.

Sizes: activations travel as a (s/c, b, h) tensor of `activation_bytes` elements; with
sequence parallelism megatron gathers/scatters it around each tensor-parallel region, without
it megatron all-reduces it (Korthikanti et al. 2022, Section 4.2.2). SimAI wants the whole
collective buffer (SIMAI-NOTES.md), i.e. the full (s/c, b, h) tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from math import comb

from inspector.formulas.flops import GEMM_FACTOR, layer_flops, mla_up_flops
from inspector.formulas.fp8_ops import expert_padding
from inspector.formulas.routing import block_hit
from inspector.job.dims import ModelDims
from inspector.report.simai import NONE, Record
from inspector.report.simai_groups import context_group, tokens_gather_group
from inspector.report.workload_dsa import dsa_indexer_records
from inspector.report.workload_gdn import gdn_records
from inspector.report.workload_hybrid import hybrid_context, mamba_records
from inspector.report.workload_inputs import ComputeRate, Context
from inspector.report.workload_tp import Phases, gemm, recompute, tp_pair

TOKENS_PER_EXPERT_BYTES = 8  # int64 counts gathered by the all-to-all dispatcher's preprocess


def _recomputes_up_proj(job: Context) -> bool:
    """Return whether `--recompute-modules mla_up_proj` checkpoints this MLA layer's up
    projections (multi_latent_attention.py `recompute_up_proj`)."""
    return (job.dims.multi_latent_attention and job.training.recompute == "selective"
            and "mla_up_proj" in job.training.recompute_modules)


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
    return dims.activation_bytes * job.tokens * sum(dims.mla_gathered(job.par.sequence_parallel))


def _attention(job: Context, layer: int, prefix: str = "") -> list[Record]:
    """Return the attention records of one layer (with the context-parallel KV exchange)."""
    dims, par = job.dims, job.par
    flops = layer_flops(dims, layer, job.training.micro_batch_size)
    split = par.tp * par.cp
    a, g = dims.num_attention_heads, dims.query_groups
    qkv_share = (a + 2 * g) / (2 * a + 2 * g)  # h d (a + 2g) of h d (a + 2g) + a d h
    if isinstance(job.compute, ComputeRate):
        core_fwd = job.compute.ns(flops.core_attention / split / 3)
        core = Phases(core_fwd, 2 * core_fwd, 0)  # no weights: both backward GEMMs are dgrad
        qkv = gemm(job, flops.attention * qkv_share / split)
        out = gemm(job, flops.attention * (1 - qkv_share) / split)
        first = Phases(qkv.fwd + core.fwd, qkv.ig + core.ig, qkv.wg)
    else:
        # AICB halves the measured attention time between the column and the row record and
        # writes it to all three phases (generator lines 388-398, 350-360).
        half = job.compute.attention // 2
        core_fwd = job.compute.flash
        first = out = Phases(half, half, half)
    first = recompute(job, first, core_fwd)
    if _recomputes_up_proj(job):  # the up projections' forward runs again (ComputeRate only)
        tokens = job.training.micro_batch_size * dims.seq_length
        up = gemm(job, mla_up_flops(dims, tokens) / split)
        first = Phases(first.fwd, first.ig + up.fwd, first.wg)
    out = recompute(job, out)
    records = tp_pair(job, prefix + "attention", 1, first, out, _attention_column(job))
    if dims.experimental_attention_variant == "dsa":  # the indexer runs inside core attention
        records[1:1] = dsa_indexer_records(job, prefix)
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
        fc1 = gemm(job, total * dims.gated_multiplier / (dims.gated_multiplier + 1) / split)
        fc2 = gemm(job, total / (dims.gated_multiplier + 1) / split)
    else:
        half = job.compute.mlp // 2
        fc1 = fc2 = Phases(half, half, half)
    modules = ("mlp",) if ffn is None else ("moe", "shared_experts")
    fc1, fc2 = recompute(job, fc1, modules=modules), recompute(job, fc2, modules=modules)
    return tp_pair(job, prefix + "mlp", 1, fc1, fc2)


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
        experts = gemm(job, total * (dims.gated_multiplier + 1) / (par.tp * par.cp))
    else:
        experts = Phases(job.compute.mlp, job.compute.mlp, job.compute.mlp)
    experts = recompute(job, experts, modules=("moe",))
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
        experts = gemm(job, total * (dims.gated_multiplier + 1) / (par.tp * par.cp))
    else:
        experts = Phases(job.compute.mlp, job.compute.mlp, job.compute.mlp)
    experts = recompute(job, experts, modules=("moe",))
    name = prefix + "mlp_moelayer"
    records = [
        Record(name, 0, comm, size, 0, comm, size),
        Record(name, experts.fwd, NONE, 0, experts.ig, NONE, 0, experts.wg),
        Record(name, 0, comm, size, 0, comm, size),
    ]
    if dims.shared_expert_ffn:
        records += _dense_mlp(job, layer, prefix + "shared_", dims.shared_expert_ffn)
    return records


def layer_records(job: Context, layer: int, prefix: str = "", symbol: str = "") -> list[Record]:
    """Return the records of 0-based global transformer `layer` for one micro-batch; in a
    hybrid stack (`symbol`: the layer's kind as the pattern writes it) only its one part."""
    if symbol:
        job = hybrid_context(job)
        if symbol == "M" and job.mamba is not None:
            return mamba_records(job, job.mamba, prefix)
        parts: tuple[Callable[[Context, int, str], list[Record]], ...] = {
            "*": (_attention,), "D": (_attention,), "-": (_dense_mlp,), "E": (_moe_mlp,),
            "G": (gdn_records,)}[symbol]  # fmt: skip
    else:
        mixer = gdn_records if job.dims.is_gdn_layer(layer) else _attention
        parts = (mixer, _moe_mlp if job.dims.is_moe_layer(layer) else _dense_mlp)
    return [record for part in parts for record in part(job, layer, prefix)]
