"""Parse bash launch scripts (never run): a recursive-descent parser, over lexer.py's tokens, for
the subset that inspector.inputs.bash.shell interprets; it returns syntax.py's syntax tree."""

from __future__ import annotations

import re
from collections.abc import Iterator

from inspector.errors import InputError
from inspector.inputs.bash.lexer import ASSIGN, Lexer, Token
from inspector.inputs.bash.runtime import MAX_NESTING
from inspector.inputs.bash.syntax import (
    AndOr,
    ArithCmd,
    Assign,
    Case,
    CondExpr,
    For,
    FuncDef,
    Group,
    If,
    Lit,
    Node,
    Pipeline,
    Seq,
    Simple,
    While,
    Word,
)

_NAME = re.compile(r"[A-Za-z_]\w*")


class Parser:
    """Read commands from a Lexer's tokens, one top-level command at a time (as bash does)."""

    def __init__(self, lexer: Lexer, origin: str):
        self.lexer, self.origin = lexer, origin
        self.tokens: list[Token] = []  # read ahead of pos; those before it are dropped per command
        self.pos = 0
        self.depth = 0  # compound commands open around the one being read

    def fail(self, message: str, line: int | None = None) -> InputError:
        where = line if line is not None else self.peek().line
        return InputError(f"{self.origin} line {where}: {message}")

    def peek(self, ahead: int = 0) -> Token:
        index = self.pos + ahead
        if index < len(self.tokens):
            return self.tokens[index]
        while index >= len(self.tokens):
            if self.tokens and self.tokens[-1].kind == "eof":
                return self.tokens[-1]
            self.tokens.append(self.lexer.next_token())
        return self.tokens[index]

    def take(self) -> Token:
        token = self.peek()
        self.pos += 1
        return token

    def keyword(self, ahead: int = 0) -> str | None:
        return self.peek(ahead).keyword

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
        while True:
            token = self.peek()
            if token.kind != "newline" and token.op != ";":
                return
            self.pos += 1

    def program(self) -> Seq:
        return Seq(list(self.commands()))

    def commands(self) -> Iterator[tuple[Node, bool]]:
        """Yield the script's top-level commands (with whether each runs in the background)."""
        while True:
            item = self.item(set())
            if item is None:
                if self.peek().kind != "eof":
                    raise self.fail(f"unexpected {self._describe(self.peek())}")
                return
            del self.tokens[: self.pos]
            self.pos = 0
            yield item

    def sequence(self, stop: set[str]) -> Seq:
        items: list[tuple[Node, bool]] = []
        while True:
            item = self.item(stop)
            if item is None:
                return Seq(items)
            items.append(item)

    def item(self, stop: set[str]) -> tuple[Node, bool] | None:
        """Read one command of a list, or None where the list ends."""
        self.skip_newlines()
        token = self.peek()
        if token.kind == "eof" or self.keyword() in stop:
            return None
        if token.op in (")", ";;", ";&", ";;&"):
            return None
        node = self.and_or()
        background = self.peek().op == "&"
        if background:
            self.take()
        elif self.peek().kind not in ("newline", "eof") and (
            self.peek().op not in (";", ")", ";;", ";&", ";;&")
        ):
            if self.keyword() not in stop:
                raise self.fail(f"unexpected {self._describe(self.peek())}")
        return node, background

    def and_or(self) -> Node:
        first = self.pipeline()
        rest: list[tuple[str, Node]] = []
        while self.peek().op in ("&&", "||"):
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
        while self.peek().op in ("|", "|&"):
            self.take()
            while self.peek().kind == "newline":
                self.take()
            commands.append(self.command())
        if len(commands) == 1 and not negate:
            return commands[0]
        return Pipeline(commands, negate, line)

    def command(self) -> Node:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise self.fail(f"commands nest more than {MAX_NESTING} deep; the reader stops there")
        try:
            return self._command()
        finally:
            self.depth -= 1

    def _command(self) -> Node:
        token, word = self.peek(), self.keyword()
        node: Node
        if token.op == "(":
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
            node = self.while_clause()
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
            token.kind == "word" and self.peek(1).op == "("
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
        if self.peek().op == "(":
            self.take()
            self.expect_op(")")
        self.skip_newlines()
        self.depth -= 1  # the body is the function's own level
        try:
            return FuncDef(name, self.command())
        finally:
            self.depth += 1

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

    def while_clause(self) -> Node:
        token = self.take()
        cond = self.sequence({"do"})
        self.expect("do")
        body = self.sequence({"done"})
        self.expect("done")
        return While(cond, body, token.value.literal() == "until", token.line)

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
            if self.peek().op == "(":
                self.take()
            patterns = []
            while True:
                token = self.take()
                if token.kind != "word":
                    raise self.fail("a `case` pattern is missing", token.line)
                patterns.append(token.value)
                if self.peek().op == "|":
                    self.take()
                    continue
                self.expect_op(")")
                break
            body = self.sequence({"esac"})
            items.append((patterns, body))
            token = self.peek()
            if token.op in (";&", ";;&"):
                raise self.fail(f"`{token.value}` in a `case` is not supported", token.line)
            if token.op == ";;":
                self.take()

    def simple(self) -> Node:
        line = self.peek().line
        assigns: list[Assign] = []
        words: list[Word | Assign] = []
        stdin = None
        while True:
            token = self.peek()
            if token.kind == "redir":
                self.take()
                if len(token.value) == 3:  # `<<EOF`: its lines are read after this line
                    stdin = token.value[2]
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
        return Simple(assigns, words, line, stdin)


def split_assignment(word: Word, origin: str = "") -> Assign | None:
    """Return `NAME=value` (or `NAME+=`, `NAME[i]=`) as an Assign when the word is one."""
    first = word.parts[0] if word.parts else None
    if not isinstance(first, Lit) or first.quoted:
        return None
    match = ASSIGN.match(first.text)
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
    return Parser(Lexer(text, origin, first_line, fixed_line), origin).program()


def read_commands(text: str, origin: str, first_line: int = 1,
                  fixed_line: bool = False) -> Iterator[tuple[Node, bool]]:  # fmt: skip
    """Yield the top-level commands of bash text as they are read (bash runs each before it
    reads the next, so a syntax error stops the script only where it stands)."""
    return Parser(Lexer(text, origin, first_line, fixed_line), origin).commands()
