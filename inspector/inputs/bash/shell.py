"""Interpret a parsed bash launch script the way bash would, without running anything.

Variables, arrays, quoting and word splitting, `$((..))`, the `${V:-x}` family, `if`/`case`/`for`/
`while` on values the script sets, functions, `source`, `eval` and `bash -c` are followed. Nothing is
ever executed: other commands (`mkdir`, `rm`, `curl`, `sbatch`, ...) are skipped as if they succeeded,
redirections write nothing, and `$(...)` is not run. A value the script does not set (the
environment, `$1`, a command's output) becomes an Unknown marker holding what bash reads (empty for an
unset variable); conditions and arithmetic read that value, and the launch reader names the markers
that reach a modelled argument (inspector.inputs.missing), with how to give them: `--set NAME=VALUE`.
The training commands met on the way are collected as Commands for inspector.inputs.launch. Words are
expanded by Shell's base class (expand.py); what the whole reading shares is in context.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from inspector.errors import InputError
from inspector.inputs.bash.arith import evaluate_arith
from inspector.inputs.bash.assign import Assignments
from inspector.inputs.bash.conditions import evaluate_test
from inspector.inputs.bash.context import Context, Unknown, describe_unknown
from inspector.inputs.bash.parser import read_commands
from inspector.inputs.bash.patterns import Glob, ere
from inspector.inputs.bash.runtime import (
    MAX_DEPTH,
    MAX_LOOPS,
    MAX_RUN_DEPTH,
    MAX_SCRIPT,
    MAX_STEPS,
    Break,
    Exit,
    Return,
    Value,
    WorkExceeded,
)
from inspector.inputs.bash.syntax import (
    AndOr,
    ArithCmd,
    Assign,
    Case,
    CmdSub,
    CondExpr,
    For,
    FuncDef,
    Group,
    If,
    Node,
    Pipeline,
    Seq,
    Simple,
    While,
    Word,
)
from inspector.inputs.bash.words import parse_fragment

_TOO_DEEP = (f"commands, functions, `eval`s and sourced files run more than {MAX_RUN_DEPTH} deep "
             "inside one another; the reader stops there")


class Commands(Protocol):
    """What the shell calls back for simple commands (inspector.inputs.bash.commands gives it)."""

    def run(self, shell: Shell, argv: list[str], node: Simple, prefix: dict[str, str],
            arrays: list[Assign], bash_argv: list[str]) -> int: ...  # fmt: skip
    def output(self, shell: Shell, script: str) -> str | None: ...


class Shell(Assignments):
    """One bash process: its variables, exports, functions and positional parameters."""

    def __init__(self, ctx: Context, commands: Commands, origin: str, positional: list[str],
                 variables: dict[str, Value], exported: set[str], depth: int = 0):  # fmt: skip
        self.ctx, self.commands, self.origin, self.positional = ctx, commands, origin, positional
        self.vars, self.exported = variables, exported
        self.functions: dict[str, Node] = {}
        self.locals: list[dict[str, Value | None]] = []
        self.depth, self.line, self.status = depth, 0, 0
        self.errexit = False  # `set -e`
        self.nounset = False  # `set -u`: an unset variable stops the script
        self.loops = 0  # loops running around the current command
        self.checked = 0  # > 0 while a status is being tested (`if`, `&&`, `!`): -e does not apply
        self.source_stack: list[str] = [origin]
        self.batch: tuple[str, ...] = ()  # the #SBATCH options of the job it runs in

    # -------------------------------------------------------------------------- errors

    def fail(self, message: str) -> InputError:
        return InputError(f"{self.source_stack[-1]} line {self.line}: {message}")

    def require(self, text: str, what: str) -> str:
        """Return `text`, or raise naming the unknown value it holds (`what` says where it is used)."""
        unknown = self.ctx.unknown_in(text)
        if unknown is None:
            return text
        raise self.fail(describe_unknown(unknown, what, self.ctx.show(text)))

    # -------------------------------------------------------------------------- running

    def run_text(self, text: str, origin: str, first_line: int = 1, fixed: bool = False) -> None:
        """Read and run bash text one top-level command at a time, as bash does."""
        if len(text) > MAX_SCRIPT:
            where = f"{self.source_stack[-1]} line {self.line}" if self.line else origin
            raise InputError(f"{where}: {origin} holds {len(text)} characters; the reader reads "
                             f"at most {MAX_SCRIPT}")  # fmt: skip
        self.ctx.depth += 1
        try:
            if self.ctx.depth > MAX_RUN_DEPTH:
                raise self.fail(_TOO_DEEP)
            for node, background in read_commands(text, origin, first_line, fixed):
                self.status = self._subshell(node) if background else self.run(node)
        finally:
            self.ctx.depth -= 1

    def run(self, node: Node) -> int:
        if isinstance(node, Simple):
            try:
                self.status = self._run_simple(node)
            except WorkExceeded as exceeded:
                raise self.fail(f"{exceeded.what}; the reader stops there") from None
            return self.status
        if isinstance(node, Seq):
            self.status = self._run_seq(node)
            return self.status
        self.ctx.depth += 1
        try:
            if self.ctx.depth > MAX_RUN_DEPTH:
                raise self.fail(_TOO_DEEP)
            self.status = getattr(self, "_run_" + type(node).__name__.lower())(node)
        except WorkExceeded as exceeded:
            raise self.fail(f"{exceeded.what}; the reader stops there") from None
        finally:
            self.ctx.depth -= 1
        return self.status

    def _run_seq(self, node: Seq) -> int:
        status = 0
        for item, background in node.items:
            status = self._subshell(item) if background else self.run(item)
        return status

    def _run_andor(self, node: AndOr) -> int:
        assumed = self.ctx.assumed
        status, reads = self._test(node.first)
        for number, (op, item) in enumerate(node.rest, 1):
            if (op == "&&") == (status == 0):
                if number == len(node.rest):  # `[ -z $X ] && exit 1`: the test decided the exit
                    return self._guarded(reads, item)
                status = self.tested(item)
            elif self.ctx.assumed > assumed:  # `[ -d DIR ] || python convert.py ...`
                self.skipped(item)
        return status

    def _test(self, node: Node) -> tuple[int, tuple[str, ...]]:
        """Run a tested command; return its status and the unset names it read."""
        outer, self.ctx.reading = self.ctx.reading, []
        try:
            status = self.tested(node)
        finally:
            reads, self.ctx.reading = self.ctx.reading, outer
            if outer is not None:
                outer.extend(name for name in reads if name not in outer)
        return status, tuple(reads)

    def _guarded(self, reads: tuple[str, ...], node: Node) -> int:
        """Run the branch a test chose; an `exit` in it keeps ctx.guard, what the test read."""
        guard, self.ctx.guard = self.ctx.guard, reads or self.ctx.guard
        status = self.run(node)
        self.ctx.guard = guard
        return status

    def _run_pipeline(self, node: Pipeline) -> int:
        status = 0
        self.checked += node.negate
        try:
            for item in node.commands:
                status = self._subshell(item) if len(node.commands) > 1 else self.run(item)
        finally:
            self.checked -= node.negate
        status = int(status == 0) if node.negate else status
        return self.check(status, "the pipeline") if len(node.commands) > 1 else status

    def tested(self, node: Node) -> int:
        """Run a command whose status is tested (`set -e` does not stop the script there)."""
        self.checked += 1
        try:
            return self.run(node)
        finally:
            self.checked -= 1

    def check(self, status: int, what: str) -> int:
        """Stop the shell as `set -e` does when a command fails where its status is not tested."""
        if status and self.errexit and not self.checked:
            self.status = status
            raise Exit(f"{self.source_stack[-1]} line {self.line}: {what} fails (status {status}) "
                       "under `set -e`")  # fmt: skip
        return status

    def _subshell(self, node: Node) -> int:
        child = self.fork()
        try:
            return child.run(node)
        except (Exit, Break, Return):  # they end the subshell only
            return child.status

    def child(self, origin: str, positional: list[str], variables: Mapping[str, str]) -> Shell:
        """Return a new bash process started by this one (`bash -c`, `bash FILE`)."""
        child = Shell(self.ctx, self.commands, origin, positional, dict(variables), set(variables),
                      self.depth + 1)  # fmt: skip
        child.line, child.batch = self.line, self.batch
        return child

    def fork(self) -> Shell:
        """Return a copy for a subshell: its assignments do not come back."""
        variables = {k: dict(v) if isinstance(v, dict) else v for k, v in self.vars.items()}
        child = Shell(self.ctx, self.commands, self.origin, self.positional, variables,
                      set(self.exported), self.depth)  # fmt: skip
        child.functions = dict(self.functions)
        child.line, child.source_stack = self.line, list(self.source_stack)
        child.errexit, child.checked, child.nounset = self.errexit, self.checked, self.nounset
        child.batch = self.batch
        return child

    def _run_group(self, node: Group) -> int:
        if node.subshell:
            return self.check(self._subshell(node.body), "the subshell `( ... )`")
        return self.run(node.body)

    def _run_funcdef(self, node: FuncDef) -> int:
        self.functions[node.name] = node.body
        return 0

    def _run_if(self, node: If) -> int:
        for number, (cond, body) in enumerate(node.clauses):
            assumed = self.ctx.assumed
            status, reads = self._test(cond)
            if status == 0:
                if self.ctx.assumed > assumed:  # `if [ -d DIR ]; then ...; else convert; fi`
                    for _, other in node.clauses[number + 1:]:
                        self.skipped(other)
                    if node.otherwise:
                        self.skipped(node.otherwise)
                return self._guarded(reads, body)
            if self.ctx.assumed > assumed:  # `if [[ ! -d DIR ]]; then convert; fi`
                self.skipped(body)
        return self.run(node.otherwise) if node.otherwise else 0

    def skipped(self, body: Node) -> None:
        """Record in ctx.skipped the launches of a branch that a file test taken as true
        skipped: what the script runs where the file is missing. The branch runs in a subshell
        with the launches set aside; nothing else it does is kept, and where it fails it simply
        stops. Branches inside it are not read again (each branch at most once more)."""
        ctx = self.ctx
        if ctx.dry:
            return
        kept = (ctx.commands, list(ctx.notes), dict(ctx.unset_read), ctx.ended, ctx.taint)
        ctx.commands, ctx.dry = [], True
        try:
            self._subshell(body)
        except InputError:
            pass
        finally:
            ctx.skipped.extend(ctx.commands)
            ctx.commands, notes, ctx.unset_read, ctx.ended, ctx.taint = kept
            ctx.notes[:] = notes
            ctx.dry = False

    def condition(self, cond: Seq) -> int:
        return self.tested(cond)

    def _run_case(self, node: Case) -> int:
        self.line = node.line
        subject = self.value(self.expand_string(node.word), "the `case` word")
        for patterns, body in node.items:
            for pattern in patterns:
                glob = self.pattern(pattern, "a `case` pattern") or Glob(())
                if glob.fullmatch(subject, self.ctx.matching):
                    return self.run(body)
        return 0

    def _run_for(self, node: For) -> int:
        self.line = node.line
        if node.words is None:
            values = self._positional("@")
        else:
            values = [v for w in node.words for v in self.expand_fields(w, as_bash=True)]
        status = 0
        for value in values:
            self.assign(node.name, value)
            status, stop = self._turn(node.body)
            if stop:
                break
        return status

    def _turn(self, body: Seq) -> tuple[int, bool]:
        """Run a loop's body once; return its status and whether `break` ends the loop."""
        self.loops += 1
        try:
            return self.run(body), False
        except Break as brk:
            if brk.levels > 1 and self.loops > 1:  # `break 2`: the loop around this one too
                raise Break(brk.levels - 1, brk.cont) from None
            return 0, not brk.cont
        finally:
            self.loops -= 1

    def _run_while(self, node: While) -> int:
        status = 0
        for _ in range(MAX_LOOPS):
            self.line = node.line
            if (self.condition(node.cond) == 0) == node.until:
                return status
            status, stop = self._turn(node.body)
            if stop:
                return status
        self.line = node.line
        raise self.fail(f"a loop ran {MAX_LOOPS} times; the reader stops there")

    def _run_condexpr(self, node: CondExpr) -> int:
        self.line = node.line
        operands: list[tuple[str, Glob | str | None]] = []
        for number, word in enumerate(node.words):
            text = self.expand_string(word)
            if number and node.words[number - 1].literal() == "=~":
                pieces = self._pieces(word.parts, quoted=False)
                regex = "".join(re.escape(p.text) if p.quoted else p.text for p in pieces)
                operands.append((text, ere(regex)))
                continue
            operands.append((text, self.pattern(word, "a `[[ ]]` test", strict=False)))
        return self.check(evaluate_test(operands, double=True, shell=self), "the test `[[ ]]`")

    def _run_arithcmd(self, node: ArithCmd) -> int:
        self.line = node.line
        return self.check(int(self.arith(node.body) == 0), f"`(({node.body.raw}))`")

    def arith(self, body: Word) -> int:
        text = self.expand_string(body)
        text = self.value(text, f"the arithmetic $(({self.ctx.show(text)}))")
        return evaluate_arith(text, self)

    # ---------------------------------------------------------------------- simple commands

    def _run_simple(self, node: Simple) -> int:
        self.line = node.line
        self.ctx.steps += 1
        if self.ctx.steps > MAX_STEPS:
            raise self.fail(f"the script runs more than {MAX_STEPS} commands; the reader stops")
        fields: list[tuple[str, bool]] = []
        arrays = []
        for word in node.words:
            if isinstance(word, Assign):
                arrays.append(word)
            else:
                fields.extend(self.split_word(word))
        while fields and fields[0][1]:  # `$LAUNCHER torchrun ...` with LAUNCHER unset
            fields.pop(0)
        if not fields:
            for assign in node.assigns:
                self.do_assign(assign)
            return 0
        # the launch keeps unset values (a flag's value the model may need); bash drops them,
        # unless a quoted part keeps the word (`"$X"`, `""$X`): one empty word, marked as such
        argv = [text if vanishes or not self.ctx.is_unset(text) else self.ctx.kept(text)
                for text, vanishes in fields]  # fmt: skip
        if argv[0] in ("[", "test"):  # `[ -z $1 ]`: the vanished word still decides the test
            for text, _ in (field for field in fields if field[1]):
                for unknown in self.ctx.held(text):
                    if unknown.hint is not None:
                        self._read_unset(unknown.text, unknown.hint)
        bash_argv = [text for text, vanishes in fields if not vanishes]
        prefix = {a.name: self.expand_string(a.value) for a in node.assigns if a.value}
        status = self.commands.run(self, argv, node, prefix, arrays, bash_argv)
        return self.check(status, f"`{_brief(self.ctx.show(' '.join(argv)))}`")

    def command_substitution(self, part: CmdSub) -> str:
        output = self.commands.output(self, part.script)
        if output is not None:
            return output
        self.ctx.note(f"{self.where()}: {part.text} is not run; it stands as a placeholder, "
                      "which only a path or a port may hold")  # fmt: skip
        return self.ctx.mark(Unknown(part.text, "which the reader never runs", None))

    def index_of(self, text: str) -> int:
        word = parse_fragment(text, self.source_stack[-1], self.line)
        return self.arith(word)

    def call_function(self, name: str, args: list[str]) -> int:
        if len(self.locals) >= MAX_DEPTH:
            raise self.fail(f"the function {name} calls itself too deeply")
        saved = self.positional
        self.positional = args
        self.locals.append({})
        try:
            return self.run(self.functions[name])
        except Return:
            return self.status
        finally:
            for var, old in self.locals.pop().items():
                if old is None:
                    self.vars.pop(var, None)
                else:
                    self.vars[var] = old
            self.positional = saved


def _brief(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
