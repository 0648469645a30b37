"""What the activation formulas return: bytes kept for backward, split by where they come from.

Symbols are those of inspector/job/dims.py; the terms are Korthikanti et al. 2022's (see
activations.py, which computes them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer layer keeps for backward, for one micro-batch on one rank."""

    norms: float  # inputs of the two norms (paper: 4sbh)
    attention: float  # QKV input, Q, K, V, projection input, dropout mask (paper: 11sbh)
    core_attention: float  # softmax output, its dropout mask and output (5as^2b), or flash stats
    mlp: float  # fc1 input, activation input and output, dropout mask (paper: 19sbh); a hybrid
    # model's Mamba layer: its mixer's (activations.py `_mamba`)
    checkpoint: float  # full recomputation: the layer input, the only thing kept

    @property
    def total(self) -> float:
        """Return the layer's bytes."""
        return self.norms + self.attention + self.core_attention + self.mlp + self.checkpoint


@dataclass(frozen=True)
class EmbeddingActivations:
    """Bytes the first stage's embedding keeps per micro-batch on one rank."""

    token_ids: float  # int64 ids, kept by the embedding lookup's backward
    dropout_mask: float  # embedding dropout mask (paper Section 4.4: sbh/t with SP)

    @property
    def total(self) -> float:
        """Return the embedding's bytes."""
        return self.token_ids + self.dropout_mask


@dataclass(frozen=True)
class OutputActivations:
    """Bytes the last stage's final norm, output layer and loss keep per micro-batch."""

    final_norm_input: float  # 2sbh (/t with SP)
    output_layer_input: float  # 2sbh (/t with SP)
    logits: float  # fp32 logits of the cross-entropy loss, 4sbv/t

    @property
    def total(self) -> float:
        """Return the output side's bytes (paper Section 4.4: 4sbh/t (1 + v/h) with SP)."""
        return self.final_norm_input + self.output_layer_input + self.logits


@dataclass(frozen=True)
class StageActivations:
    """Peak activation bytes of one pipeline stage on one rank, split by origin."""

    layers: float  # transformer layers, times the micro-batches in flight per chunk
    embedding: float  # first stage only
    output: float  # last stage only
    recompute_buffer: float  # full recomputation: one layer rebuilt during backward
    in_flight: tuple[int, ...]  # micro-batches holding activations per chunk at the peak
    # last stage: the output layer's 16-bit logits, alive beside the loss's fp32 copy while the
    # loss runs (forward), never beside a rebuild (backward)
    loss_logits: float = 0.0

    @property
    def total(self) -> float:
        """Return the stage's peak bytes: what is in flight, and the larger of what a backward
        rebuilds and what the loss holds for a moment."""
        return self.layers + self.embedding + self.output + max(self.recompute_buffer, self.loss_logits)
