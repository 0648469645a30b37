"""Which attention megatron runs for a job's arguments: flash/fused (no s x s scores kept) or
unfused, and the argument that keeps it unfused, for the errors that need flash attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError


def flash_attention(args: Mapping[str, Any]) -> bool:
    """Return whether attention keeps no s x s scores, from --use-flash-attn and the backend.

    Without Transformer Engine never: megatron-core's local layer spec (gpt_layer_specs.py
    get_gpt_layer_local_spec) runs its own unfused DotProductAttention whatever the flags say.

    --use-flash-attn wins; then --attention-backend: flash and fused never store the scores,
    unfused and local do, and auto (Megatron-LM's default, arguments.py: AttnBackend.auto, so
    also where no source names a backend) lets Transformer Engine pick flash/fused attention in
    16 bits, and unfused otherwise (fp32, or the local spec, whose DotProductAttention is
    unfused). --no-use-flash-attn (a config file's `false`) turns auto's flash off, as `plan`
    reads it (plan/request.py _flash).
    """
    backend = args.get("attention_backend") or "auto"
    if args.get("transformer_impl") != "transformer_engine":
        return False  # the local spec's DotProductAttention (see local_spec_attention_note)
    if args.get("use_flash_attn"):
        if backend in ("unfused", "local"):
            raise ConfigError(
                f"--use-flash-attn contradicts --attention-backend {backend} (which stores the "
                "s x s attention scores); pass one of them"
            )
        return True
    if backend in ("flash", "fused"):
        return True
    if backend == "auto" and args.get("use_flash_attn") is not False:
        return bool(args.get("bf16") or args.get("fp16"))  # Transformer Engine's choice in 16 bits
    return False


def scores_cause(args: Mapping[str, Any]) -> str:
    """Return the argument that keeps Transformer Engine's attention unfused (the s x s scores
    stored), as a user wrote it, for errors that need flash or fused attention (context
    parallelism); "" under the local spec, whose own error names --transformer-impl."""
    backend = args.get("attention_backend") or "auto"
    if args.get("transformer_impl") != "transformer_engine":
        return ""  # the local spec: layout.check_buildable names --transformer-impl
    if backend in ("unfused", "local"):
        return f"--attention-backend {backend}"
    if args.get("use_flash_attn") is False:
        return "--no-use-flash-attn (with --attention-backend auto)"
    return ("--attention-backend auto in fp32 (Transformer Engine picks unfused attention "
            "without --bf16 or --fp16)")
