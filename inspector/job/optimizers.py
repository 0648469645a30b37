"""Which optimizer a job trains with, and what Megatron-LM and megatron-core refuse of it.

Adam (the default) shards over the data-parallel group with --use-distributed-optimizer, or over
dp / N ranks with --num-distributed-optimizer-instances N (with --use-megatron-fsdp: HSDP,
Megatron-FSDP's buffers sharded over dp / N ranks); Muon (megatron-core 0.16's
`optimizer/muon.py`: orthogonalised momentum on the 2-D weights, Adam on everything else) keeps
whole matrices, each on one data-parallel rank with `dist_muon` (`LayerWiseDistributedOptimizer`).
Megatron-LM 0.18+ checks Muon otherwise (`_check_emerging`): muon with --use-distributed-optimizer
is the layer-wise optimizer there (`layer_wise`), which lays its matrices out in DDP's buffers by
default.
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.layout import Layout

MUON = ("muon", "dist_muon")  # Megatron-LM's --optimizer choices built by get_megatron_muon_optimizer
MOMENTUM_BYTES = 4  # TensorParallelMuon's state: one fp32 momentum per element (world/emerging.py)
# the Megatron-LM arguments (switches) the optimizer's checks read
FLAGS_READ = ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "fp16",
              "use_megatron_fsdp", "use_torch_fsdp2", "no_use_layer_wise_param_layout",
              "num_experts")  # fmt: skip


def muon_bytes_per_element(param_bytes: int) -> int:
    """Return Muon's optimizer bytes per element of a matrix it updates: its fp32 momentum and, for
    a 16-bit weight, the fp32 master copy megatron's Float16OptimizerWithFloat16Params keeps."""
    return MOMENTUM_BYTES + (4 if param_bytes < 4 else 0)


def check_optimizer(optimizer: str, layout: Layout, flags: dict[str, bool]) -> None:
    """Raise ConfigError for what Megatron-LM refuses of the optimizer's flags (`flags`: the
    switches of FLAGS_READ, as the job sets them)."""
    if flags.get("overlap_param_gather"):
        # Megatron-LM 0.17+ accepts dist_muon too (validate_args: "... distributed optimizer,
        # megatron fsdp, or dist_muon"); modelled on 0.18+, whose layout all-gathers DDP's buffers
        sharded = flags.get("use_distributed_optimizer") or flags.get("use_megatron_fsdp")
        if not (sharded or layer_wise(optimizer, flags)):
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
    instances = layout.num_distributed_optimizer_instances
    if instances > 1 and layer_wise(optimizer, flags):
        raise ConfigError(
            f"--num-distributed-optimizer-instances {instances} with the layer-wise optimizer "
            f"(--optimizer {optimizer}) is refused by megatron-core (layer_wise_optimizer.py: "
            "\"LayerWiseDistributedOptimizer does not support num_distributed_optimizer_instances "
            "> 1.\")"
        )
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
    # --use-distributed-optimizer (which it turns off; `layer_wise`); FSDP is refused;
    # optimizer/__init__.py _get_megatron_emerging_optimizer: "emerging optimizer with fp16 is
    # not supported." Both layouts of the layer-wise optimizer are modelled: by default its
    # matrices shard-aligned in DDP's buffers beside a DistributedOptimizer for the rest
    # (training.py wrap_model_chunks_with_ddp), with --no-use-layer-wise-param-layout 0.16's deal
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


def layer_wise(optimizer: str, flags: dict[str, bool]) -> bool:
    """Return whether Megatron-LM 0.18+ trains this job with megatron's layer-wise distributed
    optimizer (validate_args, "emerging optimizer check": dist_muon, or muon with
    --use-distributed-optimizer, which it then turns off)."""
    from inspector.job.versions import muon_registry

    return muon_registry() and (optimizer == "dist_muon" or (
        optimizer == "muon" and bool(flags.get("use_distributed_optimizer"))))  # fmt: skip


def _check_instances(layout: Layout, flags: dict[str, bool]) -> None:
    flag, instances = "--num-distributed-optimizer-instances", layout.num_distributed_optimizer_instances
    if instances == 1:
        return
    # Megatron-LM's validate_args turns --use-distributed-optimizer on with --use-megatron-fsdp,
    # which then shards within each instance and all-reduces across them (HSDP, _check_hsdp)
    if flags.get("use_megatron_fsdp"):
        _check_hsdp(flag, instances, flags)
    elif not flags.get("use_distributed_optimizer"):
        raise ConfigError(
            f"{flag} {instances} needs --use-distributed-optimizer (megatron-core "
            "DistributedDataParallel: \"Partial DistOpt cannot be used without DistOpt\")"
        )
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


def _check_hsdp(flag: str, instances: int, flags: dict[str, bool]) -> None:
    # megatron-core's Megatron-FSDP with N instances (mcore_fsdp_adapter.py `_init_dist_index`,
    # `enable_hsdp`): its buffers shard over the intra partial data-parallel groups (dp x cp / N,
    # expert dp / N), the gradients all-reduced over the inter-instance group (world/fsdp.py)
    from inspector.job.versions import hsdp_expert_groups, megatron_version

    if flags.get("num_experts") and not hsdp_expert_groups():
        release = ".".join(map(str, megatron_version()))
        raise ConfigError(
            f"{flag} {instances} with --use-megatron-fsdp and --num-experts fails in megatron-core "
            f"{release} (mcore_fsdp_adapter.py: the HSDP device mesh has no expert data-parallel "
            "group, so Megatron-FSDP's expert buffers find none); megatron-core 0.17 on shards "
            "them over the expert data-parallel group / N"
        )
