"""Bash launch scripts, parsed (never run): a lexer and a recursive-descent parser for the subset
that inspector.shell interprets.

The syntax tree keeps each word's structure (quoted and unquoted text, `$VAR`, `${V:-x}`, `$((..))`,
`$(..)`) because bash's word splitting depends on it. Line numbers ride on words and commands so that
errors name them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import InputError

# ---------------------------------------------------------------------------------------- words


@dataclass(frozen=True)
class Lit:
    """Literal text; `quoted` when it came from quotes or a backslash (never split or globbed)."""

    text: str
    quoted: bool


@dataclass(frozen=True)
class Param:
    """A parameter expansion: `$NAME`, `${NAME[index]}`, `${NAME:-word}`, `${#NAME}`, ..."""

    name: str
    op: str = ""  # "", ":-", "-", ":=", "=", ":+", "+", ":?", "?", "#", "##", "%", "%%", "/", "//",
    #                 "len", ":" (substring), "^^", ",,"
    arg: Word | None = None
    arg2: Word | None = None  # replacement of `/`, length of `:`
    index: str | None = None  # "@", "*", or an arithmetic expression
    text: str = ""  # as written, for messages


@dataclass(frozen=True)
class Arith:
    """`$(( expression ))`; the expression is expanded like a double-quoted string first."""

    body: Word
    text: str


@dataclass(frozen=True)
class CmdSub:
    """`$( command )` or a backquoted command: its output is not known without running it."""

    script: str
    text: str


@dataclass(frozen=True)
class DQ:
    """A double-quoted region."""

    parts: tuple[Part, ...]


Part = Lit | Param | Arith | CmdSub | DQ


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    raw: str
    line: int

    def literal(self) -> str | None:
        """Return the word's text when it is one unquoted literal (a keyword candidate)."""
        if len(self.parts) == 1 and isinstance(self.parts[0], Lit) and not self.parts[0].quoted:
            return self.parts[0].text
        return None


# -------------------------------------------------------------------------------------- commands


@dataclass
class Assign:
    name: str
    append: bool
    value: Word | None  # scalar value
    array: tuple[Word, ...] | None = None  # `NAME=( ... )`
    index: str | None = None  # `NAME[index]=value`
    line: int = 0


@dataclass
class Simple:
    assigns: list[Assign]
    words: list[Word | Assign]  # an Assign among words: `declare -a A=( ... )`
    line: int


@dataclass
class Pipeline:
    commands: list[Node]
    negate: bool
    line: int


@dataclass
class AndOr:
    first: Node
    rest: list[tuple[str, Node]]


@dataclass
class Seq:
    items: list[tuple[Node, bool]]  # (command, run in background)


@dataclass
class If:
    clauses: list[tuple[Seq, Seq]]
    otherwise: Seq | None


@dataclass
class Case:
    word: Word
    items: list[tuple[list[Word], Seq]]
    line: int


@dataclass
class For:
    name: str
    words: list[Word] | None
    body: Seq
    line: int


@dataclass
class While:
    cond: Seq
    body: Seq
    until: bool
    line: int


@dataclass
class Group:
    body: Seq
    subshell: bool


@dataclass
class FuncDef:
    name: str
    body: Node


@dataclass
class CondExpr:
    """`[[ ... ]]`: its words, with `&&`, `||`, `(`, `)`, `<`, `>` kept as plain words."""

    words: list[Word]
    line: int


@dataclass
class ArithCmd:
    body: Word
    line: int


Node = (
    Simple | Pipeline | AndOr | Seq | If | Case | For | While | Group | FuncDef | CondExpr | ArithCmd
)

# ---------------------------------------------------------------------------------------- lexer

_OPERATORS = (";;&", ";;", ";&", "&&", "||", "|&", "&>>", "&>", "<<<", "<<-", "<<", ">>", ">&",
              "<&", ">|", "<>", "|", "&", ";", "(", ")", ">", "<")  # fmt: skip
_REDIRECTS = {"&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>", ">", "<"}
_META = set(" \t\n;&|<>()")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)(?:\[([^\]]*)\])?(\+?)=")
_NAME = re.compile(r"[A-Za-z_]\w*")
_COMMAND_START = {"then", "do", "else", "elif", "if", "while", "until", "{", "!", "time"}
KEYWORDS = {"if", "then", "elif", "else", "fi", "case", "esac", "for", "while", "until", "do",
            "done", "function", "{", "}", "!", "in", "time"}  # fmt: skip


@dataclass
class Token:
    kind: str  # "word", "op", "redir", "newline", "array", "dbrack", "arith", "eof"
    value: Any
    line: int


@dataclass
class _Heredoc:
    delimiter: str
    strip_tabs: bool


class Lexer:
    """Turn script text into tokens, keeping each word's quoting structure."""

    def __init__(self, text: str, origin: str, first_line: int = 1, fixed_line: bool = False):
        self.s, self.origin, self.i = text, origin, 0
        self.line, self.fixed_line = first_line, fixed_line
        self.heredocs: list[_Heredoc] = []
        self.tokens: list[Token] = []

    def fail(self, message: str, line: int | None = None) -> InputError:
        return InputError(f"{self.origin} line {line or self.line}: {message}")

    def tokenize(self) -> list[Token]:
        while True:
            token = self._next()
            self.tokens.append(token)
            if token.kind == "eof":
                return self.tokens

    def _advance(self, count: int = 1) -> None:
        if not self.fixed_line:
            self.line += self.s.count("\n", self.i, self.i + count)
        self.i += count

    def _at_command_start(self) -> bool:
        if not self.tokens:
            return True
        last = self.tokens[-1]
        if last.kind in ("newline", "op"):
            return True
        return last.kind == "word" and isinstance(last.value, Word) and (
            last.value.literal() in _COMMAND_START
        )

    def _next(self) -> Token:
        s = self.s
        while self.i < len(s):
            if s[self.i] in " \t":
                self._advance()
            elif s.startswith("\\\n", self.i):
                self._advance(2)
            elif s[self.i] == "#":
                end = s.find("\n", self.i)
                self._advance((len(s) if end < 0 else end) - self.i)
            else:
                break
        line = self.line
        if self.i >= len(s):
            return Token("eof", None, line)
        if s[self.i] == "\n":
            self._advance()
            self._read_heredocs()
            return Token("newline", None, line)
        if self._at_command_start():
            for opener, closer, kind in (("[[", "]]", "dbrack"), ("((", "))", "arith")):
                if s.startswith(opener, self.i) and (kind == "arith" or s[self.i + 2 : self.i + 3]
                                                     in (" ", "\t", "\n")):  # fmt: skip
                    return self._read_compound(opener, closer, kind, line)
        fd = re.match(r"\d+(?=[<>])", s[self.i :])
        start = self.i + (fd.end() if fd else 0)
        for op in _OPERATORS:
            if s.startswith(op, start):
                if op in _REDIRECTS:
                    self._advance(start - self.i + len(op))
                    return self._read_redirect(op, line)
                if fd is None:
                    self._advance(len(op))
                    return Token("op", op, line)
        return self._read_word_token(line)

    def _read_redirect(self, op: str, line: int) -> Token:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self._advance()
        if self.i >= len(self.s) or self.s[self.i] in _META:
            raise self.fail(f"a redirection `{op}` has no target")
        target = self.read_word()
        if op in ("<<", "<<-"):
            delimiter = "".join(p.text for p in _flat_literals(target.parts))
            self.heredocs.append(_Heredoc(delimiter, op == "<<-"))
        return Token("redir", (op, target), line)

    def _read_heredocs(self) -> None:
        for doc in self.heredocs:
            while True:
                if self.i >= len(self.s):
                    raise self.fail(f"the here-document ending in {doc.delimiter} is not closed")
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                text = self.s[self.i : end]
                self._advance(min(end + 1, len(self.s)) - self.i)
                if (text.lstrip("\t") if doc.strip_tabs else text) == doc.delimiter:
                    break
        self.heredocs = []

    def _read_compound(self, opener: str, closer: str, kind: str, line: int) -> Token:
        self._advance(2)
        if kind == "arith":
            depth, start = 0, self.i
            while self.i < len(self.s):
                char = self.s[self.i]
                if char == "(":
                    depth += 1
                elif char == ")":
                    if depth == 0 and self.s.startswith("))", self.i):
                        body = self._parse_fragment(self.s[start : self.i], line)
                        self._advance(2)
                        return Token("arith", body, line)
                    depth -= 1
                self._advance()
            raise self.fail("`((` is not closed", line)
        words: list[Word] = []
        while True:
            while self.i < len(self.s) and self.s[self.i] in " \t\n":
                self._advance()
            if self.i >= len(self.s):
                raise self.fail("`[[` is not closed", line)
            for op in ("&&", "||", "(", ")", "<", ">"):
                if self.s.startswith(op, self.i):
                    self._advance(len(op))
                    words.append(Word((Lit(op, False),), op, self.line))
                    break
            else:
                if words and words[-1].literal() == "=~":
                    words.append(self._read_regex())
                    continue
                word = self.read_word(extra_stop="")
                if not word.parts:
                    raise self.fail(f"unexpected `{self.s[self.i]}` inside `[[ ]]`")
                if word.literal() == closer:
                    return Token("dbrack", words, line)
                words.append(word)

    def _read_regex(self) -> Word:
        """The right side of `=~`: parentheses and `|` belong to the regex, up to a blank."""
        start, line, depth = self.i, self.line, 0
        parts: list[Part] = []
        while self.i < len(self.s):
            char = self.s[self.i]
            if depth == 0 and (char in " \t\n" or char == ")"):
                break
            depth += {"(": 1, ")": -1}.get(char, 0)
            parts.extend(self._read_unit(parts, in_braces=True))
        return Word(tuple(_merge(parts)), self.s[start : self.i], line)

    def _parse_fragment(self, text: str, line: int) -> Word:
        """Parse `text` as the inside of double quotes (arithmetic bodies)."""
        sub = Lexer(text, self.origin, line, fixed_line=True)
        parts = sub._read_dquoted(end=None)
        return Word(tuple(parts), text, line)

    def _read_word_token(self, line: int) -> Token:
        start = self.i
        word = self.read_word()
        if self.i < len(self.s) and self.s[self.i] == "(" and self.i > start:
            match = _ASSIGN.fullmatch(self.s[start : self.i])
            if match:
                self._advance()
                return Token("array", self._read_array(match, line), line)
        if not word.parts:
            raise self.fail(f"unexpected `{self.s[self.i]}`")
        return Token("word", word, line)

    def _read_array(self, match: re.Match[str], line: int) -> Assign:
        elements: list[Word] = []
        while True:
            while self.i < len(self.s) and self.s[self.i] in " \t\n":
                self._advance()
            if self.s.startswith("\\\n", self.i):
                self._advance(2)
                continue
            if self.i >= len(self.s):
                raise self.fail(f"the array {match.group(1)}=( is not closed", line)
            if self.s[self.i] == "#":
                end = self.s.find("\n", self.i)
                self._advance((len(self.s) if end < 0 else end) - self.i)
            elif self.s[self.i] == ")":
                self._advance()
                name, index, plus = match.groups()
                if index is not None:
                    raise self.fail(f"`{match.group(0)}(` assigns an array to an element", line)
                return Assign(name, bool(plus), None, tuple(elements), None, line)
            elif self.s[self.i] in _META:
                raise self.fail(f"unexpected `{self.s[self.i]}` in the array {match.group(1)}")
            else:
                elements.append(self.read_word())

    # -- words

    def read_word(self, extra_stop: str = "") -> Word:
        """Read one word up to an unquoted metacharacter."""
        start, line = self.i, self.line
        parts: list[Part] = []
        s = self.s
        while self.i < len(s):
            char = s[self.i]
            if char in _META or char in extra_stop:
                break
            parts.extend(self._read_unit(parts_so_far=parts, in_braces=False))
        return Word(tuple(_merge(parts)), s[start : self.i], line)

    def _read_unit(self, parts_so_far: list[Part], in_braces: bool) -> list[Part]:
        s, char = self.s, self.s[self.i]
        if char == "\\":
            if s.startswith("\\\n", self.i):
                self._advance(2)
                return []
            self._advance(2)
            return [Lit(s[self.i - 1 : self.i], True)]
        if char == "'":
            end = s.find("'", self.i + 1)
            if end < 0:
                raise self.fail("a single quote is not closed", self.line)
            text = s[self.i + 1 : end]
            self._advance(end + 1 - self.i)
            return [Lit(text, True)]
        if char == '"':
            self._advance()
            return [DQ(tuple(self._read_dquoted(end='"')))]
        if char == "$" and s.startswith("$'", self.i):
            return [Lit(self._read_ansi_c(), True)]
        if char == "$":
            return [self._read_dollar()]
        if char == "`":
            end = s.find("`", self.i + 1)
            if end < 0:
                raise self.fail("a backquote is not closed")
            text = s[self.i : end + 1]
            self._advance(end + 1 - self.i)
            return [CmdSub(text[1:-1], text)]
        if char == "~" and not parts_so_far and not in_braces:
            self._advance()
            return [Param("HOME", text="~")]
        self._advance()
        return [Lit(char, False)]

    def _read_dquoted(self, end: str | None) -> list[Part]:
        parts: list[Part] = []
        s, start_line = self.s, self.line
        while True:
            if self.i >= len(s):
                if end is None:
                    return _merge(parts)
                raise self.fail("a double quote is not closed", start_line)
            char = s[self.i]
            if char == end:
                self._advance()
                return _merge(parts)
            if char == "\\" and self.i + 1 < len(s) and s[self.i + 1] in '$`"\\\n':
                if s[self.i + 1] != "\n":
                    parts.append(Lit(s[self.i + 1], True))
                self._advance(2)
            elif char == "$" and self.i + 1 < len(s) and s[self.i + 1] != "'":
                parts.append(self._read_dollar())
            elif char == "`":
                parts.extend(self._read_unit(parts, False))
            else:
                parts.append(Lit(char, True))
                self._advance()

    def _read_ansi_c(self) -> str:
        self._advance(2)
        out: list[str] = []
        s = self.s
        escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "a": "\a",
                   "b": "\b", "e": "\x1b", "E": "\x1b", "f": "\f", "v": "\v", "?": "?"}  # fmt: skip
        while self.i < len(s):
            char = s[self.i]
            if char == "'":
                self._advance()
                return "".join(out)
            if char == "\\" and self.i + 1 < len(s):
                nxt = s[self.i + 1]
                hexa = re.match(r"x([0-9a-fA-F]{1,2})", s[self.i + 1 :])
                octal = re.match(r"[0-7]{1,3}", s[self.i + 1 :])
                if nxt in escapes:
                    out.append(escapes[nxt])
                    self._advance(2)
                elif hexa:
                    out.append(chr(int(hexa.group(1), 16)))
                    self._advance(1 + hexa.end())
                elif octal:
                    out.append(chr(int(octal.group(0), 8) & 0xFF))
                    self._advance(1 + octal.end())
                else:
                    out.append(s[self.i : self.i + 2])
                    self._advance(2)
            else:
                out.append(char)
                self._advance()
        raise self.fail("a $'...' quote is not closed")

    def _matching(self, start: int, opener: str, closer: str) -> int:
        """Return the index of the `closer` matching the opener before `start` (quotes skipped)."""
        depth, i, s = 1, start, self.s
        while i < len(s):
            char = s[i]
            if char == "\\":
                i += 2
                continue
            if char == "'":
                i = s.find("'", i + 1)
                if i < 0:
                    break
            elif char == '"':
                i += 1
                while i < len(s) and s[i] != '"':
                    i += 2 if s[i] == "\\" else 1
            elif s.startswith(opener, i):
                depth += 1
            elif char == closer:
                depth -= 1
                if depth == 0:
                    return i
            i += 1
        raise self.fail(f"`{opener}` is not closed")

    def _read_dollar(self) -> Part:
        s, start = self.s, self.i
        if s.startswith("$((", start):
            end = self._matching(start + 3, "(", ")")
            if not s.startswith("))", end):
                end2 = self._matching(start + 2, "(", ")")  # `$( (cmd) )`: a command
                text = s[start : end2 + 1]
                self._advance(end2 + 1 - start)
                return CmdSub(text[2:-1], text)
            text = s[start : end + 2]
            body = self._parse_fragment(s[start + 3 : end], self.line)
            self._advance(end + 2 - start)
            return Arith(body, text)
        if s.startswith("$(", start):
            end = self._matching(start + 2, "(", ")")
            text = s[start : end + 1]
            self._advance(end + 1 - start)
            return CmdSub(text[2:-1], text)
        if s.startswith("${", start):
            return self._read_braced()
        match = re.match(r"\$([A-Za-z_]\w*|[0-9@*#?$!\-])", s[start:])
        if match:
            self._advance(match.end())
            return Param(match.group(1), text=match.group(0))
        self._advance()
        return Lit("$", False)

    def _read_braced(self) -> Param:
        s, start = self.s, self.i
        end = self._matching(start + 2, "{", "}")
        text = s[start : end + 1]
        inner = s[start + 2 : end]
        length = inner.startswith("#") and len(inner) > 1
        body = inner[1:] if length else inner
        match = re.match(r"([A-Za-z_]\w*|[0-9]+|[@*#?$!\-])(?:\[([^\]]*)\])?", body)
        if not match or body.startswith("!"):
            raise self.fail(f"the expansion {text} is not supported")
        name, index = match.group(1), match.group(2)
        rest = body[match.end() :]
        if length:
            if rest:
                raise self.fail(f"the expansion {text} is not supported")
            self._advance(end + 1 - start)
            return Param(name, "len", index=index, text=text)
        op_match = re.match(r":-|:=|:\+|:\?|-|=|\+|\?|##|#|%%|%|//|/|\^\^|,,|\^|,|:", rest)
        if rest and not op_match:
            raise self.fail(f"the expansion {text} is not supported")
        op = op_match.group(0) if op_match else ""
        arg = arg2 = None
        if op:
            operand = rest[len(op) :]
            base = self.line
            if op in ("/", "//"):
                pattern, _, replacement = operand.partition("/")
                arg, arg2 = self._operand(pattern, base), self._operand(replacement, base)
            elif op == ":":
                offset, _, count = operand.partition(":")
                arg = self._operand(offset, base)
                arg2 = self._operand(count, base) if ":" in operand else None
            else:
                arg = self._operand(operand, base)
        self._advance(end + 1 - start)
        return Param(name, op, arg, arg2, index, text)

    def _operand(self, text: str, line: int) -> Word:
        sub = Lexer(text, self.origin, line, fixed_line=True)
        parts: list[Part] = []
        while sub.i < len(text):
            parts.extend(sub._read_unit(parts, in_braces=True))
        return Word(tuple(_merge(parts)), text, line)


def _merge(parts: list[Part]) -> list[Part]:
    merged: list[Part] = []
    for part in parts:
        last = merged[-1] if merged else None
        if isinstance(part, Lit) and isinstance(last, Lit) and last.quoted == part.quoted:
            merged[-1] = Lit(last.text + part.text, part.quoted)
        else:
            merged.append(part)
    return merged


def _flat_literals(parts: tuple[Part, ...]) -> list[Lit]:
    out: list[Lit] = []
    for part in parts:
        if isinstance(part, Lit):
            out.append(part)
        elif isinstance(part, DQ):
            out.extend(_flat_literals(part.parts))
    return out


# --------------------------------------------------------------------------------------- parser


@dataclass
class Parser:
    tokens: list[Token]
    origin: str
    pos: int = 0
    _stop: list[set[str]] = field(default_factory=list)

    def fail(self, message: str, line: int | None = None) -> InputError:
        where = line if line is not None else self.peek().line
        return InputError(f"{self.origin} line {where}: {message}")

    def peek(self, ahead: int = 0) -> Token:
        return self.tokens[min(self.pos + ahead, len(self.tokens) - 1)]

    def take(self) -> Token:
        token = self.peek()
        self.pos += 1
        return token

    def keyword(self, ahead: int = 0) -> str | None:
        token = self.peek(ahead)
        return token.value.literal() if token.kind == "word" else None

    def expect(self, word: str) -> None:
        self.skip_newlines()
        if self.keyword() != word:
            raise self.fail(f"expected `{word}`, found {self._describe(self.peek())}")
        self.take()

    def expect_op(self, op: str) -> None:
        token = self.peek()
        if token.kind != "op" or token.value != op:
            raise self.fail(f"expected `{op}`, found {self._describe(token)}")
        self.take()

    @staticmethod
    def _describe(token: Token) -> str:
        if token.kind == "eof":
            return "the end of the script"
        if token.kind == "newline":
            return "the end of the line"
        if token.kind == "word":
            return f"`{token.value.raw}`"
        return f"`{token.value}`"

    def skip_newlines(self) -> None:
        while self.peek().kind == "newline" or (
            self.peek().kind == "op" and self.peek().value == ";"
        ):
            self.take()

    def program(self) -> Seq:
        body = self.sequence(set())
        if self.peek().kind != "eof":
            raise self.fail(f"unexpected {self._describe(self.peek())}")
        return body

    def sequence(self, stop: set[str]) -> Seq:
        items: list[tuple[Node, bool]] = []
        while True:
            self.skip_newlines()
            token = self.peek()
            if token.kind == "eof" or self.keyword() in stop:
                return Seq(items)
            if token.kind == "op" and token.value in (")", ";;", ";&", ";;&"):
                return Seq(items)
            node = self.and_or()
            background = self.peek().kind == "op" and self.peek().value == "&"
            if background:
                self.take()
            elif self.peek().kind not in ("newline", "eof") and not (
                self.peek().kind == "op" and self.peek().value in (";", ")", ";;", ";&", ";;&")
            ):
                if self.keyword() not in stop:
                    raise self.fail(f"unexpected {self._describe(self.peek())}")
            items.append((node, background))

    def and_or(self) -> Node:
        first = self.pipeline()
        rest: list[tuple[str, Node]] = []
        while self.peek().kind == "op" and self.peek().value in ("&&", "||"):
            op = str(self.take().value)
            while self.peek().kind == "newline":
                self.take()
            rest.append((op, self.pipeline()))
        return AndOr(first, rest) if rest else first

    def pipeline(self) -> Node:
        line = self.peek().line
        if self.keyword() == "time":
            self.take()
            if self.keyword() == "-p":
                self.take()
        negate = self.keyword() == "!"
        if negate:
            self.take()
        commands = [self.command()]
        while self.peek().kind == "op" and self.peek().value in ("|", "|&"):
            self.take()
            while self.peek().kind == "newline":
                self.take()
            commands.append(self.command())
        if len(commands) == 1 and not negate:
            return commands[0]
        return Pipeline(commands, negate, line)

    def command(self) -> Node:
        token, word = self.peek(), self.keyword()
        node: Node
        if token.kind == "op" and token.value == "(":
            self.take()
            body = self.sequence(set())
            self.expect_op(")")
            node = Group(body, subshell=True)
        elif token.kind == "dbrack":
            self.take()
            node = CondExpr(token.value, token.line)
        elif token.kind == "arith":
            self.take()
            node = ArithCmd(token.value, token.line)
        elif word == "if":
            node = self.if_clause()
        elif word in ("while", "until"):
            self.take()
            cond = self.sequence({"do"})
            self.expect("do")
            body = self.sequence({"done"})
            self.expect("done")
            node = While(cond, body, word == "until", token.line)
        elif word == "for":
            node = self.for_clause()
        elif word == "case":
            node = self.case_clause()
        elif word == "{":
            self.take()
            body = self.sequence({"}"})
            self.expect("}")
            node = Group(body, subshell=False)
        elif word == "function" or (
            token.kind == "word" and self.peek(1).kind == "op" and self.peek(1).value == "("
        ):
            return self.function()
        elif word in ("then", "elif", "else", "fi", "do", "done", "esac", "}", "in"):
            raise self.fail(f"unexpected `{word}`")
        else:
            return self.simple()
        self._skip_redirects()
        return node

    def _skip_redirects(self) -> None:
        while self.peek().kind == "redir":
            self.take()

    def function(self) -> Node:
        if self.keyword() == "function":
            self.take()
        name_token = self.take()
        name = name_token.value.literal() if name_token.kind == "word" else None
        if not name:
            raise self.fail("a function needs a name", name_token.line)
        if self.peek().kind == "op" and self.peek().value == "(":
            self.take()
            self.expect_op(")")
        self.skip_newlines()
        return FuncDef(name, self.command())

    def if_clause(self) -> Node:
        line = self.take().line
        clauses: list[tuple[Seq, Seq]] = []
        otherwise = None
        while True:
            cond = self.sequence({"then"})
            self.expect("then")
            body = self.sequence({"elif", "else", "fi"})
            if self.keyword() not in ("elif", "else", "fi"):
                raise self.fail(f"the `if` of line {line} is not closed with `fi`")
            clauses.append((cond, body))
            word = self.keyword()
            self.take()
            if word == "elif":
                continue
            if word == "else":
                otherwise = self.sequence({"fi"})
                self.expect("fi")
            elif word != "fi":
                raise self.fail("an `if` is not closed with `fi`")
            return If(clauses, otherwise)

    def for_clause(self) -> Node:
        line = self.take().line
        if self.peek().kind != "word":
            raise self.fail("only `for NAME in WORDS` loops are supported", line)
        name = self.take().value.literal()
        if not name or not _NAME.fullmatch(name):
            raise self.fail("only `for NAME in WORDS` loops are supported", line)
        words: list[Word] | None = None
        while self.peek().kind == "newline":
            self.take()
        if self.keyword() == "in":
            self.take()
            words = []
            while self.peek().kind == "word":
                words.append(self.take().value)
        self.expect("do")
        body = self.sequence({"done"})
        self.expect("done")
        return For(name, words, body, line)

    def case_clause(self) -> Node:
        line = self.take().line
        subject = self.take()
        if subject.kind != "word":
            raise self.fail("`case` needs a word", line)
        self.expect("in")
        items: list[tuple[list[Word], Seq]] = []
        while True:
            self.skip_newlines()
            if self.keyword() == "esac":
                self.take()
                return Case(subject.value, items, line)
            if self.peek().kind == "op" and self.peek().value == "(":
                self.take()
            patterns = []
            while True:
                token = self.take()
                if token.kind != "word":
                    raise self.fail("a `case` pattern is missing", token.line)
                patterns.append(token.value)
                if self.peek().kind == "op" and self.peek().value == "|":
                    self.take()
                    continue
                self.expect_op(")")
                break
            body = self.sequence({"esac"})
            items.append((patterns, body))
            token = self.peek()
            if token.kind == "op" and token.value in (";&", ";;&"):
                raise self.fail(f"`{token.value}` in a `case` is not supported", token.line)
            if token.kind == "op" and token.value == ";;":
                self.take()

    def simple(self) -> Node:
        line = self.peek().line
        assigns: list[Assign] = []
        words: list[Word | Assign] = []
        while True:
            token = self.peek()
            if token.kind == "redir":
                self.take()
            elif token.kind == "array":
                self.take()
                (words if words else assigns).append(token.value)
            elif token.kind == "word":
                self.take()
                word: Word = token.value
                assign = None if words else split_assignment(word, self.origin)
                if assign is not None:
                    assigns.append(assign)
                else:
                    words.append(word)
            else:
                break
        if not assigns and not words:
            raise self.fail(f"unexpected {self._describe(self.peek())}")
        return Simple(assigns, words, line)


def split_assignment(word: Word, origin: str = "") -> Assign | None:
    """Return `NAME=value` (or `NAME+=`, `NAME[i]=`) as an Assign when the word is one."""
    first = word.parts[0] if word.parts else None
    if not isinstance(first, Lit) or first.quoted:
        return None
    match = _ASSIGN.match(first.text)
    if not match:
        indexed = re.match(r"([A-Za-z_]\w*)\[", first.text)
        return _indexed_assignment(word, indexed.group(1), origin) if indexed else None
    rest = first.text[match.end() :]
    parts = ((Lit(rest, False),) if rest else ()) + word.parts[1:]
    value = Word(parts, word.raw[match.end() :], word.line)
    return Assign(match.group(1), bool(match.group(3)), value, None, match.group(2), word.line)


def _indexed_assignment(word: Word, name: str, origin: str) -> Assign | None:
    """`NAME[subscript]=value` where the subscript holds expansions: split the raw text."""
    raw, depth = word.raw, 0
    for position in range(len(name), len(raw)):
        depth += {"[": 1, "]": -1}.get(raw[position], 0)
        if depth == 0:
            rest = raw[position + 1 :]
            append = rest.startswith("+=")
            if not (append or rest.startswith("=")):
                return None
            lexer = Lexer(rest[2 if append else 1 :], origin, word.line, fixed_line=True)
            value = lexer.read_word()
            return Assign(name, append, value, None, raw[len(name) + 1 : position], word.line)
    return None


def parse_script(text: str, origin: str, first_line: int = 1, fixed_line: bool = False) -> Seq:
    """Parse bash text into a syntax tree, or raise InputError naming the line."""
    tokens = Lexer(text, origin, first_line, fixed_line).tokenize()
    return Parser(tokens, origin).program()
