"""Bash integer arithmetic (`$(( ))`, `(( ))`, array indices), evaluated as bash does.

64-bit signed integers; `/` and `%` truncate toward zero as in C; names are variables whose values
are themselves evaluated; `=`, `+=`, ..., `++` and `--` assign. Precedence is bash's (the `ARITHMETIC
EVALUATION` section of bash(1)).
"""

from __future__ import annotations

import re

from inspector.inputs.bash.context import Host
from inspector.inputs.bash.runtime import MAX_NESTING

_TOKEN = re.compile(
    r"\s*(?:(0[xX][0-9a-fA-F]+|\d+#[0-9a-zA-Z@_]+|\d+)|([A-Za-z_]\w*)|"
    r"(\*\*=|<<=|>>=|\+\+|--|\*\*|<=|>=|==|!=|&&|\|\||<<|>>|[-+*/%&^|]=|[-+*/%<>=!~&^|?:(),]))"
)
_BINARY = [  # lowest precedence first
    ("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
    ("+", "-"), ("*", "/", "%"),
]  # fmt: skip
_LEVEL = {op: level for level, ops in enumerate(_BINARY) for op in ops}
_ASSIGN_OPS = ("=", "*=", "/=", "%=", "+=", "-=", "<<=", ">>=", "&=", "^=", "|=")


def _wrap(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _binary(op: str, a: int, b: int, shell: Host) -> int:
    if op in ("/", "%") and b == 0:
        raise shell.fail("division by 0 in arithmetic")
    if op == "/":
        quotient = abs(a) // abs(b)
        return _wrap(quotient if (a < 0) == (b < 0) else -quotient)
    if op == "%":
        rest = abs(a) % abs(b)
        return rest if a >= 0 else -rest
    if op == "**":
        if b < 0:
            raise shell.fail("exponent less than 0 in arithmetic")
        return _wrap(pow(a, b, 1 << 64))
    table = {
        "+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "<<": lambda: a << (b & 63),
        ">>": lambda: a >> (b & 63), "&": lambda: a & b, "|": lambda: a | b, "^": lambda: a ^ b,
        "<": lambda: int(a < b), ">": lambda: int(a > b), "<=": lambda: int(a <= b),
        ">=": lambda: int(a >= b), "==": lambda: int(a == b), "!=": lambda: int(a != b),
        "&&": lambda: int(bool(a) and bool(b)), "||": lambda: int(bool(a) or bool(b)),
    }  # fmt: skip
    return _wrap(table[op]())


class _Arith:
    def __init__(self, text: str, shell: Host, depth: int):
        self.shell, self.text, self.depth = shell, text, depth
        self.tokens: list[tuple[str, str]] = []
        position = 0
        while position < len(text):
            if not text[position:].strip():
                break
            match = _TOKEN.match(text, position)
            if not match or match.end() == position:
                raise shell.fail(f"`{text.strip()}` is not arithmetic bash can evaluate")
            number, name, op = match.groups()
            kind = "num" if number else "name" if name else "op"
            self.tokens.append((kind, number or name or op))
            position = match.end()
        self.pos = 0
        self.open = 0  # parentheses and unary operators open around the token being read

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise self.shell.fail(f"`{self.text.strip()}` ends too early for arithmetic")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def parse(self, evaluate: bool = True) -> int:
        if not self.tokens:
            return 0
        value = self.comma(evaluate)
        if self.pos != len(self.tokens):
            raise self.shell.fail(f"`{self.text.strip()}` is not arithmetic bash can evaluate")
        return value

    def comma(self, ev: bool) -> int:
        value = self.assignment(ev)
        while self.peek() == ",":
            self.take()
            value = self.assignment(ev)
        return value

    def assignment(self, ev: bool) -> int:
        if (self.pos + 1 < len(self.tokens) and self.tokens[self.pos][0] == "name"
                and self.tokens[self.pos + 1][1] in _ASSIGN_OPS):  # fmt: skip
            name = self.take()[1]
            op = self.take()[1]
            value = self.assignment(ev)
            if ev:
                if op != "=":
                    value = _binary(op[:-1], self.variable(name), value, self.shell)
                self.shell.assign(name, str(value))
            return value
        return self.ternary(ev)

    def ternary(self, ev: bool) -> int:
        cond = self.binary(0, ev)
        if self.peek() != "?":
            return cond
        self.take()
        yes = self.assignment(ev and bool(cond))
        if self.take()[1] != ":":
            raise self.shell.fail(f"`{self.text.strip()}`: `?` without `:` in arithmetic")
        no = self.assignment(ev and not cond)
        return yes if cond else no

    def binary(self, level: int, ev: bool) -> int:
        """Binary operators of precedence `level` or tighter (precedence climbing)."""
        value = self.power(ev)
        while True:
            op = self.peek() or ""
            op_level = _LEVEL.get(op, -1)
            if op_level < level:
                return value
            self.take()
            short = (op == "&&" and not value) or (op == "||" and value)
            right = self.binary(op_level + 1, ev and not short)
            if ev:
                value = int(bool(value)) if short else _binary(op, value, right, self.shell)

    def power(self, ev: bool) -> int:
        base = self.unary(ev)
        if self.peek() == "**":
            self.take()
            exponent = self.power(ev)
            return _binary("**", base, exponent, self.shell) if ev else 0
        return base

    def nest(self) -> None:
        self.open += 1
        if self.open > MAX_NESTING:
            raise self.shell.fail(f"`{_short(self.text)}` nests more than {MAX_NESTING} deep; "
                                  "the reader stops there")  # fmt: skip

    def unary(self, ev: bool) -> int:
        op = self.peek()
        if op in ("-", "+", "!", "~"):
            self.take()
            self.nest()
            value = self.unary(ev)
            self.open -= 1
            return {"-": -value, "+": value, "!": int(not value), "~": ~value}[op]
        if op in ("++", "--"):
            self.take()
            kind, name = self.take()
            if kind != "name":
                raise self.shell.fail(f"`{self.text.strip()}`: {op} needs a variable")
            value = self.variable(name) + (1 if op == "++" else -1)
            if ev:
                self.shell.assign(name, str(value))
            return value
        return self.postfix(ev)

    def postfix(self, ev: bool) -> int:
        kind, token = self.take()
        if token == "(":
            self.nest()
            value = self.comma(ev)
            self.open -= 1
            if self.take()[1] != ")":
                raise self.shell.fail(f"`{self.text.strip()}`: a `(` is not closed")
            return value
        if kind == "num":
            return _number(token, self.shell)
        if kind != "name":
            raise self.shell.fail(f"`{self.text.strip()}` is not arithmetic bash can evaluate")
        value = self.variable(token) if ev else 0
        if self.peek() in ("++", "--"):
            op = self.take()[1]
            if ev:
                self.shell.assign(token, str(value + (1 if op == "++" else -1)))
        return value

    def variable(self, name: str) -> int:
        values = self.shell.lookup(name, None)
        if values is None:  # bash reads an unset variable as 0 in arithmetic
            self.shell.read_unset_name(name)
            return 0
        text = self.shell.value(values[0], f"{name} in the arithmetic `{self.text.strip()}`")
        if self.depth > 32:
            raise self.shell.fail(f"{name} refers to itself in arithmetic")
        return _Arith(text, self.shell, self.depth + 1).parse()


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= 40 else text[:37] + "..."


def _number(token: str, shell: Host) -> int:
    try:
        if token.lower().startswith("0x"):
            return _wrap(int(token, 16))
        if "#" in token:
            base, digits = token.split("#")
            return _wrap(int(digits, int(base)))
        if token.startswith("0") and len(token) > 1:
            return _wrap(int(token, 8))
        return _wrap(int(token))
    except ValueError:
        raise shell.fail(f"{token} is not a number bash can read") from None


def evaluate_arith(text: str, shell: Host) -> int:
    """Evaluate a bash arithmetic expression (already parameter-expanded)."""
    return _Arith(text, shell, 0).parse()
