"""LoRA fine-tuning as Megatron-Bridge runs it (its `peft` config): adapters on a frozen model.

Megatron-Bridge's `LoRA` (src/megatron/bridge/peft/lora.py 142-157) freezes every parameter of
the built model and wraps each linear named in `target_modules` (default: linear_qkv,
linear_proj, linear_fc1, linear_fc2) in a low-rank adapter of rank `dim`; no Megatron-LM
argument says it, so the tool's own flags do: `--lora-rank` (Bridge's `dim`) and
`--lora-target-modules`. Alpha only scales the adapter's output (the same tensors), and the
recipes' dropout is 0 (recipes/common.py 331-340): neither changes what a GPU holds. The adapters
themselves are world/lora.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.job.checks import check_at_most

# Bridge's LoRA.target_modules default (lora.py 143-145), and the names it can target here
LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# the base linears whose adapter's linear_in is column-parallel over --tp (its output, the rank,
# is split: Bridge's ParallelLinearAdapter builds ColumnParallelLinear(in, dim), utils.py 1034-1044)
COLUMN_TARGETS = ("linear_qkv", "linear_fc1")


def parse_targets(raw: Any) -> tuple[str, ...]:
    """Return `--lora-target-modules` as a tuple (Bridge's default when not given)."""
    if raw is None:
        return LORA_TARGETS
    names = raw if isinstance(raw, tuple) else tuple(n for n in re.split(r"[\s,]+", str(raw)) if n)
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown or not names:
        raise ConfigError(f"--lora-target-modules {' '.join(unknown) or repr(raw)} is not one of: "
                          f"{', '.join(LORA_TARGETS)}")  # fmt: skip
    return tuple(dict.fromkeys(names))


def lora_values(args: Mapping[str, Any]) -> dict[str, Any]:
    """Return ModelConfig's LoRA fields from the arguments (none without --lora-rank)."""
    rank, targets = args.get("lora_rank"), args.get("lora_target_modules")
    if rank is None:
        if targets is not None:
            raise ConfigError("--lora-target-modules needs --lora-rank (the adapters' rank)")
        return {}
    if rank < 1:
        raise ConfigError(f"--lora-rank {rank} must be at least 1 (Bridge's LoRA dim)")
    check_at_most("--lora-rank", rank)
    return {"lora_rank": int(rank), "lora_target_modules": parse_targets(targets)}


def check_lora(model: Any, tp: int, training: Any) -> None:
    """Raise ConfigError where the adapters cannot be built as Bridge builds them, or are not
    modelled (a ModelConfig, the tensor-parallel size and the Training, job.py's records)."""
    rank = model.lora_rank
    if rank is None:
        return
    if training.megatron_fsdp or training.torch_fsdp2 or training.optimizer != "adam":
        raise ConfigError(
            "--lora-rank is modelled with megatron's DistributedDataParallel and Adam (the "
            "recipes' distributed optimizer): a frozen model under FSDP or Muon is not simulated"
        )
    column = [t for t in model.lora_target_modules if t in COLUMN_TARGETS]
    if column and rank % tp:
        # megatron's ColumnParallelLinear: divide(output_size, world_size) asserts divisibility
        raise ConfigError(
            f"--lora-rank {rank} is not divisible by --tp {tp} ({rank} % {tp} = {rank % tp}): the "
            f"adapter of {column[0]} splits its rank over the tensor-parallel ranks (Bridge's "
            "ParallelLinearAdapter builds ColumnParallelLinear(in_features, dim))"
        )
    if model.num_experts or model.hybrid or model.multi_latent_attention or model.gdn or model.dsa:
        raise ConfigError(
            "--lora-rank is modelled for dense GPT models with standard attention: Bridge's "
            "adapters on experts (grouped or per expert), MLA's projections and Mamba or gated "
            "delta net mixers are not simulated"
        )
