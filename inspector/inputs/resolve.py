"""The edge: merge where a job's arguments come from into one set of Megatron-LM arguments.

Later sources win: preset < config file < launch script < flags. Each command reads only the
argument groups it takes (arguments.py); the others, when a file or script sets them, are
dropped here so they can never change a command's result (or its cache key). The merged
arguments become a validated Job (job.py) in one call.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inspector.errors import ConfigError
from inspector.inputs.arguments import BY_NAME
from inspector.inputs.hybrid_pattern import FIRST, layer_pattern
from inspector.inputs.ignored import IGNORED_NOTES
from inspector.inputs.refusals import ALL_GROUPS, refusals_message, refused_value
from inspector.inputs.unmodelled import REFUSED, refusal_message
from inspector.inputs.versions import megatron_core_version, unknown_argument_notes

if TYPE_CHECKING:
    from inspector.inputs.sources import ScriptArgs


@dataclass(frozen=True)
class Sources:
    """Where the arguments come from: a preset, a config file, a launch script, flags."""

    preset: str | None = None
    config_file: str | None = None
    script: str | None = None
    flags: dict[str, Any] = field(default_factory=dict)  # values given on the command line
    apex: bool | None = None
    settings: tuple[str, ...] = ()  # --set NAME=VALUE: what the launch script's environment holds
    hf_config: str | None = None  # a Hugging Face config.json (after the preset, before --config)
    searched: bool = False  # the command searches the parallel sizes left unset (`plan`)


@dataclass(frozen=True)
class Resolved:
    """The merged arguments of one command, and what the user should be told about them."""

    args: dict[str, Any]
    notes: tuple[str, ...]  # for stderr, e.g. what a launch script set that is not modelled


def merge_sources(sources: Sources, groups: tuple[str, ...], accepted: tuple[str, ...] = ()) -> Resolved:
    """Merge preset, config file, launch script and flags (later ones winning) for `groups`.

    `accepted`: refused values (unmodelled.REFUSED_VALUES, as "--flag value") the command models
    itself when given as flags (plan prices the flex dispatcher)."""
    _check_flag_values(sources.flags, groups, accepted)
    if sources.settings and sources.script is None:  # dropped, it read nothing (sweep46c)
        parse_settings(sources.settings)
        raise ConfigError(f"--set {sources.settings[0]} gives a value the launch script reads, and "
                          "there is none: pass --from-script SCRIPT, or the argument's own flag")  # fmt: skip
    notes: list[str] = []
    pending: list[str] = []  # validate_args' refusals: Megatron-LM checks the world size first
    layers, world = _source_layers(sources, groups, notes, accepted, pending)
    merged: dict[str, Any] = {}
    for layer in layers:
        if any(layer.get(name) is not None for name in _PATTERNS):
            # a later source's hybrid pattern replaces an earlier one's (a preset's
            # --hybrid-override-pattern under a script's --hybrid-layer-pattern); within one
            # source both names stop the job, as Megatron-LM's validate_args does
            for name in _PATTERNS:
                merged.pop(name, None)
        merged.update(layer)
    older = merged.get("hybrid_override_pattern")
    separators = older is not None and ("/" in str(older) or "|" in str(older))
    if separators and merged.get("hybrid_layer_pattern") is None:
        # Megatron-LM 0.17+ reads the deprecated spelling as --hybrid-layer-pattern (its MTP
        # depths and stage boundaries too); before 0.17, '/' and '|' are not layer symbols
        # (job/hybrid_model.py says so)
        if megatron_core_version() >= FIRST:
            merged["hybrid_layer_pattern"] = older
    if merged.get("hybrid_layer_pattern") is not None:
        notes.extend(layer_pattern(merged))
    if "model" in groups:
        _check_required(merged, sources)
    if any(merged.get(name) for name in _HYBRID_ARGS):
        # pretrain_mamba.py builds megatron's mamba_stack_spec, of Transformer Engine modules,
        # whatever the default model's local spec would be
        merged.setdefault("transformer_impl", "transformer_engine")
    if world[0] is not None:
        merged["data_parallel_size"] = _data_parallel(merged, sources.flags, world[0], world[1])
    elif world[1]:
        notes.append(f"Note from {sources.script}: the world size is not known ({world[1]}); --dp says it")
    if pending:
        raise ConfigError(pending[0])
    tp = merged.get("tensor_model_parallel_size")
    if merged.get("sequence_parallel") and int(tp or 1) == 1 and not (sources.searched and tp is None):
        # Megatron-LM validate_args: "Disabling sequence parallelism because tensor model
        # parallelism is disabled".
        merged["sequence_parallel"] = False
        if "layout" in groups:
            notes.append(
                "Note: --sequence-parallel is turned off because --tp is 1, as Megatron-LM does "
                "(\"Disabling sequence parallelism because tensor model parallelism is disabled\")"
            )
    if "training" in groups:
        notes.extend(local_spec_attention_note(merged))
        _external_graphs(merged)
    args = {k: v for k, v in merged.items() if k not in BY_NAME or BY_NAME[k].group in groups}
    return Resolved(args, tuple(notes))


def _external_graphs(merged: dict[str, Any]) -> None:
    """Read --external-cuda-graph and --enable-cuda-graph as Megatron-LM's validate_args does
    (arguments.py, 0.19.2; megatron-core's TransformerConfig.__post_init__ alike since 0.16):
    --cuda-graph-impl transformer_engine and local, with --cuda-graph-scope's scope."""
    given = [(flag, impl) for flag, impl in (("external_cuda_graph", "transformer_engine"),
                                             ("enable_cuda_graph", "local"))
             if merged.pop(flag, False)]  # fmt: skip
    if not given:
        return
    if len(given) > 1:
        raise ConfigError("--enable-cuda-graph with --external-cuda-graph: Megatron-LM refuses it "
                          "(validate_args: '--enable-cuda-graph and --external-cuda-graph cannot "
                          "be enabled at the same time.')")  # fmt: skip
    flag, wanted = given[0]
    impl = merged.get("cuda_graph_impl") or "none"
    if impl != "none":
        raise ConfigError(f"--{flag.replace('_', '-')} with --cuda-graph-impl {impl}: Megatron-LM "
                          "refuses it (validate_args: 'Do not use --enable-cuda-graph or "
                          "--external-cuda-graph with --cuda-graph-impl.')")  # fmt: skip
    merged["cuda_graph_impl"] = wanted


_PATTERNS = ("hybrid_override_pattern", "hybrid_layer_pattern")
# The arguments that make megatron-core build a hybrid (Mamba) model (job/model.py `hybrid`)
_HYBRID_ARGS = ("hybrid_override_pattern", "hybrid_attention_ratio", "hybrid_mlp_ratio",
                "is_hybrid_model")  # fmt: skip


# Megatron-LM's validate_args: `required_args = ['num_layers', 'hidden_size',
# 'num_attention_heads', 'max_position_embeddings']`, each `_check_arg_is_not_none`.
_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")


def _check_required(merged: dict[str, Any], sources: Sources) -> None:
    """Refuse a launch script or config file that gives no model, as Megatron-LM does, rather
    than build the default preset's (SRUN.sh's `pretrain_gpt.py ${MEGATRON_PARAMS}` alone)."""
    origin = sources.script or sources.config_file
    if origin is None or sources.preset is not None or sources.hf_config is not None:
        return
    absent = [BY_NAME[name].flag for name in _REQUIRED if merged.get(name) is None]
    if absent:
        raise ConfigError(
            f"{origin} gives no {', '.join(absent)}, which Megatron-LM requires (validate_args: "
            "required_args); give them with their flags (or --set the variables that hold them)"
        )


def local_spec_attention_note(merged: dict[str, Any]) -> list[str]:
    """Return a note when flash attention is asked for without Transformer Engine.

    megatron-core's local layer spec (gpt_layer_specs.py get_gpt_layer_local_spec) runs its own
    unfused DotProductAttention, and no megatron-core model reads --use-flash-attn (Megatron-LM
    core_v0.13.1 to core_v0.16.1: only megatron/legacy/model/transformer.py does), so megatron
    stores the s x s scores whatever the flag says.
    """
    backend = merged.get("attention_backend")
    asked = "--use-flash-attn" if merged.get("use_flash_attn") else (
        f"--attention-backend {backend}" if backend in ("flash", "fused") else None)
    if asked is None or merged.get("transformer_impl") == "transformer_engine":
        return []
    return [
        f"Note: {asked} does not change megatron-core's local layer spec, whose "
        "DotProductAttention is unfused (Megatron-LM reads --use-flash-attn only for "
        "--use-legacy-models): the s x s attention scores are stored, as megatron stores them; "
        "flash attention needs --transformer-impl transformer_engine"
    ]


def _check_flag_values(flags: dict[str, Any], groups: tuple[str, ...], accepted: tuple[str, ...]) -> None:
    """Raise ConfigError for a flag whose value a command of `groups` does not model, as a launch
    script's would be (refusals.refused_value)."""
    for name, value in flags.items():
        spec = BY_NAME.get(name)
        if spec is None or value is None or value is False:  # a flag not given refuses nothing
            continue
        refusal = refused_value(spec.flag, str(value), "")
        if refusal is None or (refusal.group != ALL_GROUPS and refusal.group not in groups):
            continue
        if refusal.argument not in accepted:
            raise ConfigError(f"{refusal.argument} is {refusal.verb}: {refusal.reason}")


def _check_preset(name: str, args: Mapping[str, Any], groups: tuple[str, ...]) -> None:
    """Raise ConfigError for a preset argument this tool refuses (unmodelled.REFUSED): a published
    model whose architecture the tool does not build yet is refused by name, never built without."""
    for key in args:
        flag = "--" + key.replace("_", "-")
        if refusal_message(flag, str(args[key])) is None:  # harmless, or modelled on this release
            continue
        refusal = REFUSED[flag]
        if refusal.group == ALL_GROUPS or refusal.group in groups:
            raise ConfigError(f"{flag} is not modelled: {refusal.reason} (--model {name} "
                              f"sets {flag} {args[key]})")  # fmt: skip


def _source_layers(
    sources: Sources, groups: tuple[str, ...], notes: list[str], accepted: tuple[str, ...] = (),
    pending: list[str] | None = None,
) -> tuple[list[dict[str, Any]], tuple[int | None, str]]:
    """Return the argument layers, the lowest first, and the launch script's world size."""
    layers: list[dict[str, Any]] = []
    world: tuple[int | None, str] = (None, "")
    if sources.preset is not None:
        from inspector.inputs.presets import get_preset

        preset = get_preset(sources.preset)
        _check_preset(preset.name, preset.args, groups)
        layers.append(dict(preset.args))
    if sources.hf_config is not None:
        from inspector.inputs.hf import read_hf_config

        hf = read_hf_config(sources.hf_config)
        layers.append(_file_layer(hf, sources.hf_config, sources, groups, notes, accepted, pending))
    if sources.config_file is not None:
        from inspector.inputs.megatron_config import read_config

        config = read_config(sources.config_file)
        layers.append(_file_layer(config, sources.config_file, sources, groups, notes, accepted, pending))
        if config.world_size is not None and sources.flags.get("data_parallel_size") is None:
            world = (config.world_size, config.world_origin)  # a launch script's world wins
            notes.append(f"Note from {sources.config_file}: the world is {config.world_size} "
                         f"GPUs: {config.world_origin}")  # fmt: skip
    if sources.script is not None:
        from inspector.inputs.sources import read_launch_script

        given = {name for name, value in sources.flags.items() if value is not None}
        parsed = read_launch_script(sources.script, parse_settings(sources.settings), given)
        layers.append(_file_layer(parsed, sources.script, sources, groups, notes, accepted, pending))
        world = (parsed.world_size, parsed.world_origin)
    files = (sources.hf_config, sources.config_file, sources.script)
    if any(file is not None for file in files) or describes_model(sources):
        # under the first file's layer: a later file that does not name it keeps an earlier's
        defaults = MEGATRON_LM_DEFAULTS
        if sources.config_file is not None or sources.script is not None:
            defaults = {**defaults, **SWITCHES_OFF}  # a Megatron-LM job's: off unless it says on
        layers.insert(1 if sources.preset is not None else 0, defaults)
    layers.append({name: value for name, value in sources.flags.items() if value is not None})
    if sources.apex is not None:
        layers.append({"apex": sources.apex})
    return layers, world


def _file_layer(parsed: ScriptArgs, origin: str, sources: Sources, groups: tuple[str, ...],
                notes: list[str], accepted: tuple[str, ...] = (),
                pending: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """Return the arguments a config file or launch script sets, after its refusals (one error
    naming them all, with the tokenizer's vocabulary where it is not known) and its notes (what
    is ignored, not recognised, derived); a refused value the command models (`accepted`) is
    taken as set. Where only validate_args refuses the job, the error goes to `pending`:
    Megatron-LM's validate_args checks the world size before anything else (`merge_sources`)."""
    problem = parsed.vocab_problem if sources.flags.get("vocab_size") is None else ""
    taken = [item for item in parsed.refused if item.argument in accepted]
    kept = [item for item in parsed.refused if item not in taken]
    refused = refusals_message(kept, groups)
    later = pending is not None and all(item.reason.startswith("validate_args") for item in kept)
    if refused and later:
        pending.append(f"{refused}; {problem}" if problem else refused)  # type: ignore[union-attr]
        problem = ""
    elif refused:
        raise ConfigError(f"{refused}; {problem}" if problem else refused)
    if parsed.ignored:
        notes.append(f"Ignored from {origin}: {' '.join(parsed.ignored)}")
    if parsed.unrecognised:
        notes.append(
            f"Not recognised from {origin} (not a Megatron-LM argument this tool "
            f"knows; check it changes nothing a GPU holds): {' '.join(parsed.unrecognised)}"
        )
    notes.extend(f"Note from {origin}: {note}" for note in parsed.notes)
    used = (*(BY_NAME[name].flag for name in parsed.args if name in BY_NAME), *parsed.ignored,
            *(item.argument.split()[0] for item in parsed.refused))  # fmt: skip
    notes.extend(f"Note from {origin}: {note}" for note in unknown_argument_notes(used))
    notes.extend(f"Note from {origin}: {IGNORED_NOTES[flag]}" for flag in dict.fromkeys(used)
                 if flag in IGNORED_NOTES)  # fmt: skip
    if problem:
        raise ConfigError(problem)
    args = dict(parsed.args)
    for item in taken:  # a refused value is a string value of a modelled argument (its spec.flag)
        flag, value = item.argument.split(" ", 1)
        args[flag[2:].replace("-", "_")] = value
    return args


# A Megatron-LM job that does not name --transformer-impl runs Transformer Engine (Megatron-LM
# arguments.py: default "transformer_engine"), so a config file or launch script means it too: a
# layer under the files' own (a config file's `transformer_impl: local` holds when the launch
# script after it names none), over a preset's. (--attention-backend's default, auto, every job
# gets where nothing names one: job.py.)
MEGATRON_LM_DEFAULTS: dict[str, Any] = {"transformer_impl": "transformer_engine"}
# A Megatron-LM config file or launch script that does not turn these on runs without them
# (store_true in arguments.py): set, as a flag's `--no-...` would be, so that `plan` keeps them
# off rather than searching them (plan/request.py SWITCHES).
SWITCHES_OFF: dict[str, Any] = {"sequence_parallel": False, "use_distributed_optimizer": False}


def describes_model(sources: Sources) -> bool:
    """Return whether the command line alone gives a model as Megatron-LM requires one (every
    argument of validate_args' required_args that we read: layers, hidden size, heads).

    That model runs Megatron-LM's default spec, Transformer Engine, as a launch script's does;
    flags that change only some of the default model's sizes keep its local spec (SPEC.md)."""
    given = {name for name, value in sources.flags.items() if value is not None}
    return sources.preset is None and set(_REQUIRED) <= given


_SETTING = re.compile(r"^([A-Za-z_]\w*|[1-9]\d*)=(.*)$", re.S)


def parse_settings(items: tuple[str, ...]) -> dict[str, str]:
    """Return --set NAME=VALUE items as a dict (a number names a positional parameter)."""
    settings = {}
    for item in items:
        match = _SETTING.match(item)
        if not match:
            raise ConfigError(f"--set needs NAME=VALUE, got {item!r}")
        settings[match.group(1)] = match.group(2)
    return settings


def _data_parallel(merged: dict[str, Any], flags: dict[str, Any], world: int, origin: str) -> int:
    """Return the data-parallel size of the script's world, as Megatron-LM's initialisation does."""
    from inspector.inputs.launch import data_parallel_from_world

    tp, pp, cp = (
        int(merged.get(name) or 1)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
        )
    )
    dp = data_parallel_from_world(world, tp, pp, cp, origin)
    given = flags.get("data_parallel_size")
    if given is not None and given != dp:
        raise ConfigError(
            f"--dp {given} contradicts the script's world: {world} GPUs ({origin}) / (--tp {tp} x "
            f"--pp {pp} x --cp {cp}) = {dp} data-parallel ranks"
        )
    return dp
