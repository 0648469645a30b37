"""What Megatron-LM asks of `--tp-comm-overlap` (Transformer Engine's userbuffers)."""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError


def check_tp_comm_overlap(model: Any, layout: Any, training: Any) -> None:
    """Reject `--tp-comm-overlap` where Megatron-LM stops: without Transformer Engine
    (initialize.py `_initialize_tp_communicators` imports it: "Tensor Parallel Communication/GEMM
    Overlap optimization needs ... 'transformer_engine'") or without sequence parallelism
    (arguments.py validate_args, after turning it off at --tp 1)."""
    if not training.tp_comm_overlap:
        return
    if model.transformer_impl != "transformer_engine":
        raise ConfigError(
            "--tp-comm-overlap needs --transformer-impl transformer_engine (Megatron-LM: \"Tensor "
            "Parallel Communication/GEMM Overlap optimization needs 'yaml' and "
            "'transformer_engine' packages\")"
        )
    if not layout.sequence_parallel:
        raise ConfigError(
            "--tp-comm-overlap needs --sequence-parallel and --tp above 1 (Megatron-LM: \"Tensor "
            "parallel communication/GEMM overlap can happen only when sequence parallelism is "
            "enabled\")"
        )
