"""Turn bash script text into tokens: words, operators, redirections, here-documents, `[[ ]]`, `(( ))`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inspector.inputs.bash.syntax import DQ, Assign, HereDoc, Lit, Part, Word
from inspector.inputs.bash.words import META, WordReader, merge_parts

_OPERATORS = (";;&", ";;", ";&", "&&", "||", "|&", "&>>", "&>", "<<<", "<<-", "<<", ">>", ">&",
              "<&", ">|", "<>", "|", "&", ";", "(", ")", ">", "<")  # fmt: skip
_REDIRECTS = {"&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>", ">", "<"}
ASSIGN = re.compile(r"([A-Za-z_]\w*)(?:\[([^\]]*)\])?(\+?)=")
_OPERATOR_STARTS = {op[0] for op in _OPERATORS}
_BLANKS = re.compile(r"[ \t]*")
_FD = re.compile(r"\d+(?=[<>])")
_COMMAND_START = {"then", "do", "else", "elif", "if", "while", "until", "{", "!", "time"}
KEYWORDS = {"if", "then", "elif", "else", "fi", "case", "esac", "for", "while", "until", "do",
            "done", "function", "{", "}", "!", "in", "time"}  # fmt: skip


@dataclass(slots=True)
class Token:
    kind: str  # "word", "op", "redir", "newline", "array", "dbrack", "arith", "eof"
    value: Any
    line: int
    keyword: str | None = None  # a word's text when it is one unquoted literal (`if`, `done`)
    op: str | None = None  # an operator's text (`;`, `&&`, `(`)


class Lexer(WordReader):
    """Turn script text into tokens, keeping each word's quoting structure."""

    def __init__(self, text: str, origin: str, first_line: int = 1, fixed_line: bool = False):
        super().__init__(text, origin, first_line, fixed_line)
        self.heredocs: list[HereDoc] = []
        self.last: Token | None = None

    def tokenize(self) -> list[Token]:
        tokens = [self.next_token()]
        while tokens[-1].kind != "eof":
            tokens.append(self.next_token())
        return tokens

    def next_token(self) -> Token:
        """Read the next token (the script is read as bash reads it: one token at a time)."""
        token = self._next()
        if token.kind == "word":
            token.keyword = token.value.literal()
        elif token.kind == "op":
            token.op = token.value
        self.last = token
        return token

    def _at_command_start(self) -> bool:
        last = self.last
        if last is None or last.kind in ("newline", "op"):
            return True
        return last.kind == "word" and last.keyword in _COMMAND_START

    def _next(self) -> Token:
        s = self.s
        self._skip_blanks()
        line = self.line
        if self.i >= len(s):
            return Token("eof", None, line)
        if s[self.i] == "\n":
            self._advance()
            self._read_heredocs()
            return Token("newline", None, line)
        if s[self.i] in "[(" and self._at_command_start():
            for opener, closer, kind in (("[[", "]]", "dbrack"), ("((", "))", "arith")):
                if s.startswith(opener, self.i) and (kind == "arith" or s[self.i + 2 : self.i + 3]
                                                     in (" ", "\t", "\n")):  # fmt: skip
                    return self._read_compound(opener, closer, kind, line)
        fd = _FD.match(s, self.i) if s[self.i].isdigit() else None
        start = fd.end() if fd else self.i
        if s[start : start + 1] in _OPERATOR_STARTS:
            for op in _OPERATORS:
                if s.startswith(op, start):
                    if op in _REDIRECTS:
                        self._advance(start - self.i + len(op))
                        return self._read_redirect(op, line)
                    if fd is None:
                        self._advance(len(op))
                        return Token("op", op, line)
        return self._read_word_token(line)

    def _skip_blanks(self) -> None:
        """Skip blanks, line continuations and comments."""
        s = self.s
        while self.i < len(s):
            end = _BLANKS.match(s, self.i).end()  # type: ignore[union-attr] # `*` always matches
            if end > self.i:
                self.i = end
            elif s.startswith("\\\n", self.i):
                self._advance(2)
            elif s[self.i] == "#":
                end = s.find("\n", self.i)
                self._advance((len(s) if end < 0 else end) - self.i)
            else:
                break

    def _read_redirect(self, op: str, line: int) -> Token:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self._advance()
        if self.i >= len(self.s) or self.s[self.i] in META:
            # bash: "syntax error near unexpected token", and nothing of the script runs; a
            # placeholder such as `X=<path to data>` is the usual cause
            raise self.fail(f"a redirection `{op}` has no target, a syntax error to bash too (is "
                            "a placeholder such as `<path>` still to be filled in?)")  # fmt: skip
        target = self.read_word()
        if op in ("<<", "<<-"):
            delimiter = "".join(p.text for p in _flat_literals(target.parts))
            quoted = any(not isinstance(p, Lit) or p.quoted for p in target.parts)
            doc = HereDoc(delimiter, op == "<<-", quoted, 0)
            self.heredocs.append(doc)
            return Token("redir", (op, target, doc), line)
        return Token("redir", (op, target), line)

    def _read_heredocs(self) -> None:
        for doc in self.heredocs:
            doc.line = self.line
            while True:
                if self.i >= len(self.s):
                    raise self.fail(f"the here-document ending in {doc.delimiter} is not closed")
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                text = self.s[self.i : end]
                self._advance(min(end + 1, len(self.s)) - self.i)
                if (text.lstrip("\t") if doc.strip_tabs else text) == doc.delimiter:
                    break
                doc.lines.append(text.lstrip("\t") if doc.strip_tabs else text)
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
            if words and words[-1].literal() == "=~":
                words.append(self._read_regex())
                continue
            for op in ("&&", "||", "(", ")", "<", ">"):
                if self.s.startswith(op, self.i):
                    self._advance(len(op))
                    words.append(Word((Lit(op, False),), op, self.line))
                    break
            else:
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
        return Word(tuple(merge_parts(parts)), self.s[start : self.i], line)

    def _read_word_token(self, line: int) -> Token:
        start = self.i
        word = self.read_word()
        if self.i < len(self.s) and self.s[self.i] == "(" and self.i > start:
            match = ASSIGN.fullmatch(self.s[start : self.i])
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
            elif self.s[self.i] in META:
                raise self.fail(f"unexpected `{self.s[self.i]}` in the array {match.group(1)}")
            else:
                elements.append(self.read_word())


def _flat_literals(parts: tuple[Part, ...]) -> list[Lit]:
    out: list[Lit] = []
    for part in parts:
        if isinstance(part, Lit):
            out.append(part)
        elif isinstance(part, DQ):
            out.extend(_flat_literals(part.parts))
    return out
