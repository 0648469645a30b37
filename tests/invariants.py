"""Invariants every golden file must satisfy, checked with this file's own parsing.

A golden file only proves the output did not change; these prove it is self-consistent, without
the code that wrote it (no inspector import): a wrong `--update-golden` regeneration fails here.
"""

from __future__ import annotations

import json
import math
import re

_SHAPE = re.compile(r"^\((\d+(?:, \d+)*)?,?\)$")


def _numel(shape: str) -> int:
    match = _SHAPE.match(shape)
    assert match, f"not a shape: {shape!r}"
    return math.prod(int(d) for d in match.group(1).split(", ")) if match.group(1) else 1


_STAGE_COMMENT = re.compile(
    r"^# stage \d+(?: chunk \d+)?: .*?, (\d+) params, (\d+) bytes"
    r"(?: per GPU; all (\d+) expert-parallel ranks: (\d+) params, (\d+) bytes)?$"
)


def params_csv(text: str) -> None:
    """Each `# stage` comment adds up its rows; bytes are 2 or 4 per element.

    Under expert parallelism the comment states one GPU's share, then the rows' total over E
    expert-parallel ranks: one GPU holds the shared rows and 1/E of the expert rows.
    """
    lines = text.splitlines()
    header = lines.index("name;module;shape;partitioning_ranks;precs")
    blocks: list[tuple[tuple[str | None, ...], list[int], list[int]]] = []
    for line in lines[header + 1 :]:
        comment = _STAGE_COMMENT.match(line)
        if comment:
            blocks.append((comment.groups(), [], []))
            continue
        assert not line.startswith("#"), line
        fields = line.split(";")
        assert len(fields) == 5, line
        if not blocks:  # a --rank file: no comment lines at all
            assert not any(row.startswith("#") for row in text.splitlines()), line
            continue
        blocks[-1][2 if ".experts." in fields[0] else 1].append(_numel(fields[2]))
    for (params, size, ranks, total, total_size), shared, experts in blocks:
        every = sum(shared) + sum(experts)
        if ranks is None:
            assert int(params) == every, (params, every)
        else:
            assert int(total) == every and int(ranks) > 1, (total, every)
            assert sum(experts) % int(ranks) == 0, (sum(experts), ranks)
            assert int(params) == sum(shared) + sum(experts) // int(ranks), (params, ranks)
            assert int(total_size) in (2 * int(total), 4 * int(total)), (total, total_size)
        assert int(size) in (2 * int(params), 4 * int(params)), (params, size)


def params_json(text: str) -> None:
    """Each parameter's numel is its shape's product; sharded ones are a slice of the global."""
    data = json.loads(text)
    for p in data["parameters"]:
        assert p["numel"] == math.prod(p["shape"]), p["name"]
        whole = math.prod(p["global_shape"])
        assert whole % p["numel"] == 0 and (p["tensor_parallel"] or whole == p["numel"]), p["name"]


def tree(text: str) -> None:
    """Every `Submodule: name (Class)` line is followed by that module's `Module: Class` line.

    Each `# stage` heading is a summary (layers, params, bytes) of 2 or 4 bytes per parameter;
    tests/test_tree.py checks its numbers equal the params table's comment for the same view.
    """
    for line in text.splitlines():
        if line.startswith("#"):
            summary = _STAGE_COMMENT.match(line)
            assert summary and summary.group(3) is None, line
            params, size = int(summary.group(1)), int(summary.group(2))
            assert params > 0 and size in (2 * params, 4 * params), line
    lines = [line for line in text.splitlines() if not line.startswith("# stage ")]
    for index, line in enumerate(lines):
        sub = re.match(r"^( *)Submodule: \S+ \((\w+)\)$", line)
        if sub:
            expected = " " * (len(sub.group(1)) + 2) + f"Module: {sub.group(2)}"
            assert lines[index + 1] == expected, (line, lines[index + 1])


def topology_line(text: str) -> None:
    """Ranks appear in order 0..N-1, and N is the product of the coordinates' ranges."""
    entries = re.findall(r"ProcessCoord\(([^)]*)\): (\d+)", text)
    assert [int(rank) for _, rank in entries] == list(range(len(entries)))
    axes: dict[str, int] = {}
    for coords, _ in entries:
        for part in coords.split(", "):
            name, value = part.split("=")
            axes[name] = max(axes.get(name, 0), int(value) + 1)
    assert math.prod(axes.values()) == len(entries)


def topology_table(text: str) -> None:
    """The rank column counts 0..N-1."""
    rows = text.splitlines()[2:]
    assert [int(row.split()[0]) for row in rows] == list(range(len(rows)))


_JOB = re.compile(
    r"^Job: \S+ \((?P<layers>\d+) layers, hidden \d+(?:, \d+ experts)?\), "
    r"(?P<precision>bf16|fp16|fp32), sequence (?P<seq>\d+); (?P<layout>[^;]+?)"
    r"(?:; global batch (?P<gbs>\d+) = micro-batch (?P<mbs>\d+) x (?P<k>\d+) micro-batch(?:es)?"
    r" x dp (?P<dp>\d+))?\.$"
)


def job_line(text: str) -> dict[str, str | int]:
    """The job line's sizes multiply to its GPUs and its batch to its global batch; the fp32
    note appears exactly when the job is fp32. Return the job's numbers."""
    first = text.splitlines()[0]
    match = _JOB.match(first)
    assert match, first
    sizes = dict(re.findall(r"\b(tp|pp|dp|cp) (\d+)", match["layout"].split(" = ")[0]))
    gpus = re.search(r" = (\d+) GPUs?\b", match["layout"])
    assert gpus and math.prod(map(int, sizes.values())) == int(gpus[1]), first
    job: dict[str, str | int] = {k: int(v) for k, v in sizes.items()}
    job.update(precision=match["precision"], seq=int(match["seq"]), layers=int(match["layers"]))
    if match["gbs"]:
        assert int(match["gbs"]) == int(match["mbs"]) * int(match["k"]) * int(match["dp"]), first
        assert int(match["dp"]) == job["dp"], first
        job["gbs"] = int(match["gbs"])
    header = text.split("\n\n")[0]
    assert ("Note: neither --bf16 nor --fp16" in header) == (match["precision"] == "fp32"), header
    return job


def params_human(text: str) -> None:
    """Each block's `total` row adds up its rows' params and bytes, at the job line's precision;
    the blocks are stages of the job line's pipeline."""
    job = job_line(text)
    width = 4 if job["precision"] == "fp32" else 2
    for block in text.strip().split("\n\n")[1:]:
        stage = re.match(r"stage (\d+)", block)
        assert stage and int(stage[1]) < int(job["pp"]), block.splitlines()[0]
        rows = [line.split() for line in block.splitlines()[3:]]
        *body, total = rows
        params = sum(int(r[-2].replace(",", "")) for r in body)
        size = sum(int(r[-1].replace(",", "")) for r in body)
        assert total[0] == "total"
        assert (int(total[-2].replace(",", "")), int(total[-1].replace(",", ""))) == (params, size)
        assert size == width * params, (job["precision"], params, size)


def memory_text(text: str) -> None:
    """The job line holds (job_line) and agrees with the report: one row per pipeline stage, the
    precision and the FLOPs line's batch and sequence. Each stage row's total is weights + grads
    + optimizer + buffers + activations (to the printed 0.01)."""
    job = job_line(text)
    precision = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[str(job["precision"])]
    assert f"Precision: {precision} parameters" in text
    assert f"({job['gbs']} sequences of {job['seq']} tokens" in text
    stages = [line for line in text.splitlines() if re.match(r"stage \d+ ", line)]
    assert len(stages) == job["pp"], stages
    for line in text.splitlines():
        cells = line.split()
        if len(cells) >= 12 and cells[0].isdigit() and "-" in cells[2]:
            parts = map(float, cells[4:9])  # weights, grads, optimizer, buffers, activations
            assert abs(sum(parts) - float(cells[10])) <= 0.04, line


def diff_report(text: str) -> None:
    """Each `X changes: P parameters in K patterns` summary line matches its section's K lines."""
    if text.lstrip().startswith("{"):
        data = json.loads(text)
        changes = data["changes"]
        assert data["equal"] == (not (changes or data["moves"] or data["added"] or data["removed"]))
        return
    moved = re.search(r"moved between stages\W+([\d,]+) parameters?", text)
    if moved is None:
        assert "identical" in text.splitlines()[0], text
        return
    section = re.search(r"Moved between stages(?::| \(\d+\)</summary>\n)\n((?:[-\w `].*\n)+)", text)
    lines = section.group(1).splitlines() if section else []
    counts = [re.search(r"\(([\d,]+) parameters?\)", line) for line in lines]
    total = sum(int(c.group(1).replace(",", "")) if c else 1 for c in counts)
    assert int(moved.group(1).replace(",", "")) == total, (moved.group(0), total)
    for kind, patterns in re.findall(r"(\w+) changes\W+[\d,]+ parameters? in (\d+) patterns?", text):
        title = kind.capitalize() + " changes"
        section = re.search(rf"{title}(?::| \(\d+\)</summary>\n)\n((?:[-\w `].*\n)+)", text)
        assert section, kind
        assert len(section.group(1).splitlines()) == int(patterns), (kind, section.group(1))


def simai_workload(text: str) -> None:
    """Line 2 counts the records that follow, each of SimAI's 12 whitespace-separated fields."""
    lines = text.splitlines()
    records = [line.split() for line in lines[2:] if line.strip()]
    assert int(lines[1]) == len(records)
    assert all(len(fields) == 12 and fields[1] == "-1" for fields in records)


def workload_index(text: str) -> None:
    """Each stage row names its own file, and its record count is an integer."""
    rows = [line.split(",") for line in text.splitlines()[1:]]
    for row in rows:
        assert row[-1] == f"stage{int(row[0]):03d}.txt" and int(row[6]) > 0, row


def check(name: str, text: str) -> None:
    """Check the invariant of a golden file, chosen by its name."""
    if name.startswith("diff_"):
        diff_report(text)
    elif name.startswith("workload_"):
        (workload_index if name.endswith("_index.csv") else simai_workload)(text)
    elif name.endswith(".csv"):
        params_csv(text)
    elif name.endswith(".json"):
        params_json(text)
    elif name.startswith(("tree_", "preset_")) and name.endswith("_tree.txt") or name.startswith("tree_"):
        tree(text)
    elif name.startswith("topology_") and "table" in name:
        topology_table(text)
    elif name.startswith("topology_"):
        topology_line(text)
    elif name == "params_example_table.txt":
        params_human(text)
    elif name.startswith("memory_"):
        memory_text(text)
    else:
        raise AssertionError(f"golden file {name} has no invariant in tests/invariants.py")
