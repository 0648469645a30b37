"""Interpret a parsed bash launch script the way bash would, without running anything.

Variables, arrays, quoting and word splitting, `$((..))`, the `${V:-x}` family, `if`/`case`/`for`/
`while` on values the script sets, functions, `source`, `eval` and `bash -c` are followed. Nothing is
ever executed: other commands (`mkdir`, `rm`, `curl`, `sbatch`, ...) are skipped as if they succeeded,
redirections write nothing, and `$(...)` is not run. A value the script does not set (the
environment, `$1`, a command's output) becomes an Unknown marker; it is an error only where it matters
(a condition, arithmetic, a modelled argument), and the error says how to give it: `--set NAME=VALUE`.
The training commands met on the way are collected as Commands for inspector.launch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from inspector.errors import InputError
from inspector.shellarith import evaluate_arith
from inspector.shellast import (
    DQ,
    AndOr,
    Arith,
    ArithCmd,
    Assign,
    Case,
    CmdSub,
    CondExpr,
    For,
    FuncDef,
    Group,
    If,
    Lit,
    Node,
    Param,
    Part,
    Pipeline,
    Seq,
    Simple,
    While,
    Word,
)
from inspector.shellparse import parse_script
from inspector.shelltest import evaluate_test, glob_regex

MARK = re.compile("\x00(\\d+)\x00")
_MAX_DEPTH = 32
_MAX_LOOPS = 10_000
_MAX_STEPS = 200_000  # commands run in all, so that no script keeps the reader busy for long
_MAX_VALUE = 1 << 20  # characters in one variable
_MAX_ELEMENTS = 1 << 14  # elements in one array
Value = str | dict[int, str]


@dataclass(frozen=True)
class Unknown:
    """A value the script does not determine: shown as `text`, given with `--set hint=VALUE`."""

    text: str  # `$HIDDEN`, `$1`, `$(cat layers.txt)`
    reason: str  # "which the script never sets"
    hint: str | None  # the name for --set, or None when only a flag can give it


@dataclass(frozen=True)
class Command:
    """One command the script runs (after expansion), with where it is and the variables it sees."""

    argv: tuple[str, ...]
    origin: str
    line: int
    env: Mapping[str, str]  # exported variables and the command's own NAME=value prefixes
    outer: tuple[tuple[str, ...], ...] = ()  # `srun ... bash -c "..."` around it, outermost first

    @property
    def observed(self) -> tuple[str, ...]:
        """The command as bash starts it (the outermost launcher's argv)."""
        return self.outer[0] if self.outer else self.argv


@dataclass
class Context:
    """What the whole reading shares: unknown markers, the commands met, the main script."""

    script: str
    settings: Mapping[str, str]
    unknowns: list[Unknown] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    steps: int = 0

    def mark(self, unknown: Unknown) -> str:
        self.unknowns.append(unknown)
        return f"\x00{len(self.unknowns) - 1}\x00"

    def unknown_in(self, text: str) -> Unknown | None:
        match = MARK.search(text)
        return self.unknowns[int(match.group(1))] if match else None

    def show(self, text: str) -> str:
        return MARK.sub(lambda m: self.unknowns[int(m.group(1))].text, text)


class _Exit(Exception):
    pass


class _Return(Exception):
    pass


class _Break(Exception):
    def __init__(self, levels: int, cont: bool):
        self.levels, self.cont = levels, cont


@dataclass
class _Piece:
    text: str
    quoted: bool
    brk: bool = False  # a field boundary between "${A[@]}" elements


class Shell:
    """One bash process: its variables, exports, functions and positional parameters."""

    def __init__(self, ctx: Context, origin: str, positional: list[str],
                 variables: dict[str, Value], exported: set[str], depth: int = 0):  # fmt: skip
        self.ctx, self.origin, self.positional = ctx, origin, positional
        self.vars, self.exported = variables, exported
        self.functions: dict[str, Node] = {}
        self.locals: list[dict[str, Value | None]] = []
        self.depth, self.line, self.status = depth, 0, 0
        self.source_stack: list[str] = [origin]

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
        self.run(parse_script(text, origin, first_line, fixed))

    def run(self, node: Node) -> int:
        method = getattr(self, "_run_" + type(node).__name__.lower())
        self.status = method(node)
        return self.status

    def _run_seq(self, node: Seq) -> int:
        status = 0
        for item, background in node.items:
            status = self._subshell(item) if background else self.run(item)
        return status

    def _run_andor(self, node: AndOr) -> int:
        status = self.run(node.first)
        for op, item in node.rest:
            if (op == "&&") == (status == 0):
                status = self.run(item)
        return status

    def _run_pipeline(self, node: Pipeline) -> int:
        status = 0
        for item in node.commands:
            status = self._subshell(item) if len(node.commands) > 1 else self.run(item)
        return int(status == 0) if node.negate else status

    def _subshell(self, node: Node) -> int:
        child = self.fork()
        try:
            return child.run(node)
        except _Exit:
            return child.status

    def fork(self) -> Shell:
        """Return a copy for a subshell: its assignments do not come back."""
        variables = {k: dict(v) if isinstance(v, dict) else v for k, v in self.vars.items()}
        child = Shell(self.ctx, self.origin, self.positional, variables, set(self.exported),
                      self.depth)  # fmt: skip
        child.functions = dict(self.functions)
        child.line, child.source_stack = self.line, list(self.source_stack)
        return child

    def _run_group(self, node: Group) -> int:
        return self._subshell(node.body) if node.subshell else self.run(node.body)

    def _run_funcdef(self, node: FuncDef) -> int:
        self.functions[node.name] = node.body
        return 0

    def _run_if(self, node: If) -> int:
        for cond, body in node.clauses:
            if self.condition(cond) == 0:
                return self.run(body)
        return self.run(node.otherwise) if node.otherwise else 0

    def condition(self, cond: Seq) -> int:
        return self.run(cond)

    def _run_case(self, node: Case) -> int:
        self.line = node.line
        subject = self.require(self.expand_string(node.word), "the `case` word")
        for patterns, body in node.items:
            for pattern in patterns:
                regex = self.pattern(pattern, "a `case` pattern") or ""
                if re.fullmatch(regex, subject, re.S):
                    return self.run(body)
        return 0

    def _run_for(self, node: For) -> int:
        self.line = node.line
        if node.words is None:
            values = self._positional("@")
        else:
            values = [v for w in node.words for v in self.expand_fields(w)]
        status = 0
        for value in values:
            self.assign(node.name, value)
            try:
                status = self.run(node.body)
            except _Break as brk:
                if brk.levels > 1:
                    raise _Break(brk.levels - 1, brk.cont) from None
                if not brk.cont:
                    break
        return status

    def _run_while(self, node: While) -> int:
        status = 0
        for _ in range(_MAX_LOOPS):
            self.line = node.line
            if (self.condition(node.cond) == 0) == node.until:
                return status
            try:
                status = self.run(node.body)
            except _Break as brk:
                if brk.levels > 1:
                    raise _Break(brk.levels - 1, brk.cont) from None
                if not brk.cont:
                    return status
        self.line = node.line
        raise self.fail(f"a loop ran {_MAX_LOOPS} times; the reader stops there")

    def _run_condexpr(self, node: CondExpr) -> int:
        self.line = node.line
        operands: list[tuple[str, str | None]] = []
        for number, word in enumerate(node.words):
            text = self.expand_string(word)
            if number and node.words[number - 1].literal() == "=~":
                pieces = self._pieces(word.parts, quoted=False)
                regex = "".join(re.escape(p.text) if p.quoted else p.text for p in pieces)
                operands.append((text, regex))
                continue
            operands.append((text, self.pattern(word, "a `[[ ]]` test", strict=False)))
        return evaluate_test(operands, double=True, shell=self)

    def _run_arithcmd(self, node: ArithCmd) -> int:
        self.line = node.line
        return int(self.arith(node.body) == 0)

    def arith(self, body: Word) -> int:
        text = self.expand_string(body)
        self.require(text, f"the arithmetic $(({self.ctx.show(text)}))")
        return evaluate_arith(text, self)

    # ---------------------------------------------------------------------- simple commands

    def _run_simple(self, node: Simple) -> int:
        self.line = node.line
        self.ctx.steps += 1
        if self.ctx.steps > _MAX_STEPS:
            raise self.fail(f"the script runs more than {_MAX_STEPS} commands; the reader stops")
        argv, arrays = [], []
        for word in node.words:
            if isinstance(word, Assign):
                arrays.append(word)
            else:
                argv.extend(self.expand_fields(word))
        if not argv:
            for assign in node.assigns:
                self.do_assign(assign)
            return 0
        prefix = {a.name: self.expand_string(a.value) for a in node.assigns if a.value}
        from inspector.shellcmds import run_command

        return run_command(self, argv, node, prefix, arrays)

    def do_assign(self, assign: Assign, local: bool = False) -> None:
        self.line = assign.line or self.line
        if local:
            self.make_local(assign.name)
        if assign.array is not None:
            elements = [v for w in assign.array for v in self.expand_fields(w)]
            old = self.vars.get(assign.name) if assign.append else None
            base = _as_array(old) if old is not None else {}
            start = max(base) + 1 if base else 0
            base.update({start + i: v for i, v in enumerate(elements)})
            if len(base) > _MAX_ELEMENTS or sum(len(v) for v in base.values()) > _MAX_VALUE:
                raise self.fail(f"the array {assign.name} grows past {_MAX_ELEMENTS} elements "
                                f"or {_MAX_VALUE} characters")  # fmt: skip
            self.vars[assign.name] = base
            return
        assert assign.value is not None
        value = self.expand_string(assign.value)
        if MARK.search(value) and CmdSub in _part_types(assign.value):
            given = self.ctx.settings.get(assign.name)
            value = given if given is not None else self._command_output(assign, value)
        if assign.index is not None:
            array = _as_array(self.vars.get(assign.name, {}))
            index = self.index_of(assign.index)
            array[index] = (array.get(index, "") + value) if assign.append else value
            if len(array[index]) > _MAX_VALUE or len(array) > _MAX_VALUE:
                raise self.fail(f"the array {assign.name} grows past {_MAX_VALUE} characters")
            self.vars[assign.name] = array
        elif assign.append:
            old = self.vars.get(assign.name)
            before = old.get(0, "") if isinstance(old, dict) else (old or "")
            self.assign(assign.name, before + value)
        else:
            self.assign(assign.name, value)

    def _command_output(self, assign: Assign, value: str) -> str:
        unknown = self.ctx.unknown_in(value)
        assert unknown is not None
        return self.ctx.mark(
            Unknown(f"${assign.name}",
                    f"set on line {self.line} from {unknown.text}, which the reader never runs",
                    assign.name)  # fmt: skip
        )

    def assign(self, name: str, value: str) -> None:
        if name == "IFS":
            raise self.fail("the script changes IFS; the reader splits words on blanks only")
        if len(value) > _MAX_VALUE:
            raise self.fail(f"{name} grows past {_MAX_VALUE} characters")
        old = self.vars.get(name)
        if isinstance(old, dict):
            old[0] = value
        else:
            self.vars[name] = value

    def make_local(self, name: str) -> None:
        if self.locals and name not in self.locals[-1]:
            self.locals[-1][name] = self.vars.get(name)

    def index_of(self, text: str) -> int:
        word = parse_script_word(text, self)
        return self.arith(word)

    def call_function(self, name: str, args: list[str]) -> int:
        if len(self.locals) >= _MAX_DEPTH:
            raise self.fail(f"the function {name} calls itself too deeply")
        saved = self.positional
        self.positional = args
        self.locals.append({})
        try:
            return self.run(self.functions[name])
        except _Return:
            return self.status
        finally:
            for var, old in self.locals.pop().items():
                if old is None:
                    self.vars.pop(var, None)
                else:
                    self.vars[var] = old
            self.positional = saved

    # ------------------------------------------------------------------------- expansion

    def expand_fields(self, word: Word) -> list[str]:
        """Expand a word to fields: braces first, then bash's word splitting of expansions."""
        from inspector.shellbrace import expand_braces

        words = expand_braces(word)
        if len(words) > 1:
            return [field for each in words for field in self._split_fields(each)]
        return self._split_fields(word)

    def _split_fields(self, word: Word) -> list[str]:
        fields: list[str] = []
        current: str | None = None
        for piece in self._pieces(word.parts, quoted=False):
            if piece.brk:
                if current is not None:
                    fields.append(current)
                current = None
            elif piece.quoted:
                current = (current or "") + piece.text
            elif piece.text:
                chunks = re.split(r"[ \t\n]+", piece.text)
                for number, chunk in enumerate(chunks):
                    if number and current is not None:
                        fields.append(current)
                        current = None
                    if chunk:
                        current = (current or "") + chunk
        if current is not None:
            fields.append(current)
        return fields

    def expand_string(self, word: Word | None) -> str:
        """Expand a word without splitting (assignments, `case` and `[[ ]]` operands)."""
        if word is None:
            return ""
        return "".join(" " if p.brk else p.text for p in self._pieces(word.parts, quoted=True))

    def pattern(self, word: Word, what: str, strict: bool = True) -> str | None:
        """Return a regex for a glob pattern word (quoted parts literal)."""
        pieces = self._pieces(word.parts, quoted=False)
        text = "".join(p.text for p in pieces)
        if MARK.search(text):
            if not strict:
                return None
            self.require(text, what)
        return glob_regex([(p.text, p.quoted) for p in pieces if not p.brk])

    def _pieces(self, parts: tuple[Part, ...], quoted: bool) -> list[_Piece]:
        out: list[_Piece] = []
        for part in parts:
            if isinstance(part, Lit):
                out.append(_Piece(part.text, quoted or part.quoted))
            elif isinstance(part, DQ):
                if not any(_is_at(p) for p in part.parts):
                    out.append(_Piece("", True))
                out.extend(self._pieces(part.parts, quoted=True))
            elif isinstance(part, Param):
                out.extend(self._param(part, quoted))
            elif isinstance(part, Arith):
                out.append(_Piece(str(self.arith(part.body)), quoted))
            elif isinstance(part, CmdSub):
                out.append(_Piece(self._command_substitution(part), quoted))
        return out

    def _command_substitution(self, part: CmdSub) -> str:
        from inspector.shellcmds import pure_output

        output = pure_output(self, part.script)
        if output is not None:
            return output
        return self.ctx.mark(Unknown(part.text, "which the reader never runs", None))

    def lookup(self, name: str, index: str | None) -> list[str] | None:
        """Return the values of NAME (one for a scalar), or None when it is not set."""
        if name.isdigit() or name in "@*#":
            return self._special(name)
        if name == "BASH_SOURCE":
            return [self.source_stack[-1]]
        value = self.vars.get(name)
        if value is None:
            return None
        if index in ("@", "*"):
            return [value[k] for k in sorted(value)] if isinstance(value, dict) else [value]
        position = self.index_of(index) if index is not None else 0
        if isinstance(value, dict):
            if position < 0 and value:
                position += max(value) + 1
            return [value[position]] if position in value else None
        return [value] if position == 0 else None

    def _special(self, name: str) -> list[str] | None:
        if name == "0":
            return [self.ctx.script]
        if name == "#":
            return [str(len(self.positional))]
        if name in "@*":
            return list(self.positional)
        number = int(name)
        return [self.positional[number - 1]] if number <= len(self.positional) else None

    def _positional(self, name: str) -> list[str]:
        return self._special(name) or []

    def _param(self, part: Param, quoted: bool) -> list[_Piece]:
        name, op, index = part.name, part.op, part.index
        if name in "$!?-" and len(name) == 1:
            return [_Piece(self.ctx.mark(Unknown(f"${name}", "which only a running shell knows",
                                                 None)), quoted)]  # fmt: skip
        values = self.lookup(name, index)
        is_set = values is not None
        if op == "len":
            if index in ("@", "*"):
                return [_Piece(str(len(values or [])), quoted)]
            return [_Piece(str(len(values[0]) if values else 0), quoted)]
        if values is None and op in ("", "#", "##", "%", "%%", "/", "//", ":", "^^", ",,", "^", ","):
            values = [self._unset(part)]
        elif op in (":-", "-", ":=", "=", ":+", "+", ":?", "?"):
            null = not is_set or (op.startswith(":") and values == [""])
            if op in (":-", "-") and null:
                return self._pieces(part.arg.parts, quoted) if part.arg else []
            if op in (":=", "=") and null:
                value = self.expand_string(part.arg)
                self.assign(name, value)
                values = [value]
            elif op in (":+", "+"):
                if null:
                    return []
                return self._pieces(part.arg.parts, quoted) if part.arg else []
            elif op in (":?", "?") and null:
                given = f"; give it with --set {name}=VALUE" if not name.isdigit() else ""
                raise self.fail(f"{part.text} stops the script when {name} is not set, and the "
                                f"script never sets it{given}")  # fmt: skip
        assert values is not None
        if op == ":" and (index in ("@", "*") or name in ("@", "*")):
            values = self._slice(part, values)
        else:
            values = [self._transform(part, v) for v in values]
        if index == "@" or name == "@":
            return _join_fields(values, quoted)
        if index == "*" or name == "*":
            return [_Piece(" ".join(values), quoted)] if quoted else _join_fields(values, False)
        return [_Piece(values[0], quoted)]

    def _unset(self, part: Param) -> str:
        if part.name == "HOME" and part.text == "~":
            return self.ctx.mark(Unknown("~ (the home folder)", "which the job's user decides",
                                         "HOME"))  # fmt: skip
        if part.name.isdigit():
            reason = "which the script gets from its command line"
        else:
            reason = "which the script never sets"
        return self.ctx.mark(Unknown(part.text, reason, part.name))

    def _transform(self, part: Param, value: str) -> str:
        op = part.op
        if op in ("", ":-", "-", ":=", "=", ":+", "+", ":?", "?"):
            return value
        if MARK.search(value):
            unknown = self.ctx.unknown_in(value)
            assert unknown is not None
            return self.ctx.mark(Unknown(part.text, f"where {unknown.text} is {unknown.reason}",
                                         unknown.hint))  # fmt: skip
        if op == "^^":
            return value.upper()
        if op == ",,":
            return value.lower()
        if op == "^":
            return value[:1].upper() + value[1:]
        if op == ",":
            return value[:1].lower() + value[1:]
        if op == ":":
            return self._substring(part, value)
        assert part.arg is not None
        regex = self.pattern(part.arg, part.text) or ""
        if op in ("#", "##"):
            ends = range(len(value) + 1) if op == "#" else range(len(value), -1, -1)
            for end in ends:
                if re.fullmatch(regex, value[:end], re.S):
                    return value[end:]
            return value
        if op in ("%", "%%"):
            starts = range(len(value), -1, -1) if op == "%" else range(len(value) + 1)
            for start in starts:
                if re.fullmatch(regex, value[start:], re.S):
                    return value[:start]
            return value
        replacement = self.expand_string(part.arg2)
        if not regex:
            return value
        anchored = regex
        if part.arg and part.arg.raw.startswith(("#", "%")):
            raise self.fail(f"the expansion {part.text} is not supported")
        count = 0 if op == "//" else 1
        return re.sub(f"(?s:{anchored})", lambda _m: replacement, value, count=count)

    def _slice(self, part: Param, values: list[str]) -> list[str]:
        """`${A[@]:offset:length}` and `${@:offset:length}`: a slice of the elements."""
        offset = self.arith(part.arg) if part.arg else 0
        if part.name == "@" and offset > 0:
            offset -= 1  # `${@:1}` starts at $1
        elif part.name == "@" and offset == 0:
            values = [self.ctx.script, *values]
        if offset < 0:
            offset = max(len(values) + offset, 0)
        if part.arg2 is None:
            return values[offset:]
        length = self.arith(part.arg2)
        if length < 0:
            raise self.fail(f"{part.text}: a negative length of a slice is not supported")
        return values[offset : offset + length]

    def _substring(self, part: Param, value: str) -> str:
        offset = self.arith(part.arg) if part.arg else 0
        if offset < 0:
            offset = max(len(value) + offset, 0)
        if part.arg2 is None:
            return value[offset:]
        length = self.arith(part.arg2)
        end = offset + length if length >= 0 else len(value) + length
        return value[offset:end]


def _join_fields(values: list[str], quoted: bool) -> list[_Piece]:
    pieces: list[_Piece] = []
    for number, value in enumerate(values):
        if number:
            pieces.append(_Piece("", quoted, brk=True))
        pieces.append(_Piece(value, quoted))
    return pieces


def _is_at(part: Part) -> bool:
    return isinstance(part, Param) and (part.name == "@" or part.index == "@") and part.op != "len"


def _as_array(value: Value | None) -> dict[int, str]:
    if isinstance(value, dict):
        return value
    return {0: value} if value is not None else {}


def _part_types(word: Word) -> set[type]:
    found: set[type] = set()

    def visit(parts: tuple[Part, ...]) -> None:
        for part in parts:
            found.add(type(part))
            if isinstance(part, DQ):
                visit(part.parts)
            elif isinstance(part, Param) and part.arg is not None:
                visit(part.arg.parts)

    visit(word.parts)
    return found


def parse_script_word(text: str, shell: Shell) -> Word:
    from inspector.shelllex import Lexer

    lexer = Lexer(text, shell.source_stack[-1], shell.line, fixed_line=True)
    return Word(tuple(lexer._read_dquoted(end=None)), text, shell.line)


def describe_unknown(unknown: Unknown, what: str, shown: str | None = None) -> str:
    """One sentence: where an unknown value is used, why it is unknown, how to give it."""
    if unknown.hint is None:
        how = "give the value with its own flag instead"
    elif unknown.hint.isdigit():
        how = f"give it with --set {unknown.hint}=VALUE (positional parameters are --set 1=..., 2=...)"
    else:
        how = f"give it with --set {unknown.hint}=VALUE"
    if shown is not None and shown != unknown.text:
        return f"{what} is {shown}, where {unknown.text} is a value {unknown.reason}; {how}"
    return f"{what} is {unknown.text}, {unknown.reason}; {how}"


def new_shell(ctx: Context, origin: str) -> Shell:
    """Return the main script's shell: --set values are its environment (exported)."""
    positional_keys = sorted(int(k) for k in ctx.settings if k.isdigit())
    positional: list[str] = []
    if positional_keys:
        positional = [ctx.settings.get(str(n), "") for n in range(1, max(positional_keys) + 1)]
    variables: dict[str, Value] = {k: v for k, v in ctx.settings.items() if not k.isdigit()}
    return Shell(ctx, origin, positional, variables, set(variables))


def script_dir(ctx: Context) -> str:
    return os.path.dirname(os.path.abspath(ctx.script))
