"""MoE layers on meta tensors: balanced routing, the host-side counts megatron's dispatchers read.

Routing is data-dependent: the router's top-k picks experts by value, and the token dispatchers
read how many tokens each expert got on the host (megatron/core/transformer/moe/
token_dispatcher.py: MoEAllGatherTokenDispatcher.dispatch_postprocess `local_map.sum(dim=0)
.cpu()`; MoEAlltoAllTokenDispatcher.preprocess, its input/output splits and
`_maybe_dtoh_and_synchronize`), then size tensors by them (moe_utils.py `permute`'s
`masked_select`, `sort_chunks_by_idxs`'s `split_sizes.tolist()`, experts.py SequentialMLP's
`tokens_per_expert.tolist()`, the all-to-all's output). Meta tensors have no values, so the
engine plans the routing a user plans for: balanced, every expert getting tokens * topk /
num_experts of each rank's tokens (Megatron-LM's `--moe-router-force-load-balancing`, which
routes by random logits for benchmarking, balances so on average: router.py `TopKRouter.forward`,
moe_utils.py `apply_random_logits`). With `--moe-expert-capacity-factor` an expert keeps at most
its capacity (moe_utils.py `get_capacity`, `apply_router_token_dropping`), and exactly that
many with `--moe-pad-expert-input-to-capacity`.

Only the routing map's values are simulated. The router runs as megatron wrote it (its logits,
softmax, top-k and map allocated on meta as on a GPU); the map it returns is given the values of
a balanced routing (`balanced_map`), kept on the host beside the meta tensor. Every op whose meta
inputs all have such values computes them on the host too (the counts, splits and their sums),
`masked_select` takes its output size from the mask's values, a copy to the host returns the
values, and an all-gather of counts over the fake process groups gathers every rank's (the same
balanced) counts. Everything else, the tokens themselves included, runs on meta.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.weak import WeakTensorKeyDictionary

from inspector.memory.engine.allocator import tensors_in
from inspector.world.ddp import META_STREAM

aten = torch.ops.aten


def balanced_map(
    tokens: int, experts: int, topk: int, capacity_factor: float | None, pad: bool
) -> torch.Tensor:
    """Return a [tokens, experts] routing map on the host: token t picks experts (t*topk + j) %
    experts, so each expert gets tokens * topk / experts (within one); capacity as the router's
    token dropping leaves it (moe_utils.py `apply_router_token_dropping`, `get_capacity`)."""
    picks = (torch.arange(tokens).unsqueeze(1) * topk + torch.arange(topk)) % experts
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, picks, True)
    if capacity_factor is None:
        return routing
    capacity = math.ceil(tokens * topk / experts * capacity_factor)
    if capacity > tokens:  # no token dropped; padding keeps every token for every expert
        return torch.ones_like(routing) if pad else routing
    if pad:
        routing = torch.zeros_like(routing)
        routing[:capacity] = True
        return routing
    kept = routing.cumsum(dim=0) <= capacity  # the first `capacity` tokens of each expert
    return routing & kept


class _HostValues(TorchDispatchMode):
    """Carry host values beside meta tensors through the ops that read them (module docstring)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Keep `__torch_dispatch__` as written (allocator.py's module notes)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self.values = _Values()
        self.scalars: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # see `_scalar`

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.scalar_tensor.default:
            return self._scalar(func, args, kwargs)
        tensors = tensors_in((args, kwargs))
        if not any(t in self.values for t in tensors):
            return func(*args, **kwargs)
        if func is aten._to_copy.default and _to_host(kwargs):
            return self._host_copy(args[0], kwargs)
        if func is aten._local_scalar_dense.default:
            return self.values[args[0]].item()
        if func is aten.masked_select.default:
            return self._masked_select(*args)
        if func is aten.index.Tensor and _bool_index(args[1]):
            return self._bool_index(*args)
        if func is aten.repeat_interleave.Tensor:
            return self._repeat_interleave(args[0], kwargs.get("output_size"))
        if func is torch.ops.c10d._allgather_base_.default:
            return self._all_gather(func, args, kwargs)
        stacked = self.values.copies_of(args[0]) if args else None
        if stacked is not None and func is aten.sum.dim_IntList and _exact_sum(stacked, args, kwargs):
            return self._sum(func, args, kwargs, stacked)
        if stacked is not None and _per_copy(func, args, kwargs):
            return self._each_copy(func, args, kwargs, stacked)
        out = func(*args, **kwargs)
        known = all(t in self.values or t in self.scalars or not t.is_meta for t in tensors)
        outputs = tensors_in(out)
        if not known:
            for tensor in outputs:  # an in-place op on a tensor whose values we no longer know
                self.values.pop(tensor)
            return out
        with _disable_current_modes():
            host = func(*self._on_host(args), **self._on_host(kwargs))
        values = tensors_in(host)
        for tensor, value in zip(outputs, values, strict=True):
            self.values[tensor] = value  # written in place, perhaps: no longer copies
        return out

    def _sum(self, func: Any, args: Any, kwargs: dict[str, Any],
             stacked: tuple[torch.Tensor, int]) -> torch.Tensor:  # fmt: skip
        """`gathered.sum(dim=0)` over an all-gather's copies: the input's sum times the copies
        (the [tokens, experts] maps' counts per expert, the same numbers without the big sum)."""
        out: torch.Tensor = func(*args, **kwargs)
        value, copies = stacked
        with _disable_current_modes():
            self.values[out] = value.sum(dim=0) * copies
        return out

    def _each_copy(self, func: Any, args: Any, kwargs: dict[str, Any],
                   stacked: tuple[torch.Tensor, int]) -> torch.Tensor:  # fmt: skip
        """An op that acts on each of an all-gather's copies alike (`_per_copy`): its output is
        the op's result on one copy, stacked as many times (the allgather dispatcher's
        `routing_map[:, local experts].contiguous()`: one rank's columns, not the gathered map's)."""
        out: torch.Tensor = func(*args, **kwargs)
        value, copies = stacked
        with _disable_current_modes():
            self.values.stack(out, func(value, *args[1:], **self._on_host(kwargs)), copies)
        return out

    def _scalar(self, func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        """A Python number made a tensor (`routing_map[mask] = 1` in moe_utils.py
        `pad_routing_map`): an op that reads it with the routing's values keeps its values
        (kept apart from `values`, so an op of such numbers alone runs as before)."""
        out: torch.Tensor = func(*args, **kwargs)
        with _disable_current_modes():
            self.scalars[out] = func(*self._on_host(args), **self._on_host(kwargs))
        return out

    def _on_host(self, tree: Any) -> Any:
        """Return `tree` with each tensor's host values, and the meta device the host."""

        def host(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor):
                return self.values.get(leaf, self.scalars.get(leaf, leaf))
            if isinstance(leaf, torch.device) and leaf.type == "meta":
                return torch.device("cpu")
            return leaf

        return pytree.tree_map(host, tree)

    def _host_copy(self, tensor: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """A copy to the host lands in host memory: the values, no GPU allocation."""
        dtype = kwargs.get("dtype") or tensor.dtype
        with _disable_current_modes():
            return self.values[tensor].to(dtype=dtype, copy=True)

    def _masked_select(self, input: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`masked_select`'s output holds one element per True of the (broadcast) mask."""
        with _disable_current_modes():
            shape = torch.broadcast_shapes(input.shape, mask.shape)
            if mask not in self.values:
                raise NotImplementedError("masked_select on a mask without values (not the routing)")
            # count_nonzero, not sum: a bool sum widens every element (the same count, 20x faster)
            count = int(torch.count_nonzero(self.values[mask].expand(shape)))
        out = torch.empty(count, dtype=input.dtype, device=input.device)
        if input in self.values:
            with _disable_current_modes():  # `x[mask]` selects as masked_select, 4x faster
                self.values[out] = self.values[input].expand(shape)[self.values[mask].expand(shape)]
        return out

    def _bool_index(self, input: torch.Tensor, indices: list[Any]) -> torch.Tensor:
        """`input[mask]` with a bool mask over its leading dimensions: one row per True."""
        mask = indices[0]
        if mask not in self.values:
            raise NotImplementedError("indexing by a mask without values (not the routing)")
        with _disable_current_modes():
            count = int(self.values[mask].sum())
        out = input.new_empty(count, *input.shape[mask.dim():])
        if input in self.values:
            with _disable_current_modes():
                self.values[out] = self.values[input][self.values[mask]]
        return out

    def _repeat_interleave(self, repeats: torch.Tensor, output_size: int | None) -> torch.Tensor:
        """`repeat_interleave(repeats)`: index i repeated repeats[i] times (sum(repeats) long)."""
        if repeats not in self.values:
            raise NotImplementedError("repeat_interleave by counts without values")
        with _disable_current_modes():
            host = torch.repeat_interleave(self.values[repeats])
        out = torch.empty(host.shape[0], dtype=torch.long, device=repeats.device)
        self.values[out] = host
        return out

    def get(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The host values beside `tensor`, if known (the DeepEP stand-in reads them)."""
        return self.values.get(tensor)

    def set(self, tensor: torch.Tensor, values: torch.Tensor) -> None:
        """Keep `values` on the host beside `tensor` (the DeepEP stand-in's outputs)."""
        self.values[tensor] = values

    def _all_gather(self, func: Any, args: Any, kwargs: Any) -> Any:
        """Every rank routes alike (balanced): the gather holds group-size copies of the input."""
        out = func(*args, **kwargs)
        output, input = args[0], args[1]
        if input in self.values:
            with _disable_current_modes():
                copies = output.numel() // max(input.numel(), 1)  # the group's size
                # the copies made only where an op reads them all (`_Values`)
                self.values.stack(output, self.values[input].clone(), copies)
        return out


class _Values:
    """The host values beside meta tensors, an all-gather's output kept as (the input's values,
    copies) until an op reads all of it: the allgather dispatcher gathers a [tokens, experts]
    routing map over TP x EP ranks, then keeps its local experts' columns and sums them
    (token_dispatcher.py `dispatch_postprocess`), which `_sum` and `_each_copy` answer from one
    copy. A write to a tensor replaces its copies with its values; a column slice kept as copies
    does not see a later write to the map it was cut from (megatron's dispatchers cut the map and
    copy it, and write to neither after)."""

    def __init__(self) -> None:
        self.full: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.stacked: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return tensor in self.full or tensor in self.stacked

    def __getitem__(self, tensor: torch.Tensor) -> torch.Tensor:
        value = self.full.get(tensor)
        if value is None:
            value = self.full[tensor] = _stacked(*self.stacked[tensor])
        return value

    def get(self, tensor: torch.Tensor, default: Any = None) -> Any:
        return self[tensor] if tensor in self else default

    def __setitem__(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        self.full[tensor] = value
        self.stacked.pop(tensor, None)

    def stack(self, tensor: torch.Tensor, value: torch.Tensor, copies: int) -> None:
        """Keep `tensor`'s values as `copies` copies of `value` stacked on dim 0."""
        self.full.pop(tensor, None)
        self.stacked[tensor] = (value, copies)

    def copies_of(self, tensor: Any) -> tuple[torch.Tensor, int] | None:
        return self.stacked.get(tensor) if isinstance(tensor, torch.Tensor) else None

    def pop(self, tensor: torch.Tensor) -> None:
        self.full.pop(tensor, None)
        self.stacked.pop(tensor, None)


def _stacked(value: torch.Tensor, copies: int) -> torch.Tensor:
    """`copies` copies of `value` stacked on dim 0, as torch.cat([value] * copies) (repeat copies
    a [tokens, experts] bool map 2.6x faster)."""
    return value.repeat(copies, *[1] * (value.dim() - 1))


def _per_copy(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """True for an op of one tensor that acts on each dim-0 copy alike: a slice across the other
    dimensions, a clone (`.contiguous()`), a cast on the same device."""
    if any(isinstance(a, torch.Tensor) for a in args[1:]):
        return False
    if func is aten.slice.Tensor:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return bool(dim % args[0].dim())
    if func is aten._to_copy.default:
        return kwargs.get("device") is None
    return func is aten.clone.default


def _bool_index(indices: Any) -> bool:
    """True for `x[mask]`: one bool index over the leading dimensions, nothing else."""
    return (len(indices) == 1 and isinstance(indices[0], torch.Tensor)
            and indices[0].dtype == torch.bool)  # fmt: skip


def _dim0(args: Any, kwargs: dict[str, Any]) -> bool:
    """True for `x.sum(dim=0)`: over dim 0 alone, no keepdim, no dtype (aten.sum.dim_IntList)."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return list(dims or ()) == [0] and not keepdim and kwargs.get("dtype") is None


def _exact_sum(stacked: tuple[torch.Tensor, int], args: Any, kwargs: dict[str, Any]) -> bool:
    """True for `x.sum(dim=0)` of copies whose sum is exact in any order (not floating point)."""
    value = stacked[0]
    return not (value.is_floating_point() or value.is_complex()) and _dim0(args, kwargs)


def _to_host(kwargs: dict[str, Any]) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _routed(values: _HostValues, routing: Any) -> Any:
    """Wrap TopKRouter.routing: run it, then give its map a balanced routing's values."""

    def routed(self: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        probs, routing_map = routing(self, logits, *args, **kwargs)
        tokens, experts = routing_map.shape
        config = self.config
        with _disable_current_modes():  # host values, no GPU memory
            balanced = balanced_map(
                tokens,
                experts,
                config.moe_router_topk,
                config.moe_expert_capacity_factor,
                config.moe_pad_expert_input_to_capacity,
            )
            values.values[routing_map] = balanced
            # the probs: equal weights on the picked experts, zero elsewhere (the flex
            # dispatcher's DeepEP manager takes their top-k as the expert indices)
            values.values[probs] = balanced.to(probs.dtype) / config.moe_router_topk
        return probs, routing_map

    return routed


def _sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """moe_utils.py `sinkhorn` (the router's `--moe-router-load-balancing-type sinkhorn`, under
    no_grad): its loop turns until the scalings converge (`while error > tol`), which meta tensors
    cannot tell. One turn, as written there: each turn's tensors replace the last's, so one turn
    allocates what the loop holds at once."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps = 0.00000001
    d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
    d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
    return d1 * cost * d0.unsqueeze(1)


def _multihot(values: _HostValues, to_multihot: Any) -> Any:
    """Wrap _DeepepManager._indices_to_multihot: run it, then give its map and probs the values
    the same function computes from the received indices' and weights' host values."""

    def multihot(self: Any, indices: torch.Tensor, probs: torch.Tensor) -> Any:
        routing_map, multihot_probs = to_multihot(self, indices, probs)
        if indices in values.values and probs in values.values:
            with _disable_current_modes():
                host_map, host_probs = to_multihot(self, values.values[indices], values.values[probs])
            values.values[routing_map], values.values[multihot_probs] = host_map, host_probs
        return routing_map, multihot_probs

    return multihot


def _to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.py `maybe_move_tensor_to_cpu`, with meta standing for the GPU."""
    if isinstance(tensor, torch.Tensor) and tensor.is_meta:
        host = tensor.to(torch.device("cpu"))
        return host.numpy() if as_numpy else host
    return tensor


_STREAM = META_STREAM  # dispatchers' streams and events: world/ddp.py's stand-in


class _GroupedGemm(torch.autograd.Function):
    """grouped_gemm's `gmm` (grouped_gemm/ops.py GroupedGemm): one GEMM per expert's rows.

    Output [rows, n]; saves a, b and the host batch sizes; backward allocates a's and b's
    gradients.
    """

    @staticmethod
    def forward(ctx: Any, a: Any, b: Any, batch_sizes: Any, trans_b: bool) -> Any:
        ctx.save_for_backward(a, b)
        ctx.trans_b = trans_b
        return a.new_empty(a.shape[0], b.shape[-2] if trans_b else b.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None, None


def _gmm(a: Any, b: Any, batch_sizes: Any, trans_b: bool = False) -> Any:
    return _GroupedGemm.apply(a, b, batch_sizes, trans_b)


@contextlib.contextmanager
def dispatcher_streams() -> Iterator[None]:
    """Let megatron build MoEAlltoAllTokenDispatcher without CUDA: its side stream for the host
    copies (token_dispatcher.py `__init__`: `torch.cuda.Stream()`, class-wide from 0.14) is a
    stand-in that orders nothing."""
    from megatron.core.transformer.moe import token_dispatcher

    owner = token_dispatcher.MoEAlltoAllTokenDispatcher
    saved = owner.__dict__.get("cuda_dtoh_stream")
    stream = torch.cuda.Stream
    torch.cuda.Stream = lambda *args, **kwargs: _STREAM  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Stream = stream  # type: ignore[misc]
        if "cuda_dtoh_stream" in owner.__dict__:
            owner.cuda_dtoh_stream = saved


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Run megatron's MoE layers on meta tensors with balanced routing inside the block.

    Enter it inside the allocator's Tracker: the host values it computes are no GPU memory.
    """
    from megatron.core.transformer.moe import fused_a2a, router, token_dispatcher

    from inspector.world import deep_ep

    values = _HostValues()
    deepep = token_dispatcher._DeepepManager
    patches: list[tuple[Any, str, Any]] = [
        (router.TopKRouter, "routing", _routed(values, router.TopKRouter.routing)),
        (router, "sinkhorn", _sinkhorn),
        (deepep, "_indices_to_multihot", _multihot(values, deepep._indices_to_multihot)),
        (deep_ep, "host_values", values),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _to_cpu),
        (torch.cuda, "current_stream", lambda *args: _STREAM),
        (torch.cuda, "stream", lambda *args: contextlib.nullcontext()),
        (torch.Tensor, "record_stream", lambda *args: None),
    ]
    try:  # the legacy GroupedMLP's kernels; megatron-core 0.17 removed it with GroupedMLP
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        pass
    else:
        patches.append((grouped_gemm_util, "ops", SimpleNamespace(gmm=_gmm)))
    if hasattr(fused_a2a, "_hybrid_ep_buffer"):  # 0.16+: HybridEP's buffer, made per job here
        patches.append((fused_a2a, "_hybrid_ep_buffer", None))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with values, dispatcher_streams():
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
