"""Which optimizer a job trains with, and what Megatron-LM and megatron-core refuse of it.

Adam (the default) shards over the data-parallel group with --use-distributed-optimizer, or over
dp / N ranks with --num-distributed-optimizer-instances N; Muon (megatron-core 0.16's
`optimizer/muon.py`: orthogonalised momentum on the 2-D weights, Adam on everything else) keeps
whole matrices, each on one data-parallel rank with `dist_muon` (`LayerWiseDistributedOptimizer`).
Megatron-LM 0.18+ checks Muon otherwise (`_check_emerging`): muon with --use-distributed-optimizer
is the layer-wise optimizer there.
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.layout import Layout

MUON = ("muon", "dist_muon")  # Megatron-LM's --optimizer choices built by get_megatron_muon_optimizer
# the Megatron-LM arguments (switches) the optimizer's checks read
FLAGS_READ = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "fp16",
              "use_megatron_fsdp", "use_torch_fsdp2", "no_use_layer_wise_param_layout")  # fmt: skip


def check_optimizer(optimizer: str, layout: Layout, flags: dict[str, bool]) -> None:
    """Raise ConfigError for what Megatron-LM refuses of the optimizer's flags (`flags`: the
    switches of FLAGS_READ, as the job sets them)."""
    if flags.get("overlap_param_gather"):
        if not (flags.get("use_distributed_optimizer") or flags.get("use_megatron_fsdp")):
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp "
                "(Megatron-LM: \"--overlap-param-gather only supported with distributed optimizer "
                "or megatron fsdp\")"
            )
        if not flags.get("overlap_grad_reduce"):
            raise ConfigError(
                "--overlap-param-gather needs --overlap-grad-reduce (Megatron-LM: \"Must use "
                "--overlap-param-gather with --overlap-grad-reduce\")"
            )
    if optimizer == "sgd":
        raise ConfigError(
            "--optimizer sgd is not modelled: optimizer state is counted for Adam (two fp32 moments)"
        )
    if optimizer in MUON:
        _check_muon(optimizer, flags)
    _check_instances(layout, flags)


def _check_muon(optimizer: str, flags: dict[str, bool]) -> None:
    from inspector.job.versions import megatron_version, muon_registry

    if muon_registry():
        _check_emerging(optimizer, flags)
        return
    if megatron_version() >= (0, 17):
        _check_muon_0_17(optimizer, flags)
    # Megatron-LM core_v0.16 arguments.py validate_args, "Muon optimizer check"; muon.py
    # get_megatron_muon_optimizer: "muon with fp16 is not supported." (the same in core_v0.17.1
    # but for the overlaps, _check_muon_0_17)
    said = {
        "overlap_grad_reduce": ("--overlap-grad-reduce", "does not support overlap grad reduce"),
        "overlap_param_gather": ("--overlap-param-gather", "does not support overlap param gather"),
        "use_distributed_optimizer": ("--use-distributed-optimizer",
                                      "does not support distributed optimizer"),
        "use_torch_fsdp2": ("--use-torch-fsdp2", "does not support Torch-FSDP2"),
        "use_megatron_fsdp": ("--use-megatron-fsdp", "does not support Megatron-FSDP"),
    }  # fmt: skip
    release = ".".join(map(str, megatron_version()))
    for name, (flag, words) in said.items():
        if flags.get(name):
            raise ConfigError(
                f"--optimizer {optimizer} with {flag} is refused by Megatron-LM {release} (validate_args: "
                f"\"Muon optimizer {words} for now.\"); --optimizer dist_muon shards it layer-wise"
            )
    if flags.get("fp16"):
        raise ConfigError(
            f"--optimizer {optimizer} with --fp16 is refused by megatron-core (muon.py: \"muon with "
            "fp16 is not supported.\"); use --bf16"
        )


def _check_muon_0_17(optimizer: str, flags: dict[str, bool]) -> None:
    # Megatron-LM core_v0.17.1 validate_args refuses the overlaps for muon only: "Muon optimizer
    # does not support overlap grad reduce. Use dist_muon instead." (and overlap param gather);
    # dist_muon overlaps its layer-wise all-gather (async_allgather), which is not modelled
    overlaps = (("overlap_grad_reduce", "--overlap-grad-reduce", "grad reduce"),
                ("overlap_param_gather", "--overlap-param-gather", "param gather"))  # fmt: skip
    for name, flag, words in overlaps:
        if not flags.get(name):
            continue
        if optimizer == "muon":
            raise ConfigError(f"--optimizer muon with {flag} is refused by Megatron-LM 0.17 "
                              f"(validate_args: \"Muon optimizer does not support overlap {words}. "
                              "Use dist_muon instead.\")")  # fmt: skip
        raise ConfigError(f"--optimizer dist_muon with {flag} is not modelled on megatron-core "
                          "0.17 (its layer-wise optimizer's overlapped all-gather)")  # fmt: skip


def _check_emerging(optimizer: str, flags: dict[str, bool]) -> None:
    # Megatron-LM core_v0.18.2 / core_v0.19.2 arguments.py validate_args, "emerging optimizer
    # check": dist_muon becomes muon with the layer-wise optimizer, and so does muon with
    # --use-distributed-optimizer (which it turns off); FSDP is refused; optimizer/__init__.py
    # _get_megatron_emerging_optimizer: "emerging optimizer with fp16 is not supported."
    fsdp = (("use_torch_fsdp2", "--use-torch-fsdp2", "Torch-FSDP2"),
            ("use_megatron_fsdp", "--use-megatron-fsdp", "Megatron-FSDP"))  # fmt: skip
    for name, flag, kind in fsdp:
        if flags.get(name):
            raise ConfigError(f"--optimizer {optimizer} with {flag} is refused by Megatron-LM "
                              f"(validate_args: \"Emerging optimizer does not support {kind} for "
                              "now.\")")  # fmt: skip
    if flags.get("fp16"):
        raise ConfigError(
            f"--optimizer {optimizer} with --fp16 is refused by megatron-core (optimizer/__init__.py: "
            "\"emerging optimizer with fp16 is not supported.\"); use --bf16"
        )
    if optimizer == "dist_muon" and not flags.get("no_use_layer_wise_param_layout"):
        raise ConfigError(
            "--optimizer dist_muon is not modelled on this megatron-core without "
            "--no-use-layer-wise-param-layout: Megatron-LM 0.18+ lays the layer-wise optimizer's "
            "matrices out in the DDP buffers beside a distributed Adam by default; its legacy path "
            "(--no-use-layer-wise-param-layout: whole matrices dealt over the ranks) is modelled"
        )
    if optimizer == "dist_muon" and flags.get("use_distributed_optimizer"):
        raise ConfigError(
            "--optimizer dist_muon with --use-distributed-optimizer is not modelled on this "
            "megatron-core (Megatron-LM 0.18+ turns --use-distributed-optimizer off for it; "
            "--optimizer dist_muon alone is the same job)"
        )
    if layer_wise_spelled_muon(optimizer, flags):
        return
    if optimizer == "muon" and flags.get("use_distributed_optimizer"):
        raise ConfigError(
            "--optimizer muon with --use-distributed-optimizer is not modelled on this megatron-core: "
            "Megatron-LM 0.18+ turns it into the layer-wise distributed optimizer (as dist_muon), "
            "whose matrices 0.18+ lays out in the DDP buffers beside a distributed Adam; "
            "--optimizer muon alone, and --optimizer dist_muon --no-use-layer-wise-param-layout "
            "(its legacy path), are modelled"
        )


def layer_wise_spelled_muon(optimizer: str, flags: dict[str, bool]) -> bool:
    """Return whether Megatron-LM 0.18+ makes this muon job dist_muon's legacy path (validate_args:
    muon with --use-distributed-optimizer is the layer-wise optimizer, the distributed one off;
    with --no-use-layer-wise-param-layout, training.py builds it as 0.16-0.17 do)."""
    from inspector.job.versions import muon_registry

    return (optimizer == "muon" and muon_registry() and bool(flags.get("use_distributed_optimizer"))
            and bool(flags.get("no_use_layer_wise_param_layout")))  # fmt: skip


def _check_instances(layout: Layout, flags: dict[str, bool]) -> None:
    flag, instances = "--num-distributed-optimizer-instances", layout.num_distributed_optimizer_instances
    if instances == 1:
        return
    if not flags.get("use_distributed_optimizer"):
        raise ConfigError(
            f"{flag} {instances} needs --use-distributed-optimizer (megatron-core "
            "DistributedDataParallel: \"Partial DistOpt cannot be used without DistOpt\")"
        )
    if flags.get("use_megatron_fsdp"):
        raise ConfigError(f"{flag} {instances} with --use-megatron-fsdp (HSDP) is not modelled")
    dp_cp = layout.dp * layout.cp
    if dp_cp % instances:
        raise ConfigError(
            f"{flag} {instances} does not divide the data-parallel size with context parallel "
            f"({layout.dp} x {layout.cp} = {dp_cp}; {dp_cp} % {instances} = {dp_cp % instances}; "
            "parallel_state: \"Data parallel size should be divisible by partial DistOpt shard "
            "factor\")"
        )
    if layout.expert_dp % instances:
        raise ConfigError(
            f"{flag} {instances} does not divide the expert data-parallel size ({layout.expert_dp} "
            f"% {instances} = {layout.expert_dp % instances}; parallel_state: \"Expert data "
            "parallel size should be divisible by partial DistOpt shard factor\")"
        )
