"""A DeepEP stand-in: the `deep_ep` that megatron-core's flex dispatcher calls, on meta tensors.

megatron/core/transformer/moe/fused_a2a.py imports `deep_ep.Buffer` and `deep_ep.utils`
(`EventHandle`, `EventOverlap`) and calls, through `get_buffer`, `FusedDispatch` and
`FusedCombine`: `Buffer.get_dispatch_config` / `get_combine_config` (their
`get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint`), `Buffer(group, num_nvl_bytes,
num_rdma_bytes)`, `Buffer.set_num_sms`, `get_dispatch_layout`, `dispatch` and `combine` (the
intranode path, and the cached-handle path the backward takes). Each returns what DeepEP returns
(deep_ep/buffer.py, csrc/deep_ep.cpp `Buffer::intranode_dispatch` / `intranode_combine` /
`get_dispatch_layout`; `internode_dispatch` / `internode_combine` when the group spans more
than one NVLink domain of 8 GPUs): the same shapes and dtypes, allocated on the meta device.

Which tokens go where is data: the stand-in reads the expert indices' values from the table the
engine keeps beside its meta tensors (`host_values`, set by inspector/memory/engine/moe.py while a
balanced routing runs) and gives its outputs values there too, as DeepEP's kernels would compute
them. Every rank routes alike (balanced), so a rank receives from each of the group's ranks what
it would send to itself.

DeepEP's own buffers are allocated outside PyTorch (csrc/deep_ep.cpp `Buffer::Buffer`: the NVLink
buffer with `cudaMalloc` and shared by CUDA IPC, the RDMA buffer with `nvshmem_malloc`, a 32 MiB
workspace with `cudaMalloc`): PyTorch's allocator never sees them; inspector/memory/engine/run.py
`outside_allocator` counts them from the sizes megatron asks this Buffer for.

No DeepEP code is copied here; the constants and formulas cite DeepEP's source (github.com/
deepseek-ai/DeepEP, main branch of 2025).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# deep_ep/buffer.py and csrc/kernels/configs.cuh
NUM_MAX_NVL_PEERS = 8  # GPUs one NVLink domain holds in DeepEP's kernels
NUM_WORKSPACE_BYTES = 32 * 1024 * 1024  # csrc/kernels/configs.cuh: the workspace Buffer::Buffer allocates
NUM_MAX_TOPK = 128  # csrc/config.hpp get_*_buffer_size_hint: kNumMaxTopK
NUM_MAX_SCALES = 128  # csrc/config.hpp: kNumMaxScales
SOURCE_META_BYTES = 8  # csrc/kernels/internode.cu get_source_meta_bytes: sizeof(SourceMeta), two ints
INT4_BYTES = 16  # sizeof(int4)
# csrc/deep_ep.cpp Buffer::Buffer: the NVLink allocation is num_nvl_bytes plus the barrier signals
# (NUM_MAX_NVL_PEERS ints) and two pointer arrays (NUM_MAX_NVL_PEERS pointers each)
NVL_METADATA_BYTES = NUM_MAX_NVL_PEERS * 4 + 2 * NUM_MAX_NVL_PEERS * 8


class HostValues(Protocol):
    """The engine's table of host values beside meta tensors (inspector/memory/engine/moe.py)."""

    def get(self, tensor: torch.Tensor) -> torch.Tensor | None: ...

    def set(self, tensor: torch.Tensor, values: torch.Tensor) -> None: ...


host_values: HostValues | None = None  # set by the engine while it runs MoE layers


def _align(a: int, b: int) -> int:
    return (a + b - 1) // b * b


@dataclass(frozen=True)
class Config:
    """csrc/config.hpp `Config`: SMs and the chunk sizes (tokens) of the NVLink and RDMA queues."""

    num_sms: int
    num_max_nvl_chunked_send_tokens: int
    num_max_nvl_chunked_recv_tokens: int
    num_max_rdma_chunked_send_tokens: int
    num_max_rdma_chunked_recv_tokens: int

    def __post_init__(self) -> None:
        # the constructor rounds the RDMA receive queue up to a multiple of the send chunk
        aligned = _align(self.num_max_rdma_chunked_recv_tokens, self.num_max_rdma_chunked_send_tokens)
        object.__setattr__(self, "num_max_rdma_chunked_recv_tokens", aligned)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """csrc/config.hpp `Config::get_nvl_buffer_size_hint` (NVSHMEM compiled in)."""
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        channels = self.num_sms // 2
        queue = channels * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        total = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        total += queue * hidden_bytes
        total += queue * SOURCE_META_BYTES
        total += queue * NUM_MAX_TOPK * 8  # int64 top-k indices
        total += queue * NUM_MAX_TOPK * 4  # float top-k weights
        total += queue * NUM_MAX_SCALES * 4  # float fp8 scales
        return _align(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """csrc/config.hpp `Config::get_rdma_buffer_size_hint`: none inside one NVLink domain."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        channels = self.num_sms // 2
        queue = channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * 2
        total = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        total += queue * (hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * 8 + NUM_MAX_TOPK * 4
                          + NUM_MAX_SCALES * 4 + INT4_BYTES)  # fmt: skip
        total += 1048576  # "add a large number to be safe"
        return _align(total, 128)


# deep_ep/buffer.py `Buffer.get_dispatch_config` / `get_combine_config`: (group size) -> the NVLink
# send/receive and RDMA send/receive chunk sizes
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128),
             16: (16, 288, 20, 128), 24: (8, 288, 32, 128), 32: (8, 288, 32, 128),
             64: (20, 288, 28, 128), 128: (20, 560, 32, 128), 144: (32, 720, 12, 128),
             160: (28, 720, 12, 128)}  # fmt: skip
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128),
            16: (2, 288, 28, 128), 24: (1, 288, 20, 128), 32: (1, 288, 20, 128),
            64: (1, 288, 20, 128), 128: (1, 560, 12, 128), 144: (2, 720, 8, 128),
            160: (2, 720, 8, 128)}  # fmt: skip
SUPPORTED_GROUP_SIZES = tuple(sorted(_DISPATCH))


class EventHandle:
    """deep_ep.utils `EventHandle`: a CUDA event on the current stream; here already complete."""

    def current_stream_wait(self) -> None:
        """Wait for nothing: one stream runs everything here."""


class EventOverlap:
    """deep_ep.utils `EventOverlap`: holds an event; waiting on it orders nothing here."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: Any = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Wait for nothing."""


class Buffer:
    """deep_ep.Buffer for normal (not low-latency) kernels, intranode: what megatron calls."""

    num_sms: int = 20  # deep_ep/buffer.py's default; megatron sets --moe-deepep-num-sms

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, **kwargs: Any) -> None:  # fmt: skip
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """deep_ep/buffer.py `Buffer.set_num_sms`."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """deep_ep/buffer.py `Buffer.get_dispatch_config`."""
        assert num_ranks in _DISPATCH, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *_DISPATCH[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """deep_ep/buffer.py `Buffer.get_combine_config`."""
        assert num_ranks in _COMBINE, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *_COMBINE[num_ranks])

    def _experts_per_rank(self, num_experts: int) -> int:
        return num_experts // self.group_size

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Any = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> tuple[Any, ...]:  # fmt: skip
        """csrc/deep_ep.cpp `Buffer::get_dispatch_layout`: tokens per rank [ranks] int32, per
        RDMA rank [ranks / 8] int32 (None inside one NVLink domain), per expert [experts] int32,
        and `is_token_in_rank` [tokens, ranks] bool."""
        tokens, ranks, device = topk_idx.shape[0], self.group_size, topk_idx.device
        per_rank = torch.empty(ranks, dtype=torch.int32, device=device)
        per_rdma = None
        if self._rdma_ranks > 1:
            per_rdma = torch.empty(self._rdma_ranks, dtype=torch.int32, device=device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=device)
        in_rank = torch.empty(tokens, ranks, dtype=torch.bool, device=device)
        idx = _values(topk_idx)
        if idx is not None:
            owner = torch.where(idx >= 0, idx // self._experts_per_rank(num_experts), -1)
            hit = torch.stack([(owner == r).any(dim=1) for r in range(ranks)], dim=1)
            counts = torch.bincount(idx[idx >= 0], minlength=num_experts)
            _set(per_rank, hit.sum(dim=0).int())
            if per_rdma is not None:
                node = hit.view(tokens, self._rdma_ranks, NUM_MAX_NVL_PEERS).any(dim=2)
                _set(per_rdma, node.sum(dim=0).int())
            _set(per_expert, counts.int())
            _set(in_rank, hit)
        return per_rank, per_rdma, per_expert, in_rank, EventOverlap(EventHandle())

    @property
    def _rdma_ranks(self) -> int:
        """NVLink domains the group spans (csrc/deep_ep.cpp: `num_rdma_ranks`)."""
        return max(self.group_size // NUM_MAX_NVL_PEERS, 1)

    def dispatch(self, x: torch.Tensor, handle: tuple[Any, ...] | None = None,
                 num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None,
                 topk_idx: Any = None, topk_weights: Any = None, expert_alignment: int = 1,
                 config: Any = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> tuple[Any, ...]:  # fmt: skip
        """deep_ep/buffer.py `Buffer.dispatch`, intranode (csrc/deep_ep.cpp
        `Buffer::intranode_dispatch`): received tokens [received, hidden] (x's dtype), their
        top-k indices (int64, local expert or -1) and weights (float32), the received count per
        local expert (a Python list), and the handle: rank prefix matrix [ranks, ranks], channel
        prefix matrices [ranks, channels] (int32), source indices [received] int32,
        `is_token_in_rank`, send head [tokens, ranks] int32. Over more than one NVLink domain
        (`Buffer::internode_dispatch`) the handle is internode's, below. With a handle (the
        combine's backward), only the tokens."""
        if handle is not None:
            received = (handle[7] if self._rdma_ranks > 1 else handle[3]).shape[0]
            return x.new_empty(received, x.shape[1]), None, None, None, None, EventOverlap()
        ranks, device = self.group_size, x.device
        channels = (config or self.get_dispatch_config(ranks)).num_sms // 2
        sent = _values(num_tokens_per_rank)
        if sent is None:
            raise NotImplementedError("DeepEP dispatch without the routing's values")
        received = int(sent[self.rank]) * ranks  # every rank sends this rank what it sends itself
        topk = topk_idx.shape[1]
        recv_x = x.new_empty(received, x.shape[1])
        recv_idx = torch.empty(received, topk, dtype=torch.int64, device=device)
        recv_weights = torch.empty(received, topk, dtype=torch.float32, device=device)
        local = self._experts_per_rank(num_tokens_per_expert.shape[0])
        idx, in_rank = _values(topk_idx), _values(is_token_in_rank)
        assert idx is not None and in_rank is not None
        mine = idx[in_rank[:, self.rank]]
        begin = self.rank * local
        local_idx = torch.where((mine >= begin) & (mine < begin + local), mine - begin, -1)
        _set(recv_idx, local_idx.repeat(ranks, 1))
        weights = _values(topk_weights)
        if weights is not None:
            kept = weights[in_rank[:, self.rank]] * (local_idx >= 0)
            _set(recv_weights, kept.float().repeat(ranks, 1))
        per_expert = torch.bincount(local_idx[local_idx >= 0], minlength=local) * ranks
        if expert_alignment > 1:
            per_expert = (per_expert + expert_alignment - 1) // expert_alignment * expert_alignment
        if self._rdma_ranks > 1:
            handle = self._internode_handle(x, received, num_tokens_per_rdma_rank,
                                            is_token_in_rank, channels)  # fmt: skip
            return recv_x, recv_idx, recv_weights, per_expert.tolist(), handle, EventOverlap()
        handle = (
            torch.empty(ranks, ranks, dtype=torch.int32, device=device),  # rank_prefix_matrix
            torch.empty(ranks, channels, dtype=torch.int32, device=device),  # channel_prefix_matrix
            torch.empty(ranks, channels, dtype=torch.int32, device=device),  # recv_channel_prefix_matrix
            torch.empty(received, dtype=torch.int32, device=device),  # recv_src_idx
            is_token_in_rank,
            torch.empty(x.shape[0], ranks, dtype=torch.int32, device=device),  # send_head
        )
        return recv_x, recv_idx, recv_weights, per_expert.tolist(), handle, EventOverlap()

    def _internode_handle(self, x: torch.Tensor, received: int, per_rdma: Any, in_rank: Any,
                          channels: int) -> tuple[Any, ...]:  # fmt: skip
        """csrc/deep_ep.cpp `Buffer::internode_dispatch`'s handle: `is_token_in_rank`, the RDMA
        and global channel prefix matrices [rdma ranks | ranks, channels] int32 (sent and
        received), their rank prefix sums [rdma ranks | ranks] int32, the source metadata
        [received, 8] bytes, the RDMA send head [tokens, rdma ranks] and the NVLink send head
        [tokens received over RDMA, 8] int32. Over RDMA this GPU receives, from the same GPU of
        each node, the tokens bound for any GPU of its node (balanced: alike from each)."""
        rdma, ranks, device = self._rdma_ranks, self.group_size, x.device
        sent = _values(per_rdma)
        assert sent is not None
        rdma_received = int(sent[self.rank // NUM_MAX_NVL_PEERS]) * rdma

        def int32(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.int32, device=device)

        return (
            in_rank,
            int32(rdma, channels),  # rdma_channel_prefix_matrix
            int32(ranks, channels),  # gbl_channel_prefix_matrix
            int32(rdma, channels),  # recv_rdma_channel_prefix_matrix
            int32(rdma),  # recv_rdma_rank_prefix_sum
            int32(ranks, channels),  # recv_gbl_channel_prefix_matrix
            int32(ranks),  # recv_gbl_rank_prefix_sum
            torch.empty(received, SOURCE_META_BYTES, dtype=torch.uint8, device=device),  # recv_src_meta
            int32(x.shape[0], rdma),  # send_rdma_head
            int32(rdma_received, NUM_MAX_NVL_PEERS),  # send_nvl_head
        )

    def combine(self, x: torch.Tensor, handle: tuple[Any, ...], topk_weights: Any = None,
                config: Any = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple[Any, ...]:  # fmt: skip
        """deep_ep/buffer.py `Buffer.combine`, intranode (csrc/deep_ep.cpp
        `Buffer::intranode_combine`): the reduced tokens [tokens, hidden] (tokens: the send
        head's rows; internode, `is_combined_token_in_rank`'s) and, when given, the reduced top-k
        weights [tokens, topk] float32."""
        tokens = (handle[0] if self._rdma_ranks > 1 else handle[5]).shape[0]
        out = x.new_empty(tokens, x.shape[1])
        weights = None
        if topk_weights is not None:
            weights = torch.empty(tokens, topk_weights.shape[1], dtype=torch.float32,
                                  device=x.device)  # fmt: skip
        return out, weights, EventOverlap()


def _values(tensor: Any) -> torch.Tensor | None:
    if host_values is None or not isinstance(tensor, torch.Tensor):
        return None
    return host_values.get(tensor)


def _set(tensor: torch.Tensor, values: torch.Tensor) -> None:
    if host_values is not None:
        host_values.set(tensor, values)


NAME = "deep_ep"


def install() -> None:
    """Put the stand-in into sys.modules as `deep_ep` (and `deep_ep.utils`), before megatron-core's
    fused_a2a.py is imported; idempotent. HybridEP's buffer (`deep_ep.HybridEPBuffer`) is
    world/hybrid_ep.py's stand-in, which its own `install` adds to this package."""
    if NAME in sys.modules:
        return
    package = types.ModuleType(NAME)
    utils = types.ModuleType(NAME + ".utils")
    package.Buffer = Buffer  # type: ignore[attr-defined]
    package.Config = Config  # type: ignore[attr-defined]
    package.utils = utils  # type: ignore[attr-defined]
    package.__stand_in__ = True  # type: ignore[attr-defined]
    utils.EventHandle = EventHandle  # type: ignore[attr-defined]
    utils.EventOverlap = EventOverlap  # type: ignore[attr-defined]
    sys.modules[NAME] = package
    sys.modules[NAME + ".utils"] = utils
