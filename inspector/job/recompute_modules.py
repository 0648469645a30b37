"""Selective recomputation's modules (`--recompute-modules`, `--moe-layer-recompute`), as megatron reads them.

megatron-core 0.16 TransformerConfig.__post_init__ defaults `recompute_modules` to ["core_attn"],
allows the seven names below under `recompute_granularity == "selective"`, and refuses `moe_act`
without `moe_grouped_gemm` and `mla_up_proj` without `multi_latent_attention`; the deprecated
`moe_layer_recompute` turns granularity to selective and appends "moe" (ValueError with full).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError

# megatron-core 0.16 transformer_config.py, TransformerConfig.__post_init__: allowed_modules.
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
)  # fmt: skip
DEFAULT_MODULES: tuple[str, ...] = ("core_attn",)
# What the engine measures today; the others are refused until it runs them (issue 29 item 3).
# `mlp` only without linear biases: with them megatron's tensor_parallel.checkpoint around the MLP
# (transformer_layer.py _forward_mlp) recursed without end in CheckpointFunction.backward on meta
# tensors (the MLP returns its fc2 bias Parameter as an output of the checkpoint).
MEASURED_MODULES: tuple[str, ...] = ("core_attn", "mlp", "layernorm")


def parse_modules(args: Mapping[str, Any], granularity: str) -> tuple[str, tuple[str, ...]]:
    """Return the granularity and modules megatron runs with for these Megatron-LM arguments."""
    raw = args.get("recompute_modules")
    modules = DEFAULT_MODULES if raw is None else tuple(re.split(r"[\s,]+", str(raw).strip()))
    modules = tuple(m for m in modules if m)
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(
            f"--recompute-modules {' '.join(unknown)} is not one of: {', '.join(RECOMPUTE_MODULES)}"
        )
    if args.get("moe_layer_recompute"):
        if granularity == "full":
            # TransformerConfig: "Do not set --moe-layer-recompute with full recompute granularity."
            raise ConfigError(
                "--moe-layer-recompute cannot go with --recompute-granularity full "
                "(megatron-core TransformerConfig refuses it)"
            )
        granularity = "selective"
        modules = modules if "moe" in modules else (*modules, "moe")
    if raw is not None and granularity != "selective":
        raise ConfigError(
            "--recompute-modules needs --recompute-granularity selective "
            "(megatron-core reads the modules only under selective recomputation)"
        )
    return granularity, modules


def check_modules(modules: tuple[str, ...], model: Any) -> None:
    """Refuse the modules megatron-core's TransformerConfig refuses for this model, then the
    modules megatron accepts that the tool does not measure yet."""
    if "moe_act" in modules and not model.moe_grouped_gemm:
        raise ConfigError(
            "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core TransformerConfig: "
            "\"moe_act in recompute_modules is only supported with moe_grouped_gemm\")"
        )
    if "mla_up_proj" in modules and not model.multi_latent_attention:
        raise ConfigError(
            "--recompute-modules mla_up_proj needs --multi-latent-attention (megatron-core "
            "TransformerConfig: \"only supported with multi_latent_attention\")"
        )
    if "mlp" in modules and not model.disable_bias_linear:
        raise ConfigError(
            "--recompute-modules mlp is modelled with --disable-bias-linear only: with biases "
            "megatron's checkpoint of the MLP recursed without end in its backward on meta tensors"
        )
    unmeasured = [m for m in modules if m not in MEASURED_MODULES]
    if unmeasured:
        raise ConfigError(
            f"--recompute-modules {' '.join(unmeasured)} is not modelled yet: the engine measures "
            f"selective recomputation of {', '.join(MEASURED_MODULES)} only"
        )
