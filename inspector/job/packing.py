"""Packed sequences (Megatron-LM's `--sft`): several documents in one sequence, each its own.

Megatron-LM's SFT dataset (megatron/training/datasets/sft_dataset.py) packs conversations into
sequences of --seq-length and hands each micro-batch's `cu_seqlens` and `max_seqlen` to
`pretrain_gpt.get_batch`, which builds megatron-core's `PackedSeqParams` with
`get_thd_batch_on_this_cp_rank` (core/utils.py): attention and RoPE then run per document in
Transformer Engine's `thd` format. Megatron-Bridge's fine-tuning recipes do the same with
`packed_sequence_specs`. How long the documents are is the data's, not an argument's:
`--packed-document-length` says it (the tool's own flag; default one document per sequence).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.job.checks import check_at_least_one
from inspector.job.versions import megatron_version, packed_checked


def packed_document_length(args: Mapping[str, Any]) -> int | None:
    """Return the packed documents' length in tokens, or None for unpacked (causal) sequences."""
    length = args.get("packed_document_length")
    if not args.get("sft"):
        if length is not None:
            raise ConfigError(
                f"--packed-document-length {length} needs --sft (packed sequences)"
            )
        return None
    check_at_least_one("--packed-document-length", length)
    seq_length = args.get("seq_length")
    if length is None:
        return seq_length
    if seq_length is not None and length > seq_length:
        raise ConfigError(
            f"--packed-document-length {length} is longer than --seq-length {seq_length}: a "
            "document is packed into one sequence"
        )
    return int(length)


def check_packing(job: Any) -> None:
    """Reject what megatron cannot run on packed sequences, or the simulation does not model, of
    a Job (job.py, which imports this module: hence `Any`)."""
    model, training, cp = job.model, job.training, job.layout.cp
    if training.packed_document_length is None:
        return
    if not packed_checked():
        installed = megatron_version()
        raise ConfigError("--sft: packed sequences are modelled as megatron-core 0.16 and later run "
                          f"them; {installed[0]}.{installed[1]}'s THD path is not checked")  # fmt: skip
    micro_batch_size, flash = training.micro_batch_size, training.flash_attention
    if model.fp8_dot_product_attention:
        raise ConfigError("--sft with --fp8-dot-product-attention is not modelled: Transformer "
                          "Engine's fp8 attention in the thd format is not simulated")
    if model.gdn:  # megatron-core's GatedDeltaNet.forward raises it
        raise ConfigError("--sft with gated delta net layers: megatron-core stops (\"GDN does not "
                          "support packed sequence for now\")")
    if model.hybrid:
        raise ConfigError(
            "--sft with a hybrid (Mamba) model is not modelled: megatron's Mamba mixer runs packed "
            "documents through mamba_ssm's kernels with seq_idx, which are not simulated"
        )
    if not flash:
        # TEDotProductAttention.forward: "thd format uses flash attention with cuDNN kernel"
        raise ConfigError(
            "--sft (packed sequences) needs Transformer Engine's fused or flash attention in "
            "bf16 or fp16: megatron's thd format has no unfused path"
        )
    if (micro_batch_size or 1) > 1:
        # transformer/attention.py squeezes the batch dimension of thd q, k, v (`query.squeeze(1)`)
        raise ConfigError(
            f"--sft packs a micro-batch into one sequence: --micro-batch-size {micro_batch_size} "
            "must be 1 (megatron's thd attention squeezes the batch dimension)"
        )
    if cp > 1:
        raise ConfigError(
            f"--sft with --context-parallel-size {cp} is not modelled (Transformer Engine's thd "
            "partitioning, thd_get_partitioned_indices, and its thd context-parallel ring)"
        )


def document_lengths(seq_length: int, document_length: int) -> list[int]:
    """Return one packed sequence's documents: as many of `document_length` as fit, then the
    rest in a last, shorter one."""
    length = min(document_length, seq_length)
    full, rest = divmod(seq_length, length)
    return [length] * full + ([rest] if rest else [])


def attention_squares(seq_length: int, document_length: int | None) -> int:
    """Return the sum of the squared lengths of what one sequence's causal attention spans: s^2,
    or packed the documents' (Megatron-LM's `num_floating_point_operations` counts packed
    sequences' core attention with sum_i(L_i^2), not batch x s^2: training.py
    `update_seqlen_stats_from_cu_seqlens`, after core_v0.16)."""
    if document_length is None:
        return seq_length * seq_length
    return sum(length * length for length in document_lengths(seq_length, document_length))
