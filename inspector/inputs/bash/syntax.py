"""The syntax tree of a parsed bash script: words (keeping their quoting structure) and commands.

The syntax tree keeps each word's structure (quoted and unquoted text, `$VAR`, `${V:-x}`, `$((..))`,
`$(..)`) because bash's word splitting depends on it. Line numbers ride on words and commands so that
errors name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------- words


@dataclass(frozen=True, slots=True)
class Lit:
    """Literal text; `quoted` when it came from quotes or a backslash (never split or globbed)."""

    text: str
    quoted: bool


@dataclass(frozen=True, slots=True)
class Param:
    """A parameter expansion: `$NAME`, `${NAME[index]}`, `${NAME:-word}`, `${#NAME}`, ..."""

    name: str
    op: str = ""  # "", ":-", "-", ":=", "=", ":+", "+", ":?", "?", "#", "##", "%", "%%", "/", "//",
    #                 "len", ":" (substring), "^^", ",,"
    arg: Word | None = None
    arg2: Word | None = None  # replacement of `/`, length of `:`
    index: str | None = None  # "@", "*", or an arithmetic expression
    text: str = ""  # as written, for messages


@dataclass(frozen=True, slots=True)
class Arith:
    """`$(( expression ))`; the expression is expanded like a double-quoted string first."""

    body: Word
    text: str


@dataclass(frozen=True, slots=True)
class CmdSub:
    """`$( command )` or a backquoted command: its output is not known without running it."""

    script: str
    text: str


@dataclass(frozen=True, slots=True)
class DQ:
    """A double-quoted region."""

    parts: tuple[Part, ...]


Part = Lit | Param | Arith | CmdSub | DQ


@dataclass(frozen=True, slots=True)
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


@dataclass(slots=True)
class Assign:
    name: str
    append: bool
    value: Word | None  # scalar value
    array: tuple[Word, ...] | None = None  # `NAME=( ... )`
    index: str | None = None  # `NAME[index]=value`
    line: int = 0


@dataclass(slots=True)
class HereDoc:
    """A here-document (`<<EOF`): its lines, read after the command's line."""

    delimiter: str
    strip_tabs: bool
    quoted: bool  # `<<'EOF'`: no expansion
    line: int  # where its first line stands
    lines: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Simple:
    assigns: list[Assign]
    words: list[Word | Assign]  # an Assign among words: `declare -a A=( ... )`
    line: int
    stdin: HereDoc | None = None  # a here-document on its input (`sbatch <<EOF`)


@dataclass(slots=True)
class Pipeline:
    commands: list[Node]
    negate: bool
    line: int


@dataclass(slots=True)
class AndOr:
    first: Node
    rest: list[tuple[str, Node]]


@dataclass(slots=True)
class Seq:
    items: list[tuple[Node, bool]]  # (command, run in background)


@dataclass(slots=True)
class If:
    clauses: list[tuple[Seq, Seq]]
    otherwise: Seq | None


@dataclass(slots=True)
class Case:
    word: Word
    items: list[tuple[list[Word], Seq]]
    line: int


@dataclass(slots=True)
class For:
    name: str
    words: list[Word] | None
    body: Seq
    line: int


@dataclass(slots=True)
class While:
    cond: Seq
    body: Seq
    until: bool
    line: int


@dataclass(slots=True)
class Group:
    body: Seq
    subshell: bool


@dataclass(slots=True)
class FuncDef:
    name: str
    body: Node


@dataclass(slots=True)
class CondExpr:
    """`[[ ... ]]`: its words, with `&&`, `||`, `(`, `)`, `<`, `>` kept as plain words."""

    words: list[Word]
    line: int


@dataclass(slots=True)
class ArithCmd:
    body: Word
    line: int


Node = (
    Simple | Pipeline | AndOr | Seq | If | Case | For | While | Group | FuncDef | CondExpr | ArithCmd
)


def part_types(word: Word) -> set[type]:
    """The kinds of parts a word holds, inside quotes and `${V:-x}` defaults too."""
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
