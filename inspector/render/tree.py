"""Render the module hierarchy in the `inspect-model tree` format (docs/what-rank-holds.md)."""

from __future__ import annotations

from collections.abc import Sequence

from inspector.records import ModuleNode, StageTree


def _lines(node: ModuleNode, indent: int) -> list[str]:
    pad = " " * indent
    lines = [f"{pad}Module: {node.class_name}"]
    for name, child in node.children:
        lines.append(f"{pad}  Submodule: {name} ({child.class_name})")
        lines.extend(_lines(child, indent + 4))
    return lines


def render_tree(node: ModuleNode) -> str:
    """Return one module tree: `Module:` / `Submodule:` lines, two spaces per level."""
    return "\n".join(_lines(node, 0)) + "\n"


def render_trees(trees: Sequence[StageTree], headings: Sequence[str]) -> str:
    """Return each stage's tree, under its heading (`# stage S: layers A-B, ...`) where headed."""
    parts = []
    for tree, heading in zip(trees, headings, strict=True):
        if tree.headed:
            parts.append(heading + "\n")
        parts.append(render_tree(tree.root))
    return "".join(parts)
