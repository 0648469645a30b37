"""Render a TableDiff: text for a terminal, markdown for a PR comment, JSON for tools."""

from __future__ import annotations

import dataclasses
import json

from tabulate import tabulate

from inspector.report.diff import Move, StageTotal, TableDiff
from inspector.report.table import COMPARED


def _number(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _delta(old: int | None, new: int | None) -> str:
    if old is None or new is None:
        return "new" if old is None else "gone"
    if old == new:
        return "="
    if old == 0:
        return f"+{new:,}"
    return f"{(new - old) / old:+.1%}"


def _largest(totals: list[StageTotal]) -> str:
    """Say how the largest stage (by parameters) changed."""
    old = max(
        (t for t in totals if t.old_params is not None),
        key=lambda t: t.old_params or 0,
        default=None,
    )
    new = max(
        (t for t in totals if t.new_params is not None),
        key=lambda t: t.new_params or 0,
        default=None,
    )
    if old is None or new is None:
        return ""
    return (
        f"largest stage: {old.stage} with {_number(old.old_params)} params -> "
        f"{new.stage} with {_number(new.new_params)} params ({_delta(old.old_params, new.new_params)})"
    )


def _params(count: int) -> str:
    return f"{count:,} parameter{'s' * (count != 1)}"


def _summary(d: TableDiff) -> list[tuple[str, str]]:
    """Return the summary's counts, every one in parameters (table rows)."""
    counts = [
        ("topology", f"{d.topology[0]} -> {d.topology[1]}" if d.topology else "same"),
        ("moved between stages", _params(sum(m.params for m in d.moves))),
        ("added", _params(d.added_params)),
        ("removed", _params(d.removed_params)),
    ]
    for kind in (column.label for column in COMPARED):
        changes = [c for c in d.changes if c.kind == kind]
        params = _params(sum(c.count for c in changes))
        patterns = f" in {len(changes)} pattern{'s' * (len(changes) != 1)}" if changes else ""
        counts.append((f"{kind} changes", params + patterns))
    if d.order_changed:
        counts.append(("row order", "changed"))
    return counts


def _move(m: Move) -> str:
    """Return one move: a layer run (with its parameter count) or one parameter."""
    count = f" ({_params(m.params)})" if m.what.startswith(("layer ", "layers ")) else ""
    return f"{m.what}: {m.old} -> {m.new}{count}"


def _detail_lines(d: TableDiff) -> list[tuple[str, list[str]]]:
    sections = [
        ("Moved between stages", [_move(m) for m in d.moves]),
        ("Added", d.added),
        ("Removed", d.removed),
    ]
    for kind in (column.label for column in COMPARED):
        lines = [
            f"{c.pattern}"
            + (f" ({c.count} params, layers {c.layers})" if c.layers and c.count > 1 else "")
            + f": {c.old or '(empty)'} -> {c.new or '(empty)'}"
            for c in d.changes
            if c.kind == kind
        ]
        sections.append((f"{kind.capitalize()} changes", lines))
    return [(title, lines) for title, lines in sections if lines]


def _totals_rows(d: TableDiff) -> list[list[str]]:
    return [
        [t.stage, _number(t.old_params), _number(t.new_params), _delta(t.old_params, t.new_params),
         _number(t.old_bytes), _number(t.new_bytes)]
        for t in d.totals
    ]  # fmt: skip


TOTALS_HEADERS = ["stage", "params before", "params after", "change", "bytes before", "bytes after"]


def render_text(d: TableDiff, old_name: str, new_name: str) -> str:
    """Return the terminal report: moves and the largest stage first, then counts and details."""
    if d.equal:
        return f"{old_name} and {new_name} are identical\n"
    lines = [f"{old_name} -> {new_name}"]
    lines += [f"  {_move(m)}" for m in d.moves[:20]]
    if len(d.moves) > 20:
        lines.append(f"  ... {len(d.moves) - 20} more moves below")
    if largest := _largest(d.totals):
        lines.append(f"  {largest}")
    lines += ["", "Summary:"] + [f"  {what}: {value}" for what, value in _summary(d)]
    lines += ["", tabulate(_totals_rows(d), headers=TOTALS_HEADERS, disable_numparse=True)]
    for title, items in _detail_lines(d):
        lines += ["", f"{title}:"] + [f"  {item}" for item in items]
    return "\n".join(lines) + "\n"


def render_markdown(d: TableDiff, old_name: str, new_name: str) -> str:
    """Return a GitHub comment: summary table, per-stage totals, collapsible details."""
    if d.equal:
        return f"**inspect-model**: `{old_name}` and `{new_name}` are identical.\n"
    lines = [f"### inspect-model: `{old_name}` → `{new_name}`", ""]
    if largest := _largest(d.totals):
        lines += [largest.capitalize() + ".", ""]
    lines.append(tabulate(_summary(d), headers=["what", "change"], tablefmt="github"))
    lines += [
        "",
        tabulate(_totals_rows(d), headers=TOTALS_HEADERS, tablefmt="github", disable_numparse=True),
    ]
    for title, items in _detail_lines(d):
        lines += ["", f"<details><summary>{title} ({len(items)})</summary>", ""]
        lines += [f"- `{item}`" for item in items]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def render_json(d: TableDiff, old_name: str, new_name: str) -> str:
    """Return the whole diff as JSON."""
    data = {"old": old_name, "new": new_name, "equal": d.equal, **dataclasses.asdict(d)}
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json}


def render_diff(d: TableDiff, fmt: str, old_name: str, new_name: str) -> str:
    """Return the diff in the given format (text, markdown or json)."""
    return RENDERERS[fmt](d, old_name, new_name)


def render_check(result: TableDiff | None, path: str) -> str:
    """Return what `params --check` says: up to date, formatting only, or the diff."""
    if result is None:
        return f"{path} is up to date\n"
    if result.equal:
        return f"{path} differs from the regenerated table in formatting only\n"
    return render_text(result, path, "regenerated")
