"""The commands a launch script runs, as the reader treats them: builtins are interpreted
(`export`, `source`, `eval`, `set`, `test`, ...), `bash -c` and `bash FILE` are followed in a child
shell, training launches are recorded, and everything else is skipped as if it succeeded.
"""

from __future__ import annotations

import os
import re

from inspector.inputs.bash.batch import sbatch_options, start_job
from inspector.inputs.bash.conditions import evaluate_test
from inspector.inputs.bash.context import (
    PASS_THROUGH,
    Command,
    Unknown,
    program_name,
    script_dir,
)
from inspector.inputs.bash.parser import split_assignment
from inspector.inputs.bash.runtime import MAX_DEPTH, Break, Exit, Return
from inspector.inputs.bash.shell import Shell
from inspector.inputs.bash.substitution import pure_output
from inspector.inputs.bash.syntax import Assign, HereDoc, Simple
from inspector.inputs.bash.words import parse_fragment

_ENV_ASSIGN = re.compile(r"[A-Za-z_]\w*=")
_WRAPPER_VALUES = {"env": {"-u", "--unset", "-C", "--chdir"}, "nice": {"-n"},
                   "numactl": {"-N", "-m", "-C", "-p", "-i"},
                   "uv": {"--with", "--with-editable", "--with-requirements", "--python", "-p",
                          "--project", "--directory", "--package", "--extra", "--group",
                          "--env-file", "--index", "--default-index", "--only-group",
                          "--no-group", "--config-file", "--cache-dir"}}  # fmt: skip
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}
_NO_EFFECT = {"cd", "echo", "printf", "wait", "trap", "ulimit", "umask", "shopt", "alias", "hash",
              "type", "pushd", "popd", "sleep", "true", ":", "enable", "builtin", "disown",
              "jobs", "kill", "logger"}  # fmt: skip


def run_command(shell: Shell, argv: list[str], node: Simple, prefix: dict[str, str],
                arrays: list[Assign], bash_argv: list[str]) -> int:  # fmt: skip
    """Interpret one expanded simple command and return its exit status (builtins see the
    words as bash gives them, `bash_argv`; a launch keeps unset values, which `argv` marks)."""
    name = shell.require(argv[0], "the command name")
    if name in _DECLARE:
        return _declare(shell, name, node)
    handler = _BUILTINS.get(name)
    if handler is not None:
        return handler(shell, bash_argv)
    if name in shell.functions:
        return shell.call_function(name, argv[1:])
    if name in _NO_EFFECT:
        return 0
    if node.stdin is not None and _reads_stdin(argv):
        return run_here_document(shell, argv, node.stdin, prefix)
    if name == "sbatch":
        return _sbatch_file(shell, bash_argv, prefix)
    return _external(shell, argv, prefix, outer=())


# sbatch's options that take no value (sbatch(1)); every other option takes one, inline or next.
_SBATCH_SWITCHES = {"-h", "-H", "-I", "-k", "-O", "-Q", "-s", "-v", "-V", "-W", "--exclusive",
                    "--hold", "--overcommit", "--parsable", "--requeue", "--no-requeue", "--wait",
                    "--test-only", "--contiguous", "--spread-job", "--use-min-nodes", "--quiet",
                    "--verbose", "--oversubscribe", "--ignore-pbs", "--help", "--usage"}  # fmt: skip


def _sbatch_file(shell: Shell, argv: list[str], env: dict[str, str]) -> int:
    """`sbatch [options] FILE [args]` (words as bash gives them): FILE runs as a batch job (its
    #SBATCH options first, the command line's after them, so they win), as `sbatch <<EOF` runs
    its here-document."""
    options: list[str] = []
    index = 1
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        options.append(option)
        takes_value = "=" not in option and option not in _SBATCH_SWITCHES
        if takes_value and (len(option) == 2 or option.startswith("--")) and index + 1 < len(argv):
            options.append(argv[index + 1])
            index += 1
        index += 1
    if index >= len(argv) or any(o.startswith("--wrap") for o in options):
        return 0  # no job file: `--wrap` commands are not read
    path = _resolve(shell, argv[index], f"`sbatch {argv[index]}`")
    text = _read(shell, path)
    if shell.depth >= MAX_DEPTH:
        raise shell.fail("scripts call each other too deeply")
    variables = {k: v for k, v in shell.vars.items() if k in shell.exported and isinstance(v, str)}
    variables.update(env)
    child = shell.child(path, argv[index + 1 :], variables)
    child.source_stack = [path]
    start_job(child, sbatch_options(text) + tuple(options))
    return _run_child(child, lambda: child.run_text(text, path), ())


def _external(shell: Shell, argv: list[str], prefix: dict[str, str],
              outer: tuple[tuple[str, ...], ...]) -> int:  # fmt: skip
    words, env = list(argv), dict(prefix)
    while words and (program_name(words[0]) in PASS_THROUGH or words[:2] == ["uv", "run"]):
        wrapper = program_name(words.pop(0))
        if wrapper == "uv":  # `uv run [options] python ...`: runs the rest in its environment
            words.pop(0)
        while words and (words[0].startswith("-") or (wrapper == "env" and _ENV_ASSIGN.match(words[0]))):
            option = words.pop(0)
            if not option.startswith("-"):
                key, _, value = option.partition("=")
                env[key] = value
            elif option in _WRAPPER_VALUES.get(wrapper, ()) and words:
                words.pop(0)
    if not words:
        return 0
    shell_index = _inner_shell(words)
    if shell_index is not None:
        return _child_shell(shell, words, shell_index, env, outer + ((tuple(argv),) if shell_index
                                                                    else ()))  # fmt: skip
    if shell.ctx.is_launch(words):
        visible = {k: v for k, v in shell.vars.items() if k in shell.exported and isinstance(v, str)}
        visible.update(env)
        shell.ctx.commands.append(
            Command(tuple(words), shell.source_stack[-1], shell.line, visible, outer, shell.batch)
        )
    return 0


def _inner_shell(words: list[str]) -> int | None:
    """Return where `bash`/`sh` starts in `words` (directly, or behind srun/mpirun), or None."""
    for index, word in enumerate(words):
        program = program_name(word)
        if program in ("bash", "sh", "dash", "zsh"):
            return index
        if index == 0 and program in ("srun", "mpirun", "mpiexec"):
            continue
        if index and program_name(words[0]) in ("srun", "mpirun", "mpiexec"):
            if not word.startswith("-") and re.match(r"(python[\d.]*|torchrun|deepspeed)$", program):
                return None
            continue
        return None
    return None


def _child_shell(shell: Shell, words: list[str], index: int, env: dict[str, str],
                 outer: tuple[tuple[str, ...], ...]) -> int:  # fmt: skip
    args = words[index + 1 :]
    while args and args[0].startswith("-") and args[0] != "-c":
        args.pop(0)
    if shell.depth >= MAX_DEPTH:
        raise shell.fail("scripts call each other too deeply")
    variables = {k: v for k, v in shell.vars.items() if k in shell.exported and isinstance(v, str)}
    variables.update(env)
    if args and args[0] == "-c":
        if len(args) < 2:
            raise shell.fail("`bash -c` has no command")
        text = args[1]  # unset variables in it stay marked: empty to bash, missing to the model
        if shell.ctx.bash_value(text) is None:
            shell.require(text, "the command of `bash -c`")
        child = shell.child(shell.origin, args[3:], variables)
        child.source_stack = list(shell.source_stack)
        return _run_child(child, lambda: child.run_text(text, shell.source_stack[-1], shell.line,
                                                        fixed=True), outer)  # fmt: skip
    if not args:
        return 0
    path = _resolve(shell, args[0], f"`{program_name(words[index])} {args[0]}`")
    child = shell.child(path, args[1:], variables)
    child.source_stack = [path]
    return _run_child(child, lambda: child.run_text(_read(shell, path), path), outer)


def _run_child(child: Shell, body: object, outer: tuple[tuple[str, ...], ...]) -> int:
    before = len(child.ctx.commands)
    try:
        body()  # type: ignore[operator]
    except Exit:
        pass
    if outer:
        for number in range(before, len(child.ctx.commands)):
            command = child.ctx.commands[number]
            child.ctx.commands[number] = Command(command.argv, command.origin, command.line,
                                                 command.env, outer + command.outer,
                                                 command.batch)  # fmt: skip
    return child.status


def _resolve(shell: Shell, name: str, what: str) -> str:
    if shell.ctx.unset_in(name) or shell.ctx.bash_value(name) is None:
        name = shell.require(name, what)  # a path from an unset variable: ask for it
    name = shell.value(name, what)
    # bash reads a relative name from the working folder (`source $(dirname $0)/common.sh` when
    # the script is named from the repository's root); next to the script is the fallback
    for path in (name, os.path.join(script_dir(shell.ctx), name)):
        if os.path.isfile(path):
            return path
    raise shell.fail(f"{what} reads {name}, which is not a file next to the script")


def _read(shell: Shell, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise shell.fail(f"cannot read {path} ({exc})") from None


def _declare(shell: Shell, name: str, node: Simple) -> int:
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
    path = _resolve(shell, argv[1], f"`{argv[0]} {shell.ctx.show(argv[1])}`")
    saved_line, saved_positional = shell.line, shell.positional
    if len(argv) > 2:
        shell.positional = argv[2:]
    shell.source_stack.append(path)
    try:
        shell.run_text(_read(shell, path), path)
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


_BUILTINS = {
    "unset": _unset, "source": _source, ".": _source, "eval": _eval, "set": _set,
    "shift": _shift, "exit": _exit, "return": _return, "break": _break, "continue": _break,
    "test": _test, "[": _test, "let": _let, "read": _read_builtin, "false": _false,
}  # fmt: skip


class Builtins:
    """The commands as the reader treats them: what Shell calls back for each simple command."""

    def run(self, shell: Shell, argv: list[str], node: Simple, prefix: dict[str, str],
            arrays: list[Assign], bash_argv: list[str]) -> int:  # fmt: skip
        return run_command(shell, argv, node, prefix, arrays, bash_argv)

    def output(self, shell: Shell, script: str) -> str | None:
        return pure_output(shell, script)


def _reads_stdin(argv: list[str]) -> bool:
    """`sbatch <<EOF` (the job script is the here-document), `bash <<EOF`, `sh -s <<EOF`."""
    program = program_name(argv[0])
    if program == "sbatch":
        return True
    return program in ("bash", "sh") and all(word.startswith("-") and word != "-c"
                                             for word in argv[1:])  # fmt: skip


def run_here_document(shell: Shell, argv: list[str], doc: HereDoc, env: dict[str, str]) -> int:
    """Read the script a here-document gives `sbatch` or `bash` (expanded by this shell first,
    unless its delimiter is quoted), in a shell of its own: a batch job for sbatch."""
    text = "\n".join(doc.lines) + "\n"
    if not doc.quoted:
        text = shell.expand_string(parse_fragment(text, shell.source_stack[-1], doc.line))
    if shell.depth >= MAX_DEPTH:
        raise shell.fail("scripts call each other too deeply")
    variables = {k: v for k, v in shell.vars.items() if k in shell.exported and isinstance(v, str)}
    variables.update(env)
    child = shell.child(shell.origin, [], variables)
    child.source_stack = list(shell.source_stack)
    if program_name(argv[0]) == "sbatch":
        start_job(child, tuple(a for a in argv[1:] if a.startswith("-")) + sbatch_options(text))
    return _run_child(child, lambda: child.run_text(text, shell.source_stack[-1], doc.line), ())
