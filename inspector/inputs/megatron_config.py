"""`--config FILE`: Megatron-LM arguments in a YAML or JSON file, in the forms people have them.

Three forms, told apart by their keys:
- Megatron-LM's functional-test `model_config.yaml` (tests/functional_tests/test_cases/*/*/): its
  `MODEL_ARGS` map of `--flag: value` is the training command's arguments, turned into words as
  Megatron-LM's runner does (tests/functional_tests/shell_test_utils/_run_training.sh: `true` is the
  bare flag, `[a, b]` is the flag and its items, a string in brackets `"[a b]"` the flag and its
  words, anything else the flag and its value); `ENV_VARS` and the runner's other keys
  (TEST_TYPE, METRICS, ...) are the job's environment, listed as ignored.
- a Hugging Face `config.json` (keys `architectures`/`model_type`): inspector.inputs.hf.
- a plain map of Megatron-LM arguments (`num-layers: 32`, dashes or underscores), typed values.
Every argument is then modelled, refused or ignored as a launch script's would be, and a tokenizer
is honoured the same way (its vocabulary, or an error asking for --vocab-size).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

from inspector.errors import ConfigError, InputError
from inspector.inputs.arguments import BY_NAME
from inspector.inputs.bash.context import Context
from inspector.inputs.entry_points import NOT_GPT_TRAINING, EntryPoint, entry_point
from inspector.inputs.ignored import IGNORED
from inspector.inputs.launch import is_launch
from inspector.inputs.missing import Needs
from inspector.inputs.refusals import (
    Refused,
    fsdp2_drops_fp8_param_gather,
    refused_argument,
    refused_flags,
    refused_value,
    validate_args_refusals,
)
from inspector.inputs.safe_parse import Repeated
from inspector.inputs.sources import ScriptArgs, convert, parse_config, split_arguments
from inspector.inputs.tokenizers import TOKENIZER_FLAGS, apply_tokenizer
from inspector.inputs.unmodelled import REFUSED, RENAMED
from inspector.output import read_text

_RUNNER_KEYS = ("ENV_VARS", "MODEL_ARGS")
_MODES = ("pretraining", "rl", "inference")  # the MODE values of Megatron-LM's test cases
# The runner strips the brackets of a value wrapped in [ ] ("[layernorm mlp]") and passes its
# words unquoted, one argument each (_run_training.sh: `grep -Eq '^\[[^]]+\]$'`, then eval).
_BRACKETED = re.compile(r"^\[[^]]+\]$")
# The runner launches `torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES`, by default
# 8 GPUs on 1 node (_run_training.sh: GPUS_PER_NODE=${GPUS_PER_NODE:-8}, NUM_NODES=${NUM_NODES:-1}).
RUNNER_GPUS = 8
# The runner substitutes its own variables into the file before reading it (_run_training.sh:
# `envsubst` over its environment); of its mandatory ones only the run counters are numbers, both
# 1 on the first run of the first repeat (run_ci_test.sh `export REPEAT=$i`, RUN_NUMBER=1), which
# its golden values log first.
_RUN_COUNTERS = re.compile(r"\$(?:\{(REPEAT|RUN_NUMBER)\}|(REPEAT|RUN_NUMBER)\b)")
RUNNER_WORLD = ("Megatron-LM's functional-test runner, 1 node x 8 GPUs by default "
                "(_run_training.sh); --dp gives another")  # fmt: skip


def read_config(path: str) -> ScriptArgs:
    """Read a config file of any of the three forms into Megatron-LM arguments."""
    repeated: list[Repeated] = []
    data = parse_config(read_text(path), path, repeated)
    if repeated and not (isinstance(data, dict) and "MODEL_ARGS" in data):
        first = repeated[0]  # only the test runner's form reads a repeated key (the last one)
        raise InputError(f"{path} line {first.line}: the key {first.key!r} appears twice (first "
                         f"on line {first.first_line})")  # fmt: skip
    if not isinstance(data, dict):
        raise InputError(
            f"{path} must hold a mapping of Megatron-LM arguments, not {type(data).__name__}"
        )
    if "architectures" in data or "model_type" in data:
        from inspector.inputs.hf import read_hf_mapping

        mapped = read_hf_mapping(data, path)
        found = "read as a Hugging Face config.json (it has architectures/model_type)"
        return dataclasses.replace(mapped, notes=(found, *mapped.notes))
    if "MODEL_ARGS" in data:
        read = _functional_test(data, path)
        # yq's to_entries gives the runner every entry; argparse (or export) keeps the last
        twice = tuple(f"line {item.line}: {item.key} is given again (first on line "
                      f"{item.first_line}); the last value, {item.value}, is taken, as "
                      "Megatron-LM's argparse takes the last of the runner's arguments"
                      for item in repeated)  # fmt: skip
        return dataclasses.replace(read, notes=(*twice, *read.notes))
    return _plain(data, path)


def _functional_test(data: dict[str, Any], path: str) -> ScriptArgs:
    """Read Megatron-LM's functional-test form: MODEL_ARGS as the runner passes them."""
    model_args = data["MODEL_ARGS"]
    if model_args is None:  # `MODEL_ARGS:` alone: the runner passes no arguments at all
        model_args = {}
    program = _runner_program(data, path)
    if not isinstance(model_args, dict):
        raise InputError(f"{path}: MODEL_ARGS must map --flag to value, not "
                         f"{type(model_args).__name__}")  # fmt: skip
    words: list[str] = []
    notes: list[str] = []
    for key, value in model_args.items():
        flag = str(key)
        if value is True:
            words.append(flag)
        elif value is False or value is None:
            notes.append(f"{flag}: {value} is left out (the runner would pass it as a word, which "
                         "argparse refuses for a switch)")  # fmt: skip
        elif isinstance(value, list):
            words += [flag, *(_first_run(str(item), notes) for item in value)]
        elif _BRACKETED.match(str(value).strip()):
            words += [flag, *str(value).strip()[1:-1].split()]
        else:
            words += [flag, _first_run(str(value), notes)]
    others = [str(k) for k in data if k not in _RUNNER_KEYS]
    env = data.get("ENV_VARS") or {}
    if not isinstance(env, dict) or any(isinstance(v, (dict, list)) for v in env.values()):
        shown = type(env).__name__ if not isinstance(env, dict) else "a nested value"
        raise InputError(f"{path}: ENV_VARS must map variable names to values (the runner "
                         f"exports each NAME=VALUE), not {shown}")  # fmt: skip
    bad = [str(name) for name in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name))]
    if bad:  # the runner's `export NAME=VALUE` stops on it ("not a valid identifier")
        raise InputError(f"{path}: ENV_VARS name {bad[0]!r} is not a shell variable name (letters, "
                         "digits and _, not first a digit): the runner's export would refuse it")  # fmt: skip
    if env:
        notes.append(f"ENV_VARS set the job's environment, not its arguments: {' '.join(env)}")
    if others:
        notes.append(f"keys for Megatron-LM's test runner, not arguments: {' '.join(others)}")
    raw: dict[str, str] = {}
    ctx = Context(path, {}, is_launch)
    parsed = split_arguments(words, Needs(ctx, path), ctx, raw)
    flags = {BY_NAME[name].flag for name in parsed.args} | set(parsed.ignored)
    flags |= refused_flags(parsed.refused)
    refused, dropped = fsdp2_drops_fp8_param_gather(
        parsed.refused + validate_args_refusals(flags, path, parsed.args), parsed.args)
    notes += dropped
    if program.note:
        notes.append(program.note)
    args, ignored, tokenizer_notes, problem = apply_tokenizer(
        dict(parsed.args), parsed.ignored, raw, path)  # fmt: skip
    return ScriptArgs(args, ignored, notes=(*notes, *tokenizer_notes), vocab_problem=problem,
                      refused=refused, unrecognised=parsed.unrecognised,
                      world_size=RUNNER_GPUS, world_origin=RUNNER_WORLD)  # fmt: skip


def _first_run(value: str, notes: list[str]) -> str:
    """Return a MODEL_ARGS value with the runner's run counters as its first run sets them."""
    if not _RUN_COUNTERS.search(value):
        return value
    note = "the runner's $REPEAT and $RUN_NUMBER are read as 1 (its first run, which it envsubsts)"
    if note not in notes:
        notes.append(note)
    return _RUN_COUNTERS.sub("1", value)


def _runner_program(data: dict[str, Any], path: str) -> EntryPoint:
    """Return the program Megatron-LM's runner starts for the file's MODE, or raise InputError
    where it is not GPT training (run_ci_test.sh: MODE, default pretraining; the recipes'
    TRAINING_SCRIPT_PATH: pretrain_gpt.py, train_rl.py for MODE rl, an inference program under
    examples/inference/ for MODE inference)."""
    mode = data.get("MODE", "pretraining")
    if mode not in _MODES:
        raise InputError(f"{path}: MODE {mode!r} is not one of: {', '.join(_MODES)} (Megatron-LM's "
                         "test runner, run_ci_test.sh)")  # fmt: skip
    if mode == "inference":
        raise InputError(
            f"{path}: MODE: inference: Megatron-LM's test runner runs it with an inference "
            f"program (examples/inference/), which {NOT_GPT_TRAINING['gpt_static_inference.py']}; "
            "this tool reads GPT training (pretrain_gpt.py) only"
        )
    return entry_point("train_rl.py" if mode == "rl" else "pretrain_gpt.py", path)


def _plain(data: dict[str, Any], path: str) -> ScriptArgs:
    """Read a plain map of Megatron-LM arguments with typed values (a switch may be false)."""
    args: dict[str, Any] = {}
    ignored: list[str] = []
    refused: list[Refused] = []
    unknown: list[str] = []
    raw: dict[str, str] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        _once(spelled, name, str(key), path)
        flag = "--" + name.replace("_", "-")
        if name not in BY_NAME and flag in RENAMED:
            name, meaning = RENAMED[flag]
            value = value if meaning is None else meaning
        if name in BY_NAME:
            unmodelled = refused_value(BY_NAME[name].flag, str(value), path)
            if unmodelled is not None:
                refused.append(unmodelled)
            else:
                args[name] = convert(BY_NAME[name], value, path)
            continue
        shown = None if value is True else str(value)
        refusal = refused_argument(flag, shown, path)
        if refusal is not None:
            refused.append(refusal)
        elif flag in IGNORED or flag in REFUSED:
            ignored.append(flag)
            if flag in TOKENIZER_FLAGS:
                raw[flag] = str(value)
        else:
            unknown.append(_unknown(str(key), name))
    if unknown:
        raise ConfigError(f"{path}: unknown argument{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)}")  # fmt: skip
    flags = {BY_NAME[name].flag for name in args} | set(ignored) | refused_flags(refused)
    refused += validate_args_refusals(flags, path, args)
    kept_refused, dropped = fsdp2_drops_fp8_param_gather(refused, args)
    args, kept, notes, problem = apply_tokenizer(args, tuple(ignored), raw, path)
    return ScriptArgs(args, kept, notes=(*dropped, *notes), vocab_problem=problem,
                      refused=kept_refused)  # fmt: skip


def _once(spelled: dict[str, str], name: str, key: str, path: str) -> None:
    if name in spelled:
        raise InputError(
            f"{path}: {spelled[name]!r} and {key!r} both set {BY_NAME[name].flag}"
            if name in BY_NAME
            else f"{path}: {spelled[name]!r} and {key!r} are the same argument"
        )
    spelled[name] = key


def _unknown(key: str, name: str) -> str:
    close = difflib.get_close_matches(name, BY_NAME, n=1)
    return f"{key!r}" + (f" (did you mean {BY_NAME[close[0]].flag}?)" if close else "")
