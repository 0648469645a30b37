"""The host's work per layer and micro-batch, counted in megatron's own forward and backward (issues #43, #45).

    .venv/bin/python bench/host_ops.py --megatron-lm CHECKOUT [--jobs 2] [--only REGEX] [--json FILE]

For every GPT-family training case of Megatron-LM's functional tests with H100 golden values
(bench/ci_goldens.py reads them), the case's last rank is built and the memory engine runs
megatron's forward and backward on meta tensors (memory/engine/microbatch.py); while it runs this
script counts, per transformer layer and micro-batch, forward and backward apart:
- `aten`: every aten operation that reaches the dispatcher's Python mode (the engine's allocation
  tracker): views, copies and the autograd engine's backward ops included (an op a
  CompositeImplicitAutograd kernel decomposes is counted as the ops it decomposes into, as they
  reach the backend);
- `modules`: nn.Module calls (forward; the calls a recomputation repeats in backward);
- `functions`: torch.autograd.Function applies (megatron's and Transformer Engine's stand-ins);
- `nodes`: autograd nodes the backward runs (walked from the loss before backward; the nodes a
  recomputation makes inside the backward are not in that graph yet, so not counted).
A layer is `decoder.layers.N` or `mtp.layers.N`; the rest of a micro-batch (embedding, output
layer, loss) is `other`, with the optimizer steps the engine runs (memory/engine/optimizer.py: the
first, then the steady one) as `optimizer1` and `optimizer2`. Transformer Engine's C++ kernels are stand-ins here (world/te/), so a TE
module's aten count is what the stand-in dispatches; its Python (modules, Function applies) is
megatron's and TE's call structure.

Then the relation to the golden `iteration-time`: per case the measured time per layer and
micro-batch (the iteration over (m + (p - 1) / v) micro-batch slots of the last (logging) rank's
layers, the 1F1B critical path plan/cost.py uses) against the counts, a least-squares fit of
seconds per op through the origin, and its errors. Nothing here changes the tool.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ci_goldens  # noqa: E402

_LAYER = re.compile(r"(decoder|mtp)\.layers\.(\d+)")
_BACKWARD = {"loss scale", "backward", "receive grad", "send grad"}


def _layer(label: str) -> str:
    found = _LAYER.search(label)
    return f"{found.group(1)}.{found.group(2)}" if found else "other"


class Counts:
    """Counters filled by the hooks while the engine runs one case."""

    def __init__(self) -> None:
        self.table: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.kinds: dict[str, set[str]] = collections.defaultdict(set)
        self.runs = 0
        self.steps = 0  # optimizer steps run (the engine's first and steady ones)
        self.on = True

    def add(self, phase: str, label: str, what: str, n: int = 1) -> None:
        if not self.on:
            return
        layer = _layer(label)
        self.table[(layer, phase, what)] += n
        if layer != "other":
            tail = label.split(f"layers.{layer.split('.')[1]}.", 1)[-1]
            self.kinds[layer].add(tail.split(".")[0].split(":")[0])


COUNTS = Counts()


def _install() -> None:
    """Wrap the engine's tracker, its module hooks and Function.apply to count."""
    import torch
    from torch.autograd.function import Function

    from inspector.memory.engine import allocator, microbatch

    def phase(tracker: Any) -> str:
        if type(tracker).__name__ == "_GpuTracker":  # memory/engine/optimizer.py: the step
            return f"optimizer{COUNTS.steps}"
        return "backward" if tracker.phase in _BACKWARD else "forward"

    def label(tracker: Any) -> str:
        node = torch._C._current_autograd_node()
        if node is None or tracker.stack:
            return tracker.where
        seq = node._sequence_nr()
        import bisect

        index = bisect.bisect_right(tracker.starts, seq) - 1
        return tracker.labels[index] if index >= 0 else tracker.where

    dispatch = allocator.Tracker.__torch_dispatch__
    active: list[Any] = []

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        COUNTS.add(phase(self), label(self), "aten")
        return dispatch(self, func, types, args, kwargs)

    allocator.Tracker.__torch_dispatch__ = counted  # type: ignore[method-assign]
    enter = allocator.Tracker.__enter__

    def entered(self: Any) -> Any:
        active.append(self)
        if type(self).__name__ == "_GpuTracker" and COUNTS.on:
            COUNTS.steps += 1
        return enter(self)

    leave = allocator.Tracker.__exit__

    def left(self: Any, *exc: Any) -> None:
        active.remove(self)
        leave(self, *exc)

    allocator.Tracker.__enter__ = entered  # type: ignore[method-assign]
    allocator.Tracker.__exit__ = left  # type: ignore[method-assign]
    pre = microbatch._where._pre

    def module_pre(self: Any, module: Any, args: Any) -> None:
        pre(self, module, args)
        name = self.names.get(module)
        if name is not None:
            COUNTS.add(phase(self.tracker), name, "modules")
            if _LAYER.fullmatch(name):  # the layer itself: how many times it ran
                COUNTS.add(phase(self.tracker), name, "runs")

    microbatch._where._pre = module_pre  # type: ignore[method-assign]
    apply = Function.apply.__func__  # type: ignore[attr-defined]

    def function_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if active:
            COUNTS.add(phase(active[-1]), label(active[-1]), "functions")
        return apply(cls, *args, **kwargs)

    Function.apply = classmethod(function_apply)  # type: ignore[method-assign,assignment]
    backward = microbatch._backward

    def walked(gpt: Any, state: dict[str, Any], tracker: Any) -> None:
        if COUNTS.on:
            _walk(state["output"].grad_fn, tracker)
            COUNTS.runs += 1
        backward(gpt, state, tracker)

    microbatch._backward = walked


def _walk(root: Any, tracker: Any) -> None:
    """Count the autograd nodes reachable from the loss, by the module that made them."""
    import bisect

    seen: set[int] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(fn for fn, _ in node.next_functions)
        seq = node._sequence_nr()
        if seq >= 1 << 63:  # AccumulateGrad
            continue
        index = bisect.bisect_right(tracker.starts, seq) - 1
        where = tracker.labels[index] if index >= 0 else "other"
        COUNTS.add("backward", where, "nodes")


def count_case(case: Any, plan: bool = True) -> dict[str, Any]:
    """Return the case's counts per layer and micro-batch, its schedule and (with `plan`) the
    plan's busiest stage and step time."""
    from inspector.errors import InspectorError

    global COUNTS
    COUNTS = Counts()
    plan_step = ci_goldens.plan_step

    found: dict[str, Any] = {}

    def uncounted(args: dict[str, Any], gpus: int, algo: str | None = None) -> Any:
        COUNTS.on = False  # the plan's own engine runs are not the case's
        if not plan:
            return None, False, ""
        found.update(_plan(args, gpus, algo))
        return plan_step(args, gpus, algo)

    ci_goldens.plan_step = uncounted
    from inspector.world import build as world_build

    built_by = world_build.build

    def counted_build(*args: Any, **kwargs: Any) -> Any:
        built = built_by(*args, **kwargs)
        found["rank_layers"] = rank_layers(built)
        return built

    world_build.build = counted_build
    try:
        predicted = ci_goldens._predict(case)
    except InspectorError as error:
        return {"case": f"{case.model}/{case.name}", "refusal": str(error).splitlines()[0]}
    finally:
        ci_goldens.plan_step = plan_step
        world_build.build = built_by
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    dp = ci_goldens.data_parallel(case)
    flags = {"data_parallel_size": dp} if dp is not None else {}
    sources = Sources(config_file=str(case.folder / "model_config.yaml"), flags=flags)
    job = make_job(merge_sources(sources, ("model", "layout", "training")).args)
    schedule = job.schedule()
    layout = job.layout
    layers: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (layer, phase, what), n in COUNTS.table.items():
        layers[layer][f"{phase}_{what}"] = n
    kinds = {layer: "moe" if "mlp" in parts and _is_moe(job) else "dense"
             for layer, parts in COUNTS.kinds.items()}  # fmt: skip
    return {
        "case": f"{case.model}/{case.name}",
        "layout": predicted.layout,
        "refusal": predicted.refusal,
        "pp": layout.pp,
        "vpp": layout.vpp or 1,
        "m": schedule.num_microbatches,
        **found,
        "runs": COUNTS.runs,
        "steps": COUNTS.steps,
        "layers": dict(sorted(layers.items())),
        "kinds": kinds,
        "moe": _is_moe(job),
        "deterministic": job.training.deterministic_mode,
        "launch_bound": predicted.launch_bound,
        "plan_step": predicted.step,
        "measured": ci_goldens.read_golden(case.folder / ci_goldens.GOLDEN).step
        if (case.folder / ci_goldens.GOLDEN).exists() else None,
    }


def rank_layers(built: Any) -> int:
    """Return the transformer and MTP layers megatron built on the rank's stage (all its chunks)."""
    return sum(len(chunk.layers) + chunk.mtp_layers for chunk in built.stages[0].chunks)


def _is_moe(job: Any) -> bool:
    return job.model.num_experts is not None


def _plan(args: dict[str, Any], gpus: int, algo: str | None) -> dict[str, Any]:
    """Return the plan's busiest stage: its layers, its GPU seconds per micro-batch, the stages'."""
    plan, _ = ci_goldens.matching_plan(args, gpus, algo)
    if plan is None:
        return {}
    return {
        "stage_layers": max(sum(map(len, stage.layers)) for stage in plan.stages),
        "stage_compute": [s.compute for s in plan.time.stages],
        "stage_per_mb": [s.per_microbatch for s in plan.time.stages],
        "optimizer": max(s.optimizer for s in plan.time.stages),
    }


_INSTALLED: list[bool] = []


def install() -> None:
    """Install the counting hooks once per process."""
    if not _INSTALLED:
        _install()
        _INSTALLED.append(True)


def _counted(case: Any) -> dict[str, Any]:
    install()
    return count_case(case)


def per_layer(row: dict[str, Any]) -> dict[str, float]:
    """Return the mean counts of one layer and micro-batch over the layers the engine ran."""
    layers = [v for k, v in row["layers"].items() if k != "other"]
    keys = sorted({k for v in layers for k in v})
    runs = sum(v.get("forward_runs", 0) for v in layers) or 1  # a layer's forwards the engine ran
    return {k: sum(v.get(k, 0) for v in layers) / runs for k in keys}


FITS = {  # name: the features whose seconds are fitted (per op, per module, ...)
    "aten": ("aten",),
    "modules": ("modules",),
    "aten + modules": ("aten", "modules"),
    "aten + per iteration": ("aten", "iteration"),
    "aten + per chunk pass": ("aten", "chunk"),
    "aten, --deterministic-mode apart": ("aten_other", "aten_deterministic"),
    "aten + modules + per chunk pass + per iteration": ("aten", "modules", "chunk", "iteration"),
}


def features(row: dict[str, Any]) -> dict[str, float]:
    """Return the case's counts on its critical path: (m + (p - 1) / v) micro-batch slots of the
    last rank's L layers as megatron split them (plan/cost.py's 1F1B path), each slot's chunk
    passes (v), one iteration."""
    counts = per_layer(row)
    slots = row["m"] + (row["pp"] - 1) / row["vpp"]
    layers = slots * row["rank_layers"]
    both = lambda what: counts.get(f"forward_{what}", 0) + counts.get(f"backward_{what}", 0)  # noqa: E731
    deterministic = bool(row.get("deterministic"))
    return {
        "aten": layers * both("aten"),
        "aten_deterministic": layers * both("aten") * deterministic,
        "aten_other": layers * both("aten") * (not deterministic),
        "modules": layers * both("modules"),
        "functions": layers * both("functions"),
        "nodes": layers * counts.get("backward_nodes", 0),
        "chunk": slots * row["vpp"],
        "iteration": 1.0,
        "layer_slots": layers,
    }


def fit(rows: list[dict[str, Any]], names: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """Return seconds per feature (least squares of the relative error) and each case's error."""
    import numpy as np

    a = np.array([[features(r)[n] for n in names] for r in rows])
    y = np.array([r["measured"] for r in rows])
    coef, *_ = np.linalg.lstsq(a / y[:, None], np.ones(len(y)), rcond=None)
    return [float(c) for c in coef], [float(e) for e in (a @ coef - y) / y]


def _pearson(rows: list[dict[str, Any]], what: str) -> float:
    import numpy as np

    per = [r["measured"] / features(r)["layer_slots"] for r in rows]
    counts = [features(r)[what] / features(r)["layer_slots"] for r in rows]
    return float(np.corrcoef(per, counts)[0, 1])


def render(rows: list[dict[str, Any]]) -> str:
    """Return the counts per layer and micro-batch of every case, then the fits over the
    launch-bound ones."""
    lines = ["| case | layout | m | L | aten f/b | modules f/b | Function applies | autograd nodes "
             "| measured s | ms per layer and micro-batch | launch-bound |", "|---|" * 1 + "---|" * 10]
    timed = []
    for row in rows:
        if row.get("refusal") or not row.get("rank_layers"):
            continue
        c = per_layer(row)
        f = features(row)
        g = lambda k, c=c: round(c.get(k, 0))  # noqa: E731
        per = row["measured"] / f["layer_slots"] * 1e3 if row["measured"] else float("nan")
        lines.append(
            f"| {row['case']} | {row['layout']} | {row['m']} | {row['rank_layers']} "
            f"| {g('forward_aten')}/{g('backward_aten')} | {g('forward_modules')}/{g('backward_modules')} "
            f"| {g('forward_functions') + g('backward_functions')} | {g('backward_nodes')} "
            f"| {row['measured']} | {per:.1f} | {'yes' if row['launch_bound'] else ''} |")
        if row["launch_bound"] and row["measured"]:
            timed.append(row)
    lines.append("")
    for title, subset in (("all launch-bound", timed), ("dense", [r for r in timed if not r["moe"]]),
                          ("MoE", [r for r in timed if r["moe"]])):  # fmt: skip
        if len(subset) < 3:
            continue
        lines.append(f"- {title} ({len(subset)}): Pearson r of the measured time per layer and micro-batch "
                     f"with the aten ops per layer and micro-batch {_pearson(subset, 'aten'):.2f}, "
                     f"with the module calls {_pearson(subset, 'modules'):.2f}")
        for name, feats in FITS.items():
            coef, errors = fit(subset, feats)
            within = sum(abs(e) <= 0.25 for e in errors) / len(errors)
            per = ", ".join(f"{n} {c * 1e6:.1f} us" for n, c in zip(feats, coef, strict=True))
            lines.append(f"- {title} ({len(subset)}), {name}: {per}; mean |error| "
                         f"{statistics.mean(map(abs, errors)) * 100:.1f}%, within 25%: {within * 100:.0f}%, "
                         f"worst {max(errors, key=abs) * 100:+.0f}%")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only")
    parser.add_argument("--json", type=Path, help="write the counts here as each case ends")
    parser.add_argument("--from-json", type=Path, help="render the counts a run wrote")
    ns = parser.parse_args(argv)
    if ns.from_json:
        sys.stdout.write(render(json.loads(ns.from_json.read_text())))
        return
    sys.stdout.write(render(ci_goldens.each_training_case(ns.megatron_lm, ns.only, _counted, ns.jobs, ns.json)))


if __name__ == "__main__":
    main()
