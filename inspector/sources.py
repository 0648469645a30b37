"""Where model arguments come from besides flags: YAML/JSON config files and training launch scripts.

Both give a flat dict of Megatron-LM arguments (names with underscores, as in inspector.arguments).
A launch script is read the way bash would expand it, without running it: variables assigned
earlier (`HIDDEN=4096`, `export TP=8`, `${VAR:-default}`), arrays (`GPT_ARGS=( ... )` used as
`"${GPT_ARGS[@]}"`), string variables used unquoted (`$GPT_ARGS`), comments and line continuations.
The training command is the line that launches a Python file (`torchrun ... pretrain_gpt.py ...`,
`python ...py`, `deepspeed ...py`); the arguments after the `.py` are taken.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from dataclasses import dataclass
from typing import Any

from inspector.arguments import BY_NAME, ArgSpec
from inspector.errors import ConfigError, InputError
from inspector.output import read_text

UNSET = "\x00unset:{}\x00"  # stands for a variable the script never sets
_UNSET = re.compile("\x00unset:([^\x00]*)\x00")
_VARIABLE = re.compile(
    r'"\$\{(\w+)\[@\]\}"|\$\{(\w+)\[@\]\}|\$\{(\w+):-([^}]*)\}|\$\{(\w+)\}|\$(\w+)|\$\(\(?'
)
_ASSIGNMENT = re.compile(
    r"^(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+)?([A-Za-z_]\w*)=(.*)$", re.S
)


@dataclass(frozen=True)
class ScriptArgs:
    """What a launch script sets: the arguments we model, and the ones we do not (in order)."""

    args: dict[str, Any]
    ignored: tuple[str, ...]


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
    args = {}
    for key, raw in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in BY_NAME:
            close = difflib.get_close_matches(name, BY_NAME, n=1)
            hint = f" (did you mean {BY_NAME[close[0]].flag}?)" if close else ""
            raise ConfigError(f"{path}: unknown argument {key!r}{hint}")
        args[name] = convert(BY_NAME[name], raw, path)
    return args


def _parse_config(text: str, path: str) -> Any:
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            reason = getattr(exc, "problem", None) or "syntax error"
            raise InputError(f"{path}{where}: not valid YAML ({reason})") from None
    raise InputError(f"{path}: --config takes a .yaml, .yml or .json file")


def read_launch_script(path: str) -> ScriptArgs:
    """Read a training launch script file and return the arguments it passes."""
    return parse_launch_script(read_text(path), path)


def parse_launch_script(text: str, origin: str) -> ScriptArgs:
    """Return the Megatron-LM arguments a bash launch script passes to its training program."""
    variables: dict[str, str | list[str]] = {}
    for line in _logical_lines(text):
        assignment = _ASSIGNMENT.match(line)
        if assignment and not line.startswith(("torchrun", "python", "deepspeed")):
            name, value = assignment.groups()
            variables[name] = _assigned_value(value, variables)
            continue
        words = _words(_expand(line, variables))
        program = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if program is not None and _is_launch(words[:program]):
            return _arguments(words[program + 1 :], origin)
    raise InputError(
        f"{origin}: found no training command (a line running torchrun/python/deepspeed on a .py file)"
    )


def _logical_lines(text: str) -> list[str]:
    """Join continuations and multi-line arrays; drop comments and blank lines."""
    lines: list[str] = []
    pending = ""
    for raw in text.replace("\\\n", " ").splitlines():
        stripped = _strip_comment(raw).strip()
        if not stripped and not pending:
            continue
        pending = f"{pending} {stripped}".strip() if pending else stripped
        if pending.count("(") > pending.count(")") or pending.count('"') % 2:
            continue  # an array assignment or a quoted string still open
        lines.append(pending)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def _strip_comment(line: str) -> str:
    quote = None
    for index, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def _assigned_value(value: str, variables: dict[str, str | list[str]]) -> str | list[str]:
    value = value.strip()
    if value.startswith("(") and value.endswith(")"):
        return _words(_expand(value[1:-1], variables))
    words = _words(_expand(value, variables))
    return " ".join(words)


def _expand(text: str, variables: dict[str, str | list[str]]) -> str:
    """Substitute $VAR, ${VAR}, ${VAR:-default} and arrays; unknown ones become UNSET markers."""

    def value_of(name: str, default: str | None = None) -> str:
        value = variables.get(name)  # the caller's environment is not the job's: not read
        if value is None:
            return default if default is not None else UNSET.format(name)
        return " ".join(shlex.quote(v) for v in value) if isinstance(value, list) else value

    def replace(match: re.Match[str]) -> str:
        quoted_array, array, with_default, default, braced, plain = match.groups()
        if quoted_array or array:
            return value_of(quoted_array or array)
        if with_default:
            return value_of(with_default, default)
        if braced or plain:
            return value_of(braced or plain)
        return UNSET.format("$(...)")  # command or arithmetic substitution: not run

    return _VARIABLE.sub(replace, text)


def _words(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError:
        return text.split()


def _is_launch(prefix: list[str]) -> bool:
    launchers = ("torchrun", "python", "python3", "deepspeed", "srun", "mpirun")
    return any(os.path.basename(word).startswith(launchers) for word in prefix)


def _arguments(words: list[str], origin: str) -> ScriptArgs:
    args: dict[str, Any] = {}
    ignored: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if not word.startswith("--"):
            continue
        flag, _, inline = word.partition("=")
        name = flag[2:].replace("-", "_")
        spec = BY_NAME.get(name)
        takes_value = spec.type is not bool if spec else _looks_like_value(words, index)
        value = inline if inline else (words[index] if takes_value and index < len(words) else None)
        if takes_value and not inline:
            index += 1
        if spec is None:
            if flag not in ignored:
                ignored.append(flag)
            continue
        args[name] = True if spec.type is bool else _resolved(spec, value, origin)
    return ScriptArgs(args, tuple(ignored))


def _looks_like_value(words: list[str], index: int) -> bool:
    return index < len(words) and not words[index].startswith("--")


def _resolved(spec: ArgSpec, value: str | None, origin: str) -> Any:
    if value is None:
        raise ConfigError(f"{origin}: {spec.flag} has no value")
    unset = _UNSET.search(value)
    if unset:
        raise ConfigError(
            f"{origin}: {spec.flag} is {value.replace(unset.group(0), '$' + unset.group(1))}, "
            f"and the script never sets {unset.group(1)}"
        )
    return convert(spec, value, origin)
