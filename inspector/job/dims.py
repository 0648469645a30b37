"""The inputs of the closed-form estimates: model dimensions, parallel sizes, pipeline schedule.

Activation memory (activations.py), FLOPs (flops.py) and the attention walkthrough
(walkthrough.py) are pure functions over the two frozen dataclasses defined here. They are the
only numbers in this tool that do not come from megatron-core itself, because megatron computes
them only on a GPU; each formula cites its source next to the code. The pipeline schedule
(micro-batches in flight per stage) is replayed here from megatron-core's own rules.

Symbols used in every docstring and comment of those modules (the paper's own, Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198):
  s  sequence length            b  micro-batch size          h  hidden size
  a  attention heads            g  key/value groups (GQA)    d  channels per head (kv_channels)
  f  MLP hidden size            v  padded vocabulary size    L  transformer layers
  t  tensor-parallel size       p  pipeline-parallel size    m  micro-batches per iteration
  c  context-parallel size      k  experts per token (top-k)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.job.checks import check_at_least_one, check_heads, check_query_groups
from inspector.job.gdn import GdnShape
from inspector.job.hash_once import hash_once
from inspector.job.packing import attention_squares


@hash_once  # a planner's cache keys hold it: hashed once per object
@dataclass(frozen=True)
class ModelDims:
    """The shape of a GPT model as Megatron-LM's arguments describe it.

    Optional fields take Megatron-LM's defaults (`megatron/training/arguments.py`): f = 4h,
    g = a (no GQA), d = h / a, expert MLP size = f, no shared expert, every layer MoE when
    `num_experts` is set (`--moe-layer-freq 1`), 16-bit activations (the paper's mixed precision).
    `vocab_size` must already be padded.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_latent_size: int | None = None  # LatentMoE: the routed experts' width (moe_layer.py)
    moe_layer_freq: int | tuple[int, ...] = 1
    # node-limited routing: a token's top-k among the experts of its top group_topk of num_groups
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    activation_bytes: int = 2  # bytes per activation element: 2 in bf16/fp16, 4 in fp32
    # Multi-latent attention (Megatron-LM's MLA arguments) and multi-token prediction.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None: queries projected directly, without a latent
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int = 0
    qk_layernorm: bool = False  # MLA: the two latent norms; otherwise the per-head Q and K norms
    attention_dropout: bool = True  # --attention-dropout > 0: its mask and output are stored
    hidden_dropout: bool = True  # --hidden-dropout > 0: masks after attention, MLP, embedding
    # What the step-time model's kernels depend on (formulas/ops.py):
    rotary: bool = False  # rotary embedding on Q and K (--position-embedding-type rope, MLA)
    flash_attention: bool = False  # flash attention, else megatron's unfused DotProductAttention
    fused_kernels: bool = True  # megatron's fused scale-mask-softmax (apex or Transformer Engine)
    grad_accumulation_fusion: bool = True  # off: --no-gradient-accumulation-fusion (wgrad_fused)
    deterministic: bool = False  # --deterministic-mode: its attention backward (determinism.py)
    te_attention: bool = False  # core attention is Transformer Engine's (the TE spec)
    tp_comm_overlap: bool = False  # --tp-comm-overlap: TE's userbuffers (plan/userbuffers.py)
    rope_fusion: bool = True  # RoPE in one fused kernel (TransformerConfig.apply_rope_fusion)
    fp8: str | None = None  # --fp8-format: Transformer Engine's linears multiply in fp8
    fp8_recipe: str = "delayed"  # --fp8-recipe (TransformerConfig's default): how TE scales
    moe_sorts_chunks: bool = False  # the all-to-all dispatcher sorts tokens by local expert
    # who pads fp8 experts' rows (formulas/fp8_ops.py): "" Transformer Engine (copies), "source"
    # the all-to-all's sender (--moe-router-padding-for-fp8), "destination" DeepEP's receiver
    # (the same flag) or HybridEP's dispatch kernel (under fp8 always)
    moe_row_padding: str = ""
    # linear biases (--disable-bias-linear, --add-qkv-bias: TransformerConfig's names) and
    # Megatron-LM's bias fusions (--no-bias-gelu-fusion / --no-bias-swiglu-fusion,
    # --no-bias-dropout-fusion), which decide the bias adds' kernels (formulas/ops.py)
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    bias_activation_fusion: bool = True
    bias_dropout_fusion: bool = True
    # A hybrid (Mamba) model as `plan` prices it (plan/price.py `job_dims`): each layer's pattern
    # symbol (M Mamba, * attention, - MLP, E MoE; "" for a GPT model) and MambaMixer's sizes
    # (job/hybrid_model.py MambaShape)
    layer_symbols: str = ""
    mamba: Any = None
    mtp_symbols: str = ""  # one MTP depth's layers (the pattern after `/`), as layer_symbols
    # gated delta net layers (--experimental-attention-variant gated_delta_net): which layers
    # (`linear_attention_freq`) and their sizes, TransformerConfig's defaults
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    attention_output_gate: bool = False  # a gate per query channel in the QKV projection
    document_length: int | None = None  # --sft: packed documents' length (job/packing.py)
    # DSA's indexer loss weight (--dsa-indexer-loss-coeff): above 0 it adds the loss's all-reduce
    dsa_indexer_loss_coeff: float | None = None
    # DSA's lightning indexer (--dsa-indexer-n-heads, -head-dim, -topk; None: no DSA layers)
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None

    @classmethod
    def from_fields(
        cls,
        fields: Mapping[str, Any],
        *,
        seq_length: int,
        vocab_size: int,
        attention_dropout: bool,
        hidden_dropout: bool,
        rotary: bool,
        flash_attention: bool,
        fused_kernels: bool,
        moe_sorts_chunks: bool = False,
        moe_row_padding: str = "",
        bias_fusions: tuple[bool, bool] = (True, True),
        document_length: int | None = None,
        grad_accumulation_fusion: bool = True,
        deterministic: bool = False,
        te_attention: bool = False,
        rope_fusion: bool = True,
        tp_comm_overlap: bool = False,
    ) -> ModelDims:
        """Return the dims of a model given as TransformerConfig fields (`transformer_fields`).

        Every field named here is taken by its name (two by Megatron-LM's argument name, which
        TransformerConfig renamed), so a model field is mapped once, in ModelConfig; what
        TransformerConfig does not hold (sequence, padded vocabulary, dropout, the kernels the
        step-time model prices: rotary embedding, flash attention, fused softmax, the bias
        fusions `bias_fusions` (activation, dropout-add)) comes from the job.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        values = {ARGUMENT_NAMES.get(name, name): value for name, value in fields.items()}
        return cls(
            **{name: value for name, value in values.items() if name in names},
            seq_length=seq_length,
            vocab_size=vocab_size,
            activation_bytes=2 if fields["bf16"] or fields["fp16"] else 4,
            attention_dropout=attention_dropout,
            hidden_dropout=hidden_dropout,
            rotary=rotary,
            flash_attention=flash_attention,
            fused_kernels=fused_kernels,
            moe_sorts_chunks=moe_sorts_chunks,
            moe_row_padding=moe_row_padding,
            bias_activation_fusion=bias_fusions[0],
            bias_dropout_fusion=bias_fusions[1],
            document_length=document_length,
            grad_accumulation_fusion=grad_accumulation_fusion,
            deterministic=deterministic,
            te_attention=te_attention,
            rope_fusion=rope_fusion,
            tp_comm_overlap=tp_comm_overlap,
        )

    @property
    def wgrad_fused(self) -> bool:
        """Return whether weight-gradient GEMMs accumulate into main_grad (no DDP hook add)."""
        return self.fused_kernels and self.grad_accumulation_fusion

    def mla_gathered(self, sequence_parallel: bool) -> tuple[int, ...]:
        """Return the widths multi-latent attention's tensor-parallel input collectives move in
        place of h: its duplicated down projections run on the sequence-parallel input, and its
        column-parallel up projections read q's latent (h without one) and kv's latent, with
        sequence parallelism gathered, with RoPE's shared key part gathered alone
        (multi_latent_attention.py `get_query_key_value_tensors`)."""
        widths = (self.q_lora_rank or self.hidden_size, self.kv_lora_rank)
        return (*widths, self.qk_pos_emb_head_dim) if sequence_parallel else widths

    def attention_squares(self) -> int:
        """Return what a sequence's causal attention costs in token pairs (times a half): s^2,
        or packed the sum of its documents' squares (job/packing.py)."""
        return attention_squares(self.seq_length, self.document_length)

    def __post_init__(self) -> None:
        """Reject dimensions that no formula can use (the checks config.py makes of a model)."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            check_at_least_one("--" + name.replace("_", "-"), getattr(self, name))
        check_query_groups(self.num_attention_heads, self.query_groups)
        check_heads(self.hidden_size, self.num_attention_heads, self.kv_channels)
        pattern = self.moe_layer_freq
        if isinstance(pattern, tuple) and len(pattern) != self.num_layers:
            raise ConfigError(
                f"--moe-layer-freq lists {len(pattern)} layers but --num-layers is "
                f"{self.num_layers}"
            )

    @property
    def ffn(self) -> int:
        """Return f, the dense MLP hidden size (Megatron-LM's default 4h)."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Return g, the number of key/value heads (a without GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Return d, the channels per attention head (Megatron-LM's default h / a)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn(self) -> int:
        """Return the routed experts' MLP hidden size (Megatron-LM falls back to f)."""
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def shared_expert_ffn(self) -> int:
        """Return the shared experts' total MLP hidden size (0 when there are none)."""
        return self.moe_shared_expert_intermediate_size or 0

    @property
    def gated_multiplier(self) -> int:
        """Return how many f-wide projections feed the MLP activation: 2 for SwiGLU, else 1."""
        return 2 if self.swiglu else 1

    def layer_kind(self, layer: int) -> bool | str:
        """Return what a layer's cost depends on: its pattern symbol in a hybrid model, else
        whether its MLP is MoE (`is_moe_layer`)."""
        if self.layer_symbols:
            return self.layer_symbols[layer]
        if self.experimental_attention_variant == "gated_delta_net":  # hybrid_model.gpt_kind
            return ("G" if self.is_gdn_layer(layer) else "*") + ("E" if self.is_moe_layer(layer) else "-")
        return self.is_moe_layer(layer)

    def gdn_shape(self) -> GdnShape:
        """Return the gated delta net's sizes (GatedDeltaNet `__init__`)."""
        return GdnShape(self.linear_num_key_heads, self.linear_num_value_heads,
                        self.linear_key_head_dim, self.linear_value_head_dim,
                        self.linear_conv_kernel_dim)  # fmt: skip

    def is_gdn_layer(self, layer: int) -> bool:
        """Return whether 0-based global `layer` is a gated delta net (Megatron-LM's
        `linear_attention_pattern`: an int N makes every N-th layer standard attention)."""
        freq = self.linear_attention_freq
        if self.experimental_attention_variant != "gated_delta_net" or freq is None:
            return False
        return bool(freq[layer]) if isinstance(freq, tuple) else (layer + 1) % freq != 0

    def is_moe_layer(self, layer: int) -> bool:
        """Return whether 0-based global `layer` has an MoE MLP.

        Megatron-LM's `--moe-layer-freq` rule (`num_floating_point_operations` in
        `megatron/training/training.py`): an int N makes layer i MoE when i % N == 0; a list gives
        one 0/1 per layer.
        """
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0


# TransformerConfig's names for the two fields ModelDims names as Megatron-LM's arguments.
ARGUMENT_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu"}


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Return m = G / (b * dp), Megatron-LM's micro-batches per iteration per pipeline."""
    per_step = micro_batch_size * dp
    if global_batch_size < 1 or micro_batch_size < 1 or global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {global_batch_size} is not divisible by "
            f"--micro-batch-size {micro_batch_size} x --dp {dp} "
            f"({global_batch_size} % {per_step} = {global_batch_size % per_step})"
        )
    return global_batch_size // per_step


def _schedule_table(num_microbatches: int, chunks: int, group_size: int) -> list[int]:
    """Return the model chunk of every forward step, in megatron's interleaved order.

    Reimplements `get_schedule_table` in megatron-core's `pipeline_parallel/schedules.py`:
    micro-batches go in groups of `group_size`, each group through chunk 0, then chunk 1, ...
    """
    order: list[int] = []
    for start in range(0, num_microbatches, group_size):
        width = min(group_size, num_microbatches - start)  # the last group takes the rest
        order.extend(chunk for chunk in range(chunks) for _ in range(width))
    return order


def _check_interleaved(pp: int, num_microbatches: int, group_size: int) -> None:
    """Raise ConfigError where megatron-core's interleaved schedule raises."""
    if not pp <= group_size <= num_microbatches:
        raise ConfigError(
            f"the interleaved schedule groups {group_size} micro-batches per virtual stage, "
            f"which must lie between --pp {pp} and the {num_microbatches} micro-batches per "
            "iteration (--global-batch-size / (--micro-batch-size x --dp))"
        )
    rest = num_microbatches % group_size
    if 0 < rest < pp:
        raise ConfigError(
            f"the interleaved schedule needs the {num_microbatches} micro-batches per iteration "
            f"to leave a remainder of 0 or at least --pp {pp} in groups of {group_size} "
            f"({num_microbatches} % {group_size} = {rest})"
        )


def warmup_steps(
    stage: int, pp: int, num_microbatches: int, chunks: int, group: int, extra: int = 0
) -> int:
    """Return megatron-core's warm-up forward steps for `stage`, before 1F1B starts.

    `get_pp_rank_microbatches` in `pipeline_parallel/schedules.py`: p - s - 1 without
    interleaving; 2 (p - s - 1) + (v - 1) * group with v chunks; `extra` more under the MoE
    all-to-all overlap (job/ep_overlap.py); at most m * v.
    """
    if chunks == 1:
        steps = pp - stage - 1
    else:
        steps = 2 * (pp - stage - 1) + (chunks - 1) * group
    return min(steps + extra, num_microbatches * chunks)


def live_microbatches(
    stage: int,
    pp: int,
    num_microbatches: int,
    chunks: int = 1,
    group_size: int | None = None,
    extra: int = 0,
) -> list[tuple[int, ...]]:
    """Return, after every forward step of `stage`, the micro-batches alive in each chunk
    (`extra` warm-up forwards: `warmup_steps`).

    Replays megatron-core's 1F1B schedule (`forward_backward_pipelining_without_interleaving`)
    or, with `chunks` > 1, its interleaved one (`forward_backward_pipelining_with_interleaving`,
    `microbatch_group_size_per_vp_stage` defaulting to p): warm-up forwards, then one forward
    and one backward per step, the backward of step k running chunk v - 1 - chunk(k). A
    micro-batch's activations live from its forward to its backward, so the peaks of memory are
    among the returned points.
    """
    if not 0 <= stage < pp:
        raise ConfigError(f"--stage {stage} is not a pipeline stage of --pp {pp}")
    if num_microbatches < 1:
        raise ConfigError(f"the number of micro-batches must be at least 1, got {num_microbatches}")
    group = group_size or pp
    if chunks > 1:
        _check_interleaved(pp, num_microbatches, group)
    warmup = warmup_steps(stage, pp, num_microbatches, chunks, group, extra)
    order = _schedule_table(_periods_kept(num_microbatches, chunks, group, warmup), chunks, group)
    live = [0] * chunks
    points: list[tuple[int, ...]] = []
    for step in range(len(order)):
        live[order[step]] += 1
        points.append(tuple(live))
        if step >= warmup:  # steady state: the backward of step - warmup follows
            live[chunks - 1 - order[step - warmup]] -= 1
    return points


def _periods_kept(num_microbatches: int, chunks: int, group: int, warmup: int) -> int:
    """Return the micro-batches whose replay passes through every point the whole one does.

    The order repeats with each full group (group x chunks forward steps), and a point depends
    only on the last warmup + 1 steps: groups past the few that cover such a window, the first
    and the last (partial) group add no new point, so a billion micro-batches replay as a few.
    The returned count keeps the remainder modulo `group` (the last group's width).
    """
    window = -(-(warmup + 1) // (group * chunks))
    keep = group * (window + 3)
    if num_microbatches <= keep:
        return num_microbatches
    return num_microbatches - group * ((num_microbatches - keep) // group)


def microbatches_in_flight(
    stage: int,
    pp: int,
    num_microbatches: int,
    chunks: int = 1,
    group_size: int | None = None,
    extra: int = 0,
) -> int:
    """Return the most micro-batch passes whose activations `stage` holds at once.

    1F1B: min(p - s, m). Interleaved: min(2 (p - s - 1) + (v - 1) * group + 1, m * v) chunk
    passes, each holding one chunk's layers; for stage 0 with group = p that is p (v + 1) - 1,
    i.e. L (1 + (p - 1) / (p v)) layers' worth, the paper's interleaving factor (Section 4.3)
    and Megatron-LM's `interleaved_schedule_memory_penalty`.
    """
    return max(
        sum(point)
        for point in live_microbatches(stage, pp, num_microbatches, chunks, group_size, extra)
    )


def schedule_passes(
    stage: int,
    pp: int,
    num_microbatches: int,
    chunks: int = 1,
    group_size: int | None = None,
    extra: int = 0,
) -> list[tuple[bool, int]]:
    """Return (forward?, chunk) for every pass `stage` runs in one iteration, in megatron's order.

    The same replay as `live_microbatches`: warm-up forwards, then a forward and the backward of
    the oldest micro-batch in flight per step, then the cool-down backwards.
    """
    group = group_size or pp
    if chunks > 1:
        _check_interleaved(pp, num_microbatches, group)
    order = _schedule_table(num_microbatches, chunks, group)
    warmup = warmup_steps(stage, pp, num_microbatches, chunks, group, extra)
    passes: list[tuple[bool, int]] = []
    for step, chunk in enumerate(order):
        passes.append((True, chunk))
        if step >= warmup:
            passes.append((False, chunks - 1 - order[step - warmup]))
    for step in range(max(len(order) - warmup, 0), len(order)):
        passes.append((False, chunks - 1 - order[step]))
    return passes
