"""A HybridEP stand-in: the `deep_ep.HybridEPBuffer` megatron-core's flex dispatcher calls with
`--moe-flex-dispatcher-backend hybridep`, on meta tensors.

megatron-core 0.16.1 transformer/moe/fused_a2a.py makes one `HybridEPBuffer(group, hidden_dim,
max_num_of_tokens_per_rank, num_local_experts, use_fp8, num_sms_dispatch_api,
num_sms_combine_api)` on the first dispatch (`init_hybrid_ep_buffer`) and calls
`dispatch_with_permute` (the forward dispatch, and the combine's backward with the handle) and
`combine_with_unpermute` (the forward combine, and the dispatch's backward). Each returns what
HybridEP returns, allocated on the meta device where HybridEP allocates through torch (so the
engine's allocator sees them), at DeepEP's hybrid-ep branch, commit eb9cee7 (the one Megatron-LM
core_v0.16.1's docker/Dockerfile.ci.dev installs): deep_ep/hybrid_ep_buffer.py,
csrc/hybrid_ep/hybrid_ep.cu, executor/executor.cu (`allgather_routing_map`: the gathered routing
map, through torch without the custom all-gather, megatron's case; `metadata_preprocess_core`:
the handle's maps), extension/permute.cu (`permute_preprocessing`: `row_id_map` over the buffer's
worst-case tokens, two workspaces; `permute_launcher`: the permuted tokens and probs). Host copies
(the dispatched-token count and tokens per expert in pinned memory, megatron's blocking case) are
host tensors with values.

Which tokens go where is data: the routing map's values come from the engine's table
(`deep_ep.host_values`, inspector/memory/engine/moe.py); every rank routes alike (balanced), so a rank
receives from each rank of the group what that rank's map sends to it. HybridEP's own buffers
(outside PyTorch's allocator) are sized by inspector/job/hybrid_ep.py; none are made here.

No HybridEP code is copied here; each shape cites the source above.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from inspector.job.hybrid_ep import MIN_TOKENS_PER_RANK, RANKS_PER_NVLINK_DOMAIN
from inspector.world import deep_ep

PERMUTE_BLOCK = 256  # permute.cu permute_preprocessing: block_size, the workspaces' row tile


@dataclass(frozen=True)
class _Routed:
    """What the handle's config slot carries here: the tokens per local expert (host values)."""

    tokens_per_expert: torch.Tensor


class HybridEPBuffer:
    """deep_ep.HybridEPBuffer: the calls megatron-core 0.16.1 makes."""

    def __init__(self, group: Any, hidden_dim: int, max_num_of_tokens_per_rank: int,
                 num_local_experts: int, use_fp8: bool = False, num_sms_dispatch_api: Any = None,
                 num_sms_combine_api: Any = None, **kwargs: Any) -> None:  # fmt: skip
        self.rank, self.group_size = group.rank(), group.size()
        assert self.group_size > 1, "The hybrid-ep kernel should be used with at least 2 ranks"
        self.ranks_per_node = min(self.group_size, RANKS_PER_NVLINK_DOMAIN)
        self.nodes = self.group_size // self.ranks_per_node
        self.hidden_dim = hidden_dim
        self.max_tokens = max(max_num_of_tokens_per_rank, MIN_TOKENS_PER_RANK)
        self.local_experts = num_local_experts
        self.use_fp8 = use_fp8

    def dispatch_with_permute(self, *, hidden: torch.Tensor, routing_map: Any = None,
                              probs: Any = None, num_of_experts_per_rank: Any = None,
                              pad_multiple: Any = None, num_permuted_tokens: Any = None,
                              non_blocking: bool = False, handle: Any = None,
                              **kwargs: Any) -> tuple[Any, ...]:  # fmt: skip
        """hybrid_ep_buffer.py `dispatch_with_permute`: the permuted tokens [permuted, hidden]
        (the input's dtype), their probs [permuted] float32 (with probs), no scaling factors
        (no fp8), the tokens per local expert (int64, on the host when blocking) and the handle."""
        tokens = hidden.shape[0]
        if handle is None:
            # update_template_config: the buffer grows to the largest tokens a rank has seen
            self.max_tokens = max(self.max_tokens, tokens)
            handle = self._preprocess(routing_map, tokens, pad_multiple or 0, non_blocking)
        per_expert = handle[7].tokens_per_expert
        permuted = int(num_permuted_tokens) if num_permuted_tokens is not None else int(per_expert.sum())
        out = hidden.new_empty(permuted, hidden.shape[1])
        out_probs = None
        if probs is not None:
            out_probs = torch.empty(permuted, dtype=torch.float32, device=hidden.device)
        counts = per_expert.clone()
        if non_blocking:  # on the GPU: a meta tensor with the values in the engine's table
            counts = torch.empty(per_expert.shape, dtype=torch.int64, device=hidden.device)
            deep_ep._set(counts, per_expert)
        return out, out_probs, None, counts, handle

    def _preprocess(self, routing_map: Any, tokens: int, pad: int, non_blocking: bool) -> tuple[Any, ...]:
        """hybrid_ep.cu `metadata_preprocessing` and executor.cu `dispatch_preprocess`: the
        handle (sparse-to-dense map [tokens N, R] int32, RDMA-to-attention map [tokens rounded
        up to 16, N] and attention-to-RDMA map [tokens, N - 1] bool, the dispatched-token count,
        the local experts' map [tokens R N, L] bool, `row_id_map` [M + pad, L] int32, the
        tokens, the config, an overflow flag), with the gathered routing map [tokens x group,
        experts] bool and permute's two workspaces freed on the way."""
        device, group, local = routing_map.device, self.group_size, self.local_experts
        r, n = self.ranks_per_node, self.nodes
        gathered = torch.empty(tokens * group, routing_map.shape[-1], dtype=torch.bool, device=device)
        values = deep_ep._values(routing_map)
        if values is None:
            raise NotImplementedError("HybridEP dispatch without the routing's values")
        mine = values[:, self.rank * local:(self.rank + 1) * local]
        per_expert = mine.sum(dim=0).to(torch.int64) * group  # balanced: alike from every rank
        if pad:
            per_expert = (per_expert + pad - 1) // pad * pad
        sparse_to_dense = torch.empty(tokens * n, r, dtype=torch.int32, device=device)
        rdma_to_attn = torch.empty(-(-tokens // 16) * 16, n, dtype=torch.bool, device=device)
        attn_to_rdma = torch.empty(tokens, n - 1, dtype=torch.bool, device=device)
        dispatched = torch.empty(1, dtype=torch.int32, device=device if non_blocking else "cpu")
        local_map = torch.empty(tokens * r * n, local, dtype=torch.bool, device=device)
        del gathered  # the preprocessing kernel has read it
        worst = self.max_tokens * r * n  # HybridEPBuffer::allocate_buffer `max_num_of_tokens`
        row_id_map = torch.empty(worst + pad, local, dtype=torch.int32, device=device)
        overflow = torch.empty(1, dtype=torch.int32, device=device)
        rows = -(-worst // PERMUTE_BLOCK)
        first = torch.empty(rows, local, dtype=torch.int32, device=device)
        second = torch.empty(-(-rows // PERMUTE_BLOCK), local, dtype=torch.int32, device=device)
        del first, second  # permute_preprocessing's workspaces, freed when it returns
        return (sparse_to_dense, rdma_to_attn, attn_to_rdma, dispatched, local_map, row_id_map,
                tokens, _Routed(per_expert), overflow)  # fmt: skip

    def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: Any = None, handle: Any = None,
                               pad_multiple: Any = None, **kwargs: Any) -> tuple[Any, Any]:  # fmt: skip
        """hybrid_ep.cu `combine_with_unpermute`: the combined tokens [tokens, hidden] (the
        input's dtype) and, with probs, their probs [tokens, experts of the group] float32."""
        assert handle is not None, "The handle is necessary in the combine pass."
        tokens = handle[6]
        out = hidden.new_empty(tokens, self.hidden_dim)
        out_probs = None
        if probs is not None:
            out_probs = torch.empty(tokens, self.local_experts * self.group_size,
                                    dtype=torch.float32, device=hidden.device)  # fmt: skip
        return out, out_probs


def install() -> None:
    """Offer the stand-in as `deep_ep.HybridEPBuffer` (deep_ep.py's `install` first), before
    megatron-core's fused_a2a.py is imported: it sets `HAVE_HYBRIDEP` at its own import."""
    deep_ep.install()
    sys.modules[deep_ep.NAME].HybridEPBuffer = HybridEPBuffer  # type: ignore[attr-defined]
