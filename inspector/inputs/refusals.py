"""Refused arguments of a script or config file, gathered so one `Error:` names them all.

An argument is refused for one of two reasons: this tool does not model what it changes
(inspector.inputs.unmodelled.REFUSED), or Megatron-LM itself stops on it (MEGATRON_LM_REFUSES:
removed or renamed arguments, pretrain_gpt.py's argparse, validate_args' rules). The second kind
stops every command, as Megatron-LM would not start; the first only the commands that read the
argument's group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from inspector.inputs.unmodelled import (
    LOCAL_GRAPHS,
    MEGATRON_LM_REFUSES,
    REFUSED,
    REFUSED_VALUES,
    refusal_message,
)
from inspector.inputs.versions import choice_version_fact, megatron_core_version, within

ALL_GROUPS = "all"  # a Refused.group that stops every command


@dataclass(frozen=True)
class Refused:
    """One refused argument: where it was written, as written, and why."""

    group: str  # the argument group whose commands it stops, or ALL_GROUPS
    where: str  # "train.sh line 12", "config.yaml"
    argument: str  # "--fp8-format hybrid"
    verb: str  # "not modelled" or "refused by Megatron-LM"
    reason: str


def refused_argument(flag: str, value: str | None, where: str) -> Refused | None:
    """Return why a flag (with its value, None for a switch) is refused, or None when it is not."""
    shown = f"{flag} {value}" if value is not None else flag
    if flag in MEGATRON_LM_REFUSES:
        return Refused(ALL_GROUPS, where, flag, "refused by Megatron-LM", MEGATRON_LM_REFUSES[flag])
    if refusal_message(flag, value) is None:
        return None
    return Refused(REFUSED[flag].group, where, shown, "not modelled", REFUSED[flag].reason)


def refused_value(flag: str, value: str | None, where: str) -> Refused | None:
    """Return why a modelled argument's value is refused (unmodelled.REFUSED_VALUES), or None;
    a flag modelled on some megatron-core releases only is refused by name on the others."""
    if flag in REFUSED and str(value).lower() != "false":
        return refused_argument(flag, None, where)
    refusal = REFUSED_VALUES.get(flag, {}).get(value or "")
    if refusal is None:
        return None
    known = choice_version_fact(flag, value or "")
    if refusal.modelled is not None and within(refusal.modelled, megatron_core_version()):
        return None
    if known is not None and not known[1]:  # argparse's 'invalid choice' in this Megatron-LM
        return Refused(ALL_GROUPS, where, f"{flag} {value}", "refused by Megatron-LM",
                       f"{known[0]}, whose Megatron-LM stops with 'invalid choice'")  # fmt: skip
    reason = refusal.reason if known is None else f"{refusal.reason} ({known[0]})"
    return Refused(refusal.group, where, f"{flag} {value}", "not modelled", reason)


def refused_flags(refused: Iterable[Refused]) -> set[str]:
    """Return the flags of refused arguments, for validate_args' rules that read them."""
    return {item.argument.split()[0] for item in refused}


def validate_args_refusals(flags: Iterable[str], where: str,
                           args: Mapping[str, Any] | None = None) -> tuple[Refused, ...]:  # fmt: skip
    """Return validate_args' refusals of argument combinations among the flags a job passes
    (`args`: its modelled arguments, for the rules that read a value)."""
    given = set(flags)
    found: list[Refused] = []
    if {"--step-batch-size-schedule", "--global-batch-size"} <= given:
        found.append(Refused(ALL_GROUPS, where, "--step-batch-size-schedule with --global-batch-size",
                             "refused by Megatron-LM",
                             "validate_args: 'Cannot specify both --step-batch-size-schedule and "
                             "--global-batch-size'"))  # fmt: skip
    position = (args or {}).get("position_embedding_type") or "learned_absolute"
    if "--no-position-embedding" in given and position != "rope":
        found.append(Refused(ALL_GROUPS, where, "--no-position-embedding without rope",
                             "refused by Megatron-LM",
                             "validate_args: '--no-position-embedding is deprecated, use "
                             "--position-embedding-type'"))  # fmt: skip
    # megatron-core TransformerConfig.__post_init__ (0.13-0.20): DeepEP needs the flex dispatcher
    flex = (args.get("moe_token_dispatcher_type") == "flex" if args is not None
            else "--moe-token-dispatcher-type" in given)  # fmt: skip
    if "--moe-enable-deepep" in given and not flex:
        found.append(Refused(ALL_GROUPS, where, "--moe-enable-deepep without "
                             "--moe-token-dispatcher-type flex", "refused by Megatron-LM",
                             "megatron-core's TransformerConfig: 'DeepEP backend is only supported "
                             "with flex token dispatcher.'"))  # fmt: skip
    # Megatron-LM training.py `setup_model_and_optimizer` (0.17): ModelOpt's model provider, the
    # one that reads --export-force-local-attention, builds with a ModelOpt checkpoint in --load
    # or with --export-kd-teacher-load (ModelOpt's finetune.sh always passes --load)
    if "--export-force-local-attention" in given and given & {"--load", "--export-kd-teacher-load"}:
        found.append(Refused("training", where, "--export-force-local-attention", "not modelled",
                             "ModelOpt's local attention (megatron-core DotProductAttention, which "
                             "stores the attention scores) in place of Transformer Engine's is not "
                             "modelled (ModelOpt's model provider builds it, given a ModelOpt "
                             "checkpoint in --load)"))  # fmt: skip
    found += _fp8_param_gather_refusals(given, where, args or {})
    found += _local_graph_refusals(where, args or {})
    found += _checkpoint_args_refusals(given, where)
    found += _fsdp_refusals(given, where, args or {})
    return tuple(found)


def _fsdp_refusals(given: set[str], where: str, args: Mapping[str, Any]) -> list[Refused]:
    """Megatron-LM validate_args on --use-megatron-fsdp with arguments this tool otherwise
    ignores: core_v0.18.0+ refuses meta-device initialisation under no_shard; core_v0.19.0
    turns the FSDP double buffer on with --use-nccl-ub ("FSDP double buffer and manual
    registration is enabled by default when --nccl-ub is enabled!")."""
    if "--use-megatron-fsdp" not in given:
        return []
    found = []
    version = megatron_core_version()
    no_shard = (args.get("data_parallel_sharding_strategy") or "no_shard") == "no_shard"
    if "--init-model-with-meta-device" in given and no_shard and version >= (0, 18):
        found.append(Refused(ALL_GROUPS, where, "--init-model-with-meta-device with "
                             "--data-parallel-sharding-strategy no_shard", "refused by Megatron-LM",
                             "validate_args: 'Meta device initialization (init_model_with_meta_"
                             "device=True) is not supported or necessary for the 'no_shard' / 0 "
                             "sharding strategy.'"))  # fmt: skip
    if "--use-nccl-ub" in given and version >= (0, 19):
        found.append(Refused("training", where, "--use-nccl-ub with --use-megatron-fsdp",
                             "not modelled", "Megatron-LM 0.19's validate_args turns on the FSDP "
                             "double buffer and NCCL's manual buffer registration with it, which "
                             "this tool does not model together"))  # fmt: skip
    return found


# megatron/training/checkpointing.py `load_args_from_checkpoint` (d98e8a6 L2272-2296): the valued
# architecture arguments --use-checkpoint-args takes from the checkpoint in --load (the switches
# it sets, --swiglu and the like, are read as the job writes them: inputs/ignored.py's note)
CHECKPOINT_ARCHITECTURE = ("--num-layers", "--hidden-size", "--ffn-hidden-size",
                           "--num-attention-heads", "--num-query-groups", "--kv-channels",
                           "--max-position-embeddings", "--seq-length", "--normalization")  # fmt: skip
_POSITION = ("--position-embedding-type", "--use-rotary-position-embeddings")


def _checkpoint_args_refusals(given: set[str], where: str) -> list[Refused]:
    """`--use-checkpoint-args` is read where the job gives every valued architecture argument."""
    if "--use-checkpoint-args" not in given:
        return []
    missing = [flag for flag in CHECKPOINT_ARCHITECTURE if flag not in given]
    missing += [] if given & set(_POSITION) else ["--position-embedding-type"]
    if not missing:
        return []
    return [Refused("model", where, "--use-checkpoint-args", "not modelled",
                    "Megatron-LM then takes the model's architecture from the checkpoint it loads "
                    "(checkpointing.py load_args_from_checkpoint), which this tool cannot read, and "
                    f"the job does not give {', '.join(missing)}; give them, or drop it")]  # fmt: skip


def _local_graph_refusals(where: str, args: Mapping[str, Any]) -> list[Refused]:
    """`--cuda-graph-impl local` is modelled without a scope (whole layers) or with
    `--cuda-graph-scope full_iteration`, and under --perform-rl-step, where only the rollout
    engine runs graphs (job/rollout.py); a partial scope, or MoE layers whose dispatch reads
    token counts on the host (`static_moe_layers`), are refused."""
    if args.get("cuda_graph_impl") != "local" or args.get("perform_rl_step"):
        return []
    raw = args.get("cuda_graph_scope") or ()
    words = raw if isinstance(raw, (list, tuple)) else str(raw).replace(",", " ").split()
    partial = [word for word in words if word not in ("full", "full_iteration")]
    moe = bool(args.get("num_experts")) and not static_moe_layers(args)
    if "full_iteration" in words or not (partial or moe):
        return []
    what = f"--cuda-graph-scope {' '.join(partial)}" if partial else DYNAMIC_MOE
    return [Refused(LOCAL_GRAPHS.group, where, f"--cuda-graph-impl local with {what}", "not modelled",
                    LOCAL_GRAPHS.reason)]  # fmt: skip


# the MoE layers megatron's whole-layer graphs cannot hold (`static_moe_layers`), as refused
DYNAMIC_MOE = "MoE layers of dynamic shapes"


def static_moe_layers(values: Mapping[str, Any]) -> bool:
    """Return whether a MoE layer's forward keeps its shapes on the GPU, so that a whole-layer CUDA
    graph can hold it (`values`: Megatron-LM's argument names, or Training's, which are the same).

    megatron-core graphs the whole MoE layer only then (TransformerConfig.__post_init__, 0.16.1
    and 0.19.2: "moe cuda graph is only supported with drop-padding MoE"): with
    --moe-pad-expert-input-to-capacity the dispatcher's counts are the capacity, made on the host
    (token_dispatcher.py `preprocess`, drop_and_pad: `torch.full`); from megatron-core 0.18,
    HybridEP's --moe-expert-rank-capacity-factor gives a fixed budget of permuted tokens a rank
    (token_dispatcher.py `_HybridEPManager.setup_metadata`: `num_permuted_tokens`, "None means no
    up-bound, will cause a CPU sync"), run by the op fuser's grouped MLP (checks.py
    `check_rank_capacity`). Otherwise the dispatcher or the experts copy the token counts to the
    host (`_maybe_update_cuda_sync_point`, `tokens_per_expert.tolist()`), which a CUDA graph's
    capture cannot do."""
    padded = values.get("moe_expert_capacity_factor") is not None and bool(
        values.get("moe_pad_expert_input_to_capacity"))  # fmt: skip
    return padded or values.get("moe_expert_rank_capacity_factor") is not None


def _fp8_param_gather_refusals(given: set[str], where: str,
                               args: Mapping[str, Any]) -> list[Refused]:  # fmt: skip
    """Megatron-LM's own stops for `--fp8-param-gather`:
    megatron-core's TransformerConfig.__post_init__ needs fp8 for `fp8_param` (which
    core_transformer_config_from_args copies from it), and validate_args a sharding optimizer."""
    if "--fp8-param-gather" not in given:
        return []
    found = []
    # under FSDP2 validate_args has turned it off (fsdp2_drops_fp8_param_gather) before the
    # TransformerConfig is made
    if not args.get("fp8_format") and not args.get("use_torch_fsdp2"):
        found.append(Refused(ALL_GROUPS, where, "--fp8-param-gather without --fp8-format",
                             "refused by Megatron-LM",
                             "megatron-core's TransformerConfig: 'fp8_param must be used "
                             "together with fp8 mode.'"))  # fmt: skip
    if not any(args.get(name) for name in _FP8_PARAM_OPTIMIZERS):
        found.append(Refused(ALL_GROUPS, where, "--fp8-param-gather without "
                             "--use-distributed-optimizer", "refused by Megatron-LM",
                             "validate_args: '--fp8-param-gather only supported with distributed "
                             "optimizer, torch fsdp2, megatron fsdp, or inference mode'"))  # fmt: skip
    return found


# validate_args: the arguments that let --fp8-param-gather train
_FP8_PARAM_OPTIMIZERS = ("use_distributed_optimizer", "use_torch_fsdp2", "use_megatron_fsdp")


def fsdp2_drops_fp8_param_gather(refused: Sequence[Refused], args: MutableMapping[str, Any],
                                 ) -> tuple[tuple[Refused, ...], tuple[str, ...]]:  # fmt: skip
    """Return the refusals and notes once validate_args has turned `--fp8-param-gather` off:
    under --use-torch-fsdp2 with Transformer Engine 2.0 or later (the stand-in is 2.11) it sets
    args.fp8_param_gather = False with a warning, so the job is --fp8-format's alone (`args` is
    changed in place, as validate_args changes Megatron-LM's)."""
    if not args.get("use_torch_fsdp2") or not args.get("fp8_param_gather"):
        return tuple(refused), ()
    args["fp8_param_gather"] = False
    kept = tuple(item for item in refused if item.argument.split()[0] != "--fp8-param-gather")
    return kept, (
        "--fp8-param-gather is turned off under --use-torch-fsdp2, as Megatron-LM's validate_args "
        "does with Transformer Engine 2.0 or later ('FSDP2 FP8 param gather is not supported yet "
        "in TE 2.0, will fallback to bf16 all_gather instead'): the parameters stay 16-bit",
    )


def refusals_message(refused: Sequence[Refused], groups: tuple[str, ...]) -> str:
    """Return the sentences naming every refused argument a command of `groups` reads, or ""."""
    stopping = [r for r in refused if r.group == ALL_GROUPS or r.group in groups]
    places: dict[str, list[Refused]] = {}
    for item in stopping:
        places.setdefault(item.where, []).append(item)
    return "; ".join(f"{where}: {_sentences(items)}" for where, items in places.items())


def _sentences(items: list[Refused]) -> str:
    """Join refusals, one clause per reason: 'A and B are not modelled: why; C is ...'."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for item in items:
        reasons.setdefault((item.verb, item.reason), []).append(item.argument)
    clauses = []
    for (verb, reason), arguments in reasons.items():
        names = arguments[0] if len(arguments) == 1 else (
            ", ".join(arguments[:-1]) + " and " + arguments[-1])  # fmt: skip
        clauses.append(f"{names} {'is' if len(arguments) == 1 else 'are'} {verb}: {reason}")
    return "; ".join(clauses)


def refused_in(raw: Mapping[str, Any], where: str) -> list[Refused]:
    """Return the refusals of a mapping of flags (`--name` -> value, None for a switch)."""
    found = [refused_argument(flag, value, where) for flag, value in raw.items()]
    return [item for item in found if item is not None]


def fsdp_connections_refusal(args: Mapping[str, Any], connections: str | None,
                             where: str) -> tuple[Refused, ...]:  # fmt: skip
    """Megatron-LM's validate_args (core_v0.13.1 to core_v0.19.0) asserts, with
    --use-megatron-fsdp, `os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1"` ("FSDP requires
    CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset."): a launch that exports 1 stops there."""
    if not args.get("use_megatron_fsdp") or connections != "1":
        return ()
    return (Refused(ALL_GROUPS, where, "--use-megatron-fsdp with CUDA_DEVICE_MAX_CONNECTIONS=1",
                    "refused by Megatron-LM", "validate_args: 'FSDP requires "
                    "CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.'"),)  # fmt: skip
