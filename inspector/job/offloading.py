"""Fine-grained activation offloading (`--fine-grained-activation-offloading`), as megatron reads it.

Megatron-LM's arguments (core_v0.16.1 megatron/training/arguments.py): `--offload-modules`
(nargs='*', default []) names the modules whose inputs go to the CPU, `--min-offloaded-tensor-size`
(default 1024 * 1024 elements) the smallest saved tensor that goes. megatron-core 0.16
TransformerConfig.__post_init__ asserts a non-empty list of the seven names below and raises on
`attn_proj` without `core_attn`; 0.13 has no such offloading (no pipeline_parallel/
fine_grained_activation_offload.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version
from inspector.job.checks import check_count

# megatron-core 0.16 transformer_config.py, TransformerConfig.__post_init__: allowed_modules
OFFLOAD_MODULES: tuple[str, ...] = (
    "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act",
)  # fmt: skip
# megatron-core 0.19.2 transformer_config.py 1237-1245: "offload the input of the whole fused
# grouped MLP" (Megatron-Bridge's Nemotron 3 Ultra recipes ask for it): megatron's own offload
# (experts.py `_fused_forward` wraps the op fuser's grouped MLP in it) run as for the others
FUSED_GROUP_MLP, FUSED_GROUP_MLP_SINCE = "fused_group_mlp", (0, 19)
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024  # Megatron-LM's default, in elements
FIRST_VERSION = (0, 16)


@dataclass(frozen=True)
class Offloading:
    """What is offloaded: megatron's modules whose inputs go to pinned host memory and the
    smallest tensor (elements) that goes, or (`layers`) Transformer Engine's first layers."""

    modules: tuple[str, ...] = ()
    min_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    layers: int | None = None  # --cpu-offloading-num-layers under --cpu-offloading

    def config_fields(self) -> dict[str, Any]:
        """Return the TransformerConfig fields Megatron-LM sets for it."""
        if self.layers is not None:
            return dict(cpu_offloading=True, cpu_offloading_num_layers=self.layers)
        return dict(fine_grained_activation_offloading=True, offload_modules=list(self.modules),
                    min_offloaded_tensor_size=self.min_tensor_size)  # fmt: skip


def parse_offloading(args: Mapping[str, Any]) -> Offloading | None:
    """Return the job's offloading, or None without `--fine-grained-activation-offloading` or
    `--cpu-offloading`."""
    raw, size = args.get("offload_modules"), args.get("min_offloaded_tensor_size")
    check_count("--min-offloaded-tensor-size", size)  # a count of elements
    check_count("--cpu-offloading-num-layers", args.get("cpu_offloading_num_layers"))
    if args.get("cpu_offloading"):
        return _layer_offload(args)
    if not args.get("fine_grained_activation_offloading"):
        # Megatron-LM reads neither without the switch (TransformerConfig: offloading is off)
        return None
    installed = megatron_core_version()
    if installed < FIRST_VERSION:
        raise ConfigError(
            f"--fine-grained-activation-offloading needs megatron-core 0.16 or later (the installed "
            f"{installed[0]}.{installed[1]} has no pipeline_parallel/fine_grained_activation_offload.py)"
        )
    modules = tuple(m for m in re.split(r"[\s,\[\]'\"]+", str(raw or "")) if m)
    if not modules:
        # TransformerConfig: assert self.offload_modules is not None and len(...) > 0
        raise ConfigError("--fine-grained-activation-offloading needs --offload-modules (megatron-core's "
                          "TransformerConfig asserts at least one module)")  # fmt: skip
    allowed = OFFLOAD_MODULES + ((FUSED_GROUP_MLP,) if installed >= FUSED_GROUP_MLP_SINCE else ())
    unknown = [m for m in modules if m not in allowed]
    if unknown:
        raise ConfigError(
            f"--offload-modules {' '.join(unknown)} is not one of: {', '.join(allowed)}"
        )
    if FUSED_GROUP_MLP in modules:
        _check_fused_group_mlp(args, modules)
    if "attn_proj" in modules and "core_attn" not in modules:
        raise ConfigError(
            "--offload-modules attn_proj needs core_attn too (megatron-core: the input of attn_proj "
            "is the output of core_attn, which is needed in core_attn.backward())"
        )
    return Offloading(modules, MIN_OFFLOADED_TENSOR_SIZE if size is None else int(size))


def _check_fused_group_mlp(args: Mapping[str, Any], modules: tuple[str, ...]) -> None:
    """Refuse what megatron-core 0.19's TransformerConfig refuses of `fused_group_mlp`
    (transformer_config.py __post_init__, 0.19.2 ~1895-1903): the op fuser's grouped MLP is
    what it offloads (experts.py `_fused_forward`: the input of `ops(...)` and what its fused
    operations save), and it holds what expert_fc1 and moe_act would."""
    if not args.get("use_transformer_engine_op_fuser"):
        raise ConfigError(f"--offload-modules {FUSED_GROUP_MLP} needs --use-transformer-engine-op-"
                          "fuser (megatron-core's TransformerConfig: 'fused_group_mlp requires "
                          "use_transformer_engine_op_fuser.')")  # fmt: skip
    partial = [m for m in ("expert_fc1", "moe_act") if m in modules]
    if partial:
        raise ConfigError(f"--offload-modules {FUSED_GROUP_MLP} with {' '.join(partial)}: "
                          "megatron-core refuses it (TransformerConfig: 'fused_group_mlp offloads "
                          "the whole fused grouped MLP and cannot be combined with expert_fc1 or "
                          "moe_act.')")  # fmt: skip


def _layer_offload(args: Mapping[str, Any]) -> Offloading:
    """Return Transformer Engine's layer offload as megatron-core 0.16's TransformerConfig
    checks it (transformer_config.py 1137-1153, 1268-1271, 1722)."""
    layers = args.get("cpu_offloading_num_layers") or 0  # Megatron-LM's default 0
    total = args.get("num_layers")
    if total is not None and layers >= total:
        raise ConfigError(
            f"--cpu-offloading-num-layers {layers} must be below --num-layers {total} "
            "(megatron-core: CPU offloading can be done only for layers less than it)"
        )
    refusals = (
        ("fine_grained_activation_offloading", "--fine-grained-activation-offloading"),
        ("recompute_granularity", "--recompute-granularity"),
        ("recompute_activations", "--recompute-activations"),
    )
    for name, flag in refusals:
        if args.get(name):
            raise ConfigError(f"--cpu-offloading cannot go with {flag} (megatron-core's "
                              "TransformerConfig refuses them together)")  # fmt: skip
    pp = args.get("pipeline_model_parallel_size") or 1
    if pp > 1:
        raise ConfigError(
            f"--cpu-offloading needs --pipeline-model-parallel-size 1, got {pp} "
            "(megatron-core: no support for pipeline parallelism with CPU offloading)"
        )
    if (args.get("cuda_graph_impl") or "none") != "none":
        raise ConfigError("--cpu-offloading cannot go with --cuda-graph-impl (megatron-core: "
                          "\"CUDA graphs not supported with CPU offloading\")")  # fmt: skip
    return Offloading(layers=layers)
