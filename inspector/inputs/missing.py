"""Values a launch script leaves unset where the model or layout needs them, gathered so that one
`Error:` names them all with the one `--set` line that supplies them.

A fresh login shell reads an unset variable as empty; so does the reader, in conditions and
arithmetic. Only where such a value reaches a modelled argument (`--hidden-size $HIDDEN`) or the
launcher's world (`--nproc_per_node $GPUS`) is it missing: Megatron-LM would get no number there.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from inspector.errors import InputError
from inspector.inputs.bash.context import Context, Unknown, describe_unknown

# a tokenizer value left unset (its key is the vocabulary it decides): what giving it leads to
_VOCABULARY = ("; the tokenizer's vocabulary is then read from that file where it is on this "
               "machine (or from a tokenizer this tool knows); --vocab-size gives it otherwise")
WORLD = "data_parallel_size"  # the key of a launcher's counts: --dp stands in for them
NO_FLAG = ""  # the key of a value no flag can stand in for (a word that could hold any flag)


@dataclass(frozen=True)
class Missing:
    """One value the model or layout needs that the script does not determine."""

    key: str  # the Megatron-LM argument a command-line flag may give instead, WORLD or NO_FLAG
    what: str  # "--hidden-size", "torchrun's GPUs per node"
    shown: str  # the value as written, with its unknowns shown: "$HIDDEN", "$((NODES*8))"
    unknown: Unknown  # the first unknown it holds
    where: str  # "train.sh line 40"


class Needs:
    """Collects what the model or layout needs of a script; `need` returns the value or None."""

    def __init__(self, ctx: Context, where: str):
        self.ctx, self.where = ctx, where
        self.missing: list[Missing] = []

    def need(self, text: str, what: str, key: str) -> str | None:
        unknown = self.ctx.unknown_in(text)
        if unknown is None:
            return text
        self.missing.append(Missing(key, what, self.ctx.show(text), unknown, self.where))
        return None

    def for_key(self, key: str):  # noqa: ANN201 - a launch.Require
        return lambda text, what: self.need(text, what, key)


def raise_missing(missing: Collection[Missing], given: Collection[str], refused: str = "") -> None:
    """Raise one InputError naming every missing value that no command-line flag gives, after
    `refused` (the script's refusals that stop every command), so one error names all."""
    message = missing_message(missing, given, vocabulary_hint=not refused)
    if message is not None:
        raise InputError(f"{refused}; {message}" if refused else message)


def missing_message(missing: Collection[Missing], given: Collection[str],
                    vocabulary_hint: bool = True) -> str | None:  # fmt: skip
    """Return the sentence naming every missing value that no command-line flag gives, or None
    (with what a tokenizer value leads to, unless the model is refused anyway)."""
    left = [item for item in missing if item.key == NO_FLAG or item.key not in given]
    if not left:
        return None
    tokenizer = vocabulary_hint and any(item.key == "vocab_size" for item in left)
    vocabulary = _VOCABULARY if tokenizer else ""
    if len(left) == 1:
        item = left[0]
        return f"{item.where}: {describe_unknown(item.unknown, item.what, item.shown)}{vocabulary}"
    clauses, hints, by_flag = [], [], []
    one_place = len({item.where for item in left}) == 1
    for item in left:
        unknown = item.unknown
        if item.shown != unknown.text:
            clause = f"{item.what} is {item.shown}, where {unknown.text} is a value {unknown.reason}"
        else:
            clause = f"{item.what} is {unknown.text}, {unknown.reason}"
        clauses.append(clause if one_place else f"{clause} ({item.where})")
        if unknown.hint is None:
            by_flag.append(item.what)
        elif f"--set {unknown.hint}=VALUE" not in hints:
            hints.append(f"--set {unknown.hint}=VALUE")
    how = [f"give them with {' '.join(hints)}"] if hints else []
    if by_flag:
        how.append(f"give {', '.join(by_flag)} with {'its' if len(by_flag) == 1 else 'their'} "
                   "own flag instead")  # fmt: skip
    origin = left[0].where if one_place else left[0].where.rsplit(" line ", 1)[0]
    return (f"{origin}: the model and layout need {len(left)} values the script leaves unset: "
            f"{'; '.join(clauses)}; {'; '.join(how)}{vocabulary}")  # fmt: skip
