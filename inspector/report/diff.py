"""Compare two params tables: what moved, appeared, vanished or changed, grouped for a reviewer.

Rows are matched by parameter name. A whole layer that moves between stages is one entry (runs of
consecutive layers with the same move are one line); a change that repeats across layers (a tp
change halving every QKV weight) is one pattern with a count.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from inspector.report.table import COMPARED
from inspector.report.table_reader import ParamsTable, TableRow, read_table

_LAYER = re.compile(r"^decoder\.layers\.(\d{1,30})\.")  # longer: not a layer (int() limit)


@dataclass(frozen=True)
class Move:
    """Layers (first..last) or one parameter that moved from one stage to another."""

    what: str
    old: str
    new: str
    params: int = 1  # the parameters (table rows) that moved


@dataclass(frozen=True)
class Change:
    """One kind of change (shape, owners, precs, module) seen on `count` parameters."""

    kind: str
    pattern: str  # the name with the layer number replaced by `*`
    old: str
    new: str
    count: int
    layers: str  # the layers it touches, compressed ("0-11"), or ""


@dataclass(frozen=True)
class StageTotal:
    """One stage's totals before and after (None where the stage does not exist)."""

    stage: str
    old_params: int | None
    new_params: int | None
    old_bytes: int | None
    new_bytes: int | None


@dataclass
class TableDiff:
    """Everything that differs between two tables."""

    topology: tuple[str, str] | None = None
    moves: list[Move] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    totals: list[StageTotal] = field(default_factory=list)
    order_changed: bool = False
    added_params: int = 0  # the parameters (table rows) behind `added`
    removed_params: int = 0

    @property
    def equal(self) -> bool:
        """Return whether nothing differs."""
        return not (
            self.topology
            or self.moves
            or self.added
            or self.removed
            or self.changes
            or self.order_changed
        )


def compress(numbers: list[int]) -> str:
    """Return sorted numbers as runs: [0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def _where(row: TableRow) -> str:
    if row.stage is None:
        return "?"
    return f"stage {row.stage}" + (f" chunk {row.chunk}" if row.chunk is not None else "")


def _layer(name: str) -> int | None:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def _pattern(name: str) -> str:
    return _LAYER.sub("decoder.layers.*.", name)


def diff_tables(old: ParamsTable, new: ParamsTable) -> TableDiff:
    """Return what changed from `old` to `new`."""
    result = TableDiff()
    if (old.topology or "") != (new.topology or ""):
        result.topology = (_describe_topology(old.topology), _describe_topology(new.topology))
    before = {row.name: row for row in old.rows}
    after = {row.name: row for row in new.rows}
    _added_removed(result, before, after)
    _moves(result, before, after)
    _changes(result, before, after)
    common = [n for n in before if n in after]
    result.order_changed = common != [n for n in after if n in before]
    result.totals = _totals(old, new)
    return result


def _group_by_layer(names: list[str]) -> tuple[list[int], list[str]]:
    """Split names into whole layers (every row of the layer) and loose parameters."""
    layers = sorted({n for n in map(_layer, names) if n is not None})
    loose = [n for n in names if _layer(n) is None]
    return layers, loose


def _added_removed(
    result: TableDiff, before: dict[str, TableRow], after: dict[str, TableRow]
) -> None:
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    result.added_params, result.removed_params = len(added), len(removed)
    for names, other, target in ((added, before, result.added), (removed, after, result.removed)):
        layers, loose = _group_by_layer(names)
        whole = [n for n in layers if not any(_layer(name) == n for name in other)]
        if whole:
            target.append(f"layers {compress(whole)}" if len(whole) > 1 else f"layer {whole[0]}")
        target.extend(n for n in names if _layer(n) is not None and _layer(n) not in whole)
        target.extend(loose)


def _moves(result: TableDiff, before: dict[str, TableRow], after: dict[str, TableRow]) -> None:
    by_layer: dict[int, set[tuple[str, str]]] = defaultdict(set)
    rows: dict[int, int] = defaultdict(int)
    loose: list[Move] = []
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            continue
        layer = _layer(name)
        move = (_where(old), _where(new))
        if layer is not None:
            by_layer[layer].add(move)
            rows[layer] += 1
        elif move[0] != move[1]:
            loose.append(Move(name, *move))
    runs: list[tuple[list[int], tuple[str, str]]] = []
    for layer in sorted(by_layer):
        moves = by_layer[layer]
        if len(moves) != 1 or next(iter(moves))[0] == next(iter(moves))[1]:
            continue
        move = next(iter(moves))
        if runs and runs[-1][1] == move and runs[-1][0][-1] == layer - 1:
            runs[-1][0].append(layer)
        else:
            runs.append(([layer], move))
    for layers, (source, target) in runs:
        what = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
        result.moves.append(Move(what, source, target, sum(rows[n] for n in layers)))
    result.moves.extend(loose)


def _changes(result: TableDiff, before: dict[str, TableRow], after: dict[str, TableRow]) -> None:
    groups: dict[tuple[str, str, str, str], list[int | None]] = defaultdict(list)
    for name, old in before.items():
        new = after.get(name)
        if new is None:
            continue
        for column in COMPARED:
            a = column.write(getattr(old, column.attr))
            b = column.write(getattr(new, column.attr))
            if a != b:
                groups[(column.label, _pattern(name), a, b)].append(_layer(name))
    for (kind, pattern, a, b), layers in groups.items():
        numbers = [n for n in layers if n is not None]
        result.changes.append(Change(kind, pattern, a, b, len(layers), compress(numbers)))
    order = {column.label: i for i, column in enumerate(COMPARED)}
    result.changes.sort(key=lambda c: (order[c.kind], -c.count, c.pattern, c.old, c.new))


def _stage_totals(table: ParamsTable) -> dict[str, tuple[int, int | None]]:
    totals: dict[str, list[int | None]] = {}
    for row in table.rows:
        entry = totals.setdefault(_where(row), [0, 0])
        entry[0] = (entry[0] or 0) + row.numel
        if entry[1] is not None and row.element_bytes is not None:
            entry[1] += row.numel * row.element_bytes
        else:
            entry[1] = None
    return {stage: (int(v[0] or 0), v[1]) for stage, v in totals.items()}


def _totals(old: ParamsTable, new: ParamsTable) -> list[StageTotal]:
    before, after = _stage_totals(old), _stage_totals(new)
    stages = sorted(set(before) | set(after), key=_stage_key)
    totals = []
    for stage in stages:
        a, b = before.get(stage), after.get(stage)
        totals.append(
            StageTotal(
                stage,
                a[0] if a else None,
                b[0] if b else None,
                a[1] if a else None,
                b[1] if b else None,
            )
        )
    return totals


def _stage_key(stage: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", stage)) or (-1,)


def _describe_topology(line: str | None) -> str:
    """Summarise a topology line as its sizes: `pipe 2 x data 2 x model 2 = 8 ranks`."""
    if not line:
        return "none"
    entries = re.findall(r"ProcessCoord\(([^)]*)\)", line)
    if not entries:
        return "unreadable"
    axes: dict[str, int] = {}
    for entry in entries:
        for part in entry.split(", "):
            key, _, value = part.partition("=")
            # a user's file: Python's int() refuses non-digits and numbers past 4,300 digits
            if not (value.isascii() and value.isdigit() and len(value) <= 30):
                return "unreadable"
            axes[key] = max(axes.get(key, 0), int(value) + 1)
    sizes = " x ".join(f"{key} {size}" for key, size in axes.items())
    return f"{sizes} = {len(entries)} rank{'' if len(entries) == 1 else 's'}"


def diff_files(old_path: str, new_path: str) -> TableDiff:
    """Compare two params tables given as paths (`-` is standard input, for one of them)."""
    from inspector.errors import ConfigError
    from inspector.output import read_text

    if old_path == "-" and new_path == "-":
        raise ConfigError("only one of OLD and NEW can be - (standard input)")
    old = read_table(read_text(old_path), old_path)
    new = read_table(read_text(new_path), new_path)
    return diff_tables(old, new)


def check_table(text: str, path: str) -> TableDiff | None:
    """Compare a regenerated table with the committed one at `path`.

    Returns None when they are byte-identical, else what differs (possibly nothing but format).
    """
    from inspector.output import read_text

    committed = read_text(path)
    if committed == text:
        return None
    return diff_tables(read_table(committed, path), read_table(text, "regenerated"))
