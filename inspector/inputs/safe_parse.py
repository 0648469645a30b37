"""JSON and YAML read within bounds: every file a user names is parsed through here.

Python's parsers stop at limits of their own, which reach a user as tracebacks: the JSON decoder
and PyYAML's constructor recurse once per nesting level (RecursionError near 1,000 levels), a YAML
alias repeats its anchor's whole subtree (nine aliases nine deep are a billion nodes), a YAML key
may be a list or a mapping (unhashable in Python), and `int()` refuses numbers of more than 4,300
digits. Here each is checked first, or caught, and refused in one sentence naming the file, with
the caps documented in docs/limits.md:

- MAX_DEPTH levels of nesting (lists and mappings inside each other);
- MAX_NODES values in all, aliases counted as the values they repeat;
- keys that are plain values (a string, a number), never a list or a mapping;
- numbers Python reads (at most 4,300 digits);
- integers in decimal and switches as true/false: YAML 1.1's octal, hexadecimal and base-60
  numbers and yes/no/on/off mean something else to Megatron-LM (yq's YAML 1.2, argparse).

Repeated keys are refused too (both parsers would keep the last one silently), unless the caller
asks for them (`repeated`): Megatron-LM's functional-test runner passes every entry of MODEL_ARGS to
argparse, which keeps the last. YAML merge keys (`<<: *BASE`) are merged as the YAML 1.1 merge
type and yq's `explode` merge them: the mapping's own keys win over the merged ones.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inspector.errors import InputError

MAX_DEPTH = 64
MAX_NODES = 1_000_000
# PyYAML parses in Python (about 20,000 values a second on a busy core): a config of more
# characters than this is refused before parsing (Megatron-LM's and Bridge's are kilobytes)
MAX_YAML_CHARS = 1 << 20


def parse_json(text: str, source: str) -> Any:
    """Return the JSON value in text, or raise InputError naming source (a file name)."""
    _check_json_depth(text, source)
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs(source))
    except json.JSONDecodeError as exc:
        raise InputError(f"{source} line {exc.lineno}: not valid JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # "Exceeds the limit (4300 digits)"
        raise InputError(f"{source}: not valid JSON here ({_first_words(exc)})") from None


def parse_yaml(text: str, source: str, repeated: list[Repeated] | None = None) -> Any:
    """Return the YAML document in text (None where empty), or raise InputError naming source.

    `repeated`: where given, a key repeated with another value is appended to it (the last value
    kept) instead of refused."""
    import yaml

    try:
        _check_yaml_size(text, source)
        return yaml.load(text, Loader=_loader(source, repeated))  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        reason = getattr(exc, "problem", None) or "syntax error"
        raise InputError(f"{source}{where}: not valid YAML ({reason})") from None
    except (ValueError, RecursionError) as exc:  # an int of more than 4,300 digits
        raise InputError(f"{source}: not valid YAML here ({_first_words(exc)})") from None


def _first_words(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    if "Exceeds the limit" in text:
        return "a number has more than 4,300 digits"
    return text[:120]


def _check_json_depth(text: str, source: str) -> None:
    """Refuse JSON nested deeper than MAX_DEPTH, counting brackets outside strings (linear)."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise InputError(f"{source}: nested more than {MAX_DEPTH} levels deep")
        elif char in "]}":
            depth -= 1


def _check_yaml_size(text: str, source: str) -> None:
    """Refuse YAML nested deeper than MAX_DEPTH or worth more than MAX_NODES values.

    PyYAML's parser is a state machine (no recursion), so its events are walked here before the
    recursive constructor runs; an alias counts as the values of the node it names, and as its
    depth where it stands (an alias inside an alias's nesting nests deeper still).
    """
    import yaml

    if len(text) > MAX_YAML_CHARS:
        raise InputError(f"{source}: {len(text):,} characters, more than the {MAX_YAML_CHARS:,} a "
                         "config file is read to (Megatron-LM's are a few kilobytes; "
                         "docs/limits.md)")  # fmt: skip
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> values, levels of nesting
    stack: list[list[Any]] = [[None, 0, 0]]  # anchor, values, deepest child's levels
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            count, levels = sizes.get(event.anchor or "", (1, 0))
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            stack.append([event.anchor, 1, 0])
            if len(stack) - 1 > MAX_DEPTH:
                raise InputError(f"{source}: nested more than {MAX_DEPTH} levels deep")
            continue
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, count, levels = stack.pop()
            levels += 1
            if anchor:
                sizes[anchor] = (count, levels)
        elif isinstance(event, yaml.ScalarEvent):
            count, levels = 1, 0
            if event.anchor:
                sizes[event.anchor] = (1, 0)
        else:
            continue
        if len(stack) - 1 + levels > MAX_DEPTH:
            raise InputError(f"{source}: nested more than {MAX_DEPTH} levels deep once its "
                             "aliases are expanded")  # fmt: skip
        parent = stack[-1]
        parent[1] += count
        parent[2] = max(parent[2], levels)
        if parent[1] > MAX_NODES:
            raise InputError(
                f"{source}: more than {MAX_NODES:,} values once its aliases are expanded"
            )


def _unique_pairs(source: str) -> Any:
    """A json object_pairs_hook that refuses a repeated key (json keeps the last one)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise InputError(f"{source}: the key {key!r} appears twice")
            seen[key] = value
        return seen

    return hook


@dataclass(frozen=True)
class Repeated:
    """A key given twice with different values: the last one is kept."""

    key: str
    first_line: int
    line: int
    value: Any  # the value kept


def _loader(source: str, repeated: list[Repeated] | None = None) -> Any:
    """A yaml SafeLoader that refuses a repeated key (or records it in `repeated`), or a key
    that is a list or a mapping; merge keys are merged first, the mapping's own keys winning."""
    import yaml

    class CheckedLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            own = sum(key.tag != "tag:yaml.org,2002:merge" for key, _ in node.value)
            self.flatten_mapping(node)  # SafeConstructor's merge: the merged pairs first
            merged = len(node.value) - own
            seen: dict[Any, tuple[int, Any, bool]] = {}  # key -> line, value, merged
            for index, (key_node, value_node) in enumerate(node.value):
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode):
                    kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                    raise InputError(f"{source} line {line}: a key is a {kind}, not a name")
                key = self.construct_object(key_node, deep=deep)
                value = self.construct_object(value_node, deep=True)
                before = seen.get(key)
                # the mapping's own key overrides a merged one, as merge keys mean; a key
                # repeated with the same value (Megatron-LM's test configs have some) means one
                # thing; with another value it is refused, never last-one-wins, unless asked
                if before is None or before[2] or index < merged:
                    seen[key] = (line, value, index < merged)
                elif before[1] != value:
                    if repeated is None:
                        raise InputError(
                            f"{source} line {line}: the key {key!r} appears twice (first on line "
                            f"{before[0]})"
                        )
                    repeated.append(Repeated(str(key), before[0], line, value))
                    seen[key] = (before[0], value, False)
            return super().construct_mapping(node, deep=deep)

        def yaml_1_1_int(self, node: Any) -> Any:
            value = self.construct_yaml_int(node)
            if not _DECIMAL.fullmatch(node.value.replace("_", "")):
                raise InputError(f"{source} line {node.start_mark.line + 1}: {node.value} is {value} "
                                 "to YAML 1.1 (octal, hexadecimal or base 60) but not to Megatron-LM "
                                 "(argparse's int(), yq's YAML 1.2); write it in decimal")  # fmt: skip
            return value

        def yaml_1_1_bool(self, node: Any) -> Any:
            value = self.construct_yaml_bool(node)
            if node.value.lower() not in ("true", "false"):
                raise InputError(f"{source} line {node.start_mark.line + 1}: {node.value} is "
                                 f"{str(value).lower()} to YAML 1.1 but a word to Megatron-LM's "
                                 "runner (yq's YAML 1.2); write true or false")  # fmt: skip
            return value

    CheckedLoader.add_constructor("tag:yaml.org,2002:int", CheckedLoader.yaml_1_1_int)
    CheckedLoader.add_constructor("tag:yaml.org,2002:bool", CheckedLoader.yaml_1_1_bool)
    return CheckedLoader


# PyYAML reads YAML 1.1: 010 is 8, 0x10 16, 1:30 90, yes/on true; Megatron-LM's test runner hands
# MODEL_ARGS to argparse as yq (YAML 1.2) writes them (010 -> int('010') = 10, 0x10 refused), so a
# number other than plain decimal, or a switch other than true/false, is refused, never misread
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")
