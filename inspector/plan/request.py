"""What a `plan` search is asked: the plan flags as one record, checked into a Request."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inspector.errors import ConfigError
from inspector.job.hardware import DEFAULT_EFFICIENCY, DEFAULT_GPU, Gpu, get_gpu, with_overrides
from inspector.job.job import Training, make_training
from inspector.job.model import ModelConfig, make_model_config


@dataclass(frozen=True)
class PlanFlags:
    """The `plan` command's own flags, as the user typed them (None: the GPU type's figure)."""

    gpus: int
    gpu: str = DEFAULT_GPU
    gpu_memory: float | None = None  # GiB
    gpus_per_node: int | None = None
    gpu_tflops: float | None = None
    intra_node_bandwidth: float | None = None  # GB/s, one direction
    inter_node_bandwidth: float | None = None
    efficiency: float | None = DEFAULT_EFFICIENCY  # None: the measured kernel tables
    top: int = 5


@dataclass(frozen=True)
class Request:
    """What the user asked: the model, the cluster, the batch, and any dimension they fixed."""

    model: ModelConfig
    gpus: int
    gpu: Gpu
    memory: int  # bytes per GPU
    global_batch_size: int
    efficiency: float | None = DEFAULT_EFFICIENCY  # None: the measured kernel tables
    fixed: dict[str, Any] = field(default_factory=dict)  # tp, pp, cp, ep, etp, vpp, mbs, ...
    top: int = 5
    flash_attention: bool | None = None  # None: on in 16-bit (Transformer Engine's kernels)
    training: Training = field(default_factory=Training)  # the user's dropout and grad dtype

    @property
    def gpus_per_node(self) -> int:
        """Return the GPUs that share one NVLink domain."""
        return self.gpu.gpus_per_node

    @property
    def flash(self) -> bool:
        """Return whether the candidates run flash attention."""
        if self.flash_attention is None:
            return self.model.dtype_name != "float32"
        return self.flash_attention


# Megatron-LM's argument -> the dimension it fixes in the search
FIXED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "num_virtual_stages_per_pipeline_rank": "vpp",
    "micro_batch_size": "mbs",
    "recompute_granularity": "recompute",
    "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
}


def make_request(args: dict[str, Any], flags: PlanFlags) -> Request:
    """Check the plan flags and return the search request (`args`: Megatron-LM's arguments)."""
    _check_counts(flags)
    batch = args.get("global_batch_size")
    if not batch:
        raise ConfigError("--global-batch-size is required: the plan splits it over data parallel")
    gpu = _plan_gpu(flags)
    fixed = {short: args[name] for name, short in FIXED.items() if args.get(name) is not None}
    if args.get("use_distributed_optimizer"):
        fixed["distopt"] = True
    asked = make_training(args)  # Megatron-LM's rules for the flags a plan keeps as given
    training = Training(
        fp32_grads=asked.fp32_grads,
        attention_dropout=asked.attention_dropout,
        hidden_dropout=asked.hidden_dropout,
    )
    return Request(
        model=make_model_config(args), gpus=flags.gpus, gpu=gpu,
        memory=round(gpu.memory_gib * (1 << 30)), global_batch_size=batch,
        efficiency=flags.efficiency, fixed=fixed,
        top=flags.top, training=training,
    )


def _check_counts(flags: PlanFlags) -> None:
    """Raise ConfigError naming the first count or fraction out of range."""
    for flag, value in (("--gpus", flags.gpus), ("--gpus-per-node", flags.gpus_per_node),
                        ("--top", flags.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if flags.efficiency is not None and not 0 < flags.efficiency <= 1:
        raise ConfigError(f"--efficiency must lie in (0, 1], got {flags.efficiency}")


def _plan_gpu(flags: PlanFlags) -> Gpu:
    """Return the named GPU type with the figures the user gave."""
    gpu = with_overrides(
        get_gpu(flags.gpu), flags.gpu_tflops, flags.gpu_memory, flags.intra_node_bandwidth,
        flags.inter_node_bandwidth,
    )
    if flags.gpus_per_node is not None:
        gpu = replace(gpu, gpus_per_node=flags.gpus_per_node)
    return gpu
