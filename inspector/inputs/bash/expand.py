"""Bash's expansion of words (Shell's base class): braces, parameters, arithmetic, `$(..)`, fields."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inspector.inputs.bash.brace import expand_braces
from inspector.inputs.bash.context import MARK, Context, Unknown
from inspector.inputs.bash.patterns import Glob
from inspector.inputs.bash.runtime import Exit, Value
from inspector.inputs.bash.syntax import DQ, Arith, CmdSub, Lit, Param, Part, Word

if TYPE_CHECKING:
    from inspector.errors import InputError


@dataclass
class _Piece:
    text: str
    quoted: bool
    brk: bool = False  # a field boundary between "${A[@]}" elements


class Expansion:
    """Expand words as bash does; Shell, which runs the script, holds the variables it reads."""

    ctx: Context
    vars: dict[str, Value]
    positional: list[str]
    source_stack: list[str]
    line: int
    nounset: bool
    status: int  # the last command's exit status, as the reader takes it

    if TYPE_CHECKING:  # Shell's, which expansion calls back into

        def fail(self, message: str) -> InputError: ...
        def require(self, text: str, what: str) -> str: ...
        def arith(self, body: Word) -> int: ...
        def assign(self, name: str, value: str) -> None: ...
        def index_of(self, text: str) -> int: ...
        def command_substitution(self, part: CmdSub) -> str: ...

    def expand_fields(self, word: Word, as_bash: bool = False) -> list[str]:
        """Expand a word to fields: braces first, then bash's word splitting of expansions.

        An unquoted unset variable stays as a field (a flag's value the model may need), unless
        `as_bash`: then it vanishes, as in bash."""
        return [text for text, vanishes in self.split_word(word) if not (as_bash and vanishes)]

    def split_word(self, word: Word) -> list[tuple[str, bool]]:
        """Return a word's fields, each with whether bash drops it (only unquoted unset values)."""
        words = expand_braces(word)
        return [field for each in words for field in self._split_fields(each)]

    def _split_fields(self, word: Word) -> list[tuple[str, bool]]:
        fields: list[tuple[str, bool]] = []
        current: str | None = None
        quoted = False
        for piece in self._pieces(word.parts, quoted=False):
            if piece.brk:
                if current is not None:
                    fields.append((current, not quoted and self.ctx.is_unset(current)))
                current, quoted = None, False
            elif piece.quoted:
                current, quoted = (current or "") + piece.text, True
            elif piece.text:
                chunks = re.split(r"[ \t\n]+", piece.text)
                for number, chunk in enumerate(chunks):
                    if number and current is not None:
                        fields.append((current, not quoted and self.ctx.is_unset(current)))
                        current, quoted = None, False
                    if chunk:
                        current = (current or "") + chunk
        if current is not None:
            fields.append((current, not quoted and self.ctx.is_unset(current)))
        return fields

    def expand_string(self, word: Word | None) -> str:
        """Expand a word without splitting (assignments, `case` and `[[ ]]` operands)."""
        if word is None:
            return ""
        return "".join(" " if p.brk else p.text for p in self._pieces(word.parts, quoted=True))

    def pattern(self, word: Word, what: str, strict: bool = True, skip: int = 0) -> Glob | None:
        """Compile a glob pattern word (quoted parts literal; `skip` characters dropped first)."""
        pieces = [(p.text, p.quoted) for p in self._pieces(word.parts, quoted=False) if not p.brk]
        text = "".join(text for text, _ in pieces)
        if MARK.search(text):
            if self.ctx.bash_value(text) is None and not strict:
                return None
            self.value(text, what)
            pieces = [(self.ctx.bash_value(piece) or "", quoted) for piece, quoted in pieces]
        if skip and pieces:
            pieces[0] = (pieces[0][0][skip:], pieces[0][1])
        return Glob.compile(pieces)

    def value(self, text: str, what: str) -> str:
        """Return `text` as bash reads it (unset variables empty, placeholders for `$RANDOM` and
        `$PWD`), noting each unset variable read; raise where only a command would tell."""
        held = self.ctx.held(text)
        if not held:
            return text
        known = self.ctx.bash_value(text)
        if known is None:
            self.require(text, what)
            raise AssertionError(text)  # require raised
        for unknown in held:
            if unknown.value == "" and unknown.hint is not None:
                self._read_unset(unknown.text, unknown.hint)
        if self.ctx.taint is not None:
            self.ctx.taint.extend(held)
        return known

    def _read_unset(self, text: str, hint: str) -> None:
        if self.ctx.reading is not None and hint not in self.ctx.reading:
            self.ctx.reading.append(hint)
        if hint in self.ctx.unset_read:
            return
        self.ctx.unset_read[hint] = self.where()
        self.ctx.note(f"{self.where()}: {text} is not set, so it reads as empty, as in bash; "
                      f"give it with --set {hint}=VALUE")  # fmt: skip

    def read_unset_name(self, name: str) -> None:
        """An unset variable read by name in `$(( ))`: 0 there, as in bash."""
        if self.nounset:
            self._stop_unset(name, name)
        self._read_unset(f"${name}", name)
        if self.ctx.taint is not None:
            self.ctx.taint.append(Unknown(f"${name}", "which the script never sets", name, ""))

    def _stop_unset(self, text: str, name: str) -> None:
        """`set -u`: bash stops at an unset variable (the reader names it for --set)."""
        self.ctx.unset_read.setdefault(name, self.where())
        raise Exit(f"{self.where()}: {text} is not set, which stops bash under `set -u`")

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
                out.append(_Piece(self._arith_piece(part), quoted))
            elif isinstance(part, CmdSub):
                out.append(_Piece(self.command_substitution(part), quoted))
        return out

    def _arith_piece(self, part: Arith) -> str:
        """`$(( ))`: its value; marked unknown (with that value) where it reads an unknown."""
        outer, self.ctx.taint = self.ctx.taint, []
        try:
            result = str(self.arith(part.body))
            read = self.ctx.taint
        finally:
            self.ctx.taint = outer
        if not read:
            return result
        if outer is not None:
            outer.extend(read)
        root = read[0]
        return self.ctx.mark(Unknown(f"$(({part.body.raw}))", f"where {root.text} is a value "
                                     f"{root.reason}", root.hint, result))  # fmt: skip

    def where(self) -> str:
        return f"{self.source_stack[-1]} line {self.line}"

    def placeholder(self, name: str) -> str:
        """`$RANDOM`, `$PWD` and `$HOME`, which a fresh login shell sets: marked, with the value
        the reader uses."""
        if name == "RANDOM":
            value, reason = "0", "which bash draws at random"
            self.ctx.note(f"{self.where()}: $RANDOM is a number bash draws at random; the reader "
                          "uses 0 where it builds a path or a port")  # fmt: skip
        elif name == "HOME":  # a login shell sets it from the user's passwd entry
            value, reason = os.path.expanduser("~"), "the home folder of the job's user"
            self.ctx.note(f"{self.where()}: $HOME (or ~) is the home folder of the job's user; "
                          "the reader takes its own")  # fmt: skip
        else:
            value, reason = os.getcwd(), "the folder the job starts in"
            self.ctx.note(f"{self.where()}: $PWD (or `pwd`) is the folder the job starts in; the "
                          "reader takes the folder it runs in")  # fmt: skip
        return self.ctx.mark(Unknown(f"${name}", reason, None if name == "RANDOM" else name, value))

    def lookup(self, name: str, index: str | None) -> list[str] | None:
        """Return the values of NAME (one for a scalar), or None when it is not set."""
        if name.isdigit() or name in "@*#":
            return self._special(name)
        if name == "BASH_SOURCE":
            return [self.source_stack[-1]]
        value = self.vars.get(name)
        if value is None and name in ("RANDOM", "PWD", "HOME") and index is None:
            return [self.placeholder(name)]
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
        if name == "?" and index is None and not op:
            # the status of the command before, as the reader takes it: the commands it skips
            # (`which srun`, `mkdir`) succeed
            self.ctx.note(f"{self.where()}: $? reads {self.status}, the status the reader gives "
                          "the command before it (the commands it skips succeed)")  # fmt: skip
            return [_Piece(str(self.status), quoted)]
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
        if self.nounset and part.name not in "@*":
            self._stop_unset(part.text, part.name)
        if part.name.isdigit():
            reason = "which the script gets from its command line"
        else:
            reason = "which the script never sets"
        return self.ctx.mark(Unknown(part.text, reason, part.name, ""))

    def _transform(self, part: Param, value: str) -> str:
        op = part.op
        if op in ("", ":-", "-", ":=", "=", ":+", "+", ":?", "?"):
            return value
        if MARK.search(value):
            unknown = self.ctx.unknown_in(value)
            assert unknown is not None
            known = self.ctx.bash_value(value)
            return self.ctx.mark(Unknown(part.text, f"where {unknown.text} is a value "
                                         f"{unknown.reason}", unknown.hint,
                                         None if known is None else self._transform(part, known)))
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
        if op in ("#", "##", "%", "%%"):
            return self._trim(op, self.pattern(part.arg, part.text) or Glob(()), value)
        return self._replace(part, value)

    def _trim(self, op: str, glob: Glob, value: str) -> str:
        """`${v#pat}`, `${v##pat}` (a matching prefix removed), `${v%pat}`, `${v%%pat}` (suffix)."""
        if op.startswith("%"):
            glob, value = glob.reversed(), value[::-1]
        ends = glob.ends(value, 0, self.ctx.matching, first_only=len(op) == 1)
        if ends:
            value = value[ends[0] if len(op) == 1 else ends[-1] :]
        return value[::-1] if op.startswith("%") else value

    def _replace(self, part: Param, value: str) -> str:
        """`${v/pat/x}`, `${v//pat/x}`, `${v/#pat/x}` (at the start), `${v/%pat/x}` (at the end)."""
        assert part.arg is not None
        anchor = part.arg.raw[:1] if part.arg.raw.startswith(("#", "%")) else ""
        glob = self.pattern(part.arg, part.text, skip=len(anchor)) or Glob(())
        replacement = self.expand_string(part.arg2)
        if anchor == "#":
            ends = glob.ends(value, 0, self.ctx.matching)
            return replacement + value[ends[-1] :] if ends else value
        if anchor == "%":
            ends = glob.reversed().ends(value[::-1], 0, self.ctx.matching)
            return value[: len(value) - ends[-1]] + replacement if ends else value
        if not glob.size:
            return value
        return glob.replace(value, replacement, part.op == "//", self.ctx.matching)

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
