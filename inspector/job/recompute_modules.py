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
from inspector.inputs.versions import megatron_core_version

# megatron-core 0.16 transformer_config.py, TransformerConfig.__post_init__: allowed_modules.
RECOMPUTE_MODULES: tuple[str, ...] = (
    "core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
)  # fmt: skip
DEFAULT_MODULES: tuple[str, ...] = ("core_attn",)
# Each name -> the first megatron-core whose TransformerConfig allows it (core_v0.13.1 lists the
# first six; core_v0.14.0 adds shared_experts).
FIRST_VERSION: dict[str, tuple[int, int]] = {"shared_experts": (0, 14)}
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
    installed = megatron_core_version()
    for name in modules:
        first = FIRST_VERSION.get(name, (0, 0))
        if installed < first:
            raise ConfigError(
                f"--recompute-modules {name} needs megatron-core {first[0]}.{first[1]} or later "
                f"(the installed {installed[0]}.{installed[1]} does not allow it)"
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
    """Refuse the modules megatron-core's TransformerConfig refuses for this model, and `mlp`
    with linear biases, which megatron-core cannot train (below)."""
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
    dense_mlp = model.num_experts is None or _has_dense_layers(model)
    if "mlp" in modules and not model.disable_bias_linear and dense_mlp:
        # transformer_layer.py _forward_mlp checkpoints the MLP with tensor_parallel.checkpoint;
        # the MLP returns linear_fc2's bias Parameter itself (skip_bias_add), so autograd makes
        # that Parameter an output of CheckpointFunction, and the recomputation in its backward
        # routes the bias gradient into the same CheckpointFunction again, without end. This is
        # torch's custom-Function rule, the same on a GPU (tests/test_recompute_modules.py).
        raise ConfigError(
            "--recompute-modules mlp needs --disable-bias-linear: megatron-core's checkpoint "
            "of an MLP with biases returns the fc2 bias parameter, and its backward then "
            "recomputes itself without end (docs/limits.md)"
        )


def _has_dense_layers(model: Any) -> bool:
    """Return whether an MoE model also has dense MLP layers (--moe-layer-freq)."""
    freq = getattr(model, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return freq != 1
    return not all(freq)
