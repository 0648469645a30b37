"""Megatron's precision-aware optimizer: the flags, their checks, and the bytes they leave per element.

Megatron-LM core_v0.16.1 (megatron/training/arguments.py) takes `--use-precision-aware-optimizer`
with `--main-grads-dtype fp32|bf16`, `--main-params-dtype fp32|fp16`, `--exp-avg-dtype` and
`--exp-avg-sq-dtype fp32|fp16|bf16|fp8` (fp8 is `torch.uint8`, validate_args' `dtype_map`).
megatron-core's OptimizerConfig (optimizer/optimizer_config.py `__post_init__`) asserts Adam, the
distributed optimizer, Transformer Engine's FusedAdam, and fp32 for all four without the flag;
`store_param_remainders` is True (its default; Megatron-LM has no flag for it; Transformer Engine
2.1 or later keeps it). The optimizer (optimizer/__init__.py `_get_megatron_optimizer_based_on_param_groups`)
hands Transformer Engine's FusedAdam the moments' dtypes and, when
`use_precision_aware_optimizer_no_fp8_or_ds_fp8` (main params not fp32, or no fp8 recipe but
delayed scaling), the master weights (`master_weights`, `master_weight_dtype`, gradients read
from `.decoupled_grad`): then megatron keeps no fp32 main parameter (distrib_optimizer.py
`_build_model_and_main_param_groups`: `shard_main_param = None`) and FusedAdam does, as the 16
low bits of a bf16 parameter's fp32 value with `store_param_remainders` (an int16 tensor).

Bytes per element a rank's optimizer updates (transformer_engine/pytorch/optimizers/fused_adam.py
`_initialize_state`, TE 2.11): fp32 4, fp16 and bf16 2, fp8 2 (a Float8Tensor from
`Float8Quantizer.make_empty`, rowwise data and its columnwise transpose, one byte each:
tensor/float8_tensor.py). The per-tensor fp32 scales (4 bytes a reduced state; fp8: scale, amax,
scale_inv) are not per element; the engine's run counts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version

# Megatron-LM core_v0.16.1 arguments.py: each flag's choices
CHOICES: dict[str, tuple[str, ...]] = {
    "main_grads_dtype": ("fp32", "bf16"),
    "main_params_dtype": ("fp32", "fp16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
# fused_adam.py `_initialize_state`: bytes per element of a state in each dtype (fp8: data and
# transpose of a Float8Tensor, one byte each)
STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 2}
FP32 = 4
# Megatron-LM's default --optimizer adam: the optimizer's constants, defined here only
ADAM_MOMENTS = 2 * FP32  # exp_avg and exp_avg_sq, fp32
MASTER_COPY = FP32  # the fp32 master (main) weight of a 16-bit parameter
# megatron-core 0.19.2 optimizer/__init__.py get_megatron_optimizer, Megatron-FSDP branch: FusedAdam's
# `master_weights` set False (the fp32 main weights are Megatron-FSDP's buffer); 0.16.1 lacks it
FSDP_MOMENTS_ONLY = (0, 19)
REMAINDER = 2  # store_param_remainders: int16, the low 16 bits of the fp32 master of a bf16 param


@dataclass(frozen=True)
class OptimizerPrecision:
    """The precision-aware optimizer's settings (all fp32 and off: Megatron-LM's default Adam)."""

    precision_aware: bool = False
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    store_param_remainders: bool = True  # OptimizerConfig's default

    def te_master(self, fp8_format: str | None, fp8_recipe: str) -> bool:
        """Return OptimizerConfig's `use_precision_aware_optimizer_no_fp8_or_ds_fp8`: FusedAdam
        keeps the master weights. Megatron-LM's OptimizerConfig gets its --fp8-recipe (delayed
        by default) with or without --fp8-format, as `fp8_recipe` here."""
        del fp8_format  # OptimizerConfig reads the recipe alone
        return self.precision_aware and (
            self.main_params_dtype != "fp32" or fp8_recipe == "delayed"
        )

    def moments(self) -> int:
        """Return the bytes of exp_avg and exp_avg_sq per element."""
        return STATE_BYTES[self.exp_avg_dtype] + STATE_BYTES[self.exp_avg_sq_dtype]

    def master(self, param_bytes: int, bf16: bool, te_master: bool) -> int:
        """Return the master weight's bytes per element of a parameter of `param_bytes`.

        Megatron's own (fp32, 16-bit and fp8 parameters only), or FusedAdam's: `initialize_state`
        makes one for every parameter it updates, fp32 ones included, an int16 remainder for
        bf16 ones, fp8 ones among them (a Float8Tensor's dtype is the model's: bf16).
        """
        if not te_master:
            return FP32 if param_bytes != FP32 else 0
        if self.store_param_remainders and self.main_params_dtype == "fp32" and bf16 and (
            param_bytes != FP32
        ):
            return REMAINDER
        return STATE_BYTES[self.main_params_dtype]

    def per_element(self, param_bytes: int, bf16: bool, te_master: bool) -> int:
        """Return the optimizer bytes of one updated element: master weight and both moments."""
        return self.master(param_bytes, bf16, te_master) + self.moments()

    def for_model(self, bf16: bool, fp8_format: str | None, fp8_recipe: str) -> OptimizerBytes:
        """Return the bytes per element for a model's precision."""
        return OptimizerBytes(self, bf16, self.te_master(fp8_format, fp8_recipe))


@dataclass(frozen=True)
class OptimizerBytes:
    """The optimizer bytes per updated element of a job, by the parameter's element size."""

    precision: OptimizerPrecision = OptimizerPrecision()
    bf16: bool = True
    te_master: bool = False  # FusedAdam keeps the master weights, megatron none

    def per_element(self, param_bytes: int) -> int:
        """Return the bytes of one updated element of a parameter of `param_bytes`."""
        return self.precision.per_element(param_bytes, self.bf16, self.te_master)

    def master(self, param_bytes: int) -> int:
        """Return the master weight's bytes per element of a parameter of `param_bytes`."""
        return self.precision.master(param_bytes, self.bf16, self.te_master)

    def megatron_master(self, param_bytes: int) -> int:
        """Return the bytes per element of megatron's own master weight (made with the optimizer,
        before its first step; FusedAdam's are made by the first step)."""
        return 0 if self.te_master or param_bytes == FP32 else FP32


def make_precision(args: Mapping[str, Any]) -> OptimizerPrecision:
    """Return the settings from Megatron-LM arguments, refused where megatron refuses them."""
    dtypes = {name: str(args.get(name) or "fp32") for name in CHOICES}
    for name, value in dtypes.items():
        if value not in CHOICES[name]:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {value} is not one of: {', '.join(CHOICES[name])}")
    aware = bool(args.get("use_precision_aware_optimizer"))
    if not aware:
        reduced = [name for name, value in dtypes.items() if value != "fp32"]
        if reduced:
            flag = "--" + reduced[0].replace("_", "-")
            raise ConfigError(
                f"{flag} {dtypes[reduced[0]]} needs --use-precision-aware-optimizer (megatron-core "
                f"OptimizerConfig: \"{reduced[0]} can only be fp32 when not using "
                "precision-aware optimizer\")"
            )
        return OptimizerPrecision()
    _check_aware(args, dtypes)
    return OptimizerPrecision(
        True, dtypes["main_grads_dtype"], dtypes["main_params_dtype"], dtypes["exp_avg_dtype"],
        dtypes["exp_avg_sq_dtype"],
    )


def _check_aware(args: Mapping[str, Any], dtypes: Mapping[str, str]) -> None:
    """Refuse what megatron refuses with --use-precision-aware-optimizer, and what is not modelled."""
    if not args.get("use_distributed_optimizer"):
        raise ConfigError(
            "--use-precision-aware-optimizer needs --use-distributed-optimizer (megatron-core "
            "OptimizerConfig: \"--use-precision-aware-optimizer only supported with distributed "
            "optimizer\")"
        )
    if args.get("use_torch_fsdp2"):
        raise ConfigError(
            "--use-precision-aware-optimizer with --use-torch-fsdp2 is not modelled: FSDP2's "
            "sharded optimizer state is counted in fp32; it is modelled with "
            "--use-distributed-optimizer and --use-megatron-fsdp"
        )
    if args.get("use_megatron_fsdp") and megatron_core_version() < FSDP_MOMENTS_ONLY:
        raise ConfigError(
            "--use-precision-aware-optimizer with --use-megatron-fsdp is not modelled before "
            "megatron-core 0.19: its get_megatron_optimizer leaves Transformer Engine's FusedAdam "
            "a master copy of Megatron-FSDP's fp32 main weights (0.19 turns it off: "
            "optimizer/__init__.py `master_weights` False)"
        )
    te_master = dtypes["main_params_dtype"] != "fp32" or (args.get("fp8_recipe") or "delayed") == (
        "delayed"
    )
    if args.get("fp16") and te_master and not args.get("accumulate_allreduce_grads_in_fp32"):
        raise ConfigError(
            "--use-precision-aware-optimizer with --fp16 needs --accumulate-allreduce-grads-in-fp32: "
            "FusedAdam reads the grad buffer's fp16 gradients, and megatron-core's "
            "clip_grad_by_total_norm_fp32 (--clip-grad 1.0 by default) asserts they are fp32 or bf16"
        )
    if (
        args.get("bf16")
        and args.get("accumulate_allreduce_grads_in_fp32")
        and dtypes["main_grads_dtype"] != "fp32"
    ):
        raise ConfigError(
            "--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32 (Megatron-LM's "
            "validate_args: \"--main-grads-dtype can only be fp32 when "
            "--accumulate-allreduce-grads-in-fp32 is set\")"
        )
