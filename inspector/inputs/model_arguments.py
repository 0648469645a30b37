"""The Megatron-LM arguments of the model's architecture that this tool models, and the record of
one argument (its name, type, help and group); inspector.inputs.arguments adds the layout and
training groups and holds the whole table.

Names are Megatron-LM's own (`megatron/training/arguments.py`), with underscores; on the command line
and in launch scripts they are spelled with dashes (`--num-layers`). A `bool` argument is a
store_true flag, as in Megatron-LM. This module imports nothing heavy: `--help` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArgSpec:
    """One Megatron-LM argument: its name, value type and help text."""

    name: str
    type: type
    help: str
    group: str  # "model" (architecture), "layout" (parallelism, optimizer sharding), "training"
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # extra spellings on our command line, e.g. "--tp"
    # a `--no-` spelling on our command line: False, as a config file's `false` (what `plan`
    # keeps off instead of searching; Megatron-LM's own default when the flag is absent)
    negatable: bool = False
    many: bool = False  # nargs='*' in Megatron-LM: a script's following words are its values

    @property
    def flag(self) -> str:
        """Return the command-line spelling, e.g. `--num-layers`."""
        return "--" + self.name.replace("_", "-")


def _model(name: str, type_: type, help_: str, **kw: object) -> ArgSpec:
    return ArgSpec(name, type_, help_, "model", **kw)  # type: ignore[arg-type]


MODEL_ARGUMENTS: tuple[ArgSpec, ...] = (
    # Architecture.
    _model("num_layers", int, "Number of transformer layers."),
    _model("hidden_size", int, "Transformer hidden size."),
    _model(
        "ffn_hidden_size", int, "MLP hidden size (default 4*hidden, or Megatron-LM's SwiGLU rule)."
    ),
    _model("num_attention_heads", int, "Number of attention heads."),
    _model("group_query_attention", bool, "Use grouped-query attention."),
    _model("num_query_groups", int, "Number of key/value groups with --group-query-attention."),
    _model("kv_channels", int, "Projection size per head (default hidden / heads)."),
    _model("seq_length", int, "Sequence length."),
    _model("max_position_embeddings", int, "Positions in the learned position table."),
    _model("vocab_size", int, "Tokenizer vocabulary size, before padding."),
    _model(
        "make_vocab_size_divisible_by",
        int,
        "Pad the vocabulary to a multiple of this times the tensor-parallel size.",
    ),
    _model(
        "padded_vocab_size",
        int,
        "Embedding rows as given, whatever the tokenizer (Megatron-LM 0.14+; no padding).",
    ),
    _model("normalization", str, "Norm type.", choices=("LayerNorm", "RMSNorm")),
    _model("swiglu", bool, "Use a SwiGLU MLP (gated, two input projections)."),
    _model(
        "position_embedding_type",
        str,
        "Position embedding type (yarn: Megatron-LM 0.19+'s YaRN RoPE outside MLA, gpt-oss).",
        choices=("learned_absolute", "rope", "yarn", "none"),
    ),
    _model("untie_embeddings_and_output_weights", bool, "Give the output layer its own weight."),
    _model("disable_bias_linear", bool, "No biases in linear layers."),
    _model("add_qkv_bias", bool, "Bias in the QKV projection even with --disable-bias-linear."),
    _model("qk_layernorm", bool, "Normalise queries and keys per head."),
    _model("bf16", bool, "Parameters in bfloat16."),
    _model("fp16", bool, "Parameters in float16."),
    _model(
        "fp8_format",
        str,
        "FP8 through Transformer Engine: e4m3 everywhere, or hybrid (e5m2 gradients).",
        choices=("e4m3", "hybrid"),
    ),
    _model(
        "fp8_recipe",
        str,
        "FP8 scaling recipe with --fp8-format (default delayed).",
        choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
    ),
    _model("fp8_amax_history_len", int, "Delayed scaling's amax history per module (default 1)."),
    _model(
        "fp8_param_gather",
        bool,
        "Keep Transformer Engine's weights in fp8 and all-gather them in fp8 (needs "
        "--use-distributed-optimizer).",
    ),
    _model("fp8_dot_product_attention", bool, "Attention in fp8 (Transformer Engine's fused "
           "attention, delayed or tensorwise recipes; mxfp8 from megatron-core 0.18)."),  # fmt: skip
    _model("fp4_format", str, "NVFP4 through Transformer Engine (Blackwell).", choices=("e2m1",)),
    _model("fp4_recipe", str, "FP4 recipe with --fp4-format (default nvfp4).",
           choices=("nvfp4", "custom")),  # fmt: skip
    _model("fp4_param_gather", bool, "Keep Transformer Engine's weights in NVFP4 and all-gather "
           "them packed (needs --use-distributed-optimizer; megatron-core 0.18+)."),  # fmt: skip
    _model("first_last_layers_bf16", bool, "Keep the first and last layers in bf16 under "
           "--fp8-format or --fp4-format."),  # fmt: skip
    _model("num_layers_at_start_in_bf16", int, "Layers kept in bf16 at the start (default 1)."),
    _model("num_layers_at_end_in_bf16", int, "Layers kept in bf16 at the end (default 1)."),
    _model(
        "reuse_grad_buf_for_mxfp8_param_ag",
        bool,
        "With --fp8-recipe mxfp8 --fp8-param-gather: all-gather the weights through the grad "
        "buffer (no param buffer).",
    ),
    _model("num_experts", int, "Number of MoE experts per layer (MoE on every layer)."),
    _model("moe_router_topk", int, "Experts each token is routed to."),
    _model("moe_ffn_hidden_size", int, "Hidden size of each expert's MLP."),
    _model("moe_shared_expert_intermediate_size", int, "Hidden size of the shared experts."),
    _model(
        "moe_shared_expert_gate",
        bool,
        "Gate the shared experts' output (a learned [1, hidden] weight).",
    ),
    _model("moe_latent_size", int, "LatentMoE: the routed experts work on this width, between a "
           "projection down from the hidden size and one back up (megatron-core 0.16+)."),  # fmt: skip
    _model("moe_grouped_gemm", bool, "Experts as one grouped GEMM (GroupedMLP)."),
    _model("multi_latent_attention", bool, "Multi-latent attention (DeepSeek-V2/V3 style)."),
    _model(
        "transformer_impl",
        str,
        "Layer implementation.",
        choices=("local", "transformer_engine"),
    ),
    # Multi-latent attention, multi-token prediction, mixed dense/MoE layers (DeepSeek, Qwen3).
    _model("q_lora_rank", int, "MLA: rank of the query's low-rank projection (none: full)."),
    _model("kv_lora_rank", int, "MLA: rank of the key/value low-rank projection (default 32)."),
    _model("qk_head_dim", int, "MLA: query/key head size without RoPE (default 128)."),
    _model("qk_pos_emb_head_dim", int, "MLA: query/key RoPE head size (default 64)."),
    _model("v_head_dim", int, "MLA: value head size (default 128)."),
    _model("rotary_scaling_factor", float, "MLA or yarn: RoPE scaling factor (default 1.0)."),
    _model("rope_type", str, "RoPE type (MLA's default: yarn).", choices=("rope", "yarn")),
    _model("mscale", float, "MLA or yarn: YaRN mscale (default 1.0)."),
    _model("mscale_all_dim", float, "MLA or yarn: YaRN mscale, all dimensions (default 0.0)."),
    _model("mtp_num_layers", int, "Multi-token prediction layers (on the last stage)."),
    _model("mtp_use_repeated_layer", bool, "One MTP layer run --mtp-num-layers times "
           "(megatron-core 0.17+)."),  # fmt: skip
    _model(
        "moe_layer_freq",
        str,
        "MoE layer pattern: N (every N-th layer is MoE) or a list such as ([0]*3+[1]*58).",
    ),
    _model(
        "moe_router_score_function",
        str,
        "Router score function.",
        choices=("softmax", "sigmoid"),
    ),
    _model("moe_permute_fusion", bool, "TE's fused MoE permutation (megatron-core's `fused=True` "
           "permute, unpermute and chunk sort)."),
    _model("moe_router_dtype", str, "The router's logits and routing in fp32 or fp64 (default: the "
           "model's dtype).", choices=("fp32", "fp64")),  # fmt: skip
    _model(
        "moe_router_enable_expert_bias",
        bool,
        "Router expert bias (a buffer for aux-loss-free balancing, not a parameter).",
    ),
    _model(
        "moe_router_load_balancing_type",
        str,
        "Router load balancing (routing is counted balanced; sinkhorn lets --moe-router-topk be 1).",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
    ),
    _model(
        "moe_router_pre_softmax",
        bool,
        "Router softmax before the top-k (megatron-core needs it, or sinkhorn, for top-1).",
    ),
    _model(
        "moe_router_num_groups",
        int,
        "Node-limited routing: experts in this many equal groups of consecutive experts.",
    ),
    _model(
        "moe_router_group_topk",
        int,
        "Node-limited routing: groups each token picks its top-k experts from (needs the above).",
    ),
    # Hybrid models (Megatron-LM's pretrain_mamba.py: megatron-core's MambaModel / HybridModel).
    _model(
        "hybrid_override_pattern",
        str,
        "Hybrid layer pattern, one symbol a layer: M Mamba, * attention, - MLP, E MoE.",
    ),
    _model(
        "hybrid_layer_pattern",
        str,
        "Megatron-LM 0.17+'s hybrid pattern (megatron-core 0.17+: '|' ends a pipeline stage).",
    ),
    _model("hybrid_attention_ratio", float, "Hybrid: share of attention layers (no pattern)."),
    _model("hybrid_mlp_ratio", float, "Hybrid: share of MLP layers (no pattern)."),
    _model("is_hybrid_model", bool, "A hybrid (Mamba) model, built as pretrain_mamba.py builds it."),
    _model("mamba_state_dim", int, "Mamba: SSM state size (default 128)."),
    _model("mamba_head_dim", int, "Mamba: head size (default 64)."),
    _model("mamba_num_groups", int, "Mamba: groups of B/C projections (default 8)."),
    _model("mamba_num_heads", int, "Mamba: heads (default 2 x hidden / head size)."),
    # Gated delta net (TransformerConfig fields in Megatron-LM; --linear-attention-freq its own).
    _model("linear_attention_freq", str, "GDN: every N-th layer attention, or a 1/0 list (1: GDN)."),
    _model("linear_conv_kernel_dim", int, "GDN: causal convolution width (default 4)."),
    _model("linear_key_head_dim", int, "GDN: query and key head size (default 128)."),
    _model("linear_value_head_dim", int, "GDN: value and gate head size (default 128)."),
    _model("linear_num_key_heads", int, "GDN: query and key heads (default 16)."),
    _model("linear_num_value_heads", int, "GDN: value and gate heads (default 32)."),
    _model("attention_output_gate", bool, "Gate the attention output per head (Qwen3-Next)."),
    # gpt-oss's layers (TransformerConfig fields in Megatron-LM, --quick-geglu its own flag).
    _model("quick_geglu", bool, "A gated MLP with quick-GELU (gpt-oss), in place of --swiglu."),
    _model("glu_linear_offset", float, "Offset added to the gated MLP's linear half (gpt-oss: 1)."),
    _model(
        "activation_func_clamp_value", float, "Clamp of the gated MLP's inputs (gpt-oss: 7)."
    ),
    _model(
        "softmax_type",
        str,
        "Attention softmax: learnable adds a learned offset per head (gpt-oss's attention sinks).",
        choices=("vanilla", "off-by-one", "learnable"),
    ),
    _model("window_size", str, "Sliding-window attention (left,right), e.g. 127,0."),
    _model(
        "window_attn_skip_freq",
        str,
        "With --window-size: every N-th layer full attention, or a 1/0 list per layer (1: window).",
    ),
    # DeepSeek-V3.2's sparse attention (TransformerConfig fields; megatron-core 0.18+ builds it).
    _model("experimental_attention_variant", str, "dsa: DeepSeek sparse attention on MLA layers "
           "(megatron-core 0.18+); gated_delta_net: GPTModel's gated delta net (linear attention) "
           "layers (0.16+).", choices=("dsa", "gated_delta_net")),  # fmt: skip
    _model("dsa_indexer_n_heads", int, "DSA: heads of the lightning indexer."),
    _model("dsa_indexer_head_dim", int, "DSA: head size of the lightning indexer."),
    _model("dsa_indexer_topk", int, "DSA: keys each query attends to."),
    _model("dsa_indexer_loss_coeff", float, "DSA: weight of the indexer's KL loss."),
    _model("dsa_indexer_use_sparse_loss", bool, "DSA: the indexer loss over the top-k keys only."),
    # megatron-core 0.19's top-k shared across layers (GLM-5.2's IndexShare): a layer whose number
    # is past the offset by no multiple of the frequency has no indexer and reuses the top-k of
    # the computing layer before it (experimental_attention_variant/dsa.py is_dsa_skip_topk_layer)
    _model("dsa_indexer_topk_freq", int, "DSA: one indexer (its top-k computed) every N layers; "
           "the layers between reuse it (megatron-core 0.19+)."),  # fmt: skip
    _model("dsa_indexer_skip_topk_offset", int, "DSA: the layers up to this number all compute "
           "their top-k; sharing starts after it (megatron-core 0.19+)."),  # fmt: skip
)
