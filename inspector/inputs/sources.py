"""Where model arguments come from besides flags: YAML/JSON config files and training launch scripts.

Both give a flat dict of Megatron-LM arguments (names with underscores, as in inspector.inputs.arguments).
A launch script is interpreted as bash would run it, without running anything (inspector.inputs.bash.shell):
the training command is the one that launches a Python file (`torchrun ... pretrain_gpt.py ...`,
`python ...py`, `deepspeed ...py`, behind `srun`/`bash -c`/`eval` too); the arguments after the
`.py` are taken, and the launcher's options give the world size (inspector.inputs.launch).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from inspector.errors import ConfigError, InputError
from inspector.inputs import ignored_values
from inspector.inputs.arguments import BY_NAME
from inspector.inputs.bash.context import Command, Context
from inspector.inputs.bash.interpreter import interpret
from inspector.inputs.entry_points import entry_point, program_checks, refuse_speculative
from inspector.inputs.ignored import IGNORED
from inspector.inputs.launch import (
    World,
    is_launch,
    module_as_file,
    program_arguments,
    world_of,
)
from inspector.inputs.missing import NO_FLAG, WORLD, Needs, raise_missing
from inspector.inputs.model_arguments import ArgSpec
from inspector.inputs.refusals import (
    Refused,
    fsdp2_drops_fp8_param_gather,
    fsdp_connections_refusal,
    refusals_message,
    refused_argument,
    refused_flags,
    refused_value,
)
from inspector.inputs.safe_parse import Repeated, parse_json, parse_yaml
from inspector.inputs.tokenizers import TOKENIZER_FLAGS, apply_tokenizer
from inspector.inputs.unmodelled import MEGATRON_LM_REFUSES, REFUSED, RENAMED
from inspector.output import read_text


@dataclass(frozen=True)
class ScriptArgs:
    """What a launch script sets: the arguments we model, the ones we do not (in order), and the
    world its launcher starts (None when the job's environment decides it; `world_origin` says
    where the size came from, or why it is not known)."""

    args: dict[str, Any]
    ignored: tuple[str, ...]
    world_size: int | None = None
    world_origin: str = ""
    launch: tuple[str, ...] = ()  # the launch command as bash runs it, from the launcher on
    notes: tuple[str, ...] = ()  # how a value was derived (the tokenizer's vocabulary), for stderr
    vocab_problem: str = ""  # an error unless the command line gives --vocab-size
    refused: tuple[Refused, ...] = ()  # arguments refused (inspector.inputs.refusals)
    unrecognised: tuple[str, ...] = ()  # flags in none of Megatron-LM's tables we know


def convert(spec: ArgSpec, raw: Any, origin: str) -> Any:
    """Convert one value to the argument's type, or raise ConfigError naming where it came from."""
    if spec.type is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{origin}: {spec.flag} is a switch (true/false), got {raw!r}")
    if spec.many and isinstance(raw, list):
        raw = " ".join(str(item) for item in raw)  # a config file's list for an nargs='*' flag
    try:
        value = spec.type(raw) if not isinstance(raw, bool) else None
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(.inf)
        value = None
    fraction = value is not None and spec.type is int and isinstance(raw, float) and raw != int(raw)
    if value is None or fraction or value != value:  # value != value: a NaN, no size or rate
        raise ConfigError(f"{origin}: {spec.flag} needs {spec.type.__name__} value, got {raw!r}")
    if spec.choices and value not in spec.choices:
        raise ConfigError(
            f"{origin}: {spec.flag} {value!r} is not one of: {', '.join(spec.choices)}"
        )
    return value


def parse_config(text: str, path: str, repeated: list[Repeated] | None = None) -> Any:
    """Return a config file's data; `repeated`: see safe_parse.parse_yaml (YAML only)."""
    if path.endswith(".json"):
        return parse_json(text, path)
    if path.endswith((".yaml", ".yml")):
        return parse_yaml(text, path, repeated) or {}
    raise InputError(f"{path}: --config takes a .yaml, .yml or .json file")


def read_launch_script(path: str, settings: Mapping[str, str] | None = None,
                       given: Collection[str] = ()) -> ScriptArgs:  # fmt: skip
    """Read a training launch script file and return the arguments it passes.

    Args:
        path: the bash script.
        settings: `--set NAME=VALUE` values: the script's environment (and positional parameters
            under the names "1", "2", ...); a NAME assigned from a command's output takes it too.
        given: the arguments the command line gives (a value the script leaves unset is then
            not missing); "data_parallel_size" stands in for the launcher's counts.
    """
    return parse_launch_script(read_text(path), path, settings, given)


def parse_launch_script(text: str, origin: str, settings: Mapping[str, str] | None = None,
                        given: Collection[str] = ()) -> ScriptArgs:  # fmt: skip
    """Return the Megatron-LM arguments a bash launch script passes to its training program;
    raise one error naming every value it leaves unset that the model or layout needs."""
    launch, world, needs = interpret_launch(text, origin, settings)
    where = f"{launch.origin} line {launch.line}"
    raw: dict[str, str] = {}
    try:
        parsed = split_arguments(program_arguments(launch.argv), needs, launch.ctx, raw)
    except ConfigError:  # a word its argparse refuses: a program not GPT training says so first
        program_checks(launch.argv, launch.ctx.show, (), where)
        raise
    args, ignored = dict(parsed.args), parsed.ignored
    flags = {BY_NAME[name].flag for name in args} | set(parsed.ignored) | refused_flags(parsed.refused)
    program, refused = program_checks(launch.argv, launch.ctx.show, flags, where, args)
    refused, dropped = fsdp2_drops_fp8_param_gather((*refused, *parsed.refused), args)
    value = launch.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    refused += fsdp_connections_refusal(args, value and launch.ctx.bash_value(value), where)
    own = f"{origin} line "  # the script's own lines: "line 12: ..." under "Note from SCRIPT"
    read = (note.replace(own, "line ", 1) if note.startswith(own) else note
            for note in launch.ctx.notes)  # fmt: skip
    connections = connections_note(launch, args, where.replace(own, "line ", 1))
    notes: tuple[str, ...] = (*read, *program, *dropped, *((connections,) if connections else ()))
    if "--tokenizer-type" in raw:
        raw = {flag: needs.need(value, flag, "vocab_size") or launch.ctx.show(value)
               for flag, value in raw.items()}  # fmt: skip
    # a model refused whatever its values: named in the same error as the values left unset
    raise_missing(needs.missing, given, refusals_message(refused, ("model",)))
    args, ignored, vocab_notes, problem = apply_tokenizer(args, ignored, raw, where)
    notes += vocab_notes
    return ScriptArgs(
        args, ignored, world.size, world.origin, launch.observed, notes, problem,
        refused, parsed.unrecognised,
    )  # fmt: skip


@dataclass(frozen=True)
class _Launch:
    argv: tuple[str, ...]
    observed: tuple[str, ...]
    origin: str
    line: int
    ctx: Context
    env: Mapping[str, str] = field(default_factory=dict)  # what the launched command sees


# Megatron-LM's validate_args (core_v0.13.1 to core_v0.16.1, the same text): with tp or cp above 1
# on GPUs before Blackwell, unless FSDP or the MoE all-to-all overlap (which only warn),
# `assert os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') == "1"`.
_CONNECTIONS = ("Using tensor model parallelism or context parallelism require setting the "
                "environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1")  # fmt: skip


def connections_note(launch: _Launch, args: Mapping[str, Any], where: str) -> str | None:
    """Return a note where Megatron-LM would stop on a GPU before Blackwell because the launch
    does not set CUDA_DEVICE_MAX_CONNECTIONS=1 (None where it sets it, or the check is off)."""
    if (args.get("tensor_model_parallel_size") or 1) <= 1 and (
            args.get("context_parallel_size") or 1) <= 1:  # fmt: skip
        return None
    if any(args.get(name) for name in ("use_megatron_fsdp", "use_torch_fsdp2",
                                       "overlap_moe_expert_parallel_comm")):  # fmt: skip
        return None
    value = launch.env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value is not None:
        value = launch.ctx.bash_value(value)
        if value is None or value == "1":  # a value only the job's machine knows: no claim
            return None
    given = "does not set it" if value is None else f"sets {value!r}"
    return (f"{where}: on GPUs before Blackwell (H100, A100) Megatron-LM stops here: tp or cp above "
            f"1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 and the launch {given} (validate_args: "
            f"'{_CONNECTIONS}'); on B200 and GB200 it runs")


def interpret_launch(
    text: str, origin: str, settings: Mapping[str, str] | None = None
) -> tuple[_Launch, World, Needs]:
    """Interpret a script as bash would; return its one training launch, its world, and what
    the model and layout need of it (Needs gathers the values the script leaves unset)."""
    ctx = Context(origin, dict(settings or {}), is_launch, program_of=module_as_file)
    try:
        interpret(ctx, text)
    except InputError as error:  # a syntax error, say: a program not GPT training still says why
        if not ctx.commands:
            _refuse_written_program(text, origin, str(error))
        else:  # bash ran the launch before it reached the error
            first = ctx.commands[0]
            program = next((w for i, w in enumerate(first.argv) if i and w.endswith(".py")), "")
            entry_point(ctx.show(program), f"{first.origin} line {first.line}")
        raise
    refuse_speculative([(c.argv, f"{c.origin} line {c.line}") for c in (*ctx.commands, *ctx.skipped)],
                       ctx.show)  # fmt: skip
    command = _the_launch(ctx, origin, text)
    where = f"{command.origin} line {command.line}"
    needs = Needs(ctx, where)
    world = world_of(command.argv, dict(command.env), where, needs.for_key(WORLD), command.batch,
                     command.outer)
    observed = tuple(_as_bash(ctx, word) for word in command.observed if not ctx.is_unset(word))
    launch = _Launch(command.argv, observed, command.origin, command.line, ctx, dict(command.env))
    return launch, world, needs


def _as_bash(ctx: Context, word: str) -> str:
    """A word of the launch as bash passes it: placeholders' values; the rest shown as written."""
    value = ctx.bash_value(word)
    return value if value is not None else ctx.show(word)


def _the_launch(ctx: Context, origin: str, text: str) -> Command:
    if not ctx.commands:
        if ctx.ended:
            _refuse_written_program(text, origin, ctx.ended)
        ended = f"; the script stops before any: {ctx.ended}" if ctx.ended else ""
        # the test whose branch exits names what decided it; otherwise every unset value read
        guard = {name: ctx.unset_read[name] for name in ctx.guard if name in ctx.unset_read}
        unset = guard or ctx.unset_read
        if ctx.ended and unset:
            found = ", ".join(f"${name} ({where})" for name, where in unset.items())
            ended += (f"; unset on the way: {found}; give "
                      f"{'it' if len(unset) == 1 else 'them'} with "
                      + " ".join(f"--set {name}=VALUE" for name in unset))  # fmt: skip
        raise InputError(
            f"{origin}: found no training command (a line running torchrun/python/deepspeed on a "
            f".py file){ended}"
        )
    first = ctx.commands[0]
    for other in ctx.commands[1:]:
        if other.observed != first.observed:
            raise InputError(
                f"{origin}: the script runs two different training commands, "
                f"{first.origin} line {first.line} ({_short(ctx, first.argv)}) and "
                f"{other.origin} line {other.line} ({_short(ctx, other.argv)}); keep one"
            )
    return first


_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_LAUNCHERS = ("torchrun", "deepspeed", "srun", "uv", "env", "exec")


def _refuse_written_program(text: str, origin: str, ended: str) -> None:
    """Raise the entry-point error where a script that stops before its launch (a guard's
    `exit 1` on a value its caller gives, a placeholder bash cannot parse) launches, as written
    after that, a program that is not GPT training: no --set would make it readable. The
    script's lines are read as words, not run: a line starting with a launcher (torchrun,
    python, ..., or a variable holding one) and naming a `.py` file or a `-m` module."""
    for line, words in _written_commands(text):
        first = next((w for w in words if not _ASSIGNMENT.match(w)), "")
        name = first.strip("\"'${}").rsplit("/", 1)[-1]
        launcher = first.strip("\"'").startswith("$")  # ModelOpt's ${LAUNCH_SCRIPT} file.py
        if not (launcher or name in _LAUNCHERS or "python" in name.lower()):
            continue
        argv = [first.strip("\"'"), *(w.strip("\"'") for w in words[words.index(first) + 1:])]
        argv = list(module_as_file(["python", *argv[1:]]))[1:] if "-m" in argv else argv[1:]
        program = next((w for w in argv if w.endswith(".py")), None)
        if program is None:
            continue
        # `${SCRIPT_DIR}/generate.py` (ModelOpt's): the folder is taken as the script's own
        here = re.sub(r"^\$\{?\w+\}?/", posixpath.dirname(origin) + "/", program)
        try:
            entry_point(program, f"{origin} line {line}")
            if here != program:
                entry_point(here, f"{origin} line {line}")
        except InputError as refused:
            raise InputError(f"{refused} (read from the script as written; it stops before "
                             f"that line: {ended})") from None  # fmt: skip
        return


def _written_commands(text: str) -> list[tuple[int, list[str]]]:
    """Return the script's logical lines (backslash continuations joined) as words, each with
    its first line's number; comments and blank lines left out."""
    found: list[tuple[int, list[str]]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        words = (pending + raw).split()
        pending = ""
        if words and not words[0].startswith("#"):
            found.append((start, words))
    return found


def _short(ctx: Context, argv: tuple[str, ...]) -> str:
    text = ctx.show(" ".join(argv))
    return text if len(text) <= 60 else text[:57] + "..."


# Refused or ignored arguments that take nargs='*' in Megatron-LM's arguments.py (shown whole)
_UNMODELLED_MANY = frozenset({"--spec"})


def split_arguments(words: list[str], needs: Needs, ctx: Context,
                    raw: dict[str, str]) -> ScriptArgs:  # fmt: skip
    """Split the program's words into modelled arguments and ignored flags; `raw` receives the
    values of the ignored flags that the tokenizer needs. An unset value where a flag stands is
    dropped, as bash drops it; one a modelled flag needs is missing (`needs` records it)."""
    where = needs.where
    args: dict[str, Any] = {}
    skipped = _Unmodelled()
    index = 0
    after = ""  # the modelled flag (and its one value) just read: a plain word next is refused
    while index < len(words):
        word = words[index]
        index += 1
        # '' and "$UNSET" are one empty word (bash passes it), bare $UNSET none (bash drops it)
        empty = ctx.bash_value(word) == ""
        if empty and not ctx.is_unset(word):
            _refuse_empty_word(words, index - 1, ctx, where)
        if ctx.unknown_in(word) and not word.startswith("--") and not empty:
            needs.need(word, "an argument of the training command", NO_FLAG)
        elif after and not empty and not word.startswith("-"):
            raise ConfigError(f"{where}: {word!r} follows {after}, which takes no further value "
                              "(Megatron-LM's argparse refuses it as an unrecognised argument)")  # fmt: skip
        after = ""
        if word == "--" or (word[:1] == "-" and word[1:2].isalpha()):  # never skipped: dropped
            raise ConfigError(f"{where}: {word!r} is not a Megatron-LM argument (they begin with "
                              "'--'); Megatron-LM's argparse refuses it as an unrecognised argument")
        if not word.startswith("--"):
            continue
        flag, equals, inline = word.partition("=")
        if needs.need(flag, "an argument of the training command", NO_FLAG) is None:
            continue
        name = flag[2:].replace("-", "_")
        spec = BY_NAME.get(name)
        typed = spec is None and flag in IGNORED and flag not in RENAMED  # argparse's own kind
        if spec is not None:
            takes_value = spec.type is not bool
        else:
            takes_value = not (typed and ignored_values.switch(flag)) and _looks_like_value(words, index)
        value = inline if inline else (words[index] if takes_value and index < len(words) else None)
        if takes_value and not inline:
            index += 1
        named = BY_NAME[RENAMED[flag][0]] if spec is None and flag in RENAMED else spec
        many = named.many if named is not None else flag in _UNMODELLED_MANY | ignored_values.MANY
        while many and not inline and _looks_like_value(words, index):
            value, index = f"{value} {words[index]}", index + 1  # nargs='*': the words that follow
        switch = spec is not None and spec.type is bool or typed and ignored_values.switch(flag)
        if spec is None and flag in RENAMED:
            name, meaning = RENAMED[flag]
            spec, value = BY_NAME[name], (value if meaning is None else str(meaning))
            switch = meaning is not None or spec.type is bool
            if meaning is not None and takes_value and not inline:
                index -= 1  # a switch: the next word is not its value
        if switch and equals:
            raise ConfigError(f"{where}: {flag} is a switch and takes no value; Megatron-LM's "
                              f"argparse refuses {word}")  # fmt: skip
        if spec is None:
            _refuse_abbreviation(flag, where)
            if typed and not switch and not (value and ctx.unknown_in(value)):
                ignored_values.check_value(flag, value, where)
            if typed and (switch or ignored_values.one_value(flag)):
                after = flag if switch else f"{flag} {ctx.show(value or '')}"
            if flag in TOKENIZER_FLAGS and value is not None:
                raw[flag] = value
            skipped.add(flag, value, where)
            continue
        refusal = refused_value(spec.flag, value, where)
        if refusal is not None:
            skipped.refused.append(refusal)
            continue
        _take_modelled(spec, value, needs, args)
        if not spec.many:
            after = flag if switch else f"{flag} {value}"
    return skipped.script_args(args)


def _refuse_empty_word(words: list[str], index: int, ctx: Context, where: str) -> None:
    """Refuse an empty word where a flag should be: Megatron-LM's argparse reads it as a
    positional argument, which its parser has none of, and stops ("unrecognized arguments: ")."""
    shown = ctx.show(words[index]) or "''"
    before = [word for word in words[:index] if not ctx.is_unset(word)]
    place = f"after {ctx.show(before[-1]) or repr('')}" if before else "first"
    unset = [unknown for unknown in ctx.held(words[index]) if unknown.hint]
    how = (f"; {unset[0].text} is a value {unset[0].reason}: give it with --set "
           f"{unset[0].hint}=VALUE or drop the word") if unset else ""  # fmt: skip
    raise ConfigError(f"{where}: argument {len(before) + 1} of the training program ({place}) is "
                      f"an empty word, {shown}, where a flag should be; Megatron-LM's argparse "
                      f"stops on it as an unrecognised argument{how}")  # fmt: skip


def _refuse_abbreviation(flag: str, where: str) -> None:
    """Refuse a flag that only begins a Megatron-LM argument: Megatron-LM's parser is built with
    allow_abbrev=False (megatron/training/arguments.py parse_args), so it stops on it."""
    tables = (IGNORED, REFUSED, RENAMED, MEGATRON_LM_REFUSES)
    if len(flag) < 4 or any(flag in table for table in tables):
        return
    known = sorted({spec.flag for spec in BY_NAME.values()}.union(*tables))
    meant = [name for name in known if name.startswith(flag)]
    if meant:
        shown = ", ".join(meant[:3]) + (", ..." if len(meant) > 3 else "")
        raise ConfigError(f"{where}: {flag} is not a Megatron-LM argument but the start of {shown}; "
                          "Megatron-LM's parser takes no abbreviations (allow_abbrev=False) and "
                          "stops on it as an unrecognised argument; spell it out")  # fmt: skip


def _take_modelled(spec: ArgSpec, value: str | None, needs: Needs, args: dict[str, Any]) -> None:
    """Record a modelled flag: a switch is True; a value a flag needs but the script leaves unset
    is missing (`needs` records it)."""
    if spec.type is bool:  # a BooleanOptionalAction's `--no-` spelling (RENAMED) reads "False"
        args[spec.name] = value != str(False)
        return
    if value is None:
        raise ConfigError(f"{needs.where}: {spec.flag} has no value")
    known = needs.need(value, spec.flag, spec.name)
    if known is not None:
        args[spec.name] = convert(spec, known, needs.where)


@dataclass
class _Unmodelled:
    """The flags a script passes that no row of the argument table models, in order of use."""

    ignored: list[str] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    unrecognised: list[str] = field(default_factory=list)

    def script_args(self, args: dict[str, Any]) -> ScriptArgs:
        """Return the script's modelled `args` with these flags beside them."""
        return ScriptArgs(
            args, tuple(self.ignored), refused=tuple(self.refused), unrecognised=tuple(self.unrecognised)
        )

    def add(self, flag: str, value: str | None, where: str) -> None:
        """File `flag` as refused (with why), ignored, or not recognised, each once."""
        refusal = refused_argument(flag, value, where)
        if refusal is not None:
            self.refused.append(refusal)
        elif flag in REFUSED or flag in IGNORED:
            if flag not in self.ignored:
                self.ignored.append(flag)
        elif flag not in self.unrecognised:
            self.unrecognised.append(flag)


def _looks_like_value(words: list[str], index: int) -> bool:
    return index < len(words) and not words[index].startswith("--")
