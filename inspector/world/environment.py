"""The process environment a Megatron-LM job builds and runs in: torch's deterministic algorithms
and the NVTE_* variables megatron-core and Transformer Engine read (world/stage.py enters them),
and what the Transformer Engine release it runs with does (world/te declares it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """Run the block as a Megatron-LM process with --deterministic-mode runs.

    Megatron-LM's validate_args calls `torch.use_deterministic_algorithms(True)`, and megatron-core
    branches on it: MoE routing builds its maps by `index_put_` and unpermutation adds tokens back
    by `index_add_` (whose autograd keeps its source for the backward) where it would `scatter`
    (transformer/moe/moe_utils.py `topk_routing_with_score_function`, `unpermute`). Its
    TEDotProductAttention refuses to build unless NVTE_ALLOW_NONDETERMINISTIC_ALGO is 0, the
    environment such a job runs in (extensions/transformer_engine.py). Both are restored after.
    """
    if not on:
        yield
        return
    import torch

    enabled, warn = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    torch.use_deterministic_algorithms(True)
    try:
        with _environment(_NONDETERMINISTIC, "0"):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn)


_NONDETERMINISTIC = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
_FUSED_GROUPED_MLP = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"


def op_fuser_environment(on: bool) -> contextlib.AbstractContextManager[None]:
    """Run the block as a job with --use-transformer-engine-op-fuser runs: NVTE_CUTEDSL_FUSED_
    GROUPED_MLP=1. megatron-core 0.18+'s TEGroupedMLP._is_fused_impl_supported (transformer/moe/
    experts.py) refuses the op fuser's SwiGLU without it; the jobs that run the op fuser set it
    (Megatron-LM's op_fuser functional test, Megatron-Bridge's recipes), and Transformer Engine
    reads it only to pick its sm100 MXFP8 kernel (world/te/ops.py)."""
    return _environment(_FUSED_GROUPED_MLP, "1" if on else None)


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """Set the environment variable for the block (None: leave it as it is); restore it after."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


_ATTENTION = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def fresh_attention_env() -> None:
    """Clear TE's attention opt-outs, as a fresh Megatron-LM process starts: megatron's
    LanguageModule._set_attention_backend sets NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and
    NVTE_UNFUSED_ATTN from config.attention_backend and asserts any value already set agrees, so
    one process building jobs of different backends (and a user's own NVTE_* settings) would
    fail or leak into the next build; the TE stand-in reads them as TE does (world/te)."""
    for name in _ATTENTION:
        os.environ.pop(name, None)


def attention_environment() -> contextlib.ExitStack[bool | None]:
    """Run the block (a stage's build and the engine's run of it) with the opt-outs megatron sets
    there, and give the process back the values it had before: a later build clears them again
    (`fresh_attention_env`), but Transformer Engine used outside a build reads them too, and would
    run --attention-backend unfused's backend for a job that did not ask for it."""
    stack = contextlib.ExitStack()
    for name in _ATTENTION:
        stack.enter_context(_environment(name, None))
    return stack


def te_fuses_bf16_moments() -> bool:
    """Return whether the declared Transformer Engine release's FusedAdam updates bf16 moments in
    its kernel (world/te `fuses_bf16_moments`), for the planner's time of the optimizer step:
    plan/ hands it to formulas/optimizer.py, neither of which may import world/te."""
    from inspector.world.te import fuses_bf16_moments

    return fuses_bf16_moments()
