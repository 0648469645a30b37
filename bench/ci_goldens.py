"""Megatron-LM's functional tests as a corpus: the tool against what H100s measured (issue #43).

    .venv/bin/python bench/ci_goldens.py --megatron-lm CHECKOUT [--jobs 2] [--only REGEX] [-o FILE]

CHECKOUT is a Megatron-LM tree (at least `tests/functional_tests/test_cases/` and
`tests/test_utils/recipes/h100/`); nothing is fetched, nothing written into it. Each case folder
`test_cases/<model>/<case>/` holds the job (`model_config.yaml`) and, per platform, what its CI
run logged every iteration (`golden_values_<environment>_<platform>.json`). Only the H100 file,
`golden_values_dev_dgx_h100.json`, is opened: the other platforms' files (A100, GB200, ...) are
skipped by name, never read.

For every case with that file:
- the job is read from `model_config.yaml` as written (inspector.inputs.megatron_config: MODEL_ARGS
  as Megatron-LM's runner passes them, ENV_VARS as the job's environment: PYTORCH_CUDA_ALLOC_CONF,
  NCCL_ALGO and CUBLAS_WORKSPACE_CONFIG, which sizes torch's cuBLAS workspaces), on H100;
- the world size from the H100 recipe that lists the case (`recipes/h100/*.yaml`: `spec.nodes` x
  `spec.gpus`, launched as `torchrun --nnodes --nproc_per_node`; the runner's 8 GPUs per node
  where the recipe runs run_ci_test.sh without exporting GPUS_PER_NODE: `recipe_gpus`); 1 x 8
  where none lists it (_run_training.sh's defaults);
- the rank compared is the one that logs: Megatron-LM gives the tensorboard writer to the last
  global rank only (megatron/training/global_vars.py `_set_tensorboard_writer`: `args.rank ==
  (args.world_size - 1)`), and training.py's `training_log` writes `mem-allocated-bytes` and
  `mem-max-allocated-bytes` from `torch.cuda.memory_stats()` there, never reset: the peak of
  every iteration so far;
- predicted: that rank's static memory (weights, gradients, optimizer state of its own shard, the
  buffers megatron keeps; not Megatron-FSDP's gathered buckets, released by then) against `mem-allocated-bytes` at the last iteration, and its peak
  against `mem-max-allocated-bytes` at the last iteration (the optimizer state exists after the
  first step); memory held outside PyTorch's allocator (DeepEP's buffers) is left out of both, as
  `memory_stats` never sees it;
- the step time `plan --gpu h100` gives the same layout against the median `iteration-time` past the
  warm-up (WARMUP iterations and the first logged one dropped).

A case is launch-bound (host-bound) when the plan's host time exceeds its GPU time on the busiest
stage (the stage with the most time per micro-batch): there the host, not the GPU, sets the pace.
`plan` prices the host since issue #45 item 2 (inspector/plan/host.py: kernels launched and layer
passes per micro-batch at three constants fitted on these goldens by bench/host_fit.py; the GPU waits
where the host is slower, per segment between the MoE dispatchers' host syncs), so the step time
of a host-bound case is the host's. (Before, the rule was under 5 ms of priced GPU work per layer
and micro-batch, and the host was not priced: bench/RESULTS.md `hostop`, `hostpace`.) Step-time
errors are summarised over the GPU-bound cases, and over the host-bound ones apart; the table
marks the host-bound ones.

Refusals (the tool's `Error:` line) are rows of their own, with the cause. `make bench` runs this
when a checkout is at hand (BENCH_MEGATRON_LM, default /work/mlm) and appends its summary to
bench/RESULTS.md. Nothing here is fitted to the golden values.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

# this checkout's inspector, not an installed one (`python bench/ci_goldens.py` puts bench/ first)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PLATFORM = "dgx_h100"
GOLDEN = f"golden_values_dev_{PLATFORM}.json"
CASES = Path("tests/functional_tests/test_cases")
RECIPES = Path("tests/test_utils/recipes/h100")
# Megatron-LM's pretrain_gpt.py models: the GPT family (the other folders train BERT, T5, hybrid
# Mamba, multimodal models with programs of their own).
GPT_FAMILY = ("gpt", "moe", "mixtral")
# Megatron-LM's hybrid (Mamba) models: pretrain_hybrid.py (megatron-core 0.18+'s HybridModel, the
# `hybrid` recipes' TRAINING_SCRIPT_PATH), modelled as pretrain_mamba.py builds them; summarised
# apart from the GPT family
HYBRID_FAMILY = ("hybrid",)
RUNNER_WORLD = (1, 8)  # _run_training.sh: NUM_NODES=${NUM_NODES:-1}, GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RUNNER_SCRIPT = "shell_test_utils/run_ci_test.sh"  # the functional tests' runner a recipe starts
WARMUP = 3  # iterations whose time is dropped (cuDNN/cuBLAS autotuning, allocator growth)
PEAK_BAND, STATIC_BAND, UNDER_LIMIT = 0.03, 0.01, -0.05  # the bar


@dataclass(frozen=True)
class Case:
    """One functional test with H100 golden values."""

    model: str  # the test_cases folder: gpt, moe, ...
    name: str
    folder: Path
    nodes: int
    gpus: int
    mode: str = "pretraining"  # the runner's MODE (run_ci_test.sh): pretraining, rl, inference
    listed: bool = True  # an H100 recipe lists it

    @property
    def world_unknown(self) -> bool:
        """Return whether its world size is unknown: a release test (`*_release*`) that no recipe
        in the repository lists runs from Megatron-LM's release recipes, on several nodes."""
        return not self.listed and "_release" in self.name

    @property
    def world(self) -> int:
        """Return the GPUs the recipe launches."""
        return self.nodes * self.gpus

    @property
    def gpt_family(self) -> bool:
        """Return whether it trains a GPT-family model (pretrain_gpt.py; train_rl.py for MODE rl)."""
        return self.model in GPT_FAMILY and self.mode != "inference"

    @property
    def hybrid(self) -> bool:
        """Return whether it trains a hybrid (Mamba) model."""
        return self.model in HYBRID_FAMILY and self.mode != "inference"

    @property
    def predicted(self) -> bool:
        """Return whether the tool is asked for it: a GPT-family or hybrid training job on a
        known world."""
        return (self.gpt_family or self.hybrid) and not self.world_unknown


@dataclass(frozen=True)
class Measured:
    """What the last rank logged: bytes at the last iteration, the median step past warm-up."""

    allocated: int | None
    peak: int | None
    step: float | None


@dataclass(frozen=True)
class Predicted:
    """The tool's answer for the last rank, or why it gave none."""

    layout: str = ""
    static: int | None = None
    peak: int | None = None
    step: float | None = None
    launch_bound: bool = False
    refusal: str = ""
    step_note: str = ""  # why there is no step time (the plan's refusal)


@dataclass(frozen=True)
class Row:
    case: Case
    measured: Measured
    predicted: Predicted


def recipe_worlds(root: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """Return (nodes, GPUs per node) of every case an H100 recipe lists, by (model, case)."""
    worlds: dict[tuple[str, str], tuple[int, int]] = {}
    for path in sorted((root / RECIPES).glob("*.yaml")):
        spec = yaml.safe_load(path.read_text()) or {}
        head = spec.get("spec") or {}
        model = str(head.get("model", ""))
        size = (int(head.get("nodes", RUNNER_WORLD[0])), recipe_gpus(head))
        for product in spec.get("products") or []:
            for name in product.get("test_case") or []:
                worlds.setdefault((model, str(name)), size)
    return worlds


def recipe_gpus(head: dict[str, Any]) -> int:
    """Return the GPUs per node a recipe's job launches: `spec.gpus` books the node, but where the
    recipe's script runs the functional-test runner (run_ci_test.sh) without exporting
    GPUS_PER_NODE, _run_training.sh L202 starts `GPUS_PER_NODE=${GPUS_PER_NODE:-8}` processes
    (`torchrun --nproc_per_node $GPUS_PER_NODE`, L212) whatever the booking says: the H100
    `gpt-grpo.yaml` and `moe-grpo.yaml` book `gpus: 1` and run tp4 x dp2 and dp8 cases on 8."""
    gpus = int(head.get("gpus", RUNNER_WORLD[1]))
    script = str(head.get("script") or "")
    if RUNNER_SCRIPT in script and "GPUS_PER_NODE" not in script:
        return RUNNER_WORLD[1]
    return gpus


def discover(root: Path) -> list[Case]:
    """Return every case with an H100 golden file, sorted by model and name."""
    worlds = recipe_worlds(root)
    cases = []
    for golden in sorted((root / CASES).glob(f"*/*/{GOLDEN}")):  # no other platform's file
        folder = golden.parent
        model = folder.parent.name
        listed = (model, folder.name) in worlds
        nodes, gpus = worlds.get((model, folder.name), RUNNER_WORLD)
        config = folder / "model_config.yaml"
        data = (yaml.safe_load(config.read_text()) if config.exists() else None) or {}
        mode = str(data.get("MODE") or "pretraining")
        cases.append(Case(model, folder.name, folder, nodes, runner_gpus(data, gpus), mode, listed))
    return cases


def runner_gpus(config: dict[str, Any], recipe: int) -> int:
    """Return the GPUs per node the runner launches the case's MODEL_ARGS with: the config's own
    GPUS_PER_NODE where it sets one (run_ci_test.sh exports MODEL_ENV_VARS.<key>.GPUS_PER_NODE
    for each MODEL_ARGS key it runs, and ENV_VARS into the job's environment), else the recipe's."""
    per_run = ((config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE")
    env = (config.get("ENV_VARS") or {}).get("GPUS_PER_NODE")
    given = per_run if per_run is not None else env
    return int(given) if given is not None else recipe


def read_golden(path: Path) -> Measured:
    """Return the last iteration's bytes and the median step time past the warm-up."""
    data = json.loads(path.read_text())

    def series(key: str) -> list[tuple[int, float]]:
        entry = data.get(key)  # training's form; inference writes other shapes
        values = entry.get("values") if isinstance(entry, dict) else None
        if not isinstance(values, dict):
            return []
        out = [(int(step), float(value)) for step, value in values.items()]
        return sorted((s, v) for s, v in out if not math.isnan(v))

    allocated, peak, times = series("mem-allocated-bytes"), series("mem-max-allocated-bytes"), series(
        "iteration-time")
    kept = [v for s, v in times[1:] if s > WARMUP]  # the first logged time holds the set-up
    return Measured(
        int(allocated[-1][1]) if allocated else None,
        int(peak[-1][1]) if peak else None,
        statistics.median(kept) if kept else None,
    )


def model_args(folder: Path) -> dict[str, Any]:
    """Return the MODEL_ARGS of a case's model_config.yaml (the sizes, for the world)."""
    data = yaml.safe_load((folder / "model_config.yaml").read_text()) or {}
    return dict(data.get("MODEL_ARGS") or {})


def data_parallel(case: Case) -> int | None:
    """Return the data-parallel size on the recipe's world (None: the runner's default 8 GPUs)."""
    if case.world == RUNNER_WORLD[0] * RUNNER_WORLD[1]:
        return None
    args = model_args(case.folder)
    sizes = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size"):  # fmt: skip
        sizes *= int(args.get(flag) or 1)
    return max(case.world // sizes, 1)


def predict(case: Case) -> Predicted:
    """Return the tool's memory and step time for the case's last rank (in-process)."""
    from inspector.errors import InspectorError

    try:
        return _predict(case)
    except InspectorError as error:
        return Predicted(refusal=str(error).splitlines()[0])


def _predict(case: Case) -> Predicted:
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.device import with_device
    from inspector.job.job import make_job
    from inspector.memory.measure import job_optimizer_bytes, make_hardware, measure, state_bytes
    from inspector.memory.segments import expandable_segments, torch_counts
    from inspector.world.build import build, select_view
    from inspector.world.ranks import rank_shard_indices

    dp = data_parallel(case)
    flags = {"data_parallel_size": dp} if dp is not None else {}
    sources = Sources(config_file=str(case.folder / "model_config.yaml"), flags=flags)
    args = merge_sources(sources, ("model", "layout", "training")).args
    # on H100, with the CUBLAS_WORKSPACE_CONFIG its ENV_VARS give torch (job/device.py)
    job = with_device(make_job(args), "h100", env_var(case.folder, "CUBLAS_WORKSPACE_CONFIG"))
    job.schedule()
    layout = job.layout
    rank = layout.world_size - 1
    view = select_view(job, rank=rank)
    built = build(job, view, expert_ranks=(view.expert_rank,))
    conf = env_var(case.folder, "PYTORCH_CUDA_ALLOC_CONF")
    report = measure(built, make_hardware(None, None, None, "h100", job.model.dtype_name),
                     expandable_segments(conf))  # fmt: skip
    stage = report.stages[0]
    label = layout_label(layout, job.schedule().micro_batch_size)
    if stage.run is None:
        return Predicted(label, refusal=f"the engine does not run it: {report.not_run}")
    training = job.training
    state = stage.state
    if not (training.megatron_fsdp or training.torch_fsdp2):
        _, data, expert = rank_shard_indices(layout)[rank]
        buffers = [b for chunk in built.stages[0].chunks for b in chunk.buffers()]
        state = state_bytes(buffers, training.use_distributed_optimizer, data, expert,
                            job_optimizer_bytes(job))  # fmt: skip
        if stage.optimizer_by_rank:  # Muon: this rank's whole matrices (memory/engine/muon.py)
            state = replace(state, optimizer=dict(stage.optimizer_by_rank)[rank])
    # what torch.cuda counts on this rank, as `memory` and `check LOG` report it (segments.py)
    static, peak = torch_counts(stage, state)
    step, bound, note = plan_step(args, layout.world_size, nccl_algo(case.folder))
    return Predicted(label, static, peak, step, bound, step_note=note)


def layout_label(layout: Any, mbs: int) -> str:
    """Return the layout as the plan writes it: tp1 pp4 dp2 vpp8 mbs1 (cp, ep where used)."""
    parts = [f"tp{layout.tp}", f"pp{layout.pp}", f"dp{layout.dp}"]
    parts += [f"cp{layout.cp}"] if layout.cp > 1 else []
    parts += [f"ep{layout.ep}"] if layout.ep > 1 else []
    parts += [f"vpp{layout.vpp}"] if layout.vpp else []
    return " ".join([*parts, f"mbs{mbs}"])


def nccl_algo(folder: Path) -> str | None:
    """Return the NCCL_ALGO the case's ENV_VARS set (the job's environment), or None."""
    return env_var(folder, "NCCL_ALGO")


def env_var(folder: Path, name: str) -> str | None:
    """Return the value the case's ENV_VARS give `name` (the job's environment), or None."""
    data = yaml.safe_load((folder / "model_config.yaml").read_text()) or {}
    value = (data.get("ENV_VARS") or {}).get(name)
    return None if value is None else str(value)


def plan_step(args: dict[str, Any], gpus: int, algo: str | None = None) -> tuple[float | None, bool, str]:
    """Return `plan --gpu h100`'s step time of this very layout, whether it is host-bound, or
    the plan's reason for none; `algo`: the job's NCCL_ALGO (NVLink SHARP's all-reduces or not)."""
    plan, note = matching_plan(args, gpus, algo)
    if plan is None:
        return None, False, note
    return plan.time.seconds, host_bound(plan), ""


def host_bound(plan: Any) -> bool:
    """Return whether the plan's host time exceeds its GPU time on its busiest stage (the most
    time per micro-batch through all its chunks; plan/host.py)."""
    return plan.time.host_bound() is not None


def matching_plan(args: dict[str, Any], gpus: int, algo: str | None = None) -> tuple[Any, str]:
    """Return the plan `plan --gpu h100` gives this layout's sizes, or None and the reason."""
    from inspector.errors import InspectorError
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    pinned = {"context_parallel_size": 1, "expert_model_parallel_size": 1, **args}
    try:
        result = search(make_request(pinned, PlanFlags(gpus, "h100", top=1000, nccl_algo=algo)))
    except InspectorError as error:
        return None, str(error).splitlines()[0]
    want = _sizes(args)
    match = [p for p in result.plans if _sizes(_plan_args(p)) == want]
    if not match:
        return None, "the plan finds no candidate of this layout that fits"
    split = [p for p in match if p.split == _megatron_split(args, p)]
    if not split:  # the search's other splits price another job
        return None, "the plan finds no candidate of this layout with megatron's layer split that fits"
    return split[0], ""


def _megatron_split(args: dict[str, Any], plan: Any) -> Any:
    """Return the layer split megatron makes of this job (plan/split.py `pinned_split`: the job's
    split flags, else even, at the job's own virtual stages), or the plan's own where the model's
    pattern fixes it (hybrid models: plan/hybrid.py `pinned_by_pattern`)."""
    from inspector.plan.hybrid import pinned_by_pattern
    from inspector.plan.split import PIN_FLAGS, pinned_split

    job = plan.job
    if job.model.hybrid or pinned_by_pattern(job.model):
        return plan.split
    pin = {name: args[name] for name in PIN_FLAGS if args.get(name) not in (None, False)}
    pp = job.layout.pp
    vpp = args.get("num_virtual_stages_per_pipeline_rank") or 1  # Megatron-LM: none, no interleaving
    if args.get("num_layers_per_virtual_pipeline_stage"):
        vpp = job.model.num_layers // pp // int(args["num_layers_per_virtual_pipeline_stage"])
    return pinned_split(pin, job.model.num_layers, pp, int(vpp))


_SIZE_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "micro_batch_size")  # fmt: skip


def _sizes(args: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(args.get(k) or 1) for k in _SIZE_KEYS)


def _plan_args(plan: Any) -> dict[str, Any]:
    lay = plan.job.layout
    return dict(zip(_SIZE_KEYS, (lay.tp, lay.pp, lay.cp, lay.ep, plan.job.schedule().micro_batch_size)))


def run_cases(cases: Sequence[Case], jobs: int) -> list[Row]:
    """Predict every GPT-family and hybrid case (jobs processes); the others are rows without a
    prediction."""
    todo = [c for c in cases if c.predicted]
    measured = {c: read_golden(c.folder / GOLDEN) for c in cases}
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            answers = dict(zip(todo, pool.map(predict, todo)))
    else:
        answers = {c: predict(c) for c in todo}
    def other(case: Case) -> Predicted:
        if case.world_unknown:
            return Predicted(refusal="world size unknown: a release test no H100 recipe lists")
        if case.mode == "inference":
            return Predicted(refusal="MODE: inference (an inference program, not training)")
        return Predicted(refusal=f"not a GPT-family model ({case.model}: not pretrain_gpt.py)")

    return [Row(c, measured[c], answers.get(c) or other(c)) for c in cases]


def error(predicted: int | float | None, measured: int | float | None) -> float | None:
    """Return (predicted - measured) / measured, or None where either is missing."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def render_table(rows: Iterable[Row]) -> str:
    """Return one markdown row per case: layout, predicted vs measured, errors, or the refusal."""
    lines = [
        "| case | GPUs | layout | peak GiB (pred / H100) | err | static GiB (pred / H100) | err "
        "| step s (pred / H100) | err | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m, p = row.measured, row.predicted
        note = p.refusal or p.step_note or ("host-bound" if p.launch_bound else "")
        step = "-" if p.step is None else f"{p.step:.3f}"
        lines.append(
            f"| {row.case.model}/{row.case.name} | {row.case.world} | {p.layout or '-'} "
            f"| {_gib(p.peak)} / {_gib(m.peak)} | {_pct(error(p.peak, m.peak))} "
            f"| {_gib(p.static)} / {_gib(m.allocated)} | {_pct(error(p.static, m.allocated))} "
            f"| {step} / {'-' if m.step is None else f'{m.step:.3f}'} | {_pct(error(p.step, m.step))} "
            f"| {note.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Return coverage and the error distribution of the GPT-family cases, and of the hybrid
    ones apart (`hybrid`)."""
    family = [r for r in rows if r.case.gpt_family and not r.case.world_unknown]
    hybrid = [r for r in rows if r.case.hybrid and not r.case.world_unknown]
    return {
        "cases": len(rows),
        "gpt_family": len(family),
        "world_unknown": sum(r.case.gpt_family and r.case.world_unknown for r in rows),
        **_errors(family),
        "hybrid": {"cases": len(hybrid), **_errors(hybrid)},
    }


def _errors(family: Sequence[Row]) -> dict[str, Any]:
    """Return how many of the rows are modelled and their errors' spread."""
    modelled = [r for r in family if not r.predicted.refusal]
    peaks = [e for r in modelled if (e := error(r.predicted.peak, r.measured.peak)) is not None]
    statics = [e for r in modelled if (e := error(r.predicted.static, r.measured.allocated)) is not None]
    timed = [(r.predicted.launch_bound, e) for r in modelled
             if (e := error(r.predicted.step, r.measured.step)) is not None]  # fmt: skip
    steps = [e for bound, e in timed if not bound]
    bound_steps = [e for bound, e in timed if bound]  # reported apart: the host paces them
    return {
        "modelled": len(modelled),
        "peak": _spread(peaks),
        "peak_within": _share(peaks, lambda e: abs(e) <= PEAK_BAND),
        "peak_under_5": sum(e < UNDER_LIMIT for e in peaks),
        "static": _spread(statics),
        "static_within": _share(statics, lambda e: abs(e) <= STATIC_BAND),
        "step": _spread(steps),
        "step_mae": statistics.mean(abs(e) for e in steps) if steps else None,
        "launch_bound": sum(r.predicted.launch_bound for r in modelled),
        "launch_step": _spread(bound_steps),
        "launch_mae": statistics.mean(abs(e) for e in bound_steps) if bound_steps else None,
    }


def _spread(errors: Sequence[float]) -> dict[str, Any]:
    if not errors:
        return {"n": 0}
    worst = max(errors, key=abs)
    return {"n": len(errors), "median": statistics.median(errors), "median_abs":
            statistics.median(abs(e) for e in errors), "worst": worst}  # fmt: skip


def _share(errors: Sequence[float], test: Any) -> float | None:
    return sum(map(test, errors)) / len(errors) if errors else None


def render_summary(found: dict[str, Any]) -> str:
    """Return the summary as a few sentences of markdown."""
    def spread(key: str, within: dict[str, Any] = found) -> str:
        s = within[key]
        if not s["n"]:
            return "none"
        return (f"{s['n']} cases, median {_pct(s['median'])} (median |error| "
                f"{s['median_abs'] * 100:.1f}%), worst {_pct(s['worst'])}")

    share = lambda v: "-" if v is None else f"{v * 100:.0f}%"  # noqa: E731
    hybrid = found["hybrid"]
    mae = lambda key: "-" if found[key] is None else f"{found[key] * 100:.1f}%"  # noqa: E731
    return "\n".join([
        f"Cases with H100 golden values: {found['cases']}; GPT-family training (pretrain_gpt.py, "
        f"train_rl.py) on a known world: {found['gpt_family']} ({found['world_unknown']} release "
        f"tests on an unknown world left out); modelled: {found['modelled']} "
        f"({found['modelled'] / max(found['gpt_family'], 1) * 100:.0f}%).",
        f"- peak: {spread('peak')}; within 3%: {share(found['peak_within'])}; more than 5% "
        f"under: {found['peak_under_5']}.",
        f"- static: {spread('static')}; within 1%: {share(found['static_within'])}.",
        f"- step time (GPU-bound; {found['launch_bound']} host-bound cases left out): "
        f"{spread('step')}; mean |error| {mae('step_mae')}.",
        f"- step time of the host-bound cases, apart: {spread('launch_step')}; mean |error| "
        f"{mae('launch_mae')}.",
        f"Hybrid (Mamba) training cases (pretrain_hybrid.py): {hybrid['cases']}; modelled: "
        f"{hybrid['modelled']}; peak: {spread('peak', hybrid)}; static: {spread('static', hybrid)}; "
        f"step time (GPU-bound): {spread('step', hybrid)}; host-bound: "
        f"{spread('launch_step', hybrid)}.",
    ]) + "\n"  # fmt: skip


def each_training_case(root: Path, only: str | None, function: Any, jobs: int,
                       json_path: Path | None = None) -> list[Any]:  # fmt: skip
    """Return `function`'s row for every GPT-family training case on a known world whose
    model/name matches `only` (jobs processes), writing the rows to `json_path` as each case ends
    (a long run keeps what it has): what bench/host_fit.py and bench/host_ops.py run over."""
    cases = [c for c in discover(root) if c.gpt_family and not c.world_unknown]
    cases = [c for c in cases if not only or re.search(only, f"{c.model}/{c.name}")]
    rows: list[Any] = []
    with ProcessPoolExecutor(jobs) as pool:
        for row in pool.map(function, cases):
            rows.append(row)
            if json_path:
                json_path.write_text(json.dumps(rows, indent=1, sort_keys=True))
    return rows


def report(root: Path, jobs: int = 2, only: str | None = None) -> str:
    """Return the table and its summary for a Megatron-LM checkout."""
    cases = discover(root)
    if only:
        cases = [c for c in cases if re.search(only, f"{c.model}/{c.name}")]
    start = time.perf_counter()
    rows = run_cases(cases, jobs)
    seconds = time.perf_counter() - start
    return (f"Megatron-LM functional tests against their H100 golden values "
            f"(bench/ci_goldens.py, {jobs} processes, {seconds:.0f} s):\n\n"
            + render_summary(summary(rows)) + "\n" + render_table(rows))  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM checkout")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", help="regex over model/case")
    parser.add_argument("-o", "--output", type=Path)
    ns = parser.parse_args(argv)
    text = report(ns.megatron_lm, ns.jobs, ns.only)
    if ns.output:
        ns.output.write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
