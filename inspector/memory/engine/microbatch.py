"""One micro-batch through one pipeline stage, as Megatron-LM's training step runs it, recorded.

The stage is built by megatron-core (world/stage.py) with the job's runtime settings
(runtime.py `runtime_config`), wrapped in megatron's DistributedDataParallel, and run on meta tensors
(cuda.py) under the allocator model (allocator.py):

- inputs as Megatron-LM's `pretrain_gpt.get_batch` puts them on the GPU for this stage (tokens,
  position ids and the attention mask on the first stage, labels and the loss mask on the
  last, the mask everywhere), and the tensor a later stage receives from the one before
  (`p2p_communication`: `torch.empty(shape, requires_grad=True)` in the pipeline dtype);
- `GPTModel.forward` through DDP; on the last stage Megatron-LM's `loss_func` (pretrain_gpt.py:
  masked sum of the fp32 losses, the token count) and `forward_step_calc_loss`'s division by
  the micro-batches; elsewhere the output's data is freed after its send
  (`deallocate_output_tensor`, Megatron-LM's `deallocate_pipeline_outputs=True`);
- `backward_step`: the loss scaled by the optimizer's scale on the last stage, else the gradient
  received from the next stage (`custom_backward`); DDP's hooks add each weight gradient into
  its grad buffer.

Buffers that outlive the micro-batch (megatron's global memory buffer, the rotary cache) are
found as the storages still alive at its end: they are persistent, allocated once per run.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from inspector.errors import ConfigError
from inspector.job.job import Job
from inspector.memory.engine.allocator import Event, Tracker
from inspector.memory.engine.cuda import cuda_on_meta
from inspector.memory.engine.deferral import drain_deferred
from inspector.memory.engine.delayed_wgrad import delayed_wgrad
from inspector.memory.engine.offload import offloaded
from inspector.memory.engine.paged_stash import stashed
from inspector.world.te.state import placeholders_named


@dataclass(frozen=True)
class Trace:
    """One micro-batch of one chunk: its allocations in order, and what persists after it."""

    forward: tuple[Event, ...]  # steady state: persistent buffers taken out
    backward: tuple[Event, ...]
    persistent: tuple[tuple[str, int], ...]  # (where megatron made it, bytes)
    # --defer-embedding-wgrad-compute: (bytes, limit) the output layer keeps of a micro-batch
    # after its backward until the pipeline's drain, for the first `limit` (0: all) of them
    deferred: tuple[int, int] = (0, 0)
    # --fine-grained-activation-offloading: the pinned host buffers its forward made (where,
    # bytes), held until its backward reloads them (offload.py)
    host: tuple[tuple[str, int], ...] = ()
    # --moe-paged-stash: the tokens megatron's profiling pass counted, per layer and kind
    # (paged_stash.py; the trace itself is the steady pass, the marked tensors in pages)
    stash: tuple[tuple[str, int], ...] = ()
    # (a layer, bytes): of the persistent buffers, those a layer's module keeps alive through an
    # attribute its forward set with the autograd graph behind it (`_retained`), in the events
    # too: held from the backward until the layer's next pass replaces it (schedule.py `freeing`)
    retained: tuple[tuple[str, int], ...] = ()

    @property
    def held(self) -> int:
        """Return the bytes the micro-batch holds between its forward and its backward."""
        return self.forward[-1].allocated if self.forward else 0

    @property
    def left(self) -> int:
        """Return the bytes a backward leaves the chunk's layers (`retained`, all layers)."""
        return sum(size for _, size in self.retained)


def run_microbatch(job: Job, ddp: Any, gpt: Any, num_microbatches: int) -> Trace:
    """Run one micro-batch forward and backward through `ddp` (around `gpt`); return its trace."""
    tracker = Tracker()
    where = _where(tracker, gpt)
    with cuda_on_meta(), _failures(tracker, where), where, _global_buffer_named(tracker), \
            placeholders_named(functools.partial(_named, tracker)):
        with tracker, _routing(job), _graphed_steps_named(job, tracker, where), \
                stashed(gpt, job.training.ep_overlap, lambda: tracker.where) as stash, \
                delayed_wgrad(gpt, job.training.delay_wgrad):
            if stash is not None:  # megatron's profiling first iteration, then its buffers
                with offloaded(gpt.config, lambda: tracker.where):  # its own offload manager
                    _backward(gpt, _forward(job, ddp, gpt, num_microbatches, tracker), tracker)
                    drain_deferred(gpt, tracker)
                stash.captured()
            with offloaded(gpt.config, lambda: tracker.where) as host:
                start = tracker.mark()
                state = _forward(job, ddp, gpt, num_microbatches, tracker)
                if stash is not None:
                    stash.forward_done()
                middle = tracker.mark()
                if stash is not None:
                    stash.backward_start()
                _backward(gpt, state, tracker)
                del state
                deferred = drain_deferred(gpt, tracker)
    persistent = _persistent(tracker)
    events = list(tracker.events)  # `_retained` frees what it finds: not part of the pass
    retained, kept = _retained(gpt, tracker)  # in the pass's events, and persistent
    # with the stash's profiling pass first: what it made and the steady pass replaced (a
    # dispatcher's last routing metadata) is freed by the steady pass, as on every micro-batch
    # after the first: left out, as the persistent buffers are
    stale = {i: 0 for i, made in tracker.made_by.items() if i >= start > made} if stash else {}
    left_out = {**{i: size for i, size in persistent.items() if i not in kept}, **stale}
    steady = _steady(events, left_out)
    before = start - sum(1 for index in left_out if index < start)  # the profiling pass's
    split = middle - sum(1 for index in left_out if index < middle) - before
    base = steady[before - 1].allocated if before else 0  # what the profiling pass left
    steady = [Event(e.bytes, e.allocated - base, e.where, e.origin) for e in steady[before:]]
    return Trace(
        forward=tuple(steady[:split]),
        backward=tuple(steady[split:]),
        persistent=tuple((events[i].where, size) for i, size in sorted(persistent.items())),
        deferred=(deferred, gpt.config.wgrad_deferral_limit),
        host=tuple(host.made),
        stash=tuple(stash.counts) if stash is not None else (),
        retained=retained,
    )


_LAYER_MODULE = re.compile(r"(?:^|\.)(decoder\.layers\.\d+)$")


def _retained(gpt: Any, tracker: Tracker) -> tuple[tuple[tuple[str, int], ...], set[int]]:
    """Return, per transformer layer, the bytes still allocated after the micro-batch only
    because one of its modules keeps a tensor of its forward with that tensor's autograd graph,
    and the events that allocated them; each such attribute is dropped here, as the layer's next
    forward replaces it. They stay in the pass's events (a micro-batch in flight holds its
    layers' inputs) and count among the persistent buffers (the last backward leaves them for
    the optimizer step): schedule.py frees them where the layer's next pass replaces them.

    megatron-core's token dispatchers keep the routing probabilities of the last forward
    (MoEAllGatherTokenDispatcher `self.local_probs`, the all-to-all dispatcher's `self.probs`).
    Under full recomputation the last forward is the one CheckpointFunction.backward reran
    (tensor_parallel/random.py) on a detached copy of the layer's input: its graph holds that
    input (AccumulateGrad keeps the leaf) and the gradient written into its `.grad`, two
    [s, b, h] tensors per layer, until the layer's next forward (bench/RESULTS.md `retained`).
    """
    out: list[tuple[str, int]] = []
    made: set[int] = set()
    for name, layer in gpt.named_modules():
        match = _LAYER_MODULE.search(name)
        if match is None:
            continue
        before = dict(tracker.live)
        owners = [m for module in layer.modules() for m in (module, *_plain_objects(module))]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    setattr(owner, attr, None)
        freed = {index: size for key, (size, index) in before.items() if key not in tracker.live}
        if freed:
            out.append((match.group(1), sum(freed.values())))
            made.update(freed)
    return tuple(out), made


def _plain_objects(module: Any) -> list[Any]:
    """Return the objects a module holds that are neither modules nor tensors (a dispatcher)."""
    skip = torch.nn.Module | torch.Tensor
    return [value for value in vars(module).values()
            if hasattr(value, "__dict__") and not isinstance(value, skip)]  # fmt: skip


def _graphed_steps_named(job: Job, tracker: Tracker, where: _where) -> Any:
    """Name the MoE steps a CUDA graph takes that are no module (engine/graph_steps.py)."""
    from inspector.memory.engine.graph_steps import preprocess_named

    return preprocess_named(job, tracker.enter, tracker.leave, where.names)


def _routing(job: Job) -> contextlib.AbstractContextManager[None]:
    """Return MoE routing on meta tensors (moe.py) for a job with experts, else nothing."""
    if job.model.num_experts is None:
        return contextlib.nullcontext()
    from inspector.memory.engine.moe import balanced_routing

    return balanced_routing()


def _inputs(job: Job, gpt: Any) -> dict[str, Any]:
    """Return the batch `pretrain_gpt.get_batch` gives this stage, on the GPU.

    A stage holding MTP layers gets the whole batch, tokens and position ids included
    (Megatron-LM's `get_batch_on_this_tp_rank(..., mtp_on_this_rank)`, training/utils.py).
    Under context parallelism megatron-core's `get_batch_on_this_cp_rank` then keeps this
    rank's two chunks of every tensor's sequence (a copy: `index_select`).
    """
    s, b = job.model.seq_length, job.schedule().micro_batch_size
    packed = job.training.packed_document_length is not None  # --sft: no mask, cu_seqlens
    batch: dict[str, Any] = {
        "attention_mask": None if packed else torch.empty(b, 1, s, s, dtype=torch.bool, device="cuda")
    }
    if gpt.pre_process or getattr(gpt, "mtp_process", False):
        batch["input_ids"] = torch.empty(b, s, dtype=torch.long, device="cuda")
        batch["position_ids"] = torch.empty(b, s, dtype=torch.long, device="cuda")
    else:
        batch["input_ids"] = batch["position_ids"] = None
    if gpt.post_process:
        batch["labels"] = torch.empty(b, s, dtype=torch.long, device="cuda")
        batch["loss_mask"] = torch.empty(b, s, dtype=torch.float32, device="cuda")
    if packed:
        from inspector.memory.engine.packed import packed_batch

        return packed_batch(job, batch)
    if job.layout.cp > 1:  # pretrain_gpt.get_batch: this cp rank's two chunks of the sequence
        import inspect

        from megatron.core.utils import get_batch_on_this_cp_rank

        # 0.19 takes the group and whether context parallelism is hybrid, as pretrain_gpt.py
        # (core_v0.19.0) passes them; before, it read the group from parallel_state
        if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
            batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
        else:
            batch = get_batch_on_this_cp_rank(batch)
    return batch


def _received(job: Job, gpt: Any) -> torch.Tensor:
    """Return the tensor p2p_communication allocates to receive a stage's input (or its grad)."""
    layout = job.layout
    s = job.model.seq_length // layout.cp
    if layout.sequence_parallel:
        s //= layout.tp
    shape = (s * _copies_received(gpt), job.schedule().micro_batch_size, job.model.hidden_size)
    return torch.empty(shape, dtype=gpt.config.pipeline_dtype, device="cuda", requires_grad=True)


def _copies_received(gpt: Any) -> int:
    """Return how many sequences a chunk's input holds: 1 + MTP layers after a standalone MTP
    stage, else 1.

    A chunk with MTP layers that does not compute the loss sends the main hidden states and
    each MTP layer's, concatenated ([(1 + mtp) s, b, h]: multi_token_prediction.py), and with
    such a layout (`mtp_standalone`, pipeline_parallel_layer_layout.py) p2p_communication.py
    receives every tensor at the shape sent. MTP sits in a rank's last virtual stage, so the
    last virtual stages of the later ranks receive that tensor.
    """
    config = gpt.config
    if not getattr(config, "mtp_standalone", False):
        return 1
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType

    layout = config.pipeline_model_parallel_layout
    rank = parallel_state.get_pipeline_model_parallel_rank()
    last = layout.virtual_pipeline_model_parallel_size - 1
    mtp_rank = min(r for r, chunks in enumerate(layout.layout) if LayerType.mtp in chunks[-1])
    if (getattr(gpt, "vp_stage", None) or 0) == last and rank > mtp_rank:
        return 1 + config.mtp_num_layers
    return 1


def _forward(
    job: Job, ddp: Any, gpt: Any, num_microbatches: int, tracker: Tracker
) -> dict[str, Any]:
    tracker.at("inputs")
    batch = _inputs(job, gpt)
    state: dict[str, Any] = {}
    if not gpt.pre_process:
        state["input"] = _received(job, gpt)
        gpt.set_input_tensor(state["input"])
    loss_mask = batch.pop("loss_mask", None)
    output = ddp(**batch)
    tracker.at("loss")
    if gpt.post_process:
        output = _loss_func(loss_mask, output) / num_microbatches
    else:
        tracker.at("send")
        state["output_shape"] = output.shape
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
    state["output"] = output
    state["batch"] = batch
    return state


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Megatron-LM pretrain_gpt.py `loss_func`, then `forward_step_calc_loss`'s token division."""
    losses = output.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss / torch.clamp(num_tokens, min=1)


def _backward(gpt: Any, state: dict[str, Any], tracker: Tracker) -> None:
    from megatron.core.pipeline_parallel.schedules import custom_backward

    output = state.pop("output")
    if gpt.post_process:
        tracker.at("loss scale")
        scale = torch.ones(1, dtype=torch.float32, device="cuda")  # the optimizer's _scale_one
        output = scale * output
        tracker.at("backward")
        torch.autograd.backward(output)
    else:
        tracker.at("receive grad")
        grad = torch.empty(state["output_shape"], dtype=output.dtype, device="cuda")
        tracker.at("backward")
        custom_backward(output, grad)
        del grad
    del output
    tracker.at("send grad")
    state.clear()


def _persistent(tracker: Tracker) -> dict[int, int]:
    """Return event index -> bytes of the allocations still alive after the micro-batch.

    They are megatron's buffers made on first use and kept (the global memory buffer, the
    rotary cache): a run allocates them once, before the steady state.
    """
    return {index: size for size, index in tracker.live.values()}


def _steady(events: list[Event], persistent: dict[int, int]) -> list[Event]:
    """Return the events without the persistent allocations, totals counted without them."""
    steady, kept = [], 0
    for index, event in enumerate(events):
        if index in persistent:
            kept += event.bytes
            continue
        steady.append(Event(event.bytes, event.allocated - kept, event.where, event.origin))
    return steady


@contextlib.contextmanager
def _failures(tracker: Tracker, modules: _where) -> Iterator[None]:
    """Turn an error inside megatron's forward or backward into one sentence that says where."""
    from megatron.core.utils import ExperimentalNotEnabledError

    try:
        yield
    except (*MEGATRON_ERRORS, ExperimentalNotEnabledError) as exc:
        where = modules.failed or tracker.where
        raise megatron_failed(
            f"the {_pass(tracker)} of a micro-batch on meta tensors in {where}", exc
        ) from exc


# what megatron's own code raises when a job it cannot run reaches it (its asserts and checks)
MEGATRON_ERRORS = (ValueError, AssertionError, RuntimeError, TypeError, ArithmeticError)
# megatron-core's `experimental_fn` (utils.py) refuses to run unless Megatron-LM's
# --enable-experimental set config.ENABLE_EXPERIMENTAL: 0.13 wraps its fused MLA RoPE so
EXPERIMENTAL = "megatron-core runs this function only under Megatron-LM's --enable-experimental"


def megatron_failed(what: str, exc: BaseException) -> ConfigError:
    """Return the one-sentence error for megatron-core failing to run `what` on meta tensors."""
    reason = " ".join(str(exc).split()) or type(exc).__name__
    from megatron.core.utils import ExperimentalNotEnabledError

    if isinstance(exc, ExperimentalNotEnabledError):
        reason = f"{reason} ({EXPERIMENTAL})"
    from inspector.world.config import flags_named

    flags = flags_named(reason)  # a refusal names the flags to change, as a build's does
    change = f"the flags it names: {', '.join(flags)}; " if flags else ""
    return ConfigError(
        f"megatron-core failed running {what}: {reason} ({change}--debug shows its traceback)"
    )


def _pass(tracker: Tracker) -> str:
    return "backward" if tracker.phase in ("loss scale", "backward", "receive grad") else "forward"


GLOBAL_BUFFER = "megatron's global memory buffer"


@contextlib.contextmanager
def _global_buffer_named(tracker: Tracker) -> Iterator[None]:
    """Label what megatron's GlobalMemoryBuffer allocates: one buffer per (name, dtype) per
    process, grown to the largest request (megatron/core/utils.py), shared by a rank's chunks."""
    from megatron.core.utils import GlobalMemoryBuffer

    get_tensor = GlobalMemoryBuffer.get_tensor

    def named(self: Any, tensor_shape: Any, dtype: Any, name: str, *args: Any, **kw: Any) -> Any:
        where = tracker.where
        tracker.where = f"{GLOBAL_BUFFER} ({name}, {str(dtype).removeprefix('torch.')})"
        try:
            return get_tensor(self, tensor_shape, dtype, name, *args, **kw)
        finally:
            tracker.where = where

    GlobalMemoryBuffer.get_tensor = named
    try:
        yield
    finally:
        GlobalMemoryBuffer.get_tensor = get_tensor


@contextlib.contextmanager
def _named(tracker: Tracker, label: str) -> Iterator[None]:
    """Name what is allocated inside, in backward too (where the tracker otherwise names the
    module whose forward made the running autograd node: a module on the stack takes over)."""
    where = tracker.where
    tracker.stack.append(label)
    tracker.where = label
    try:
        yield
    finally:
        tracker.stack.pop()
        tracker.where = where


class _where:
    """Tell the tracker which megatron module runs (global forward hooks, recomputation too)."""

    def __init__(self, tracker: Tracker, gpt: Any) -> None:
        self.tracker = tracker
        self.names = {module: name or "model" for name, module in gpt.named_modules()}
        self.handles: list[Any] = []
        self.failed: str | None = None  # the module an error left

    def __enter__(self) -> None:
        from torch.nn.modules import module

        self.handles = [
            module.register_module_forward_pre_hook(self._pre),
            module.register_module_forward_hook(self._post, always_call=True),
        ]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _pre(self, module: Any, args: Any) -> None:
        name = self.names.get(module)
        if name is not None:
            self.tracker.enter(name)

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if module in self.names:
            if sys.exc_info()[1] is not None and self.failed is None:
                self.failed = self.tracker.where  # torch runs this hook while an error unwinds
            self.tracker.leave()
