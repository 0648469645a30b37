"""Activation memory per layer, per pipeline stage, from the published closed forms.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), Section 4 and Table 2, cross-checked with Megatron-LM's
`megatron/training/theoretical_memory_usage.py` (`compute_activation_memory`, tag core_v0.16.1)
and megatron-core's pipeline schedules. Symbols are those of inspector/job/dims.py.

Table 2 of the paper, bytes per layer for one micro-batch:
  no parallelism                       sbh (34 + 5as/h)
  tensor parallel                      sbh (10 + 24/t + 5as/(ht))
  tensor + sequence parallel           sbh/t (34 + 5as/h)
  tensor parallel + selective          sbh (10 + 24/t)
  tensor + sequence + selective        sbh/t (34)
  full recomputation                   2sbh
The functions below itemise the same terms (Section 4.1) so that the model's real shapes can
replace the paper's GPT-3 assumptions; with f = 4h, g = a, d = h/a, no SwiGLU and no MoE they
reduce exactly to the table. Assumptions, all the paper's unless said otherwise:
  - activations are 16-bit (2 bytes; `ModelDims.activation_bytes`, 4 when training in fp32),
    dropout masks 1 byte, the loss's logits fp32 (4 bytes);
  - dropout is on (attention and hidden), as in the paper and Megatron-LM's estimator;
  - GQA (our extension): Q is a*d wide, K and V g*d wide, the projection input a*d wide;
  - SwiGLU (our extension): the activation stores its 2f-wide input and the fc2 input (f wide),
    as megatron-core's `SwiGLUFunction` and the fc2 linear save them, so 6sbf instead of 4sbf;
  - flash attention (our extension): the 5as^2b score terms vanish and the kernel keeps its
    fp32 softmax statistics, 4asb bytes per layer (Q, K, V and the output are already counted);
  - selective recomputation of core attention (megatron-core's default
    `recompute_modules=["core_attn"]`) removes exactly the 5as^2b (or flash) terms; of `mlp`
    (our extension) a dense MLP's terms split by t, of `shared_experts` the shared expert's, of
    `mla_up_proj` multi-latent attention's Q, K and V (`layer_activations`; other modules are
    not counted);
  - full recomputation follows `--recompute-method` / `--recompute-num-layers` (default uniform,
    1): a checkpointed group keeps its input (2sbh, split by t under sequence parallelism), the
    layers `block` leaves alone keep everything, and backward rebuilds one group at a time,
    counted once per stage as `recompute_buffer` (see `recompute_plan`); megatron-core's
    multi-token-prediction layers skip `block` recomputation (`mtp_recompute`);
  - context parallelism divides s by c for every term (megatron runs it only through Transformer
    Engine's flash/fused attention, so it requires `flash_attention`);
  - MoE (our extension, balanced routing): a rank's experts see s*b*k*e/t token copies on average
    (e = expert tensor-parallel size), keep their permuted input (2h per copy, gathered across the
    expert tensor-parallel group) and their activation terms split by e; a shared expert is a
    dense MLP of its own size. megatron-core refuses MoE training with t > 1 without sequence
    parallelism (`MoELayer.forward`), so that combination is an error here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from inspector.errors import ConfigError
from inspector.job.dims import ModelDims, live_microbatches
from inspector.job.job import RECOMPUTE_MODES, Recompute
from inspector.job.layout import Layout
from inspector.job.versions import gdn_conv_keeps_projection
from inspector.memory.closed.activation_records import (
    EmbeddingActivations,
    LayerActivations,
    OutputActivations,
    StageActivations,
)
from inspector.memory.closed.dsa import dsa_core_bytes
from inspector.memory.closed.recompute import mtp_recompute, recompute_buffer, recompute_plan

MASK = 1  # bytes per dropout-mask element (torch stores a bool)
FP32 = 4  # bytes per fp32 element (softmax statistics, logits of the loss)
TOKEN_ID = 8  # bytes per int64 token id
GDN_CHUNK = 64  # flash-linear-attention's chunk of the gated delta rule (world/ssm/fla_kernels.py)


def check_activation_inputs(
    dims: ModelDims, par: Layout, recompute: str, flash_attention: bool
) -> None:
    """Raise ConfigError for settings the formulas (or megatron) do not support."""
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(
            f"--recompute-granularity must be one of {', '.join(RECOMPUTE_MODES)}, "
            f"got {recompute!r}"
        )
    if par.cp > 1 and not flash_attention:
        raise ConfigError(
            f"--context-parallel-size {par.cp} needs flash or fused attention (Transformer "
            "Engine in bf16 or fp16 with --attention-backend auto, flash or fused): megatron runs "
            "context parallelism only through Transformer Engine's flash/fused attention"
        )
    if dims.num_experts is not None and par.tp > 1 and not par.sequence_parallel:
        raise ConfigError(
            f"--num-experts with --tp {par.tp} needs --sequence-parallel: megatron-core's "
            "MoELayer refuses to train MoE with tensor parallelism alone"
        )


def _hidden_mask(dims: ModelDims) -> int:
    """Return bytes per hidden dropout-mask element: none with --hidden-dropout 0 (Table 2's sbh
    terms go; torch's dropout with p = 0 returns its input and saves no mask)."""
    return MASK if dims.hidden_dropout else 0


def _tokens(dims: ModelDims, par: Layout, micro_batch_size: int) -> float:
    """Return s*b with s split by context parallelism."""
    return dims.seq_length / par.cp * micro_batch_size


def _attention(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return the attention block's bytes besides the scores (paper Section 4.1: 11sbh)."""
    h, a, g, d = dims.hidden_size, dims.num_attention_heads, dims.query_groups, dims.head_dim
    # Replicated across TP ranks unless sequence parallel: QKV input 2sbh, dropout mask sbh.
    outside = dims.activation_bytes * sb * h + _hidden_mask(dims) * sb * h
    # Split by t: Q and K (paper 4sbh), V (2sbh), projection input (2sbh), widened for GQA.
    inside = (
        dims.activation_bytes * sb * d * (a + g)
        + dims.activation_bytes * sb * d * g
        + dims.activation_bytes * sb * d * a
    )
    if dims.qk_layernorm:  # attention.py: q_layernorm(query), k_layernorm(key); each norm keeps
        inside += dims.activation_bytes * sb * d * (a + g)  # its input (TE rmsnorm.py 182, 202)
    return outside / par.sp_divisor + inside / par.tp


def _mla_attention(dims: ModelDims, par: Layout, sb: float, up_proj: bool = False) -> float:
    """Return multi-latent attention's bytes besides the scores (our extension, Section 4.1's method).

    Every tensor a backward GEMM or norm reads is counted once, in the paper's way:
      - the down projections' input (the layer norm's output, shared by both) 2sbh and the
        dropout mask sbh, whole on every TP rank unless sequence parallel (as for QKV);
      - the latents, whole on every TP rank (megatron-core's down projections are not split
        over heads): the up projections' inputs 2sb q_lora and 2sb kv_lora, and with
        --qk-layernorm the latent norms' inputs, as much again;
      - split by t: Q and K, n (c + r) wide each (the RoPE part is joined to every head), V n v
        wide, and the output projection's input n v wide.

    `up_proj` (--recompute-modules mla_up_proj; multi_latent_attention.py CheckpointWithoutOutput
    around `qkv_up_proj_and_rope_apply`, its output freed once core attention has run): Q, K
    and V go, and the checkpoint keeps its inputs instead of what the up projections saved: the
    RoPE key k_pos_emb, sb r, holds linear_kv_down_proj's whole output (kv_lora + r wide, a view
    of it) where the kv up projection kept its own kv_lora-wide copy; with sequence parallelism
    over t > 1 k_pos_emb is gathered to a tensor of its own (s b r) beside the local output.
    With --qk-layernorm (TE's LayerNormLinear up projections) the norms' inputs already held
    that output, and their outputs (the latents' width, on the rank's rows) go too.
    """
    n, b = dims.num_attention_heads, dims.activation_bytes
    c, r, v = dims.qk_head_dim, dims.qk_pos_emb_head_dim, dims.v_head_dim
    outside = b * sb * dims.hidden_size + MASK * sb * dims.hidden_size
    latent_width = (dims.q_lora_rank or 0) + dims.kv_lora_rank
    latents = b * sb * latent_width * (2 if dims.qk_layernorm else 1)
    inside = b * sb * n * (2 * (c + r) + 2 * v)
    if up_proj:
        inside = b * sb * n * v  # the output projection's input only
        gathered = par.sequence_parallel and par.tp > 1
        if dims.qk_layernorm:  # the norms' outputs go; their inputs held kv_down's output already
            latents -= b * sb * latent_width / par.sp_divisor
            latents += b * sb * r * gathered
        else:
            latents += b * sb * r * (1 + (1 / par.tp if gathered else 0))
    return outside / par.sp_divisor + latents + inside / par.tp


def _core_attention(dims: ModelDims, par: Layout, sb: float, flash_attention: bool) -> float:
    """Return the score terms: 5as^2b/t (paper Section 4.1), or flash attention's fp32 stats."""
    a = dims.num_attention_heads
    if flash_attention:
        return FP32 * a * sb / par.tp  # softmax log-sum-exp, [b, a/t, s] in fp32
    # Softmax output 2as^2b, dropout mask as^2b, dropout output 2as^2b (cp == 1 here); with
    # --attention-dropout 0 torch's dropout returns its input: no mask, no second copy.
    per_score = dims.activation_bytes + (MASK + dims.activation_bytes) * dims.attention_dropout
    return per_score * a * sb * dims.seq_length / par.tp


def _dense_mlp(dims: ModelDims, par: Layout, sb: float, ffn: int) -> float:
    """Return a dense MLP's bytes (paper Section 4.1: 19sbh when f = 4h)."""
    h = dims.hidden_size
    outside = dims.activation_bytes * sb * h + _hidden_mask(dims) * sb * h  # fc1 in 2sbh, mask sbh
    inside = dims.activation_bytes * sb * ffn * (dims.gated_multiplier + 1)  # GeLU in/out 8sbh+8sbh
    return outside / par.sp_divisor + inside / par.tp


def _mamba(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return a Mamba layer's bytes besides its norm's input, as megatron's MambaMixer keeps them
    (our extension; each tensor what the engine's stand-ins save, world/ssm/kernels.py):
      - in_proj's normed input 2sbh and its fp32 rstd 4sb (Transformer Engine's LayerNormLinear;
        the rows of this rank under sequence parallelism), the dropout mask after out_proj sbh;
      - split by t: in_proj's output zxbcdt, 2sb (2 d_inner + 2 G N + H) wide, saved whole by
        mamba_split_conv1d_scan_combined (ssd_combined.py 888) with the scan's ungated output
        out_x; the gated norm's input and output (layernorm_gated.py 360: x saved, and the
        output out_proj keeps), 2sb d_inner each; the gated norm's fp32 rstd per group 4sbG.
      - with context parallelism zxbcdt is saved after MambaContextParallel's all-to-all, its B
        and C repeated `group_repeat_count` times where a rank's groups are fewer than its tp x
        cp share (ssm/mamba_context_parallel.py `pre_conv_ssm`): 2sb 2GN (repeat - 1) more.
    Per-head fp32 vectors (A, D, dt_bias: a few hundred bytes) are left out, and with context
    parallelism the copies of this rank's slice of them and of the convolution's weight (a few
    KiB, `_slice_conv_param`)."""
    shape, b, h = dims.mamba, dims.activation_bytes, dims.hidden_size
    repeat = max(1, par.cp * par.tp // shape.groups)
    width = shape.in_width + 2 * shape.groups * shape.state * (repeat - 1)
    outside = b * sb * h + FP32 * sb + _hidden_mask(dims) * sb * h
    inside = b * sb * width + 3 * b * sb * shape.d_inner + FP32 * sb * shape.groups
    return outside / par.sp_divisor + inside / par.tp


def _gdn(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return a gated delta net layer's bytes besides its norm's input, as megatron's
    GatedDeltaNet and fla's kernels keep them (our extension; world/ssm/fla_kernels.py):
      - in_proj's normed input 2sbh and fp32 rstd 4sb, the dropout mask after out_proj sbh;
      - split by t: in_proj's output (q, k, v, z, beta, alpha) 2sb in_width (megatron-core
        0.18+; 0.16-0.17 copy q, k and v for the convolution and free it: 2sb conv_width); the causal
        convolution's input and output, 2sb conv_width each; the L2-normed q and k 2sb 2qk with
        their fp32 rstd per head; q and k made contiguous at the value heads 2sb 2 n_v d_k; v and
        the gate z 2sb v each; what chunk_gated_delta_rule saves besides them: the fp32 gate and
        its chunk cumsum 8sb n_v, beta 2sb n_v and A 2sb n_v 64 (fla's chunk); its output and the
        gated norm's output 2sb v each, the norm's fp32 rstd per value head.
    An estimate to within about 1% of the engine (the temporaries of the fused gating left out)."""
    g, b, h = dims.gdn_shape(), dims.activation_bytes, dims.hidden_size
    qk, v, nv = g.key_heads * g.key_dim, g.value_heads * g.value_dim, g.value_heads
    outside = b * sb * h + FP32 * sb + _hidden_mask(dims) * sb * h
    # megatron-core 0.16-0.17 copy q, k and v for the convolution and free in_proj's output
    projected = g.in_width if gdn_conv_keeps_projection() else g.conv_width
    halves = b * (projected + 2 * g.conv_width + 2 * qk + 2 * nv * g.key_dim + 4 * v + nv * GDN_CHUNK)
    stats = FP32 * 2 * g.key_heads + 2 * FP32 * nv + b * nv + FP32 * nv
    return outside / par.sp_divisor + sb * (halves + stats) / par.tp


def _moe_mlp(dims: ModelDims, par: Layout, sb: float) -> float:
    """Return an MoE MLP's bytes under balanced routing (our extension, see module docstring)."""
    h, e, k = dims.hidden_size, par.expert_tp, dims.moe_router_topk
    outside = (dims.activation_bytes + _hidden_mask(dims)) * sb * h  # router/shared input, mask
    copies = sb * k * e / par.tp  # token copies reaching one rank's experts
    routed = (
        dims.activation_bytes * copies * h
        + (
            dims.activation_bytes * copies * dims.expert_ffn * dims.gated_multiplier
            + dims.activation_bytes * copies * dims.expert_ffn
        )
        / e
    )
    shared = (
        dims.activation_bytes * sb * dims.shared_expert_ffn * (dims.gated_multiplier + 1) / par.tp
    )
    return outside / par.sp_divisor + routed + shared


def layer_activations(
    dims: ModelDims,
    par: Layout,
    layer: int,
    micro_batch_size: int,
    recompute: Recompute = "none",
    flash_attention: bool = False,
    modules: Sequence[str] = ("core_attn",),
) -> LayerActivations:
    """Return the bytes 0-based global `layer` keeps per micro-batch on one rank.

    Args:
        dims: model dimensions (s, h, a, g, d, f, MoE sizes).
        par: tensor, context, expert sizes and sequence parallelism.
        layer: global layer index, which decides dense or MoE MLP.
        micro_batch_size: b.
        recompute: "none", "selective" (`modules`) or "full" (layer input only).
        flash_attention: the core attention never materialises the s x s scores.
        modules: --recompute-modules under selective recomputation, of which these formulas
            count core_attn (the score terms go), mlp (a dense layer's MLP keeps its input
            only: the terms split by t go), shared_experts (the shared expert's terms go) and
            mla_up_proj (Q, K and V go, `_mla_attention`);
            the callers refuse the others (tests/test_recompute_modules.py checks each saving
            against the engine's measured drop).
    """
    check_activation_inputs(dims, par, recompute, flash_attention)
    sb = _tokens(dims, par, micro_batch_size)
    if recompute == "full":  # paper Table 2, "full activation recomputation": 2sbh
        return LayerActivations(
            0, 0, 0, 0, dims.activation_bytes * sb * dims.hidden_size / par.sp_divisor
        )
    norms = 2 * dims.activation_bytes * sb * dims.hidden_size / par.sp_divisor  # two norm inputs, 4sbh
    asked = modules if recompute == "selective" else ()
    core = 0.0 if "core_attn" in asked else _core_attention(dims, par, sb, flash_attention)
    if dims.experimental_attention_variant == "dsa" and core:  # DSA's (closed/dsa.py)
        core = dsa_core_bytes(dims, par, sb)
    if dims.layer_symbols:  # a hybrid stack's layer: one module, one norm
        symbol = dims.layer_symbols[layer]
        parts = {"*": (_attention(dims, par, sb), core, 0.0), "M": (0.0, 0.0, _mamba(dims, par, sb)),
                 "D": (_mla_attention(dims, par, sb, "mla_up_proj" in asked), core, 0.0),
                 "-": (0.0, 0.0, _dense_mlp(dims, par, sb, 0 if "mlp" in asked else dims.ffn)),
                 "E": (0.0, 0.0, _moe_mlp(dims, par, sb)),
                 "G": (0.0, 0.0, _gdn(dims, par, sb))}[symbol]  # fmt: skip
        return LayerActivations(norms / 2, *parts, 0.0)
    if dims.is_moe_layer(layer):
        mlp = _moe_mlp(dims, par, sb)
        if "shared_experts" in asked:  # moe_layer.py: checkpoint(self.shared_experts)
            mlp -= _dense_mlp(dims, par, sb, dims.shared_expert_ffn) - _dense_mlp(dims, par, sb, 0)
    else:
        # transformer_layer.py _forward_mlp: tensor_parallel.checkpoint(self.mlp) keeps fc1's input
        ffn = 0 if "mlp" in asked else dims.ffn
        mlp = _dense_mlp(dims, par, sb, ffn)
    attention = (
        _mla_attention(dims, par, sb, "mla_up_proj" in asked) if dims.multi_latent_attention
        else None
    )
    if dims.is_gdn_layer(layer):  # a gated delta net in place of attention: no core attention
        attention, core = _gdn(dims, par, sb), 0.0
    return LayerActivations(
        norms, attention if attention is not None else _attention(dims, par, sb), core, mlp, 0.0
    )


def mtp_activations(
    dims: ModelDims,
    par: Layout,
    micro_batch_size: int,
    recompute: Recompute = "none",
    flash_attention: bool = False,
) -> float:
    """Return the bytes the multi-token-prediction layers keep per micro-batch (our extension).

    Per depth (megatron-core `MultiTokenPredictionLayer`): the shifted tokens' ids 8sb and
    embedding dropout mask sbh, the inputs of `enorm` and `hnorm` 2sbh each, `eh_proj`'s input
    4sbh (the two normed halves side by side), a transformer layer like the decoder's last
    (`layer_activations`, the same recomputation), the final norm's and the output layer's inputs
    2sbh each and the loss's fp32 logits 4sbv/t (paper Section 4.4); the sbh terms split by t
    under sequence parallelism. A hybrid model's depth holds the MTP pattern's layers instead of
    the transformer layer (HybridModel's MultiTokenPredictionBlock).
    """
    if not dims.mtp_num_layers:
        return 0.0
    sb = _tokens(dims, par, micro_batch_size)
    h = dims.hidden_size
    hidden = (MASK + 2 * dims.activation_bytes * 5) * sb * h / par.sp_divisor
    if dims.mtp_symbols:  # a hybrid model's depth: the layers of the pattern after `/`
        inner = replace(dims, layer_symbols=dims.mtp_symbols)
        layer = sum(layer_activations(inner, par, k, micro_batch_size, recompute, flash_attention).total
                    for k in range(len(dims.mtp_symbols)))  # fmt: skip
    else:
        layer = layer_activations(
            dims, par, dims.num_layers - 1, micro_batch_size, recompute, flash_attention
        ).total
    depth = TOKEN_ID * sb + hidden + layer + FP32 * sb * dims.vocab_size / par.tp
    return dims.mtp_num_layers * depth


def embedding_activations(
    dims: ModelDims, par: Layout, micro_batch_size: int
) -> EmbeddingActivations:
    """Return the first stage's embedding bytes per micro-batch.

    Dropout mask: paper Section 4.4 (sbh, /t with sequence parallelism, where megatron scatters
    the embeddings before dropout). Token ids: Megatron-LM's estimator counts 8sb ("input to
    embedding"); it divides them by t with everything else, but every TP rank holds all ids, so
    here they are not divided.
    """
    sb = _tokens(dims, par, micro_batch_size)
    return EmbeddingActivations(
        token_ids=TOKEN_ID * sb,
        dropout_mask=_hidden_mask(dims) * sb * dims.hidden_size / par.sp_divisor,
    )


def output_activations(
    dims: ModelDims, par: Layout, micro_batch_size: int
) -> OutputActivations:
    """Return the last stage's final norm, output layer and loss bytes per micro-batch.

    Paper Section 4.4: final norm input 2sbh/t, output layer input 2sbh/t and the loss's fp32
    logits 4sbv/t, together 4sbh/t (1 + v/h) with sequence parallelism; without it the two
    2sbh terms are held whole on every TP rank.
    """
    sb = _tokens(dims, par, micro_batch_size)
    hidden = dims.activation_bytes * sb * dims.hidden_size / par.sp_divisor
    return OutputActivations(hidden, hidden, FP32 * sb * dims.vocab_size / par.tp)


def loss_logits(dims: ModelDims, par: Layout, micro_batch_size: int) -> float:
    """Return the last stage's 16-bit logits [s, b, v/t], alive beside the loss's fp32 copy
    while the loss runs: megatron-core cross_entropy.py `calculate_logits_max` makes the copy
    (`vocab_parallel_logits.float()`) while GPTModel still holds the output layer's output."""
    return dims.activation_bytes * _tokens(dims, par, micro_batch_size) * dims.vocab_size / par.tp


def stage_activations(
    dims: ModelDims,
    par: Layout,
    stage: int,
    chunk_layers: Sequence[Sequence[int]],
    micro_batch_size: int,
    num_microbatches: int,
    recompute: Recompute = "none",
    flash_attention: bool = False,
    group_size: int | None = None,
    mtp_chunks: Sequence[int] = (),
    recompute_method: str = "uniform",
    recompute_num_layers: int = 1,
    extra: int = 0,
) -> StageActivations:
    """Return the peak activation bytes of pipeline `stage` on one rank.

    `chunk_layers` holds the 0-based global layers of each of the stage's virtual chunks as
    megatron placed them, `mtp_chunks` the multi-token-prediction layers per chunk (counted with
    the output side, `mtp_activations`); b and m are `micro_batch_size` and `num_microbatches`;
    `group_size` is `--microbatch-group-size-per-virtual-pipeline-stage` (default p); recompute
    and flash attention as in `layer_activations`, full recomputation's groups `recompute_plan`'s.
    The peak is the schedule point (`live_microbatches`) with the most bytes, each chunk adding
    its live micro-batches times its bytes per micro-batch; stage 0's first chunk adds the
    embedding, the last stage's last chunk the output layer and loss.
    """
    _check_chunks(par, stage, chunk_layers)
    plan = recompute_plan(stage, chunk_layers, recompute, recompute_method, recompute_num_layers)
    b, flash = micro_batch_size, flash_attention
    layers, embedding, output = _chunk_bytes(dims, par, stage, chunk_layers, b, plan, flash)
    if any(mtp_chunks):
        mtp = mtp_activations(dims, par, b, mtp_recompute(recompute, recompute_method), flash)
        output = tuple(x + (mtp if n else 0.0) for x, n in zip(output, mtp_chunks, strict=True))
    points = live_microbatches(stage, par.pp, num_microbatches, par.chunks, group_size, extra)
    peak = max(points, key=lambda pt: sum(_weigh(pt, x) for x in (layers, embedding, output)))
    rebuilt = recompute_buffer(plan, lambda i: layer_activations(dims, par, i, b, "none", flash).total)
    layer_bytes, embedding_bytes, output_bytes = (_weigh(peak, x) for x in (layers, embedding, output))
    logits = loss_logits(dims, par, b) if stage == par.pp - 1 else 0.0
    return StageActivations(layer_bytes, embedding_bytes, output_bytes, rebuilt, in_flight=peak,
                            loss_logits=logits)


def _check_chunks(par: Layout, stage: int, chunk_layers: Sequence[Sequence[int]]) -> None:
    """Raise ConfigError unless the stage has one layer list per virtual chunk."""
    if len(chunk_layers) != par.chunks:
        raise ConfigError(
            f"stage {stage} has {len(chunk_layers)} chunks but --num-virtual-stages-per-"
            f"pipeline-rank is {par.chunks}"
        )


def _weigh(point: tuple[int, ...], per_chunk: Sequence[float]) -> float:
    """Return the bytes of `point`'s live micro-batches, `per_chunk` bytes each."""
    return sum(n * x for n, x in zip(point, per_chunk, strict=True))


def _chunk_bytes(
    dims: ModelDims,
    par: Layout,
    stage: int,
    chunk_layers: Sequence[Sequence[int]],
    micro_batch_size: int,
    plan: list[list[tuple[Sequence[int], Recompute]]],
    flash_attention: bool,
) -> tuple[list[float], tuple[float, ...], tuple[float, ...]]:
    """Return per-chunk bytes of one micro-batch: layers, embedding, output side."""
    layers = [
        sum(
            layer_activations(dims, par, group[0], micro_batch_size, mode, flash_attention).total
            if mode == "full"  # a checkpointed group keeps its first layer's input only
            else sum(
                layer_activations(dims, par, i, micro_batch_size, mode, flash_attention).total
                for i in group
            )
            for group, mode in chunk
        )
        for chunk in plan
    ]
    zeros = [0.0] * par.chunks
    embedding, output = list(zeros), list(zeros)
    if stage == 0:
        embedding[0] = embedding_activations(dims, par, micro_batch_size).total
    if stage == par.pp - 1:
        output[-1] = output_activations(dims, par, micro_batch_size).total
    return layers, tuple(embedding), tuple(output)
