"""megatron-core 0.18+'s MoE paged stash (`--moe-paged-stash`), run on meta tensors.

megatron's own code runs (transformer/moe/paged_stash.py, core_v0.19.2): `PagedStashManager`,
its saved-tensor hooks around Transformer Engine's fused grouped MLP (experts.py
`TEGroupedMLP._fused_forward`, `get_paged_stash_context`), its group start and commit, and
`paged_stash_reset`, which the pipeline schedules call at the start of every iteration
(schedules.py: `paged_stash_reset(enabled=not forward_only, config=config)`):

- the first iteration is megatron's profiling one (status "capture"): the hook keeps each marked
  tensor cut to the tokens that arrived, and counts per kind (dtype, columns) the tokens saved
  and not yet given back to backward, keeping the most (`max_avg_tokens_across_vp_stages` from
  the budget / capacity factor, `max_tokens_across_vp_stages` from the real counts);
- the second call of `paged_stash_reset` (status "captured") runs `allocate_stash_buffers`:
  per kind a GPU buffer of int(most x factor) tokens rounded up to whole pages
  (`PagedStashBuffer`), its free lists, and with a CPU factor a pinned host buffer;
- from then on the commit after a layer's experts copies its marked tensors into pages and the
  next layer's start frees them; the backward reloads one layer ahead into new tensors. The
  layer whose backward comes right after its forward keeps its tensors.

Each micro-batch trace runs both: the profiling pass (its counts, per layer, kept in
`Trace.stash`) and then the captured pass, the trace the engine replays. A trace holds one
micro-batch of one chunk, while megatron counts across every micro-batch in flight and every
chunk: `most_counted` replays the schedule's passes over the traces' counts (the profiling
iteration's most) and `stash_buffers` runs megatron's `allocate_stash_buffers` with them for the
rank (engine/run.py `rank_stash`).

What only a GPU runs, each the smallest piece that lets megatron's code run:
- the Triton page kernels `paged_stash_copy_kernel` / `paged_stash_pop_kernel`
  (transformer/moe/ops/paged_stash.py 13, 147) move values and the free lists' heads, which
  meta tensors do not have: they launch nothing (world/setup.py `KernelLaunchingNothing`, as
  for megatron's MLA RoPE kernels);
- streams, events and pinned host buffers are offload.py's (`offloading_on_meta`): a pinned
  buffer is counted in `HostBytes`.

Not simulated (a static run has no overflow): `PagedStashRunner`'s rerun of a step without the
stash when a rank's buffer overflows or HybridEP's budget drops tokens (paged_stash.py
`PagedStashRunner.__call__`); job/checks.py `check_paged_stash` refuses factors that would
overflow under balanced routing.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from inspector.memory.engine.allocator import rounded
from inspector.memory.engine.offload import HostBytes, offloading_on_meta, pinned
from inspector.world.setup import KernelLaunchingNothing

MODULE = "megatron.core.transformer.moe.paged_stash"
STASH = "paged stash"  # the label of its buffers and counts
_COUNT = ": paged stash count "  # a count's label: "<layer>: paged stash count <dtype> <cols> <avg|max>"


def _manager() -> Any:
    return importlib.import_module(MODULE).PagedStashManager


@contextlib.contextmanager
def _on_meta(host: HostBytes) -> Iterator[None]:
    """Let megatron's stash run on meta: streams, pinned buffers (offload.py) and page kernels."""
    module: Any = importlib.import_module(MODULE)
    kernels = module.paged_stash_copy_kernel, module.paged_stash_pop_kernel
    module.paged_stash_copy_kernel = KernelLaunchingNothing("paged_stash_copy_kernel")
    module.paged_stash_pop_kernel = KernelLaunchingNothing("paged_stash_pop_kernel")
    try:
        with offloading_on_meta(host):
            yield
    finally:
        module.paged_stash_copy_kernel, module.paged_stash_pop_kernel = kernels


class StashRun:
    """One micro-batch's stash: megatron's profiling pass counted per layer, then its steady one.

    A trace holds one micro-batch, so the schedule megatron's profiling pass records is that
    micro-batch's: its last layer's forward, then that layer's backward, where megatron keeps the
    layer's tensors (`PipelinePostScheduleFunction.forward`: the current layer is the negated
    next one). That is the iteration's order only where a chunk's backward follows its own
    forward: one pipeline stage's 1F1B, or the last stage's without virtual stages, and without
    the all-to-all overlap (its step pairs a forward with an older micro-batch's backward). Where
    another micro-batch's pass comes between (`keeps_last` False), the steady pass stashes the
    last layer too, frees its tensors when that pass would start (`wait_for_stash_to_complete`)
    and reloads them at its backward's start (`reload_paged_tensors`), as megatron does.
    """

    def __init__(self, config: Any, where: Callable[[], str], keeps_last: bool) -> None:
        self.config = config
        self.where = where
        self.keeps_last = keeps_last
        self.counts: list[tuple[str, int]] = []  # (label, tokens) per layer and kind
        self.steady = False
        self.last: int | None = None  # the schedule key of a last layer stashed
        self.manager: Any = None

    def hooked(self, manager: Any) -> None:
        """Count what megatron's capture hook adds, each addition named by the layer running."""
        save = manager.on_save_for_backward

        def counted(tensor: torch.Tensor) -> Any:
            before = dict(manager.temp_avg_tokens_across_vp_stages or {})
            before_max = dict(manager.temp_tokens_across_vp_stages or {})
            out = save(tensor)
            if manager.status == "capture":
                for (dtype, cols), total in (manager.temp_avg_tokens_across_vp_stages or {}).items():
                    avg = total - before.get((dtype, cols), 0)
                    real = manager.temp_tokens_across_vp_stages[dtype, cols]
                    real -= before_max.get((dtype, cols), 0)
                    if avg or real:  # the kind this tensor added to
                        name = f"{self.where()}{_COUNT}{str(dtype).removeprefix('torch.')} {cols}"
                        self.counts += [(f"{name} avg", avg), (f"{name} max", real)]
            return out

        manager.on_save_for_backward = counted
        self.manager = manager
        keep = manager.remove_paged_tensor_from_stash

        def stash_last() -> None:
            """The last layer's commit: stash it where another pass comes next (class notes)."""
            if not self.steady or self.keeps_last:
                keep()
                return
            self.last = manager._pp_schedule[manager.current_schedule_index]
            manager.stash_paged_tensors(self.last)

        manager.remove_paged_tensor_from_stash = stash_last

    def forward_done(self) -> None:
        """Another micro-batch's pass starts: the last layer's stashed tensors are freed."""
        if self.last is not None:
            self.manager.wait_for_stash_to_complete()

    def backward_start(self) -> None:
        """The pass before this backward reloads its last layer's tensors (megatron's one ahead)."""
        if self.last is not None:
            self.manager.reload_paged_tensors(self.last)

    def captured(self) -> None:
        """Megatron's second `paged_stash_reset`: buffers for the trace's steady pass (sized by
        this micro-batch alone: the rank's are `stash_buffers`'), kept out of the trace."""
        reset = importlib.import_module(MODULE).paged_stash_reset
        with _disable_current_modes(), _on_meta(HostBytes()):
            reset(enabled=True, config=self.config)
        self.steady = True


@contextlib.contextmanager
def stashed(gpt: Any, ep_overlap: bool, where: Callable[[], str]) -> Iterator[StashRun | None]:
    """Run a micro-batch of chunk `gpt` with megatron's paged stash when its config says so (a
    fresh manager, its first `paged_stash_reset`: the profiling status); None without it."""
    config = gpt.config
    if not getattr(config, "moe_paged_stash", False):
        yield None
        return
    manager = _manager()
    keeps_last = bool(gpt.post_process) and not ep_overlap and \
        config.virtual_pipeline_model_parallel_size is None  # fmt: skip
    with _on_meta(HostBytes()):
        manager.STASH_MGR = None
        run = StashRun(config, where, keeps_last)
        run.hooked(manager.get_instance())
        importlib.import_module(MODULE).paged_stash_reset(enabled=True, config=config)
        try:
            yield run
        finally:
            manager.STASH_MGR = None


Kind = tuple[str, int, str]  # a stash buffer's dtype and columns, and avg (budget) or max (real)


def layer_counts(stash: Sequence[tuple[str, int]]) -> list[dict[Kind, int]]:
    """Return a chunk's micro-batch counts layer by layer in forward order, by kind (a layer: the
    consecutive counts its experts' module made)."""
    out: list[dict[Kind, int]] = []
    last = None
    for label, tokens in stash:
        where, rest = label.split(_COUNT, 1)
        dtype, cols, how = rest.split()
        if where != last:
            out.append({})
            last = where
        key = (dtype, int(cols), how)
        out[-1][key] = out[-1].get(key, 0) + tokens
    return out


def most_counted(passes: Iterable[Any], layers: Sequence[list[dict[Kind, int]]]) -> dict[Kind, int]:
    """Return the most tokens megatron's profiling iteration counts at once, by kind, over the
    schedule's passes (memory/engine/schedule.py `replay_passes`): a forward adds each layer's
    tokens (`on_save_for_backward`), a backward takes them off (`on_get_saved_tensor`); under the
    MoE all-to-all overlap a forward runs with an older micro-batch's backward layer by layer,
    forward layer i with backward layer L-1-i, whose experts' backward runs before the forward's
    experts (models/common/model_chunk_schedule_plan.py `TransformerLayerSchedulePlan.run`:
    `b_layer.mlp.backward` before `f_layer.mlp.forward`, core_v0.19.2)."""
    live: dict[Kind, int] = {}
    top: dict[Kind, int] = {}

    def add(counts: dict[Kind, int], sign: int) -> None:
        for kind, tokens in counts.items():
            live[kind] = live.get(kind, 0) + sign * tokens
            top[kind] = max(top.get(kind, 0), live[kind])

    for ran in passes:
        mine = layers[ran.chunk]
        theirs = list(reversed(layers[ran.paired[0]])) if ran.paired is not None else []
        if not ran.forward:
            theirs = list(reversed(mine))
        for k in range(max(len(mine) if ran.forward else 0, len(theirs))):
            if k < len(theirs):
                add(theirs[k], -1)
            if ran.forward and k < len(mine):
                add(mine[k], 1)
    return top


def stash_buffers(sizes: tuple[int, float, float], counts: dict[tuple[str, int, str], int]
                  ) -> tuple[tuple[tuple[str, int], ...], tuple[int, int]]:  # fmt: skip
    """Run megatron's `allocate_stash_buffers` (`sizes`: page size, CUDA and CPU factors) for a
    rank whose profiling iteration counted `counts` at most (by dtype, columns, avg|max); return
    its GPU buffers (where, bytes as the caching allocator holds them) and its pinned host
    buffers (bytes asked, bytes pinned)."""
    host = HostBytes()
    page_size, cuda, cpu = sizes
    with _on_meta(host), warnings.catch_warnings():
        # its log_single_rank asks torch.distributed for a rank: none outside the traces
        warnings.simplefilter("ignore")
        manager = _manager()()
        manager.page_size = page_size
        manager.device = torch.device("meta")
        avg = {(getattr(torch, d), c): n for (d, c, how), n in counts.items() if how == "avg"}
        real = {(getattr(torch, d), c): n for (d, c, how), n in counts.items() if how == "max"}
        manager.max_avg_tokens_across_vp_stages = avg
        manager.max_tokens_across_vp_stages = real
        manager.allocate_stash_buffers(moe_paged_stash_buffer_size_factor_cuda=cuda,
                                       moe_paged_stash_buffer_size_factor_cpu=cpu)
    gpu: list[tuple[str, int]] = []
    for dtype, by_cols in sorted(manager.stash_buffers.items(), key=lambda kv: str(kv[0])):
        for cols, buffer in sorted(by_cols.items()):
            name = str(dtype).removeprefix("torch.")
            pages = f"{buffer.num_cuda_pages} pages of {buffer.page_size} x {cols} {buffer.dtype}"
            gpu.append((f"{STASH}: {name} pages ({pages})".replace("torch.", ""),
                        rounded(buffer.cuda_buffer.untyped_storage().nbytes())))
            lists = sum(rounded(t.untyped_storage().nbytes()) for t in vars(buffer).values()
                        if isinstance(t, torch.Tensor) and t is not buffer.cuda_buffer
                        and t is not buffer.host_buffer)  # fmt: skip
            gpu.append((f"{STASH}: {name} {cols} free lists", lists))
    flags = sum(rounded(t.untyped_storage().nbytes()) for t in (manager.overflow, manager.host_spill))
    gpu.append((f"{STASH}: overflow and spill flags", flags))
    return tuple(gpu), (sum(host.sizes), sum(pinned(size) for size in host.sizes))
