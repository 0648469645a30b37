"""Read one bash word from script text: quotes, `$VAR`, `${V:-x}`, `$((..))` and `$(..)` kept apart."""

from __future__ import annotations

import re

from inspector.errors import InputError
from inspector.inputs.bash.syntax import DQ, Arith, CmdSub, Lit, Param, Part, Word

META = set(" \t\n;&|<>()")
_PLAIN = re.compile(r"[^ \t\n;&|<>()\\'\"$`~][^ \t\n;&|<>()\\'\"$`]*")  # no quoting, no expansion
_PLAIN_QUOTED = re.compile(r'[^"\\$`]+')  # inside double quotes, up to a quote or an expansion
_HEX = re.compile(r"x([0-9a-fA-F]{1,2})")
_OCTAL = re.compile(r"[0-7]{1,3}")
_SIMPLE_PARAM = re.compile(r"\$([A-Za-z_]\w*|[0-9@*#?$!\-])")


class WordReader:
    """Read words from script text, keeping each word's quoting structure (the Lexer's base)."""

    def __init__(self, text: str, origin: str, first_line: int = 1, fixed_line: bool = False):
        self.s, self.origin, self.i = text, origin, 0
        self.line, self.fixed_line = first_line, fixed_line

    def fail(self, message: str, line: int | None = None) -> InputError:
        return InputError(f"{self.origin} line {line or self.line}: {message}")

    def _advance(self, count: int = 1) -> None:
        if not self.fixed_line:
            self.line += self.s.count("\n", self.i, self.i + count)
        self.i += count

    def _parse_fragment(self, text: str, line: int) -> Word:
        return parse_fragment(text, self.origin, line)

    def read_word(self, extra_stop: str = "") -> Word:
        """Read one word up to an unquoted metacharacter."""
        start, line = self.i, self.line
        parts: list[Part] = []
        s = self.s
        while self.i < len(s):
            char = s[self.i]
            if char in META or char in extra_stop:
                break
            plain = None if extra_stop else _PLAIN.match(s, self.i)
            if plain:
                parts.append(Lit(plain.group(0), False))
                self._advance(plain.end() - self.i)
                continue
            parts.extend(self._read_unit(parts_so_far=parts, in_braces=False))
        return Word(tuple(merge_parts(parts)), s[start : self.i], line)

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
            return [DQ(tuple(self.read_dquoted(end='"')))]
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

    def read_dquoted(self, end: str | None) -> list[Part]:
        parts: list[Part] = []
        s, start_line = self.s, self.line
        while True:
            if self.i >= len(s):
                if end is None:
                    return merge_parts(parts)
                raise self.fail("a double quote is not closed", start_line)
            char = s[self.i]
            if char == end:
                self._advance()
                return merge_parts(parts)
            plain = _PLAIN_QUOTED.match(s, self.i)
            if plain:
                parts.append(Lit(plain.group(0), True))
                self._advance(plain.end() - self.i)
                continue
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
                hexa = _HEX.match(s, self.i + 1)
                octal = _OCTAL.match(s, self.i + 1)
                if nxt in escapes:
                    out.append(escapes[nxt])
                    self._advance(2)
                elif hexa:
                    out.append(chr(int(hexa.group(1), 16)))
                    self._advance(hexa.end() - self.i)
                elif octal:
                    out.append(chr(int(octal.group(0), 8) & 0xFF))
                    self._advance(octal.end() - self.i)
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
        match = _SIMPLE_PARAM.match(s, start)
        if match:
            self._advance(match.end() - start)
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
        sub = WordReader(text, self.origin, line, fixed_line=True)
        parts: list[Part] = []
        while sub.i < len(text):
            parts.extend(sub._read_unit(parts, in_braces=True))
        return Word(tuple(merge_parts(parts)), text, line)


def parse_fragment(text: str, origin: str, line: int) -> Word:
    """Parse `text` as the inside of double quotes (arithmetic bodies, array indices)."""
    parts = WordReader(text, origin, line, fixed_line=True).read_dquoted(end=None)
    return Word(tuple(parts), text, line)


def merge_parts(parts: list[Part]) -> list[Part]:
    """Join neighbouring literals of the same quoting into one (in linear time)."""
    merged: list[Part] = []
    run: list[str] = []
    quoted = False
    for part in parts:
        if isinstance(part, Lit) and (not run or part.quoted == quoted):
            run.append(part.text)
            quoted = part.quoted
            continue
        if run:
            merged.append(Lit("".join(run), quoted))
            run = []
        if isinstance(part, Lit):
            run, quoted = [part.text], part.quoted
        else:
            merged.append(part)
    if run:
        merged.append(Lit("".join(run), quoted))
    return merged
