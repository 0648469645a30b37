"""HybridEP's buffers (`--moe-flex-dispatcher-backend hybridep`): what one rank holds outside
PyTorch's allocator, and HybridEP's refusals of a group, from the arguments megatron passes.

megatron-core 0.16.1 (transformer/moe/fused_a2a.py `init_hybrid_ep_buffer`, called by
`HybridEPDispatch.forward` on the first dispatch) builds one `deep_ep.HybridEPBuffer(group,
hidden_dim, max_num_of_tokens_per_rank=seq_len, num_local_experts, use_fp8=False,
num_sms_dispatch_api, num_sms_combine_api)` per process: `group` the expert-tensor x expert
parallel ranks (token_dispatcher.py `_HybridEPManager`, `tp_ep_group`), `seq_len` the tokens
of the first dispatch's input (`x.shape[-2]`, the rank's s b / (cp t) tokens), both SM counts
`moe_hybridep_num_sms` (TransformerConfig default 16, which Megatron-LM does not set).

What HybridEP allocates for those arguments, from its source at the commit megatron-core 0.16.1
installs (Megatron-LM core_v0.16.1 docker/Dockerfile.ci.dev: DeepEP branch hybrid-ep, commit
eb9cee7de5a24193bf09500668d3a619d3d3f3fb, 2026-01-27; its third-party/nccl submodule at
1e0c869c39bb33f1034cb9920bd2a8a8406f04a3 for the DOCA GPUNetIO queue pairs):

- deep_ep/hybrid_ep_buffer.py `HybridEPBuffer.__init__`: T = max(seq_len, 512) tokens a rank
  (`max_num_of_tokens_per_rank`); R ranks per NVLink domain (`detect_accessible_ranks`: the
  group's ranks whose memory handles it can open, on a node without fabric handles the ones on
  the same host; `NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN` overrides), N = group / R nodes;
  the preprocessing kernel's 108 blocks; tokens sent as uint16 (no fp8); 128 tokens a chunk.
- csrc/hybrid_ep/hybrid_ep.cu `HybridEPBuffer::allocate_buffer`: M = T R N tokens at worst;
  `allocate_buffer_for_preprocessing` (cudaMalloc 108 R `tmp_state_t` of 8 bytes),
  `allocate_buffer_for_combine` (the expert input tokens M H x 2 bytes and probs M L R x 4,
  through the remote allocator; two 4-byte flags), `allocate_buffer_for_dispatch` (the expert
  output tokens and probs share the combine's, `use_shared_buffer` True; its scaling factors
  M (H / 128) x 4, allocated without fp8 too; two 4-byte flags).
- csrc/hybrid_ep/extension/allgather.cu `CustomAllgather::allocate_ag_buffer`: the gathered
  routing map, one bool per (expert, token of the group): L R N x T R N bytes; on one node its
  flags (3 x 8 bytes) and R device pointers.
- csrc/hybrid_ep/allocator/allocator.cu: the remote allocator cudaMallocs (GPUs without fabric
  handles, as H100 and H200 nodes) and allocates a 512-byte test buffer when made.
- csrc/hybrid_ep/internode.cu (N > 1) `allocate_dispatch_rdma_buffers` /
  `allocate_combine_rdma_buffers`: cudaMalloc'd and registered with the NIC; queue pairs
  (N - 1) x the SMs, each `doca_gpu_verbs_create_qp_hl` with 3 T + 1 (dispatch) or 2 T + 1
  (combine) send entries, rounded up to a power of two W: a completion ring and a send ring of
  W x 64 bytes, page aligned, and two doorbell pages, each `doca_gpu_mem_alloc` one page more
  (NCCL src/transport/net_ib/gdaki/doca-gpunetio/src/doca_gpunetio_high_level.cpp
  `create_cq` / `create_qp`, doca_gpunetio.cpp `doca_gpu_mem_alloc`, `doca_gpu_verbs_get_qp_dev`).

Sizes are the bytes asked for, as DeepEP's are counted (no rounding to the driver's pages).
The buffers grow when a later dispatch needs more (`update_buffer`); megatron's dispatches
all carry the same tokens, so the first size holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError

# megatron-core 0.16.1 transformer_config.py: `moe_hybridep_num_sms: int = 16` (both APIs' SMs)
HYBRIDEP_NUM_SMS = 16
# GPUs one NVLink domain holds on the nodes the tool prices by default (DGX/HGX H100, H200):
# HybridEP finds the group's ranks on the same host (allocator.cu `is_accessible`: same hostname)
RANKS_PER_NVLINK_DOMAIN = 8
MIN_TOKENS_PER_RANK = 512  # hybrid_ep_buffer.py: max(max_num_of_tokens_per_rank, 512)
PREPROCESSING_BLOCKS = 108  # hybrid_ep_buffer.py: num_sms_preprocessing_api's default
TOKENS_PER_CHUNK = 128  # hybrid_ep_buffer.py: NUM_OF_TOKENS_PER_CHUNK_{DISPATCH,COMBINE}_API
TOKEN_BYTES = 2  # uint16 tokens (hybrid_ep_buffer.py: UINT8 only with use_fp8)
PROB_BYTES = 4  # float32 probs
SCALE_BLOCK = 128  # a float32 scaling factor per 128 hidden elements
TMP_STATE_BYTES = 8  # backend/hybrid_ep_backend.cuh tmp_state_t: an enum and an int32
TEST_BYTES = 128 * 4  # allocator.cu: the test buffer the remote allocator allocates when made
FLAG_BYTES = 4  # uint32_t completion and expected-value flags
U64 = 8  # uint64_t flags, pointers
# DOCA GPUNetIO (NCCL 1e0c869c): a page (sysconf, 4 KiB on x86-64 Linux), a WQE and a CQE of
# 64 bytes, `sizeof(struct doca_gpu_dev_verbs_qp)` 280 (common/doca_gpunetio_verbs_dev.h, its
# fields laid out with x86-64 alignment)
PAGE = 4096
WQE_BYTES = CQE_BYTES = 64
DEV_QP_BYTES = 280
MR_INFO_BYTES = {"dispatch": 96, "combine": 72}  # backend/utils.cuh *_memory_region_info_t
MAX_SEND_ENTRIES = 65536  # internode.cu setup_qp_init_attr: assert(tx_depth < 65536)


@dataclass(frozen=True)
class HybridEPShape:
    """The arguments HybridEP sizes its buffers from, for one rank."""

    hidden: int  # H
    tokens: int  # T: max(the first dispatch's tokens, 512)
    local_experts: int  # L
    ranks_per_node: int  # R
    nodes: int  # N
    sms: int = HYBRIDEP_NUM_SMS  # both APIs' blocks


def dispatch_tokens(model: Any, layout: Any, micro_batch_size: int) -> int:
    """Return the tokens a rank hands the dispatcher: s b / (cp t) (MoELayer's input, viewed
    [-1, hidden] by MoEFlexTokenDispatcher.dispatch_preprocess)."""
    return model.seq_length * micro_batch_size // (layout.cp * layout.sp_divisor)


def hybridep_shape(model: Any, layout: Any, micro_batch_size: int) -> HybridEPShape:
    """Return what megatron passes HybridEPBuffer for the job, as HybridEP reads it."""
    group = layout.expert_tp * layout.ep
    ranks = min(group, RANKS_PER_NVLINK_DOMAIN)
    tokens = max(dispatch_tokens(model, layout, micro_batch_size), MIN_TOKENS_PER_RANK)
    return HybridEPShape(model.hidden_size, tokens, model.num_experts // layout.ep, ranks,
                         group // ranks)  # fmt: skip


def _ring(entries: int) -> int:
    """One ring's GPU bytes: entries rounded up to a power of two, 64 bytes each, page aligned,
    plus the page `doca_gpu_mem_alloc` adds for alignment."""
    ring = (1 << (entries - 1).bit_length()) * WQE_BYTES
    return -(-ring // PAGE) * PAGE + PAGE


def _queue_pair(entries: int) -> int:
    """One queue pair's GPU bytes: its completion ring and send ring, their doorbell pages
    (`DBR_SIZE` 8 rounded to a page, plus a page) and the device copy of the QP."""
    return 2 * _ring(entries) + 2 * 2 * PAGE + DEV_QP_BYTES + PAGE


def _rdma(s: HybridEPShape) -> tuple[int, int]:
    """Return (buffers, queue pairs) bytes internode.cu allocates over N > 1 nodes."""
    t, h, n = s.tokens, s.hidden, s.nodes - 1
    probs = s.local_experts * s.ranks_per_node
    flags = 2 * (-(-t // TOKENS_PER_CHUNK)) * n * U64  # the group and attention flags, each
    scales = h // SCALE_BLOCK * PROB_BYTES
    dispatch = (t * h * TOKEN_BYTES + t * probs * s.nodes * PROB_BYTES + t * scales  # attn input
                + n * t * (h * TOKEN_BYTES + probs * PROB_BYTES + scales) + flags + U64)  # fmt: skip
    combine = 2 * n * t * (h * TOKEN_BYTES + probs * PROB_BYTES) + flags + U64
    qps = n * s.sms
    metadata = qps * (2 * U64 + MR_INFO_BYTES["dispatch"] + MR_INFO_BYTES["combine"])
    pairs = qps * (_queue_pair(3 * t + 1) + _queue_pair(2 * t + 1))
    return dispatch + combine + metadata, pairs


def hybridep_buffers(s: HybridEPShape) -> tuple[tuple[str, int], ...]:
    """Return (what, bytes) HybridEP holds on local rank 0 of a group outside PyTorch's
    allocator (module docstring: each term's source)."""
    group = s.ranks_per_node * s.nodes
    worst = s.tokens * group  # M: every token of the group to one rank
    nvlink = (worst * s.hidden * TOKEN_BYTES  # expert input (and output) tokens
              + worst * s.local_experts * s.ranks_per_node * PROB_BYTES  # their probs
              + worst * (s.hidden // SCALE_BLOCK) * PROB_BYTES)  # fmt: skip  # scaling factors
    routing = s.local_experts * group * s.tokens * group  # the gathered routing map, bools
    small = (PREPROCESSING_BLOCKS * s.ranks_per_node * TMP_STATE_BYTES
             + 2 * 2 * FLAG_BYTES  # dispatch and combine: completion flag (rank 0), expected value
             + TEST_BYTES)  # fmt: skip
    if s.nodes == 1:
        small += 3 * U64 + s.ranks_per_node * U64  # the all-gather's flags and peer pointers
    rdma, pairs = _rdma(s) if s.nodes > 1 else (0, 0)
    held = (("HybridEP NVLink buffers", nvlink), ("HybridEP routing map", routing),
            ("HybridEP RDMA buffers", rdma), ("HybridEP queue pairs", pairs),
            ("HybridEP flags", small))  # fmt: skip
    return tuple((what, size) for what, size in held if size)


def check_hybridep_dtype(model: Any) -> None:
    """Raise ConfigError where the layer's activations are not 16-bit: HybridEP's combine cannot
    take them."""
    if not (model.bf16 or model.fp16):
        raise ConfigError(
            "--moe-flex-dispatcher-backend hybridep needs 16-bit activations (--bf16 or --fp16): "
            "HybridEP sends tokens as 2-byte words and its combine asserts a 2-byte element "
            "(csrc/hybrid_ep/hybrid_ep.cu `combine_with_unpermute`)"
        )


def _where(ep: int, expert_tp: int) -> str:
    group = expert_tp * ep
    ranks = min(group, RANKS_PER_NVLINK_DOMAIN)
    return (f"--expert-tensor-parallel-size {expert_tp} x --ep {ep} = {group} ranks, {ranks} a "
            f"node of {RANKS_PER_NVLINK_DOMAIN} GPUs")  # fmt: skip


def check_hybridep_group(ep: int, expert_tp: int) -> None:
    """Raise ConfigError where the group's ranks do not lie on nodes as HybridEP needs: whole
    nodes of it, or within one (hybrid_ep_buffer.py asserts the group divides by the ranks it
    finds on a node; megatron's expert group is consecutive ranks)."""
    group = expert_tp * ep
    ranks = min(group, RANKS_PER_NVLINK_DOMAIN)
    if group % ranks or RANKS_PER_NVLINK_DOMAIN % ranks:
        raise ConfigError(f"--moe-flex-dispatcher-backend hybridep: {_where(ep, expert_tp)}: "
                          "HybridEP needs the group to fill whole nodes or lie within one "
                          "(hybrid_ep_buffer.py: 'The number of ranks ... should be divisible by "
                          "the number of ranks per node')")  # fmt: skip


def check_hybridep(model: Any, layout: Any, micro_batch_size: int | None) -> None:
    """Raise ConfigError where HybridEP refuses the job megatron gives it (its group is checked
    with the flex dispatcher's, job/flex.py `check_flex_group`): its dtype,
    `BufferConfig::is_valid`, `allocate_buffer`'s and internode.cu's asserts."""
    check_hybridep_dtype(model)
    s = hybridep_shape(model, layout, micro_batch_size or 1)
    ranks, group = s.ranks_per_node, s.ranks_per_node * s.nodes
    bad = []
    if s.hidden % 16:
        bad.append(f"--hidden-size {s.hidden} % 16 = {s.hidden % 16}")
    if s.local_experts * ranks % 4:
        bad.append(f"{s.local_experts} local experts x {ranks} ranks a node = "
                   f"{s.local_experts * ranks}, not a multiple of 4")  # fmt: skip
    if ranks % 2:
        bad.append(f"{ranks} ranks a node is odd")
    if s.tokens * group % 4:
        bad.append(f"{s.tokens} tokens a rank x {group} ranks = {s.tokens * group}, not a "
                   "multiple of 4")  # fmt: skip
    if s.nodes > 1 and 3 * s.tokens + 1 >= MAX_SEND_ENTRIES:
        bad.append(f"3 x {s.tokens} tokens a rank + 1 = {3 * s.tokens + 1} queue entries, "
                   f"HybridEP's limit {MAX_SEND_ENTRIES - 1} over more than one node")  # fmt: skip
    if bad:
        raise ConfigError(f"--moe-flex-dispatcher-backend hybridep: {_where(layout.ep, layout.expert_tp)}: "
                          f"HybridEP refuses {'; '.join(bad)} (csrc/hybrid_ep/config.cuh "
                          "`BufferConfig::is_valid`, hybrid_ep.cu, internode.cu)")  # fmt: skip
