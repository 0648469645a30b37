"""Where model arguments come from besides flags: YAML/JSON config files and training launch scripts.

Both give a flat dict of Megatron-LM arguments (names with underscores, as in inspector.inputs.arguments).
A launch script is interpreted as bash would run it, without running anything (inspector.inputs.bash.shell):
the training command is the one that launches a Python file (`torchrun ... pretrain_gpt.py ...`,
`python ...py`, `deepspeed ...py`, behind `srun`/`bash -c`/`eval` too); the arguments after the
`.py` are taken, and the launcher's options give the world size (inspector.inputs.launch).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError, InputError
from inspector.inputs.arguments import BY_NAME, ArgSpec
from inspector.inputs.bash.context import Command, Context, describe_unknown
from inspector.inputs.bash.interpreter import interpret
from inspector.inputs.launch import (
    Require,
    World,
    is_launch,
    program_arguments,
    sbatch_options,
    world_of,
)
from inspector.inputs.tokenizers import vocabulary
from inspector.inputs.unmodelled import IGNORED, REFUSED, RENAMED, refusal_message
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
    refused: tuple[tuple[str, str], ...] = ()  # (argument group, error) for refused arguments
    unrecognised: tuple[str, ...] = ()  # flags in none of Megatron-LM's tables we know


def convert(spec: ArgSpec, raw: Any, origin: str) -> Any:
    """Convert one value to the argument's type, or raise ConfigError naming where it came from."""
    if spec.type is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{origin}: {spec.flag} is a switch (true/false), got {raw!r}")
    try:
        value = spec.type(raw) if not isinstance(raw, bool) else None
    except (TypeError, ValueError):
        value = None
    if value is None or (spec.type is int and isinstance(raw, float) and raw != int(raw)):
        raise ConfigError(f"{origin}: {spec.flag} needs {spec.type.__name__} value, got {raw!r}")
    if spec.choices and value not in spec.choices:
        raise ConfigError(
            f"{origin}: {spec.flag} {value!r} is not one of: {', '.join(spec.choices)}"
        )
    return value


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON file of Megatron-LM arguments (keys with dashes or underscores)."""
    text = read_text(path)
    data = _parse_config(text, path)
    if not isinstance(data, dict):
        raise InputError(
            f"{path} must hold a mapping of Megatron-LM arguments, not {type(data).__name__}"
        )
    args: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, raw in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name in spelled:
            raise InputError(
                f"{path}: {spelled[name]!r} and {key!r} both set {BY_NAME[name].flag}"
                if name in BY_NAME
                else f"{path}: {spelled[name]!r} and {key!r} are the same argument"
            )
        spelled[name] = str(key)
        message = refusal_message("--" + name.replace("_", "-"), None if raw is True else str(raw))
        if name not in BY_NAME and message is not None:
            raise ConfigError(f"{path}: {message}")
        if name not in BY_NAME:
            close = difflib.get_close_matches(name, BY_NAME, n=1)
            hint = f" (did you mean {BY_NAME[close[0]].flag}?)" if close else ""
            raise ConfigError(f"{path}: unknown argument {key!r}{hint}")
        args[name] = convert(BY_NAME[name], raw, path)
    return args


def _parse_config(text: str, path: str) -> Any:
    if path.endswith(".json"):
        try:
            return json.loads(text, object_pairs_hook=_unique_pairs(path))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.load(text, Loader=_yaml_loader(path)) or {}  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            reason = getattr(exc, "problem", None) or "syntax error"
            raise InputError(f"{path}{where}: not valid YAML ({reason})") from None
    raise InputError(f"{path}: --config takes a .yaml, .yml or .json file")


def _unique_pairs(path: str) -> Any:
    """A json object_pairs_hook that refuses a repeated key (json keeps the last one)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise InputError(f"{path}: the key {key!r} appears twice")
            seen[key] = value
        return seen

    return hook


def _yaml_loader(path: str) -> Any:
    """A yaml SafeLoader that refuses a repeated key (PyYAML keeps the last one)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise InputError(
                        f"{path} line {line}: the key {key!r} appears twice (first on line "
                        f"{seen[key]})"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def read_launch_script(path: str, settings: Mapping[str, str] | None = None) -> ScriptArgs:
    """Read a training launch script file and return the arguments it passes.

    Args:
        path: the bash script.
        settings: `--set NAME=VALUE` values: the script's environment (and positional parameters
            under the names "1", "2", ...); a NAME assigned from a command's output takes it too.
    """
    return parse_launch_script(read_text(path), path, settings)


def parse_launch_script(
    text: str, origin: str, settings: Mapping[str, str] | None = None
) -> ScriptArgs:
    """Return the Megatron-LM arguments a bash launch script passes to its training program."""
    launch, world, require = interpret_launch(text, origin, settings)
    where = f"{launch.origin} line {launch.line}"
    raw: dict[str, str] = {}
    parsed = _arguments(program_arguments(launch.argv), where, require, launch.ctx, raw)
    args, ignored = dict(parsed.args), parsed.ignored
    notes: tuple[str, ...] = ()
    problem = ""
    if "--tokenizer-type" in raw:
        given = {flag: require(value, flag) for flag, value in raw.items()}
        vocab = vocabulary(given["--tokenizer-type"], given.get("--tokenizer-model"),
                           args.get("vocab_size"), given.get("--vocab-file"), where)  # fmt: skip
        if vocab.size is not None:
            args["vocab_size"] = vocab.size
        notes, problem = ((vocab.note,) if vocab.note else ()), vocab.problem
        ignored = tuple(f for f in ignored if f not in ("--tokenizer-type", "--tokenizer-model"))
    return ScriptArgs(
        args, ignored, world.size, world.origin, launch.observed, notes, problem,
        parsed.refused, parsed.unrecognised,
    )  # fmt: skip


@dataclass(frozen=True)
class _Launch:
    argv: tuple[str, ...]
    observed: tuple[str, ...]
    origin: str
    line: int
    ctx: Context


def interpret_launch(
    text: str, origin: str, settings: Mapping[str, str] | None = None
) -> tuple[_Launch, World, Require]:
    """Interpret a script as bash would; return its one training launch, its world, and a
    function that raises InputError for a value the script does not determine."""
    ctx = Context(origin, dict(settings or {}), is_launch)
    interpret(ctx, text)
    command = _the_launch(ctx, origin)

    def require(value: str, what: str) -> str:
        unknown = ctx.unknown_in(value)
        if unknown is None:
            return value
        message = describe_unknown(unknown, what, ctx.show(value))
        raise InputError(f"{command.origin} line {command.line}: {message}")

    where = f"{command.origin} line {command.line}"
    sbatch = sbatch_options(text) if command.origin == origin else ()
    world = world_of(command.argv, dict(command.env), where, require, sbatch)
    launch = _Launch(command.argv, command.observed, command.origin, command.line, ctx)
    return launch, world, require


def _the_launch(ctx: Context, origin: str) -> Command:
    if not ctx.commands:
        ended = f"; the script stops before any: {ctx.ended}" if ctx.ended else ""
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


def _short(ctx: Context, argv: tuple[str, ...]) -> str:
    text = ctx.show(" ".join(argv))
    return text if len(text) <= 60 else text[:57] + "..."


def _arguments(words: list[str], where: str, require: Require, ctx: Context,
               raw: dict[str, str]) -> ScriptArgs:  # fmt: skip
    """Split the program's words into modelled arguments and ignored flags; `raw` receives the
    values of the ignored flags that the tokenizer needs."""
    args: dict[str, Any] = {}
    ignored: list[str] = []
    refused: list[tuple[str, str]] = []
    unrecognised: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if ctx.unknown_in(word) and not word.startswith("--"):
            require(word, "an argument of the training command")
        if not word.startswith("--"):
            continue
        flag, _, inline = word.partition("=")
        require(flag, "an argument of the training command")
        name = flag[2:].replace("-", "_")
        spec = BY_NAME.get(name)
        takes_value = spec.type is not bool if spec else _looks_like_value(words, index)
        value = inline if inline else (words[index] if takes_value and index < len(words) else None)
        if takes_value and not inline:
            index += 1
        if spec is None and flag in RENAMED:
            name, meaning = RENAMED[flag]
            spec, value = BY_NAME[name], (value if meaning is None else str(meaning))
            if meaning is not None and takes_value and not inline:
                index -= 1  # a switch: the next word is not its value
        if spec is None:
            if flag in _TOKENIZER_FLAGS and value is not None:
                raw[flag] = value
            message = refusal_message(flag, value)
            if message is not None:
                refused.append((REFUSED[flag].group, f"{where}: {message}"))
            elif flag in REFUSED or flag in IGNORED:
                ignored.append(flag) if flag not in ignored else None
            elif flag not in unrecognised:
                unrecognised.append(flag)
            continue
        if spec.type is bool:
            args[spec.name] = True
            continue
        if value is None:
            raise ConfigError(f"{where}: {spec.flag} has no value")
        args[spec.name] = convert(spec, require(value, spec.flag), where)
    return ScriptArgs(
        args, tuple(ignored), refused=tuple(refused), unrecognised=tuple(unrecognised)
    )


_TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model", "--vocab-file")


def _looks_like_value(words: list[str], index: int) -> bool:
    return index < len(words) and not words[index].startswith("--")
