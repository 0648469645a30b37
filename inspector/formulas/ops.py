"""The kernels one transformer layer runs on one rank, forward and backward, with their shapes.

Megatron-core's layer (transformer_layer.py, attention.py, mlp.py, moe/) on a rank of tensor
parallel size t, context parallel c, expert parallel e (expert tensor parallel u), micro-batch b
(symbols of inspector/job/dims.py; T = s b / c tokens of the rank's sequence share):
  - input norm; QKV column-parallel linear (h -> (a + 2g) d / t); core attention; output
    row-parallel linear (a d / t -> h); bias-dropout-add; pre-MLP norm; MLP (fc1 h -> f / t, or
    2f / t with SwiGLU; GeLU or SwiGLU; fc2 f / t -> h) or MoE (router h -> E, permutation, E / e
    local experts of T k e u / (E t) tokens each on h -> f_e / u, un-permutation, shared experts
    as a dense MLP); bias-dropout-add. With sequence parallelism the norms and residual adds run
    on T / t tokens, the linears on all T (after the all-gather). Rotary embedding on Q and K.
  - each linear is 3 GEMMs: forward, data gradient, weight gradient (kernels.py's orientations);
  - core attention: flash (one forward and one backward kernel; determinism.py's workspace under
    --deterministic-mode), or megatron's unfused DotProductAttention: baddbmm Q K^T into [b a/t,
    s/c, s], scale-mask-softmax (the fused kernel with apex or TE, else forward_torch_softmax),
    attention dropout, bmm with V, the context's permute copy (tests/test_ops_dispatch.py), or
    DeepSeek sparse attention's indexer and masked attention (dsa_ops.py);
  - memory-bound ops priced by the bytes each reads and writes (backward: the saved input and the
    output gradient read, the input gradient written); TE's unfused attention: te_unfused.py;
  - linear biases (bias_ops.py): without TE the QKV linear adds its bias after the GEMM; fc1's
    bias goes to the bias-GeLU, the output and fc2 biases to the bias-dropout-adds (one compiled
    kernel each, or eager ones with --no-bias-*-fusion); each bias gradient a sum over tokens
    (tests/test_ops_dispatch.py: a local-spec layer's bytes and GEMMs against megatron's);
  - with --no-gradient-accumulation-fusion each weight gradient is a 16-bit tensor that DDP's
    hook adds into the fp32 main_grad (distributed_data_parallel.py `main_grad.add_`).
Multi-latent attention (megatron-core multi_latent_attention.py, MLASelfAttention, TE spec): the
down projections h -> q_lora and h -> kv_lora + r are duplicated on every TP rank (TELinear
`parallel_mode="duplicated"`) and run on the rank's local rows (T / t with sequence parallelism,
else all T); the latent norms (with --qk-layernorm) on the same rows; the column-parallel up
projections q_lora -> n (c + r) / t (or h -> n (c + r) / t without a query latent) and
kv_lora -> n (c + v) / t on all T; RoPE on the rotary parts of Q and K; core attention; the
row-parallel output n v / t -> h. Their GEMM FLOPs are Megatron-LM's (mla_attention_flops, less
the latent norms' "+ 1" terms). The output layer and loss: `output_ops`. Not memoised here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from inspector.formulas.bias_ops import Kernels, bias_add, unfused_bias_dropout_add
from inspector.formulas.determinism import workspace_pass
from inspector.formulas.dsa_ops import dsa_core_ops
from inspector.formulas.fp8_ops import amax_pass, expert_padding, norm_fused_linears
from inspector.formulas.kernels import (
    ATTENTION_BACKWARD,
    Attention,
    Gemm,
    Memory,
    Op,
    Orient,
    ops_seconds,
)
from inspector.formulas.rope_ops import mla_rope, rotary
from inspector.formulas.te_unfused import full_mask_pass
from inspector.job.dims import ModelDims
from inspector.job.hardware import Gpu

FP32, MASK = 4, 1  # bytes of an fp32 element, of a bool dropout mask element
# torch's softmax over rows longer than this (fp32 rows above 4,096 bytes) runs one thread block
# per row with block-wide reductions (aten/src/ATen/native/cuda/SoftMax.cu host_softmax and
# host_softmax_backward: cunn_SoftMaxForward / cunn_SoftMaxBackward), as the norm kernels do;
# shorter rows run in one warp's registers (dispatch_softmax_forward / _backward), as megatron's
# fused scaled masked softmax does at every length it takes
WARP_SOFTMAX_ROW = 1024
GRAD_ACCUMULATE = 4 + 2 + 4  # main_grad.add_(grad): fp32 read, 16-bit read, fp32 write


@dataclass(frozen=True)
class Shard:
    """How one rank cuts a layer: t, c, e, u, sequence parallel, micro-batch."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    micro_batch: int = 1


@dataclass(frozen=True)
class LayerOps:
    """A layer's kernels: forward, backward, and the forward selective recomputation repeats.

    `core`: core attention's forward (the default `--recompute-modules core_attn`); `modules`:
    each recompute module this layer has and the forward kernels it runs again (`RECOMPUTED`).
    """

    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    core: tuple[Op, ...]
    modules: tuple[tuple[str, tuple[Op, ...]], ...] = ()

    def recomputed(self, modules: tuple[str, ...]) -> tuple[Op, ...]:
        """Return the forward kernels selective recomputation of `modules` runs again."""
        regions = dict(self.modules)
        return tuple(op for name in modules for op in regions.get(name, ()))


# What each --recompute-modules name runs again before its backward, in megatron-core 0.16 (a
# module this layer lacks runs nothing: `mlp` on an MoE layer, `moe` on a dense one):
#   core_attn: attention.py `_checkpointed_attention_forward`, core attention (tensor_parallel
#     checkpoint);
#   layernorm: transformer_layer.py CheckpointWithoutOutput of input_layernorm and
#     pre_mlp_layernorm (no GEMM);
#   mlp: transformer_layer.py `_forward_mlp`, tensor_parallel.checkpoint(self.mlp) of a dense
#     layer (`recompute_mlp` only `if not self.is_moe_layer`);
#   moe: moe_layer.py MoELayer.forward, tensor_parallel.checkpoint(custom_forward): router,
#     permutation, experts, un-permutation and shared experts;
#   moe_act: moe/experts.py CheckpointWithoutOutput of the experts' activation (no GEMM);
#   shared_experts: moe_layer.py `shared_experts_compute`, checkpoint(self.shared_experts).
#   mla_up_proj: multi_latent_attention.py `get_query_key_value_tensors`, CheckpointWithoutOutput
#     of `qkv_up_proj_and_rope_apply`: the q and kv up projections and RoPE (not the down
#     projections, not the latent norms).
RECOMPUTED: tuple[str, ...] = (
    "core_attn", "layernorm", "mla_up_proj", "mlp", "moe", "moe_act", "shared_experts")


def linear(name: str, tokens: int, fan_in: int, fan_out: int, expert: bool = False,
           fp8: bool = False) -> list[Gemm]:  # fmt: skip
    """Return a linear's forward, data-gradient and weight-gradient GEMMs."""
    orients: tuple[Orient, ...] = ("expert",) * 3 if expert else ("fwd", "dgrad", "wgrad")
    return [Gemm(name, tokens, fan_out, fan_in, orients[0], fp8=fp8),
            Gemm(name + " dgrad", tokens, fan_in, fan_out, orients[1], fp8=fp8),
            Gemm(name + " wgrad", fan_in, fan_out, tokens, orients[2], fp8=fp8)]


class _Pass:
    """Forward and backward op lists being filled side by side."""

    def __init__(self, fused: bool = True, fp8: bool = False, amax: bool = False,
                 norm_fused: frozenset[str] = frozenset()) -> None:  # fmt: skip
        self.forward: list[Op] = []
        self.backward: list[Op] = []
        self.fused = fused
        self.fp8 = fp8  # Transformer Engine's linears in fp8 (megatron's router stays 16-bit)
        self.amax = amax  # current scaling (`tensorwise`): an amax pass before each cast
        self.norm_fused = norm_fused  # linears whose norm kernel computes the input's amax

    def linear(self, name: str, tokens: int, fan_in: int, fan_out: int, expert: bool = False,
               count: int = 1) -> None:
        """Add a linear's GEMMs; without fused kernels, DDP's main_grad.add_ of its gradient.

        Under fp8 the GEMMs run at the fp8 peak (kernels.py) and Transformer Engine first casts
        the input (forward) and the output gradient (backward) to fp8 with its transpose: a pass
        reading 2 bytes and writing 1 + 1 per element (TE's cast_transpose, one per GEMM input).
        With current scaling the cast's amax is computed first (fp8_ops.amax_pass).
        """
        fp8 = self.fp8 and name != "router"
        forward, *backward = linear(name, tokens, fan_in, fan_out, expert, fp8)
        if fp8:
            if self.amax and name not in self.norm_fused:
                self.forward.append(amax_pass(name, count * tokens * fan_in))
            self.forward.append(Memory(name + " fp8 cast", "copy", count * tokens * fan_in, 4))
            self.backward.append(Memory(name + " fp8 cast", "copy", count * tokens * fan_out, 4))
            if self.amax:
                self.backward.append(amax_pass(name, count * tokens * fan_out))
        self.forward += [forward] * count
        self.backward += backward * count
        if not self.fused:  # fp32 main_grad += 16-bit grad: read 4 + 2, write 4 bytes
            self.backward.append(Memory(name + " main_grad.add_", "add", count * fan_in * fan_out,
                                        GRAD_ACCUMULATE))

    def extend(self, kernels: Kernels) -> None:
        """Add forward and backward kernels made elsewhere (bias_ops.py)."""
        self.forward += kernels[0]
        self.backward += kernels[1]

    def memory(self, name: str, cls: str, elements: int, forward: float, backward: float) -> None:
        """Add a memory-bound op moving `forward` / `backward` bytes per element."""
        self.forward.append(Memory(name, cls, elements, forward))  # type: ignore[arg-type]
        self.backward.append(Memory(name + " backward", cls, elements, backward))  # type: ignore[arg-type]


def _residual(p: _Pass, dims: ModelDims, name: str, elements: int, act: int, bias: bool = False) -> None:
    """Add a norm (before) or a bias-dropout-add (after) on the residual stream.

    A norm reads and writes a row (backward: the input, the gradient, the input gradient). The
    bias-dropout-add (fusions/fused_bias_dropout.py `_bias_dropout_add_func`: x + bias,
    dropout, residual + x) with --bias-dropout-fusion is one kernel (jit_fuser: torch.compile
    on torch >= 2.2, megatron/core/jit.py), priced as reading x and the residual and writing
    the sum and the mask; its backward adds the residual's two gradients and applies the mask.
    `bias`: the linear before it returned its bias (skip_bias_add); without the fusion
    bias_ops.unfused_bias_dropout_add.
    """
    if name.endswith("norm"):
        p.memory(name, "rms_norm", elements, 2 * act, 3 * act)
        return
    mask = MASK if dims.hidden_dropout else 0
    if not dims.bias_dropout_fusion:
        p.extend(unfused_bias_dropout_add(name, elements, act, mask, bias))
        return
    p.memory(name, "add", elements, 3 * act + mask, 3 * act + (2 * act + mask if mask else 0))


def _unfused_attention(p: _Pass, dims: ModelDims, heads: int, sq: int, fused: bool) -> None:
    """Add megatron's DotProductAttention: two batched GEMMs around the softmax of the scores.

    Multi-latent attention's heads are wider for Q K^T than for P V: the attention is built with
    k_channels = qk_head_dim + qk_pos_emb_head_dim and v_channels = v_head_dim
    (multi_latent_attention.py `self.core_attention = build_module(...)`)."""
    s, act = dims.seq_length, dims.activation_bytes
    d, dv = dims.head_dim, dims.head_dim
    if dims.multi_latent_attention:
        d, dv = dims.qk_head_dim + dims.qk_pos_emb_head_dim, dims.v_head_dim
    scores = Gemm("Q K^T", sq, s, d, "fwd", heads)
    p.forward.append(scores)
    p.backward += [Gemm("dQ", sq, d, s, "dgrad", heads), Gemm("dK", s, d, sq, "wgrad", heads)]
    # torch's autograd formula of baddbmm(alpha=softmax_scale): maybe_multiply(grad.bmm(..), alpha)
    # for each of Q and K, an elementwise multiply after the GEMM (read 2, write 2 bytes)
    p.backward.append(Memory("dQ, dK times alpha", "copy", heads * (sq + s) * d, 2 * act))
    elements = heads * sq * s
    if dims.te_attention:  # Transformer Engine's UnfusedDotProductAttention (te_unfused.py)
        p.forward.append(full_mask_pass(sq, s))
    if fused:  # one kernel, a warp a row, reads and writes 16-bit scores
        p.memory("scale-mask-softmax", "copy", elements, 2 * act, 3 * act)
    else:
        _torch_softmax(p, sq, s, elements, act)
    if dims.attention_dropout:
        p.memory("attention dropout", "copy", elements, 2 * act + MASK, 2 * act + MASK)
    p.forward.append(Gemm("P V", sq, dv, s, "fwd", heads))
    p.backward += [Gemm("dP", sq, s, dv, "dgrad", heads), Gemm("dV", s, dv, sq, "wgrad", heads)]
    # dot_product_attention.py: context.permute(2, 0, 1, 3).contiguous(), [b, np, sq, hn] to
    # [sq, b, np, hn]: one copy (its backward is a view: the bmm reads the strided gradient)
    p.forward.append(Memory("context permute", "copy", heads * sq * dv, 2 * act))


def _torch_softmax(p: _Pass, sq: int, s: int, elements: int, act: int) -> None:
    """Add FusedScaleMaskSoftmax.forward_torch_softmax, the path without a fused kernel.

    fusions/fused_softmax.py: the causal mask made anew each call (transformer/utils.py
    get_default_causal_mask: torch.ones fp32 (write 4), triu (4 + 4), .bool() (4 + 1), on
    [sq, sk] once, not per head); then per score: .float() (2 + 4), masked_fill_ in place
    (attention_mask_func: reads 4 + 1 mask, writes 4), softmax (4 + 4), back to 16-bit (4 + 2).
    Backward: the cast's gradient (2 + 4), _softmax_backward_data (4 + 4 + 4), masked_fill's
    gradient (4 + 1 + 4), the .float()'s gradient (4 + 2). No scale multiply: DotProductAttention
    scales in the baddbmm (alpha) and passes scale=None unless query-key layer scaling.
    """
    cast = act + FP32
    p.forward.append(Memory("causal mask", "copy", sq * s, 3 * FP32 + FP32 + 1 + FP32))
    p.memory("softmax casts and mask", "copy", elements, 2 * cast + 2 * FP32 + MASK,
             2 * cast + 2 * FP32 + MASK)
    # the softmax itself: longer rows at the norm kernels' measured rate (WARP_SOFTMAX_ROW)
    rows = "copy" if s <= WARP_SOFTMAX_ROW else "rms_norm"
    p.memory("softmax in fp32", rows, elements, 2 * FP32, 3 * FP32)


def _core_attention(dims: ModelDims, z: Shard, flash: bool, fused: bool) -> _Pass:
    """Return the core attention's forward and backward kernels on one rank."""
    p = _Pass()
    if dims.experimental_attention_variant == "dsa":  # DeepSeek sparse attention (dsa_ops.py)
        p.forward, p.backward = dsa_core_ops(dims, z.tp, z.micro_batch)
        return p
    heads = dims.num_attention_heads // z.tp * z.micro_batch
    sq = dims.seq_length // z.cp
    if not flash:
        _unfused_attention(p, dims, heads, sq, fused)
        return p
    if dims.multi_latent_attention:
        per_head = dims.qk_head_dim + dims.qk_pos_emb_head_dim + dims.v_head_dim
    else:
        per_head = 2 * dims.head_dim
    # 2 (Q K^T, P V) x 2 / 2 (causal); packed (--sft, cp 1): per document, sum of squares
    flops = heads * sq * dims.attention_squares() // dims.seq_length * per_head
    p.forward.append(Attention("flash attention", sq, heads, flops, False))
    p.backward.append(Attention("flash attention backward", sq, heads,
                                ATTENTION_BACKWARD * flops, True))
    if dims.deterministic:  # cuDNN's deterministic backward (formulas/determinism.py)
        p.backward.append(workspace_pass(heads, sq, dims.attention_squares() // dims.seq_length))
    return p


def _mla(p: _Pass, dims: ModelDims, z: Shard, tokens: int, local: int, core: _Pass) -> tuple[Op, ...]:
    """Add multi-latent attention's projections, norms, RoPE, core attention and output.

    Returns the forward kernels `--recompute-modules mla_up_proj` runs again: the up
    projections and RoPE (`qkv_up_proj_and_rope_apply`).
    """
    h, t, act = dims.hidden_size, z.tp, dims.activation_bytes
    n = max(1, dims.num_attention_heads // t)
    c, r, v = dims.qk_head_dim, dims.qk_pos_emb_head_dim, dims.v_head_dim
    q, k = dims.q_lora_rank, dims.kv_lora_rank
    if q is not None:
        p.linear("q down projection", local, h, q)
    p.linear("kv down projection", local, h, k + r)
    if dims.qk_layernorm:
        if q is not None:
            p.memory("q latent norm", "rms_norm", local * q, 2 * act, 3 * act)
        p.memory("kv latent norm", "rms_norm", local * k, 2 * act, 3 * act)
    start = len(p.forward)
    p.linear("q up projection", tokens, q if q is not None else h, n * (c + r))
    p.linear("kv up projection", tokens, k, n * (c + v))
    if dims.rotary:  # RoPE; without its fusion the q/k/v cats too (rope_ops.py)
        p.extend(mla_rope(tokens, n, (c, r, v), act, dims.rope_fusion))
    up = tuple(p.forward[start:])
    p.forward += core.forward
    p.backward += core.backward
    p.linear("attention output", tokens, n * v, h)
    return up


def _attention(p: _Pass, dims: ModelDims, z: Shard, tokens: int, core: _Pass) -> None:
    """Add the QKV projection, rotary embedding, core attention and output projection."""
    h, d, t = dims.hidden_size, dims.head_dim, z.tp
    heads, groups = dims.num_attention_heads // t, max(dims.query_groups // t, 1)
    p.linear("QKV", tokens, h, (heads + 2 * groups) * d)
    if not dims.fused_kernels and (dims.add_bias_linear or dims.add_qkv_bias):
        # ColumnParallelLinear (skip_bias_add False): torch.matmul, then `output + bias`
        # (tensor_parallel/layers.py); Transformer Engine adds it in the GEMM
        p.extend(bias_add("QKV", tokens * (heads + 2 * groups) * d, dims.activation_bytes, True))
    if dims.qk_layernorm:  # attention.py: q_layernorm(query), k_layernorm(key), per head
        p.memory("QK norm", "rms_norm", tokens * (heads + groups) * d,
                 2 * dims.activation_bytes, 3 * dims.activation_bytes)
    if not dims.fused_kernels:  # no Transformer Engine (apex alone: the same torch.split)
        # attention.py get_query_key_value_tensors: torch.split of the QKV output (Transformer
        # Engine's SplitAlongDim where installed); its backward is one torch.cat of the three
        # gradients into the QKV gradient (read 2, write 2 bytes per element)
        p.backward.append(Memory("QKV split backward (cat)", "copy",
                                 tokens * (heads + 2 * groups) * d, 2 * dims.activation_bytes))
    if dims.rotary:
        p.extend(rotary(tokens * (heads + groups) * d, dims.activation_bytes, dims.rope_fusion))
    p.forward += core.forward
    p.backward += core.backward
    p.linear("attention output", tokens, heads * d, h)


def _dense_mlp(p: _Pass, dims: ModelDims, tokens: int, ffn: int, name: str) -> None:
    """Add fc1, the activation and fc2 of an MLP whose rank holds `ffn` columns."""
    act = dims.activation_bytes
    p.linear(name + " fc1", tokens, dims.hidden_size, dims.gated_multiplier * ffn)
    if dims.add_bias_linear:  # mlp.py MLP.forward: fc1 returns its bias (skip_bias_add True)
        # and bias_gelu_impl / bias_swiglu_impl take it, else `intermediate + bias` eagerly
        p.extend(bias_add(name + " fc1", tokens * dims.gated_multiplier * ffn, act,
                          not dims.bias_activation_fusion))
    if dims.swiglu:
        p.memory(name + " SwiGLU", "swiglu", tokens * ffn, 3 * act, 5 * act)
    else:
        p.memory(name + " GeLU", "copy", tokens * ffn, 2 * act, 3 * act)
    p.linear(name + " fc2", tokens, ffn, dims.hidden_size)


def _moe(p: _Pass, dims: ModelDims, z: Shard, tokens: int, local: int) -> None:
    """Add the router, permutation, local experts and shared experts of an MoE layer.

    The all-to-all dispatcher (token_dispatcher.py) sorts received tokens by local expert and
    back (`sort_chunks_by_idxs`, 2+ local experts); fp8 experts pad and unpad (fp8_ops.py).
    """
    h, act, experts = dims.hidden_size, dims.activation_bytes, dims.num_experts or 1
    k = dims.moe_router_topk
    p.linear("router", local, h, experts)
    p.memory("router softmax, top-k", "copy", local * experts, 4 * FP32, 4 * FP32)
    ffn = dims.expert_ffn // z.etp
    routed = max(1, tokens * k * z.ep * z.etp // (experts * z.tp))
    count, sent = max(1, experts // z.ep), local * k
    te_pads = p.fp8 and not dims.moe_row_padding
    if p.fp8 and dims.moe_row_padding:  # the dispatcher padded them (fp8_ops.expert_padding)
        routed, dispatched = expert_padding(dims, tokens, experts, z.ep, z.etp, z.tp, k)
        if dims.moe_row_padding == "source":  # the sender's padding rows are permuted and sent
            sent = math.ceil(dispatched)
    p.memory("permute", "copy", sent * h, 2 * act, 2 * act)
    sort, rows = dims.moe_sorts_chunks and count > 1, routed * count * h
    if sort:  # token_dispatcher.py dispatch_postprocess: sort_chunks_by_idxs (a gather)
        p.memory("sort chunks", "copy", rows, 2 * act, 2 * act)
    if te_pads:  # experts.py TEGroupedMLP: Fp8Padding of the input (TE fused_multi_row_padding);
        # the expert GEMMs then run the padded rows (fp8_ops.py expert_padding, destination)
        p.memory("expert fp8 padding", "copy", rows, 2 * act, 2 * act)
        routed, _ = expert_padding(dims, tokens, experts, z.ep, z.etp, z.tp, k)
    p.linear("expert fc1", routed, h, dims.gated_multiplier * ffn, True, count)
    cls, fwd, bwd = ("swiglu", 3, 5) if dims.swiglu else ("copy", 2, 3)
    p.memory("expert activation", cls, routed * ffn * count, fwd * act, bwd * act)
    p.linear("expert fc2", routed, ffn, h, True, count)
    if te_pads:  # Fp8Unpadding of the output
        p.memory("expert fp8 unpadding", "copy", rows, 2 * act, 2 * act)
    if sort:  # combine_preprocess: the reverse sort_chunks_by_idxs
        p.memory("unsort chunks", "copy", rows, 2 * act, 2 * act)
    p.memory("unpermute", "add", sent * h, 2 * act, 2 * act)
    if dims.shared_expert_ffn:
        _dense_mlp(p, dims, tokens, dims.shared_expert_ffn // z.tp, "shared expert")


def layer_ops(dims: ModelDims, z: Shard, moe: bool) -> LayerOps:
    """Return one layer's kernels on one rank for one micro-batch.

    Args:
        dims: the model (its `flash_attention` and `fused_kernels` pick the attention path).
        z: the rank's share of the layer.
        moe: the layer's MLP is a mixture of experts.
    """
    tokens = dims.seq_length * z.micro_batch // z.cp
    local = tokens // z.tp if z.sequence_parallel else tokens  # the norms' and residuals' rows
    elements, act = local * dims.hidden_size, dims.activation_bytes
    p = _Pass(dims.wgrad_fused, dims.fp8 is not None, dims.fp8_recipe == "tensorwise",
              norm_fused_linears(dims))
    _residual(p, dims, "input norm", elements, act)
    norms = p.forward[-1:]
    core = _core_attention(dims, z, dims.flash_attention, dims.fused_kernels)
    up: tuple[Op, ...] = ()
    if dims.multi_latent_attention:
        up = _mla(p, dims, z, tokens, local, core)
    else:
        _attention(p, dims, z, tokens, core)
    _residual(p, dims, "attention bias-dropout-add", elements, act, dims.add_bias_linear)
    _residual(p, dims, "pre-MLP norm", elements, act)
    norms += p.forward[-1:]
    start = len(p.forward)
    if moe:
        _moe(p, dims, z, tokens, local)
    else:
        _dense_mlp(p, dims, tokens, dims.ffn // z.tp, "MLP")
    mlp = tuple(p.forward[start:])
    _residual(p, dims, "MLP bias-dropout-add", elements, act, dims.add_bias_linear and not moe)
    modules: dict[str, tuple[Op, ...]] = {"core_attn": tuple(core.forward), "layernorm": tuple(norms)}
    if up:
        modules["mla_up_proj"] = up
    if moe:
        modules["moe"] = mlp
        modules["moe_act"] = tuple(op for op in mlp if op.name == "expert activation")
        modules["shared_experts"] = tuple(op for op in mlp if op.name.startswith("shared expert"))
    else:
        modules["mlp"] = mlp
    return LayerOps(tuple(p.forward), tuple(reversed(p.backward)), tuple(core.forward),
                    tuple(modules.items()))


def output_ops(dims: ModelDims, z: Shard) -> LayerOps:
    """Return the final norm, output layer and loss on one rank for one micro-batch.

    megatron-core tensor_parallel/cross_entropy.py, vocab_parallel_cross_entropy on the rank's
    [T, v / t] logits: .float() (2 + 4 bytes per element), max (4), subtract in place (8), exp
    in place (8), sum (4), divide in place (8); backward: scale the softmax in place (8), and the
    16-bit cast's gradient (4 + 2).
    """
    tokens = dims.seq_length * z.micro_batch // z.cp
    local = tokens // z.tp if z.sequence_parallel else tokens
    act, vocab = dims.activation_bytes, dims.vocab_size // z.tp
    p = _Pass(dims.wgrad_fused)
    _residual(p, dims, "final norm", local * dims.hidden_size, act)
    p.linear("output layer", tokens, dims.hidden_size, vocab)
    p.memory("cross entropy", "copy", tokens * vocab, act + FP32 + 32, 8 + FP32 + act)
    return LayerOps(tuple(p.forward), tuple(reversed(p.backward)), ())


def layer_seconds(
    ops: LayerOps, gpu: Gpu, recompute: str, modules: tuple[str, ...] = ("core_attn",)
) -> float:
    """Return a layer's seconds for one micro-batch under megatron's recomputation.

    `full`: the checkpointed layer's forward runs again before its backward
    (tensor_parallel/random.py CheckpointFunction); `selective`: the forward kernels of
    `modules` (`--recompute-modules`, default core_attn; LayerOps.recomputed).
    """
    seconds = ops_seconds(ops.forward, gpu) + ops_seconds(ops.backward, gpu)
    if recompute == "full":
        return seconds + ops_seconds(ops.forward, gpu)
    if recompute == "selective":
        return seconds + ops_seconds(ops.recomputed(modules), gpu)
    return seconds
