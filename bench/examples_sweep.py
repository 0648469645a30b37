"""Sweep: read every launch script of a Megatron-LM checkout as Megatron-LM runs them (issue #27).

    .venv/bin/python bench/examples_sweep.py /tmp/mlm [--tool .venv/bin/inspect-model] [--timeout 300]

CHECKOUT is a Megatron-LM tree (at least `examples/` and `tests/functional_tests/test_cases/`); the
script fetches nothing and writes nothing into it. Each case runs `inspect-model memory` with
CHECKOUT as the working folder (Megatron-LM's scripts are run from the repository root):

- every `examples/**/*.sh`, `*.slurm`, `*.sbatch`, as written (`--from-script examples/...`);
  ModelOpt's scripts with their positional model name (`--set 1=Qwen/Qwen3-8B`, README's example),
  sc21's from their own folder (they source `` `pwd` ``/CONFIG.sh);
- every ModelOpt config `examples/post_training/modelopt/conf/ORG/NAME.sh` through `finetune.sh`,
  given its name as the positional argument the script asks for (`--set 1=ORG/NAME`);
- every `examples/rl/model_configs/*.sh` sourced before the `torchrun ... train_rl.py` command of
  `examples/rl/README.md` (taken from that README at run time into a temporary script, outside the
  checkout); README's `<Specify>` variables (CHECKPOINT, RUN_DIR, WANDB_*) are given with `--set`;
- a sample of the functional tests' `model_config.yaml` (`--config`): every fifth of gpt/ and
  moe/, every mixtral/, in sorted order (`--all-configs` for all of them).

Each is classified: table (exit 0), entry point (the `Error:` naming a program that is not GPT
training), error (any other `Error:`), traceback (anything else, timeouts included). Prints one
line per case (`--verbose`: with its first error line) and the counts per family as a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOL = HERE.parent / ".venv" / "bin" / "inspect-model"
ENTRY_POINT = "this tool reads GPT training"
MODELOPT_MODEL = "Qwen/Qwen3-8B"  # README's example name, given as the scripts' $1
RL_SETS = ["CHECKPOINT=/checkpoint", "RUN_DIR=/run", "WANDB_PROJECT=project", "WANDB_EXP_NAME=exp"]
FAMILIES = (
    "gpt3", "llama", "mixtral", "megatron_fsdp", "academic_paper_scripts/sc21",
    "post_training/modelopt/conf", "post_training/modelopt", "rl/model_configs",
)  # fmt: skip


@dataclass(frozen=True)
class Case:
    family: str
    label: str
    argv: list[str]
    folder: str = ""  # the working folder, under the checkout (its root when empty)


@dataclass(frozen=True)
class Outcome:
    case: Case
    kind: str  # table, entry point, error, traceback
    line: str  # the first Error: line, or the last line of a traceback


def family_of(rel: str) -> str:
    """Return the family of an examples/ path: its GPT-training folder, or its top folder."""
    inner = rel.removeprefix("examples/")
    for family in FAMILIES:
        if inner.startswith(family + "/"):
            return family
    return "other: " + inner.split("/")[0]


def script_cases(root: Path) -> list[Case]:
    """Return one case per launch script under examples/, as written."""
    paths = sorted(
        p for p in (root / "examples").rglob("*") if p.suffix in (".sh", ".slurm", ".sbatch")
    )
    cases = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if "/modelopt/conf/" in rel or "/rl/model_configs/" in rel:
            continue  # sourced by their launchers: cases of their own below
        family = family_of(rel)
        if family == "academic_paper_scripts/sc21":  # they source `pwd`/CONFIG.sh: run from there
            cases.append(Case(family, rel, ["--from-script", path.name], str(path.parent)))
        elif family == "post_training/modelopt":  # the model name is their positional argument
            cases.append(Case(family, rel, ["--from-script", rel, "--set", f"1={MODELOPT_MODEL}"]))
        else:
            cases.append(Case(family, rel, ["--from-script", rel]))
    return cases


def modelopt_cases(root: Path) -> list[Case]:
    """Return one case per ModelOpt model config, launched by finetune.sh with its name."""
    conf = root / "examples/post_training/modelopt/conf"
    launcher = "examples/post_training/modelopt/finetune.sh"
    cases = []
    for path in sorted(conf.glob("*/*.sh")):
        name = path.relative_to(conf).with_suffix("").as_posix()
        cases.append(Case("post_training/modelopt/conf", name,
                          ["--from-script", launcher, "--set", f"1={name}"]))  # fmt: skip
    return cases


def rl_launch(root: Path) -> str:
    """Return README's `torchrun ... train_rl.py` command, up to the end of its code block."""
    text = (root / "examples/rl/README.md").read_text()
    start = text.index("\ntorchrun")
    return text[start : text.index("```", start)]


def rl_cases(root: Path, folder: Path) -> list[Case]:
    """Return one case per RL model config: a script sourcing it, then README's launch."""
    launch = rl_launch(root)
    cases = []
    for path in sorted((root / "examples/rl/model_configs").glob("*.sh")):
        if path.name == "common.sh":
            continue
        rel = path.relative_to(root).as_posix()
        script = folder / f"rl_{path.stem}.sh"
        script.write_text(f"#!/bin/bash\nsource {rel}\n{launch}")
        sets = [a for s in RL_SETS for a in ("--set", s)]
        cases.append(Case("rl/model_configs", rel, ["--from-script", str(script), *sets]))
    return cases


def config_cases(root: Path, every: int) -> list[Case]:
    """Return a sample of the functional tests' model_config.yaml files, read with --config."""
    base = root / "tests/functional_tests/test_cases"
    cases = []
    for family, step in (("gpt", every), ("moe", every), ("mixtral", 1)):
        paths = sorted((base / family).glob("*/model_config.yaml"))
        for path in paths[::step]:
            rel = path.relative_to(root).as_posix()
            cases.append(Case(f"functional tests {family}", rel, ["--config", rel]))
    return cases


def run_case(tool: str, command: str, root: Path, case: Case, timeout: int) -> Outcome:
    """Run one case from the checkout's root and classify what it printed."""
    try:
        done = subprocess.run([tool, command, *case.argv], cwd=root / case.folder,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return Outcome(case, "traceback", f"timed out after {timeout} s")
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    if done.returncode == 0:
        return Outcome(case, "table", "")
    if done.returncode == 2 and errors:
        kind = "entry point" if ENTRY_POINT in errors[0] else "error"
        return Outcome(case, kind, errors[0])
    tail = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
    return Outcome(case, "traceback", tail[0])


def counts_table(outcomes: list[Outcome]) -> str:
    """Return the counts per family as a Markdown table."""
    kinds = ("table", "entry point", "error", "traceback")
    families: dict[str, dict[str, int]] = {}
    for outcome in outcomes:
        row = families.setdefault(outcome.case.family, dict.fromkeys(kinds, 0))
        row[outcome.kind] += 1
    lines = ["| family | cases | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 2) + "|"]
    for family in sorted(families):
        row = families[family]
        cells = " | ".join(str(row[k]) for k in kinds)
        lines.append(f"| `{family}` | {sum(row.values())} | {cells} |")
    totals = " | ".join(str(sum(r[k] for r in families.values())) for k in kinds)
    lines.append(f"| all | {len(outcomes)} | {totals} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--tool", default=str(TOOL))
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--command", default="memory", help="memory (default) or params")
    parser.add_argument("--all-configs", action="store_true")
    parser.add_argument("--only", default="", help="run the cases whose label matches this regex")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    root = args.checkout.resolve()
    with tempfile.TemporaryDirectory() as folder:
        cases = [*script_cases(root), *modelopt_cases(root), *rl_cases(root, Path(folder)),
                 *config_cases(root, 1 if args.all_configs else 5)]  # fmt: skip
        cases = [c for c in cases if re.search(args.only, c.label)]
        outcomes = []
        for case in cases:
            outcome = run_case(args.tool, args.command, root, case, args.timeout)
            outcomes.append(outcome)
            detail = f"  {outcome.line}" if args.verbose and outcome.line else ""
            print(f"{outcome.kind:12} {case.family:28} {case.label}{detail}", flush=True)
    print()
    print(counts_table(outcomes))


if __name__ == "__main__":
    sys.exit(main())
