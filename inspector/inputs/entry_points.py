"""Which program a launch script runs: GPT training is read; anything else stops with its name.

This tool builds megatron-core's GPTModel as Megatron-LM's `pretrain_gpt.py` builds it
(gpt_builders.py). A few other Megatron-LM programs train the same model from the same arguments;
BERT, T5, multimodal, Mamba/hybrid, inference and conversion programs build something else, and a
table of their arguments would be a plausible misreading. Programs are matched by the end of their
path, as Megatron-LM's examples name them (checked against Megatron-LM main, megatron-core 0.20).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from inspector.errors import InputError
from inspector.inputs.refusals import Refused, validate_args_refusals


@dataclass(frozen=True)
class EntryPoint:
    """What a recognised GPT training program means for the reading: a note, and the arguments
    it implies."""

    note: str = ""
    # Megatron-LM arguments the program itself implies (pretrain_mamba.py: a hybrid model)
    implied: Mapping[str, Any] = field(default_factory=dict)
    # the flag with which the program builds a hybrid model instead (train_rl.py)
    hybrid_with: str = ""


# Programs that build GPTModel from Megatron-LM's arguments and train it.
GPT_TRAINING: dict[str, EntryPoint] = {
    "pretrain_gpt.py": EntryPoint(),
    "train_rl.py": EntryPoint(
        note="train_rl.py trains GPTModel (gpt_builders.py) as pretrain_gpt.py does; with "
        "--perform-rl-step `memory` adds the KV cache its rollout engine keeps on the GPU through "
        "the training step (megatron-core's DynamicInferenceContext), not what the rollouts "
        "hold while they run",
        # train_rl.py `_model_builder`: mamba_builder when args.is_hybrid_model
        hybrid_with="--is-hybrid-model",
    ),
    # mamba_builders.py `mamba_builder` (core_v0.16.1): MambaModel from the same arguments, with
    # the layer stack spec --spec names (required: "You must provide a valid Mamba layer spec")
    "pretrain_mamba.py": EntryPoint(
        note="pretrain_mamba.py builds megatron-core's MambaModel (mamba_builders.py) from "
        "Megatron-LM's hybrid arguments (docs/hybrid-models.md)",
        implied=MappingProxyType({"is_hybrid_model": True}),
    ),
    "post_training/modelopt/finetune.py": EntryPoint(
        note="ModelOpt's finetune.py builds GPTModel through modelopt_gpt_hybrid_builder from "
        "Megatron-LM's arguments; ModelOpt state restored from --load (quantizers, distillation "
        "teachers, Eagle heads) is not modelled"
    ),
}

_MULTIMODAL = "builds a multimodal model (a vision or audio encoder beside the language model)"
_VISION = "builds a vision transformer"
_HYBRID = "builds a hybrid model as megatron-core 0.18+ does (HybridModel), not modelled yet"
_INFERENCE = "runs inference or text generation, not training"
_CONVERSION = "converts, exports, quantizes or prunes a checkpoint, not training"

# Programs that do something else, by what they build or do.
NOT_GPT_TRAINING: dict[str, str] = {
    "pretrain_bert.py": "builds BERT (BertModel)",
    "pretrain_t5.py": "builds T5 (an encoder-decoder T5Model)",
    "pretrain_vlm.py": _MULTIMODAL,
    "multimodal/train.py": _MULTIMODAL,
    "mimo/train.py": _MULTIMODAL,
    "pretrain_mimo.py": _MULTIMODAL,
    "pretrain_vision_classify.py": _VISION,
    "pretrain_vision_dino.py": _VISION,
    "pretrain_vision_inpaint.py": _VISION,
    "pretrain_ict.py": "builds a biencoder (ICT)",
    "pretrain_retro.py": "builds RETRO (a retrieval-augmented model)",
    "pretrain_hybrid.py": _HYBRID,
    "run_text_generation_server.py": _INFERENCE,
    "run_hybrid_text_generation_server.py": _INFERENCE,
    "run_text_generation.py": _INFERENCE,
    "text_generation_cli.py": _INFERENCE,
    "gpt_dynamic_inference.py": _INFERENCE,
    "gpt_dynamic_inference_with_coordinator.py": _INFERENCE,
    "gpt_static_inference.py": _INFERENCE,
    "simple_t5_batch_inference.py": _INFERENCE,
    "offline_inference.py": _INFERENCE,
    "launch_inference_server.py": _INFERENCE,
    "generate_samples_gpt.py": _INFERENCE,
    "msdp/main.py": _INFERENCE,
    "modelopt/generate.py": _INFERENCE,
    "modelopt/mmlu.py": _INFERENCE,
    "modelopt/validate.py": _INFERENCE,
    "modelopt/offline_feature_extract.py": _INFERENCE,
    "checkpoint/convert.py": _CONVERSION,
    "multimodal/combine_state_dicts.py": _CONVERSION,
    "modelopt/convert_model.py": _CONVERSION,
    "modelopt/export.py": _CONVERSION,
    "modelopt/quantize.py": _CONVERSION,
    "modelopt/prune.py": _CONVERSION,
    "checkpoint_inspector.py": _CONVERSION,
    "pp_checkpoint_converter.py": _CONVERSION,
    "01_convert_from_hf.py": _CONVERSION,
    "03_convert_to_hf.py": _CONVERSION,
    "preprocess_data.py": "preprocesses data, not training",
    "msdp/preprocessing.py": "preprocesses data, not training",  # Megatron-LM tasks/msdp
}


def entry_point(program: str, where: str) -> EntryPoint:
    """Return what the launched program means, or raise InputError when it is not GPT training.

    `program` is the `.py` path as the script spells it after expansion; an unknown program is
    read as pretrain_gpt.py, with a note saying so.
    """
    path = posixpath.normpath(program)
    for suffix, entry in GPT_TRAINING.items():
        if _ends_with(path, suffix):
            return entry
    for suffix, what in NOT_GPT_TRAINING.items():
        if _ends_with(path, suffix):
            raise InputError(
                f"{where}: the script runs {program}, which {what}; this tool reads GPT training "
                "(pretrain_gpt.py) only"
            )
    return EntryPoint(
        note=f"{posixpath.basename(path)} is not a Megatron-LM program this tool knows; its "
        "arguments are read as pretrain_gpt.py reads them"
    )


# ModelOpt's convert_model.py (examples/post_training/modelopt) with `--algorithm eagle3` (its
# choices: eagle3, None) runs mtsp.convert with EAGLE3_DEFAULT_CFG and saves the model with an
# EAGLE-3 draft module; finetune.py then restores that module from --load (load_modelopt_state in
# megatron/post_training/model_builder.py) and trains it on the frozen base model ("base model is
# frozen and the draft model is attached as a transformation", speculative.md). eagle3.sh runs the
# conversion only where its checkpoint folder is missing.
SPECULATIVE_CONVERSION = "convert_model.py"


def refuse_speculative(launches: Sequence[tuple[Sequence[str], str]],
                       show: Callable[[str], str]) -> None:  # fmt: skip
    """Raise InputError when a launch (argv, where) converts the model for speculative decoding:
    what is trained is then a draft module on a frozen base, not the GPTModel of the arguments."""
    for argv, where in launches:
        words = [show(word) for word in argv]
        program = next((w for index, w in enumerate(words) if index and w.endswith(".py")), "")
        if posixpath.basename(program) != SPECULATIVE_CONVERSION:
            continue
        algorithm = _value_of(words, "--algorithm")
        if algorithm in (None, "None"):
            continue
        raise InputError(
            f"{where}: the script converts its model for speculative decoding "
            f"({posixpath.basename(program)} --algorithm {algorithm}): ModelOpt's finetune.py "
            "then trains the draft module that conversion adds (its architecture is ModelOpt's) "
            "on a frozen base model; this tool builds and trains the GPTModel of the arguments "
            "only, and does not model the draft module or frozen parameters"
        )


# the arguments that describe a hybrid stack (inputs/arguments.py), which only hybrid builders read
_HYBRID_FLAGS = frozenset({"--hybrid-override-pattern", "--hybrid-layer-pattern", "--hybrid-attention-ratio",
                           "--hybrid-mlp-ratio", "--is-hybrid-model"})  # fmt: skip


def _value_of(words: Sequence[str], flag: str) -> str | None:
    """The last value a flag is given (`--flag VALUE` or `--flag=VALUE`), as argparse keeps it."""
    found = None
    for index, word in enumerate(words):
        if word == flag and index + 1 < len(words):
            found = words[index + 1]
        elif word.startswith(flag + "="):
            found = word[len(flag) + 1:]
    return found


def _ends_with(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("/" + suffix)


def program_checks(argv: Sequence[str], show: Callable[[str], str], flags: Collection[str],
                   where: str, args: Mapping[str, Any] | None = None,
                   ) -> tuple[tuple[str, ...], tuple[Refused, ...]]:  # fmt: skip
    """Return the notes and refusals of a launch: its program's, and validate_args' combinations
    of the flags it passes (raise InputError when the program is not GPT training)."""
    program = show(next(word for index, word in enumerate(argv) if index and word.endswith(".py")))
    entry = entry_point(program, where)
    refused = validate_args_refusals(flags, where, args)
    hybrid = sorted(flag for flag in flags if flag in _HYBRID_FLAGS)
    builds_hybrid = bool(entry.implied) or bool(entry.hybrid_with and entry.hybrid_with in flags)
    if hybrid and not builds_hybrid:
        # gpt_builders.py builds GPTModel whatever they say: Megatron-LM would train a GPT
        raise InputError(f"{where}: {posixpath.basename(program)} builds GPTModel whatever "
                         f"{', '.join(hybrid)} say (gpt_builders.py); Megatron-LM builds hybrid "
                         "models with pretrain_mamba.py")  # fmt: skip
    if builds_hybrid:
        if "--spec" not in flags:
            raise InputError(f"{where}: {posixpath.basename(program)} needs --spec (Megatron-LM: "
                             "'You must provide a valid Mamba layer spec via --spec')")  # fmt: skip
        if isinstance(args, dict):
            args.update(entry.implied)  # (none for train_rl.py: its flag says it)
    return ((entry.note,) if entry.note else ()), refused
