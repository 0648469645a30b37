"""Megatron-LM's checks on --use-megatron-fsdp and --use-torch-fsdp2 (validate_args, core_v0.16.1).

Each error is one Megatron-LM stops on (megatron/training/arguments.py), or, for
--use-distributed-optimizer, one its Megatron-FSDP guide states ("The custom FSDP must be used with
a distributed optimizer", docs/user-guide/features/custom_fsdp.md). Without --use-megatron-fsdp,
--data-parallel-sharding-strategy and --fsdp-double-buffer change nothing, as in Megatron-LM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DEFAULT_CKPT_FORMAT = "torch_dist"  # Megatron-LM's --ckpt-format default


def fsdp_rules(args: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Set the sharding strategy in `values`; raise ConfigError where Megatron-LM stops."""
    strategy = args.get("data_parallel_sharding_strategy") or "no_shard"
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"--data-parallel-sharding-strategy {strategy!r} is not one of: {', '.join(STRATEGIES)}"
        )
    values["sharding_strategy"] = strategy
    ckpt = args.get("ckpt_format") or DEFAULT_CKPT_FORMAT
    megatron, torch = bool(args.get("use_megatron_fsdp")), bool(args.get("use_torch_fsdp2"))
    if megatron and torch:
        raise ConfigError(
            "--use-megatron-fsdp and --use-torch-fsdp2 are two FSDP implementations; pass one "
            "(Megatron-LM's get_model would wrap the model in torch's)"
        )
    if ckpt == "fsdp_dtensor" and not megatron:
        raise ConfigError(
            "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM: \"--ckpt-format "
            "fsdp_dtensor is only tested with Megatron FSDP\")"
        )
    if ckpt == "torch_dcp":
        _torch_dcp_rules(args, torch)
    if megatron:
        _megatron_rules(args, ckpt)
    if torch:
        _torch_rules(args, ckpt)


def _megatron_rules(args: Mapping[str, Any], ckpt: str) -> None:
    if not args.get("use_distributed_optimizer"):
        raise ConfigError(
            "--use-megatron-fsdp needs --use-distributed-optimizer (Megatron-LM's Megatron-FSDP "
            "guide: \"The custom FSDP must be used with a distributed optimizer\")"
        )
    if ckpt != "fsdp_dtensor":
        raise ConfigError(
            f"--use-megatron-fsdp needs --ckpt-format fsdp_dtensor, not {ckpt} (Megatron-LM: "
            "\"Megatron FSDP only supports fsdp_dtensor checkpoint format\")"
        )
    check_fsdp_pipeline(args)


def check_fsdp_pipeline(args: Mapping[str, Any], searched: bool = False) -> None:
    """Stop Megatron-FSDP with pp > 1 where megatron-core cannot run it (job/versions.py);
    `searched`: `plan`, whose data-parallel size is not given, says no arithmetic of ranks."""
    from inspector.job.versions import fsdp_with_pipeline, megatron_version

    pp = args.get("pipeline_model_parallel_size") or 1
    if not args.get("use_megatron_fsdp") or pp == 1 or fsdp_with_pipeline():
        return
    dp, cp, tp = (args.get(name) or 1 for name in ("data_parallel_size", "context_parallel_size",
                                                  "tensor_model_parallel_size"))  # fmt: skip
    world = f"dp x cp x tp = {dp} x {cp} x {tp} = {dp * cp * tp} of the world's {dp * cp * tp * pp}"
    ranks = "one pipeline stage's ranks, not the world's" if searched else f"{world} ranks"
    release = ".".join(map(str, megatron_version()))
    raise ConfigError(
        f"--use-megatron-fsdp with --pipeline-model-parallel-size {pp} fails in megatron-core "
        f"0.14 to 0.19 (installed: {release}): FullyShardedDataParallel's device mesh "
        f"(mcore_fsdp_adapter.py `_get_dp_tp_mesh`) spans {ranks}, and einops stops on "
        "'Shape mismatch' when pp > 1; pass --pipeline-model-parallel-size 1, or the distributed "
        "optimizer without --use-megatron-fsdp"
    )


def _torch_rules(args: Mapping[str, Any], ckpt: str) -> None:
    for name, flag in (("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                       ("expert_model_parallel_size", "--expert-model-parallel-size")):  # fmt: skip
        size = args.get(name) or 1
        if size != 1:
            raise ConfigError(
                f"--use-torch-fsdp2 needs {flag} 1, not {size} (Megatron-LM: \"--use-torch-fsdp2 "
                f"is not supported with {name.split('_')[0]} parallelism\")"
            )
    stops = (
        (args.get("use_distributed_optimizer"), "without --use-distributed-optimizer",
         "is not supported with MCore's distributed optimizer"),
        (not args.get("no_gradient_accumulation_fusion"), "with --no-gradient-accumulation-fusion",
         "is not supported with gradient accumulation fusion"),
        (ckpt not in ("torch_dist", "torch_dcp"), "with --ckpt-format torch_dist or torch_dcp",
         "requires --ckpt-format torch_dist or torch_dcp"),
        (not args.get("untie_embeddings_and_output_weights"),
         "with --untie-embeddings-and-output-weights",
         "requires --untie-embeddings-and-output-weights"),
        (args.get("fp16"), "without --fp16", "not supported with fp16 yet"),
    )  # fmt: skip
    for failed, needed, said in stops:
        if failed:
            raise ConfigError(
                f"--use-torch-fsdp2 runs only {needed} (Megatron-LM: \"--use-torch-fsdp2 {said}\")"
            )


def _torch_dcp_rules(args: Mapping[str, Any], torch: bool) -> None:
    if not torch:
        raise ConfigError(
            "--ckpt-format torch_dcp needs --use-torch-fsdp2 (Megatron-LM: \"--ckpt-format "
            "torch_dcp is only tested with FSDP\")"
        )
    for name, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("pipeline_model_parallel_size", "--pipeline-model-parallel-size")):  # fmt: skip
        size = args.get(name) or 1
        if size > 1:
            raise ConfigError(
                f"--ckpt-format torch_dcp needs {flag} 1, not {size} (Megatron-LM: \"--ckpt-format "
                f"torch_dcp is not tested with megatron {name.split('_')[0]} parallelism\")"
            )
