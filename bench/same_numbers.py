"""`memory` and `plan` on two megatron-core releases: the numbers side by side (issue #42).

    PYTHON bench/same_numbers.py run -o FILE [--only REGEX]   # in each release's interpreter
    python bench/same_numbers.py diff OLD.json NEW.json       # the cases whose numbers differ

`run` answers every case in this process, on the installed megatron-core, the result cache off,
and writes the numbers as JSON: per stage of `memory --format json` its parameters, weights,
gradients, optimizer state, buffers, static bytes, activations and peak, and the FLOPs; per plan
of `plan --format json` its layout, micro-batch, recompute, peak and step time; per stage of
`params --format json` its parameter count. The cases:

- every `$ inspect-model memory|plan|params` example of README.md and docs/*.md (the ones
  tests/docs_examples.py runs), with `--format json` and without the page's pipes and files
  (`--timeline`, `--snapshot`, `--check` and `--attention-walkthrough` examples left out);
- every preset of `inspect-model models`, `memory` on 8 GPUs of data parallelism (PRESET_FLAGS:
  bf16, the distributed optimizer, micro-batch 1);
- the representative jobs of tests/test_same_numbers.py (dense GPT, MoE, MLA, FSDP, pipeline
  with virtual stages), `memory` and `plan`.

Megatron-LM's functional tests are compared through bench/ci_goldens.py's tables instead (`diff
--ci OLD.md NEW.md`: the predicted peak, static and step columns, case by case).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PRESET_FLAGS = "--bf16 --micro-batch-size 1 --global-batch-size 16 --use-distributed-optimizer --dp 8"
SKIPPED = ("--check", "--attention-walkthrough", "--timeline", "--snapshot")


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from inspector.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _json_argv(command: str) -> list[str] | None:
    """Return an example's inspect-model words with --format json, or None to leave it out."""
    from tests.docs_examples import _segments

    words = _segments(command)[0]
    words = words[: words.index(">")] if ">" in words else words
    if words[:1] != ["inspect-model"] or words[1] not in ("memory", "plan", "params"):
        return None
    if any(w in SKIPPED for w in words):
        return None
    argv = words[1:]
    if "--format" in argv:
        at = argv.index("--format")
        del argv[at : at + 2]
    return [*argv, "--format", "json"]


def doc_cases() -> dict[str, list[str]]:
    from tests.docs_examples import examples, pages

    found = {}
    for page in pages():
        for example in examples(page):
            argv = _json_argv(example.command)
            if argv is not None:
                found[f"{example.page}:{example.line} {argv[0]}"] = argv
    return found


def preset_cases() -> dict[str, list[str]]:
    from inspector.inputs.presets import PRESETS

    cases = {}
    for name in PRESETS:
        cases[f"preset {name}"] = ["memory", "--model", name, *PRESET_FLAGS.split(), "--format", "json"]
    return cases


def job_cases() -> dict[str, list[str]]:
    from tests.test_same_numbers import JOBS

    cases = {}
    for label, (command, flags) in JOBS.items():
        cases[f"job {label}"] = [command, *flags.split(), "--format", "json"]
    return cases


def numbers(command: str, text: str) -> dict[str, Any]:
    """Return the numbers of one command's JSON output, flat, by a stable key."""
    data = json.loads(text)
    found: dict[str, Any] = {}
    if command == "memory":
        for s in data["stages"]:
            key = f"stage {s['stage']}"
            for field in ("parameters", "weights", "gradients", "optimizer", "static", "total", "flops"):
                found[f"{key} {field}"] = s[field]
            found[f"{key} buffers"] = s["buffers"]["total"]
            found[f"{key} activations"] = s["activations"]["total"]
        found["seconds"] = data.get("seconds_per_iteration")
    elif command == "plan":
        for rank, p in enumerate(data["plans"], 1):
            lay = p["layout"]
            found[f"plan {rank} layout"] = (
                f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} cp{lay['cp']} ep{lay['ep']} vpp{lay['vpp']} "
                f"mbs{p['micro_batch_size']} {p['recompute']} distopt={p['distributed_optimizer']}"
            )
            found[f"plan {rank} peak"] = p["peak_bytes"]
            found[f"plan {rank} step"] = round(p["step_seconds"], 9)
        found["evaluated"] = data["evaluated"]
    else:
        per_stage: dict[str, int] = {}
        for p in data["parameters"]:
            key = f"stage {p['stage']} chunk {p['chunk']} params"
            per_stage[key] = per_stage.get(key, 0) + p["numel"]
        found.update(per_stage)
    return found


def run(only: str | None, output: Path) -> dict[str, Any]:
    from inspector.world.setup import megatron

    megatron()  # first, as the simulated world imports it (the stand-ins in; tests/conftest.py)
    import megatron.core

    os.environ["INSPECT_MODEL_NO_CACHE"] = "1"
    output = output.resolve()
    os.chdir(ROOT)
    cases = {**doc_cases(), **preset_cases(), **job_cases()}
    results: dict[str, Any] = {"megatron-core": megatron.core.__version__}
    for label, argv in cases.items():
        if only and not re.search(only, label):
            continue
        code, out, err = _cli(argv)
        line = next((ln for ln in err.splitlines() if ln.startswith("Error:")), err.strip()[-300:])
        results[label] = {"argv": argv, **(numbers(argv[0], out) if code == 0 else {"error": line})}
        print(f"{label}: {'ok' if code == 0 else line}", file=sys.stderr, flush=True)
        output.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")  # case by case
    return results


def _differs(a: Any, b: Any) -> bool:
    return a != b


def diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Return one line per number that differs between the two runs."""
    lines = [f"{old['megatron-core']} -> {new['megatron-core']}"]
    for label in old:
        if label == "megatron-core" or label not in new:
            continue
        a, b = old[label], new[label]
        for key in sorted(set(a) | set(b)):
            if key != "argv" and _differs(a.get(key), b.get(key)):
                va, vb = a.get(key), b.get(key)
                delta = f" ({vb - va:+})" if isinstance(va, int) and isinstance(vb, int) else ""
                lines.append(f"{label} | {key} | {va} | {vb}{delta}")
    return lines


def ci_rows(path: Path) -> dict[str, dict[str, str]]:
    """Return bench/ci_goldens.py's table by case: its layout, the predicted peak, static and step
    (the part of each `pred / H100` cell before the slash) and its note (a refusal)."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 10 or cells[0] == "case":
            continue
        predicted = [cells[i].split(" / ")[0] for i in (3, 5, 7)]
        rows[cells[0]] = dict(zip(("layout", "peak", "static", "step", "note"), [cells[2], *predicted, cells[9]]))
    return rows


def ci_diff(old: Path, new: Path) -> list[str]:
    """Return one line per functional-test case whose layout, predicted numbers or refusal differ."""
    a, b = ci_rows(old), ci_rows(new)
    lines = [f"{len(a)} cases | {len(b)} cases"]
    for case in sorted(set(a) | set(b)):
        ra, rb = a.get(case, {}), b.get(case, {})
        for key in ("layout", "peak", "static", "step", "note"):
            if ra.get(key) != rb.get(key):
                lines.append(f"{case} | {key} | {ra.get(key)} | {rb.get(key)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("-o", "--output", type=Path, required=True)
    r.add_argument("--only")
    d = sub.add_parser("diff")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--ci", action="store_true", help="compare two bench/ci_goldens.py tables")
    ns = parser.parse_args()
    if ns.verb == "run":
        run(ns.only, ns.output)
    elif ns.ci:
        print("\n".join(ci_diff(ns.old, ns.new)))
    else:
        print("\n".join(diff(json.loads(ns.old.read_text()), json.loads(ns.new.read_text()))))


if __name__ == "__main__":
    main()
