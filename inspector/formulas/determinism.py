"""What Megatron-LM's --deterministic-mode adds to a layer's kernels: the attention backward's.

Megatron-LM's validate_args (megatron/training/arguments.py) requires NCCL_ALGO to name one
algorithm (Tree, Ring, ...) and calls `torch.use_deterministic_algorithms(True)`; megatron-core's
TEDotProductAttention refuses deterministic mode unless NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
(extensions/transformer_engine.py). Transformer Engine then keeps cuDNN's fused attention on Hopper
(attention/dot_product_attention/utils.py `get_attention_backend`, its determinism table:
sub-backend 1 "workspace optimization path and sm90+: yes") and asks cuDNN for its deterministic
backward (common/fused_attn/fused_attn_f16_arbitrary_seqlen.cu:
`sdpa_backward_options.set_deterministic_algorithm(deterministic)`). On Hopper that backward is
cuDNN's dP-workspace decomposition (NVIDIA/cudnn-frontend#398, "SDPA bwd: linear-workspace
deterministic path on Hopper (cuDNN 9.25+)": `use_deterministic_algorithm` "always forced the
dP-workspace decomposition. Its workspace is quadratic in sequence length (b * h * s_q_pad *
s_kv_pad * 2 bytes)"): the gradients of the scores go out to that workspace and a separate product
reads them back for dQ, where the default kernel adds each tile's dQ into an fp32 buffer with
atomics, in no fixed order. The FLOPs are the same; the workspace's traffic is added: one write and
one read of its causal half (the tiles the causal mask keeps, as the flash FLOPs count them), 2
bytes an element each way, at the measured copy rate. Other GPUs are priced the same, as a stand-in:
Blackwell's deterministic backward runs a separate dQ kernel instead (NVIDIA/cudnn-frontend#895),
and before Hopper Transformer Engine drops its fused attention under determinism (flash-attn 2's
deterministic kernel or the unfused path run instead).

Published measurements of deterministic attention backward kernels on an H100 at head dim 128,
causal, sequence 8192 (Dao-AILab/flash-attention#1893): FlashAttention-3 non-deterministic 574.7
TFLOP/s, deterministic 474.0 (shortest-processing-time schedule) to 361.3 (naive order), 0.63-0.82
of the default. This price gives 0.65 at the same shape against the H100 table's backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from inspector.formulas.kernels import Gemm, Memory, Op
from inspector.job.dims import ModelDims

WORKSPACE_BYTES = 2 + 2  # a 16-bit score gradient written, then read by the dQ product


def workspace_pass(heads: int, rows: int, squares_per_row: int) -> Memory:
    """Return the deterministic backward's dP-workspace traffic: `heads` (x micro-batch) heads of
    `rows` query rows, each attending to `squares_per_row` keys before the causal half."""
    return Memory("deterministic attention dP workspace", "copy", heads * rows * squares_per_row // 2,
                  WORKSPACE_BYTES)


# fill_uninitialized_memory (torch.utils.deterministic, True by default): under
# torch.use_deterministic_algorithms(True) torch's CUDA `empty` fills each new tensor with NaN
# (aten/src/ATen/native/cuda/TensorFactories.cu `empty_cuda`, `empty_strided_cuda`: `if
# (deterministicAlgorithms() && deterministicFillUninitializedMemory())
# fill_empty_deterministic_(result)`). Aten's own structured kernels make their outputs with
# at::detail::empty_cuda, past that check (torchgen/dest/register_dispatch_key.py
# `gen_create_out_helper`), and torch.compile's kernels with `empty_strided_cuda` the same way;
# what goes through `at::empty` is filled: every output of Transformer Engine's C++ (its GEMMs,
# norms, fused attention, fused RoPE, fp8 casts) and the buffers megatron and TE allocate with
# torch.empty for the sequence-parallel gathers and reduce-scatters. Each is written once more.
NAN_FILLED_NORMS = ("input norm", "pre-MLP norm", "q latent norm", "kv latent norm", "QK norm")


def nan_fill(dims: ModelDims, forward: Sequence[Op], backward: Sequence[Op], tokens: int,
             local: int, tp: int, moe: bool) -> tuple[Memory, Memory]:
    """Return the NaN fill of a Transformer Engine layer's outputs, forward and backward, for a
    rank's `tokens` rows (`local` of them with sequence parallelism; `tp` ranks share its heads;
    `moe`: its MLP is an MoE block, whose exchanges are not counted here; a hybrid model's Mamba
    and gated-delta-net layers are not priced with it). tests/test_nan_fill.py
    checks it against the bytes of every `empty` the engine's run of megatron's layer allocates,
    less the norms' and attention's statistics (1/hidden of their outputs).

    Of formulas/ops.py's kernels: each GEMM's output (not the router's, a torch product; not
    the weight gradient accumulated into main_grad; not unfused attention's batched products),
    the norms' output and input gradient, the fused RoPE's output and gradient; beside them the
    flash attention's output and its Q, K and V gradients, and with sequence parallelism each
    linear's gathered input (its gradient's before a row-parallel data gradient and again its
    input's for a column-parallel weight gradient) and reduce-scattered output.
    """
    d, h = dims.head_dim, dims.hidden_size
    heads, groups = dims.num_attention_heads // tp, max(dims.query_groups // tp, 1)
    fills = [0, 0]
    for index, ops in enumerate((forward, backward)):
        for op in ops:
            if isinstance(op, Gemm) and op.batch == 1 and op.name != "router" and not (
                    op.orient == "wgrad" and dims.wgrad_fused):
                fills[index] += op.m * op.n
            elif isinstance(op, Memory) and (op.name.removesuffix(" backward") in NAN_FILLED_NORMS
                                             or op.name.startswith("rotary")):
                fills[index] += op.elements
    if dims.flash_attention:
        fills[0] += tokens * heads * d
        fills[1] += tokens * (heads + 2 * groups) * d
    if local != tokens:  # attention's and a dense MLP's: a column- and a row-parallel linear each
        pairs = 1 if moe else 2
        fills[0] += pairs * (tokens + local) * h  # the column's gather, the row's reduce-scatter
        fills[1] += pairs * (2 * tokens + local) * h  # + the weight gradient's gather again
    act = dims.activation_bytes
    return (Memory("NaN fill of new tensors", "copy", fills[0], act),
            Memory("NaN fill of new tensors backward", "copy", fills[1], act))
