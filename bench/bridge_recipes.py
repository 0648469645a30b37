"""Megatron-Bridge's performance recipes through `inspect-model memory`: how many are fully modelled.

    .venv/bin/python bench/bridge_recipes.py BRIDGE_CHECKOUT [--run] [--family F] [--list]

BRIDGE_CHECKOUT is a Megatron-Bridge source tree (its src/megatron/bridge/perf_recipes/<family>/
<gpu>/*.py define one function per recipe, `<model>_<task>_<N>gpu_<gpu>_<precision>_config`).
Nothing of Bridge is imported or executed: each recipe function is read from its source
(bridge_reader.py) into the ConfigContainer it builds, turned into Megatron-LM's arguments
(bridge_job.py) on N GPUs, and given to the tool as `memory` takes it (a preset, a config file of
those arguments, --dp N / (tp x pp x cp)). Each recipe is then

- modelled: the tool takes the job (its arguments, refusals and Megatron-LM's own checks), and
  with --run, `memory` itself runs to the end;
- refused: the tool names what it does not model (the cause is the refused argument), or the
  recipe trains something no Megatron-LM argument says (a model without a preset; LoRA is
  the tool's --lora-rank);
  packed sequences are Megatron-LM's --sft, one document per sequence;
- error: the tool stops with an `Error:` about the job (a layout megatron-core would refuse);
  Bridge runs no Megatron-LM validate_args, so the job is read as Bridge and megatron-core run
  it (bridge_job.py: the checkpoint format of a Megatron-FSDP recipe that never saves, the
  overlaps CommOverlapConfig sets; bridge_reader.py: torch.cuda answers the recipe's GPU);
- failed: the recipe could not be read, or the tool raised anything else (a traceback: a bug).

Prints one table per model family and GPU, then the causes. Language models only (Bridge's
qwen_vl and wan families are vision/video models); --all-families keeps them.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bridge_eval import Record, Unreadable
from bridge_job import recipe_args
from bridge_reader import Reader

NOT_LANGUAGE = ("qwen_vl", "wan")
_NAME = re.compile(r"_(\d+)gpu_([a-z0-9]+)_([a-z0-9]+)")


@dataclass(frozen=True)
class Outcome:
    """One recipe: where it is, and what the tool said."""

    family: str
    gpu: str
    name: str
    status: str  # modelled, refused, error, failed
    cause: str  # the refused argument, the error or the failure ("" when modelled)


def recipes(src: Path, families: tuple[str, ...] | None) -> list[tuple[str, str, str, str]]:
    """Return (family, gpu, module, function) of every performance recipe, in file order."""
    root = src / "megatron/bridge/perf_recipes"
    found = []
    for path in sorted(root.glob("*/*/*.py")):
        family, gpu = path.parts[-3], path.parts[-2]
        if families is not None and family not in families:
            continue
        module = ".".join(path.relative_to(src).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_config") \
                    and not node.name.startswith("_"):  # fmt: skip
                found.append((family, gpu, module, node.name))
    return found


def check(preset: str | None, args: dict[str, Any], dp: int, run: bool, folder: Path,
          name: str) -> tuple[str, str]:  # fmt: skip
    """Return (status, cause) of one job as `memory` takes it (and runs it, with `run`)."""
    from inspector.errors import InspectorError
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    path = folder / f"{name}.json"
    path.write_text(json.dumps(args, indent=1, sort_keys=True))
    try:
        resolved = merge_sources(Sources(preset=preset, config_file=str(path),
                                         flags={"data_parallel_size": dp}),
                                 ("model", "layout", "training"))  # fmt: skip
        make_job(resolved.args).schedule()
    except InspectorError as error:
        return _classify(str(error))
    except Exception:  # noqa: BLE001 - a traceback is the bench's finding
        return "failed", "traceback: " + traceback.format_exc().strip().splitlines()[-1][:120]
    if not run:
        return "modelled", ""
    argv = [sys.executable, "-m", "inspector", "memory", "--config", str(path), "--dp", str(dp),
            "--no-cache", "--format", "json"] + (["--model", preset] if preset else [])  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    if done.returncode == 0:
        return "modelled", ""
    last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return ("error", last[:160]) if last.startswith("Error:") else ("failed", last[:160])


def _classify(message: str) -> tuple[str, str]:
    """Return ("refused", the refused arguments joined by +) for the tool's refusal
    (inspector.inputs.refusals: "FILE: A and B are not modelled: why; C is not modelled: why")."""
    if " not modelled" not in message:
        return "error", message.split(": ", 1)[-1][:160]
    refused = []
    for clause in message.split(".json: ", 1)[-1].split("; "):
        head = re.split(r" (?:is|are) not modelled", clause)[0]
        if head != clause:
            refused += [a.strip() for a in re.split(r", | and ", head) if a.strip()]
    return "refused", " + ".join(refused)


def _megatron_core() -> Path | None:
    """The installed megatron-core's source folder (its config defaults), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def run_all(checkout: Path, run: bool, families: tuple[str, ...] | None) -> list[Outcome]:
    src = checkout / "src"
    reader = Reader(src, _megatron_core())
    outcomes = []
    with tempfile.TemporaryDirectory() as folder:
        for family, gpu, module, function in recipes(src, families):
            outcomes.append(_one(reader, family, gpu, module, function, run, Path(folder)))
    return outcomes


def _one(reader: Reader, family: str, gpu: str, module: str, function: str, run: bool,
         folder: Path) -> Outcome:  # fmt: skip
    def done(status: str, cause: str) -> Outcome:
        return Outcome(family, gpu, function, status, cause)

    reader.gpu = gpu
    try:
        cfg = reader.apply(reader.lookup(module, function), [], {}, function)
    except Unreadable as error:
        return done("failed", f"unreadable: {error}"[:160])
    except Exception as error:  # noqa: BLE001 - the recipe's source is outside this bench's subset
        return done("failed", f"unreadable: {type(error).__name__}: {error}"[:160])
    if not isinstance(cfg, Record):
        return done("failed", "unreadable: the recipe returns no ConfigContainer")
    gpus = int(_NAME.search(function).group(1)) if _NAME.search(function) else 0
    preset, args, refusals = recipe_args(cfg, gpus)
    if refusals:
        return done("refused", " + ".join(item.split(":")[0] for item in refusals))
    per_replica = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):  # fmt: skip
        per_replica *= int(args.get(name) or 1)
    if gpus % per_replica:
        return done("error", f"{gpus} GPUs are not a multiple of tp x pp x cp = {per_replica}")
    return done(*check(preset, args, gpus // per_replica, run, folder, function))


def show(checkout: Path, name: str) -> str:
    """Return one recipe's preset, GPUs and Megatron-LM arguments, as the bench gives them."""
    src = checkout / "src"
    reader = Reader(src, _megatron_core())
    for _family, gpu, module, function in recipes(src, None):
        if function == name:
            reader.gpu = gpu
            cfg = reader.apply(reader.lookup(module, function), [], {}, function)
            match = _NAME.search(function)
            gpus = int(match.group(1)) if match else 0
            preset, args, refusals = recipe_args(cfg, gpus)
            return json.dumps({"preset": preset, "gpus": gpus, "refusals": refusals,
                               "arguments": args}, indent=1, sort_keys=True)  # fmt: skip
    raise SystemExit(f"no recipe {name}")


def render(outcomes: list[Outcome]) -> str:
    """The coverage table per family and GPU, the totals, and the causes by count."""
    groups: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(
        collections.Counter)
    for item in outcomes:
        groups[(item.family, item.gpu)][item.status] += 1
    statuses = ("modelled", "refused", "error", "failed")
    lines = ["| family | GPU | recipes | " + " | ".join(statuses) + " |",
             "|---|---|---|" + "---|" * len(statuses)]  # fmt: skip
    for (family, gpu), counts in sorted(groups.items()):
        lines.append(f"| {family} | {gpu} | {sum(counts.values())} | "
                     + " | ".join(str(counts[s]) for s in statuses) + " |")  # fmt: skip
    total = collections.Counter(item.status for item in outcomes)
    share = total["modelled"] / max(len(outcomes), 1)
    lines.append(f"| all | | {len(outcomes)} | " + " | ".join(str(total[s]) for s in statuses)
                 + " |")  # fmt: skip
    lines += ["", f"Fully modelled: {total['modelled']} of {len(outcomes)} ({share:.0%}).", ""]
    each = collections.Counter(part.split(" ")[0] if part.startswith("--") else part
                               for item in outcomes if item.status == "refused"
                               for part in item.cause.split(" + "))  # fmt: skip
    lines.append("refused recipes naming each argument (a recipe may name several):")
    lines += [f"  {count:4d}  {cause}" for cause, count in each.most_common()]
    for status in statuses[1:]:
        causes = collections.Counter(item.cause for item in outcomes if item.status == status)
        if causes:
            lines.append(f"{status}, by cause:")
            lines += [f"  {count:4d}  {cause}" for cause, count in causes.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Megatron-Bridge source tree")
    parser.add_argument("--run", action="store_true", help="run `memory` on each modelled job")
    parser.add_argument("--family", action="append", help="only this family (repeatable)")
    parser.add_argument("--all-families", action="store_true", help="keep vision/video models")
    parser.add_argument("--list", action="store_true", help="print every recipe's outcome too")
    parser.add_argument("--show", metavar="RECIPE", help="print one recipe's preset and arguments")
    options = parser.parse_args()
    if options.show:
        print(show(options.checkout, options.show))
        return
    families = tuple(options.family) if options.family else None
    outcomes = run_all(options.checkout, options.run, families)
    if not options.all_families:
        outcomes = [o for o in outcomes if o.family not in NOT_LANGUAGE]
    if options.list:
        for item in outcomes:
            print(f"{item.family}\t{item.gpu}\t{item.name}\t{item.status}\t{item.cause}")
        print()
    print(render(outcomes))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
