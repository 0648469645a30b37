"""FP8 training as Megatron-LM configures it: the flags, their defaults and their checks.

Megatron-LM (megatron/training/arguments.py, from TransformerConfig's `argparse_meta`) takes
`--fp8-format e4m3|hybrid` (TransformerConfig.fp8, default None: no fp8), `--fp8-recipe
delayed|tensorwise|blockwise|mxfp8` (default delayed) and `--fp8-amax-history-len` (default 1);
megatron-core's TransformerConfig and `fp8_utils.get_fp8_recipe` turn them into Transformer
Engine's recipe, and only Transformer Engine's layers compute in fp8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.unmodelled import refusal_message
from inspector.inputs.versions import megatron_core_version
from inspector.job.checks import check_at_least_one, check_at_most

FP8_FORMATS = ("e4m3", "hybrid")
# megatron-core enums.py Fp8Recipe, less `custom` (a user's quantizer factory cannot be imported)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
DEFAULT_RECIPE = "delayed"  # TransformerConfig.fp8_recipe
DEFAULT_AMAX_HISTORY_LEN = 1  # TransformerConfig.fp8_amax_history_len
# --fp8-param-gather: every recipe's weights are simulated, a Float8Tensor
# (world/te/float8_tensor.py), an MXFP8Tensor (mxfp8_tensor.py) or, with blockwise, a
# Float8BlockwiseQTensor (blockwise_tensor.py)
_REUSE = "--reuse-grad-buf-for-mxfp8-param-ag"


def validate_fp8(
    fp8_format: str | None,
    recipe: str,
    amax_history_len: int,
    transformer_impl: str,
    param_gather: bool = False,
    reuse_grad_buf: bool = False,
) -> None:
    """Raise ConfigError for fp8 settings megatron rejects or this tool cannot build as described."""
    _check_mxfp8_params(recipe, param_gather, reuse_grad_buf)
    if fp8_format is None:
        for flag, value, default in (
            ("--fp8-recipe", recipe, DEFAULT_RECIPE),
            ("--fp8-amax-history-len", amax_history_len, DEFAULT_AMAX_HISTORY_LEN),
        ):
            if value != default:
                raise ConfigError(
                    f"{flag} {value} has no effect without --fp8-format (Megatron-LM trains in "
                    "16 bits then); pass --fp8-format e4m3 or hybrid, or drop it"
                )
        return
    if fp8_format not in FP8_FORMATS:
        raise ConfigError(f"--fp8-format {fp8_format!r} is not one of: {', '.join(FP8_FORMATS)}")
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe {recipe!r} is not one of: {', '.join(FP8_RECIPES)}")
    check_at_least_one("--fp8-amax-history-len", amax_history_len)
    check_at_most("--fp8-amax-history-len", amax_history_len)
    if transformer_impl != "transformer_engine":
        # Megatron-LM's validate_args does not stop here: megatron-core enters TE's fp8_autocast,
        # but its local layers (ColumnParallelLinear, ...) never quantize, so the job would train
        # in 16 bits. Building that while the user asked for fp8 would be a different job.
        raise ConfigError(
            f"--fp8-format {fp8_format} needs --transformer-impl transformer_engine: only "
            "Transformer Engine's layers compute in fp8 (megatron-core's local layers ignore it "
            "and would train in 16 bits)"
        )


def _check_mxfp8_params(recipe: str, param_gather: bool, reuse_grad_buf: bool) -> None:
    """Refuse what megatron-core refuses of MXFP8 weights and the grad buffer's reuse."""
    if reuse_grad_buf and not param_gather:
        raise ConfigError(
            f"{_REUSE} needs --fp8-param-gather (megatron-core's DistributedDataParallelConfig: "
            "'Reuse grad buffer only when keeping params in MXFP8.')"
        )
    if reuse_grad_buf and recipe != "mxfp8":
        raise ConfigError(
            f"{_REUSE} needs --fp8-recipe mxfp8, not {recipe} (megatron-core's "
            "DistributedDataParallelConfig: 'Should be set to True only when fp8_recipe is mxfp8 "
            "and fp8_param_gather is True'; a Float8Tensor would then never be refreshed)"
        )


def fp8_fields(
    fp8_format: str | None, recipe: str, amax_history_len: int, param_gather: bool = False
) -> dict[str, Any]:
    """Return TransformerConfig's fp8 fields as core_transformer_config_from_args copies them
    (Megatron-LM argument_utils.py: `fp8_param = args.fp8_param_gather`)."""
    if fp8_format is None:
        return {}
    fields: dict[str, Any] = dict(
        fp8=fp8_format, fp8_recipe=recipe, fp8_amax_history_len=amax_history_len
    )
    if param_gather:
        fields["fp8_param"] = True
    return fields


def check_param_gather(args: Mapping[str, Any]) -> None:
    """Reject --fp8-param-gather (--fp4-param-gather) where Megatron-LM does (validate_args,
    megatron-core's TransformerConfig), and under FSDP2 and the parts of Megatron-FSDP this tool
    does not model with it (a launch script's FSDP2 has it turned off already, as validate_args
    does)."""
    for low in ("fp8", "fp4"):
        if not args.get(f"{low}_param_gather"):
            continue
        flag = f"--{low}-param-gather"
        refused = refusal_message(flag, None)  # --fp4-param-gather before megatron-core 0.18
        if refused is not None:
            raise ConfigError(refused)
        if not args.get(f"{low}_format"):
            raise ConfigError(f"{flag} needs --{low}-format (megatron-core's TransformerConfig: "
                              f"'{low}_param must be used together with {low} mode.')")  # fmt: skip
        if args.get("use_torch_fsdp2") or (args.get("use_megatron_fsdp") and low == "fp4"):
            fsdp = "--use-megatron-fsdp" if args.get("use_megatron_fsdp") else "--use-torch-fsdp2"
            raise ConfigError(
                f"{flag} with {fsdp} is not modelled: FSDP keeps {low} weights in its "
                "own sharded buffers (Megatron-LM turns it off under FSDP2 with Transformer Engine "
                "2.0 or later); it is modelled with --use-distributed-optimizer"
            )
        if args.get("use_megatron_fsdp"):  # its own buffers, not DDP's (job/fsdp.py: distopt)
            _megatron_fsdp_rules(args)
            continue
        if low == "fp8" and args.get("fp8_recipe") == "mxfp8" and not args.get(
                "reuse_grad_buf_for_mxfp8_param_ag"):  # fmt: skip
            # megatron's DDP only (Megatron-FSDP keeps its own buffers, above)
            raise ConfigError(
                f"--fp8-param-gather with --fp8-recipe mxfp8 needs {_REUSE}: without it megatron's "
                "DDP points each MXFP8 weight into its param buffer, which Transformer Engine "
                "refuses (tensor/utils.py replace_raw_data: 'replace_raw_data for MXFP8Tensor is "
                "not supported yet')"
            )
        if low == "fp8" and not args.get("use_distributed_optimizer"):
            # --fp4-param-gather has no such check (core_v0.18.0-core_v0.19.0 arguments.py):
            # without the distributed optimizer megatron's DDP makes no param buffer, each NVFP4
            # weight keeps its own storage and Float16OptimizerWithFloat16Params its fp32 main
            # copy, as for any 16-bit weight (world/te/nvfp4_tensor.py)
            raise ConfigError(
                f"{flag} needs --use-distributed-optimizer (Megatron-LM's validate_args: "
                f"'{flag} only supported with distributed optimizer, torch fsdp2, "
                "megatron fsdp, or inference mode')"
            )


# --fp8-recipe values whose weights Megatron-FSDP keeps as modelled (world/fsdp.py `_fp8_bucket`):
# TE's Float8Tensor (delayed, tensorwise) and MXFP8Tensor
FSDP_FP8_RECIPES = ("delayed", "tensorwise", "mxfp8")


def _megatron_fsdp_rules(args: Mapping[str, Any]) -> None:
    """Refuse what this tool does not model of --fp8-param-gather under --use-megatron-fsdp."""
    recipe = args.get("fp8_recipe") or "delayed"
    strategy = args.get("data_parallel_sharding_strategy") or "no_shard"
    if megatron_core_version() < (0, 16):
        raise ConfigError(
            "--fp8-param-gather with --use-megatron-fsdp is not modelled before megatron-core "
            "0.16 (its custom_fsdp keeps fp8 weights otherwise)"
        )
    if recipe not in FSDP_FP8_RECIPES:
        raise ConfigError(
            f"--fp8-param-gather with --use-megatron-fsdp and --fp8-recipe {recipe} is not "
            f"modelled: Megatron-FSDP is modelled with the {', '.join(FSDP_FP8_RECIPES)} "
            "recipes' fp8 weights"
        )
    if strategy == "no_shard":
        raise ConfigError(
            "--fp8-param-gather with --use-megatron-fsdp and --data-parallel-sharding-strategy "
            "no_shard is not modelled: Megatron-FSDP makes no weight buffer there and the fp8 "
            "weights keep their own storage"
        )


def check_legacy_gather(model: Any, dp_cp: int, overlap_param_gather: bool) -> None:
    """Refuse MXFP8 weights under the layer-wise optimizer without its param layout (0.18+'s
    --no-use-layer-wise-param-layout: no DDP param buffer): after the step
    layer_wise_optimizer.py `allgather_params` flattens each rank's weights
    (`_flatten_dense_tensors`, a view(-1) of each), which Transformer Engine refuses for an
    MXFP8Tensor (mxfp8_tensor.py `__torch_dispatch__`: "Attempted to make view with size=...";
    megatron-core's param_and_grad_buffer.py: "MXFP8 params can't be flattened (view(-1)
    unsupported)"). With --overlap-param-gather DDP's buckets gather the fp32 main copies
    instead; with one data-parallel rank nothing is gathered."""
    mxfp8 = model.fp8_param_gather and model.fp8_recipe == "mxfp8"
    if mxfp8 and dp_cp > 1 and not overlap_param_gather:
        raise ConfigError(
            "--fp8-param-gather with --fp8-recipe mxfp8 and --no-use-layer-wise-param-layout "
            "needs --overlap-param-gather: megatron-core's layer-wise optimizer otherwise "
            "all-gathers the updated weights by flattening them (layer_wise_optimizer.py "
            "allgather_params), which Transformer Engine refuses for MXFP8 weights "
            "(mxfp8_tensor.py: 'Attempted to make view with size=...')"
        )
