"""The builtins a launch script runs, interpreted as bash does: `export` and `declare`, `unset`,
`source`, `eval`, `set`, `shift`, `exit`, `return`, `break`, `test`, `let`, `read`, `false`
(commands.py dispatches to them and runs everything else).
"""

from __future__ import annotations

import os

from inspector.errors import InputError
from inspector.inputs.bash.conditions import evaluate_test
from inspector.inputs.bash.context import Unknown, script_dir
from inspector.inputs.bash.parser import split_assignment
from inspector.inputs.bash.runtime import MAX_DEPTH, Break, Exit, Return
from inspector.inputs.bash.shell import Shell
from inspector.inputs.bash.syntax import Assign, Simple
from inspector.inputs.bash.words import parse_fragment
from inspector.output import read_text


def resolve_file(shell: Shell, name: str, what: str) -> str:
    if shell.ctx.unset_in(name) or shell.ctx.bash_value(name) is None:
        name = shell.require(name, what)  # a path from an unset variable: ask for it
    name = shell.value(name, what)
    # bash reads a relative name from the working folder (`source $(dirname $0)/common.sh` when
    # the script is named from the repository's root); next to the script is the fallback
    for path in (name, os.path.join(script_dir(shell.ctx), name)):
        if os.path.isfile(path):
            return path
    raise shell.fail(f"{what} reads {name}, which is not a file next to the script")


def read_file(shell: Shell, path: str) -> str:
    """A sourced file's text, read as every input is (inspector.output.read_text: bounded)."""
    try:
        return read_text(path)
    except InputError as exc:
        raise shell.fail(f"cannot read {path} ({exc})") from None


def declare(shell: Shell, name: str, node: Simple) -> int:
    export = name == "export"
    for item in node.words[1:]:
        if isinstance(item, Assign):
            shell.do_assign(item, local=name == "local")
            if export:
                shell.exported.add(item.name)
            continue
        assign = split_assignment(item)
        if assign is not None:
            shell.do_assign(assign, local=name == "local")
            if export:
                shell.exported.add(assign.name)
            continue
        for text in shell.expand_fields(item):
            if text.startswith(("-", "+")):
                if "A" in text and text.startswith("-"):
                    raise shell.fail(f"`{name} -A` (associative arrays) is not supported")
                if "i" in text and text.startswith("-"):
                    raise shell.fail(f"`{name} -i` (integer variables) is not supported")
                export = export or ("x" in text and text.startswith("-"))
            else:
                if name == "local":
                    shell.make_local(text)
                if export:
                    shell.exported.add(text)
    return 0


def _unset(shell: Shell, argv: list[str]) -> int:
    for name in argv[1:]:
        if not name.startswith("-"):
            shell.vars.pop(name, None)
            shell.exported.discard(name)
    return 0


def _source(shell: Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise shell.fail(f"`{argv[0]}` needs a file")
    if shell.depth >= MAX_DEPTH or len(shell.source_stack) > MAX_DEPTH:
        raise shell.fail("sourced files include each other too deeply")
    path = resolve_file(shell, argv[1], f"`{argv[0]} {shell.ctx.show(argv[1])}`")
    saved_line, saved_positional = shell.line, shell.positional
    if len(argv) > 2:
        shell.positional = argv[2:]
    shell.source_stack.append(path)
    try:
        shell.run_text(read_file(shell, path), path)
    except Return:
        pass
    finally:
        shell.source_stack.pop()
        shell.line = saved_line
        if len(argv) > 2:
            shell.positional = saved_positional
    return shell.status


def _eval(shell: Shell, argv: list[str]) -> int:
    text = " ".join(argv[1:])
    shell.run_text(text, shell.source_stack[-1], shell.line, fixed=True)
    return shell.status


def _set(shell: Shell, argv: list[str]) -> int:
    args = argv[1:]
    if "--" in args:
        _options(shell, args[: args.index("--")])
        shell.positional = args[args.index("--") + 1 :]
        return 0
    values = [arg for arg in _options(shell, args) if not arg.startswith(("-", "+"))]
    if values:
        shell.positional = values
    return 0


def _options(shell: Shell, args: list[str]) -> list[str]:
    """Apply `set`'s options that change a reading (`-e`, `-o errexit`); return the other words."""
    rest: list[str] = []
    words = iter(args)
    for arg in words:
        if arg[:1] not in ("-", "+") or arg in ("-", "+"):
            rest.append(arg)
            continue
        if "e" in arg[1:]:
            shell.errexit = arg.startswith("-")
        if "u" in arg[1:]:
            shell.nounset = arg.startswith("-")
        if arg.endswith("o"):  # `-o errexit`, `-euo pipefail`
            option = next(words, "")
            if option in ("errexit", "nounset"):
                setattr(shell, option, arg.startswith("-"))
    return rest


def _shift(shell: Shell, argv: list[str]) -> int:
    count = int(shell.value(argv[1], "the count of `shift`") or 0) if len(argv) > 1 else 1
    if count > len(shell.positional):
        return 1
    shell.positional = shell.positional[count:]
    return 0


def _status_of(shell: Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        return shell.status
    text = shell.value(argv[1], f"the status of `{argv[0]}`")
    try:
        return int(text) & 255
    except ValueError:
        raise shell.fail(f"`{argv[0]} {text}` needs a number") from None


def _exit(shell: Shell, argv: list[str]) -> int:
    shell.status = _status_of(shell, argv)
    raise Exit(f"{shell.source_stack[-1]} line {shell.line}: `{shell.ctx.show(' '.join(argv))}`")


def _return(shell: Shell, argv: list[str]) -> int:
    shell.status = _status_of(shell, argv)
    raise Return


def _break(shell: Shell, argv: list[str]) -> int:
    levels = int(shell.value(argv[1], f"the count of `{argv[0]}`") or 1) if len(argv) > 1 else 1
    raise Break(levels, argv[0] == "continue")


def _test(shell: Shell, argv: list[str]) -> int:
    args = argv[1:]
    if argv[0] == "[":
        if not args or args[-1] != "]":
            raise shell.fail("a `[` condition is not closed with `]`")
        args = args[:-1]
    return evaluate_test([(a, None) for a in args], double=False, shell=shell)


def _let(shell: Shell, argv: list[str]) -> int:
    value = 0
    for arg in argv[1:]:
        value = shell.arith(parse_fragment(arg, shell.source_stack[-1], shell.line))
    return int(value == 0)


def _read_builtin(shell: Shell, argv: list[str]) -> int:
    """`read`: a launch runs with no input (a batch job's is /dev/null), so bash's `read` meets
    the end of input, empties its variables and fails (status 1)."""
    words = argv[1:]
    names: list[str] = []
    while words:
        word = words.pop(0)
        if word.startswith("-"):
            if word[-1] in "pdtnNuai" and words:  # `-p PROMPT`, `-t 5`, ...: the option's value
                words.pop(0)
            continue
        names.append(word)
    names = names or ["REPLY"]
    if all(name in shell.ctx.settings for name in names):  # --set NAME=VALUE: the line read
        for name in names:
            shell.assign(name, shell.ctx.settings[name])
        return 0
    for name in names:
        shell.ctx.unset_read.setdefault(name, shell.where())  # noted here, once
        shell.assign(name, shell.ctx.mark(Unknown(f"${name}", f"which `read` on line {shell.line} "
                                                  "reads from no input", name, "")))  # fmt: skip
    shown = " ".join(f"--set {name}=VALUE" for name in names)
    shell.ctx.note(f"{shell.where()}: `read` gets no input in a launch (a batch job reads "
                   f"/dev/null), so {', '.join('$' + n for n in names)} reads as empty and `read` "
                   f"fails, as in bash; give the line it would read with {shown}")  # fmt: skip
    return 1


def _false(shell: Shell, argv: list[str]) -> int:
    return 1


BUILTINS = {
    "unset": _unset, "source": _source, ".": _source, "eval": _eval, "set": _set,
    "shift": _shift, "exit": _exit, "return": _return, "break": _break, "continue": _break,
    "test": _test, "[": _test, "let": _let, "read": _read_builtin, "false": _false,
}  # fmt: skip
