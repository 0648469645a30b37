"""The commands a launch script runs, as the reader treats them: builtins are interpreted
(`export`, `source`, `eval`, `set`, `test`, ...: builtin.py), `bash -c` and `bash FILE` are
followed in a child shell, training launches are recorded, and everything else is skipped as if it
succeeded.
"""

from __future__ import annotations

import re

from inspector.inputs.bash.batch import sbatch_options, start_job
from inspector.inputs.bash.builtin import BUILTINS, declare, read_file, resolve_file
from inspector.inputs.bash.context import PASS_THROUGH, Command, program_name
from inspector.inputs.bash.runtime import MAX_DEPTH, Exit
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
        return declare(shell, name, node)
    handler = BUILTINS.get(name)
    if handler is not None:
        return handler(shell, bash_argv)
    if name in shell.functions:
        return shell.call_function(name, [shell.ctx.unkept(word) for word in argv[1:]])
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
    path = resolve_file(shell, argv[index], f"`sbatch {argv[index]}`")
    text = read_file(shell, path)
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
    words = list(shell.ctx.program_of(words))
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
    path = resolve_file(shell, args[0], f"`{program_name(words[index])} {args[0]}`")
    child = shell.child(path, args[1:], variables)
    child.source_stack = [path]
    return _run_child(child, lambda: child.run_text(read_file(shell, path), path), outer)


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
