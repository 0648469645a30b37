"""What a `$(...)` gives without running anything: `dirname`, `basename`, `realpath`, `echo`, `pwd`
and `cd DIR && pwd` on values bash knows; any other command's output stays unknown."""

from __future__ import annotations

import os

from inspector.inputs.bash.context import MARK, Unknown
from inspector.inputs.bash.parser import parse_script
from inspector.inputs.bash.shell import Shell
from inspector.inputs.bash.syntax import AndOr, Assign, Seq, Simple, Word


def pure_output(shell: Shell, script: str) -> str | None:
    """Return the output of a `$(...)` that needs no running (`dirname`, `basename`, `echo`,
    `cd DIR && pwd`), or None."""
    try:
        tree = parse_script(script, shell.source_stack[-1], shell.line, fixed_line=True)
    except Exception:
        return None
    if len(tree.items) != 1 or tree.items[0][1]:
        return None
    node = tree.items[0][0]
    if isinstance(node, AndOr) and len(node.rest) == 1 and node.rest[0][0] == "&&":
        first, (_, second) = node.first, node.rest[0]
        if _argv(shell, second) in (["pwd"], ["pwd", "-P"]):
            where = _argv(shell, first)
            if where and len(where) == 2 and where[0] == "cd" and not MARK.search(where[1]):
                return os.path.abspath(where[1])
        return None
    argv = _argv(shell, node)
    if argv in (["pwd"], ["pwd", "-P"]):
        return (shell.lookup("PWD", None) or [""])[0]
    known = [shell.ctx.bash_value(a) for a in argv or ()]
    if not argv or any(a is None for a in known):
        return None
    output = _output([a or "" for a in known])
    unset = [u for word in argv for u in shell.ctx.held(word) if u.value == ""]
    if output is None or not unset:
        return output
    for word in argv:  # one note for each unset variable read, as anywhere else
        shell.value(word, f"`{script.strip()}`")
    # From an unset variable: bash's output of the empty value, which stays missing where a
    # modelled argument needs it (the variable's --set gives it).
    return shell.ctx.mark(Unknown(unset[0].text, unset[0].reason, unset[0].hint, output))


def _output(argv: list[str]) -> str | None:
    """The output of `dirname`, `basename`, `realpath`, `readlink -f` or `echo` on known words."""
    if argv[0] == "dirname" and len(argv) == 2:
        return _dirname(argv[1])
    if argv[0] == "basename" and len(argv) in (2, 3):
        base = argv[1].rstrip("/").rsplit("/", 1)[-1] or argv[1][:1]  # `basename ""` is empty
        return base[: -len(argv[2])] if len(argv) == 3 and base.endswith(argv[2]) else base
    if argv[0] in ("realpath", "readlink") and len(argv) == 2 + (argv[0] == "readlink"):
        return os.path.abspath(argv[-1])
    if argv[0] == "echo" and not any(a.startswith("-") for a in argv[1:2]):
        return " ".join(argv[1:])
    return None


def _argv(shell: Shell, node: object) -> list[str] | None:
    if isinstance(node, Seq) and len(node.items) == 1:
        node = node.items[0][0]
    if not isinstance(node, Simple) or node.assigns or any(isinstance(w, Assign) for w in node.words):
        return None
    return [text for word in node.words if isinstance(word, Word) for text in shell.expand_fields(word)]


def _dirname(path: str) -> str:
    stripped = path.rstrip("/")
    if not stripped:
        return "/" if path else "."
    head = stripped.rsplit("/", 1)
    if len(head) == 1:
        return "."
    return head[0].rstrip("/") or "/"
