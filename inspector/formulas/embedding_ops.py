"""The kernels megatron-core's word embedding runs on the first stage (formulas/ops.py's layer
kernels leave it out), forward and backward, per micro-batch.

megatron-core 0.16 models/common/embeddings/language_model_embedding.py LanguageModelEmbedding and
tensor_parallel/layers.py VocabParallelEmbedding, on T = s b / c tokens, a rank's v / t rows of
the padded vocabulary (width h, act bytes a):
  forward: the lookup (`F.embedding`, or `self.weight[masked_input]` under --deterministic-mode:
  reads and writes T h); with tp > 1 `output_parallel[input_mask, :] = 0.0` over the (t - 1) / t
  of the tokens another rank holds (writes them) and the sum over tp (an all-reduce, or with
  sequence parallelism a reduce-scatter: plan/cost.py prices it); `transpose(0, 1).contiguous()`
  of [b, s, h] into [s, b, h] (a copy when b > 1: with b = 1 the transpose is already contiguous);
  the embedding dropout on the rank's rows (T / t with sequence parallelism), as the layers'.
  backward: the same in reverse, and the weight's gradient: a zeroed [v / t, h] tensor
  (embedding_dense_backward's `at::zeros`, or the index's `zeros_like(self).index_put_(...,
  accumulate=True)`), the output gradient read and the touched rows written (at most T), then
  DDP's hook adds it into the fp32 main_grad (distributed_data_parallel.py `main_grad.add_`: the
  embedding is no linear, its gradient is never accumulated into main_grad by a GEMM). Left out:
  the index masking on [b, s] integers and the backward's sort of T indices.
"""

from __future__ import annotations

from inspector.formulas.bias_ops import Kernels
from inspector.formulas.kernels import Memory
from inspector.formulas.ops import GRAD_ACCUMULATE, MASK


def embedding_kernels(tokens: int, local: int, rows: int, hidden: int, tp: int, batch: int,
                      act: int, dropout: bool) -> Kernels:  # fmt: skip
    """Return the word embedding's forward and backward kernels (module docstring): `tokens` T,
    `local` the rows dropout runs on, `rows` the rank's vocabulary rows, `batch` b."""
    elements = tokens * hidden
    forward = [Memory("embedding lookup", "copy", elements, 2 * act)]
    backward = [Memory("embedding gradient", "copy", rows * hidden + 2 * elements, act),
                Memory("embedding main_grad.add_", "add", rows * hidden, GRAD_ACCUMULATE)]
    if tp > 1:  # the rows of tokens outside the rank's vocabulary, zeroed (and their gradient)
        other = elements * (tp - 1) // tp
        forward.append(Memory("embedding other ranks' rows", "copy", other, act))
        backward.append(Memory("embedding other ranks' rows backward", "copy", other, act))
    if batch > 1:  # [b, s, h] -> [s, b, h]
        forward.append(Memory("embedding transpose", "copy", elements, 2 * act))
        backward.append(Memory("embedding transpose backward", "copy", elements, 2 * act))
    if dropout:
        forward.append(Memory("embedding dropout", "copy", local * hidden, 2 * act + MASK))
        backward.append(Memory("embedding dropout backward", "copy", local * hidden, 2 * act + MASK))
    return forward, backward
