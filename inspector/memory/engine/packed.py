"""A packed micro-batch (Megatron-LM's `--sft`) as `pretrain_gpt.get_batch` gives it to the model.

Megatron-LM's SFT dataset returns no attention mask but `cu_seqlens` (int32 [documents + 1]) and
`max_seqlen` (megatron/training/datasets/sft_dataset.py); `pretrain_gpt.get_batch` pops them and
calls megatron-core's `get_thd_batch_on_this_cp_rank` (core/utils.py 2041-2078, 0.16.1): at
context parallel size 1 the batch unchanged and a `PackedSeqParams` (qkv_format "thd", the same
cu_seqlens for q and kv, max_seqlen as an int), which the model takes as `packed_seq_params`;
0.19 moved the function, so the engine builds the same PackedSeqParams itself.
megatron reads the lengths back on the host (`int(max_seqlen[0].item())`; rope_utils'
unfused thd RoPE splits by `.tolist()`), so they are real tensors here, on the host: on a GPU
they are a few bytes. The documents follow `--packed-document-length` (job/packing.py).
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.job.job import Job
from inspector.job.packing import document_lengths


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """Return the cumulative lengths, int32 [documents + 1], as the SFT dataset gives them."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32)


def packed_batch(job: Job, batch: dict[str, Any]) -> dict[str, Any]:
    """Return the batch with megatron-core's PackedSeqParams for the job's packed documents."""
    from megatron.core.packed_seq_params import PackedSeqParams

    s, length = job.model.seq_length, job.training.packed_document_length
    assert length is not None
    lengths = document_lengths(s, length)
    cu = cu_seqlens(lengths)
    # the SFT dataset has no cu_seqlens_padded: None, as pretrain_gpt.get_batch passes it
    batch["packed_seq_params"] = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None,
        cu_seqlens_kv_padded=None, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
    )  # fmt: skip
    return batch
