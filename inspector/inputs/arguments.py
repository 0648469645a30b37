"""The Megatron-LM arguments this tool models: one table shared by the CLI, config files and scripts.

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


def _layout(name: str, type_: type, help_: str, **kw: object) -> ArgSpec:
    return ArgSpec(name, type_, help_, "layout", **kw)  # type: ignore[arg-type]


def _training(name: str, type_: type, help_: str, **kw: object) -> ArgSpec:
    return ArgSpec(name, type_, help_, "training", **kw)  # type: ignore[arg-type]


ARGUMENTS: tuple[ArgSpec, ...] = (
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
        "Embedding rows as given, whatever the tokenizer (Megatron-LM 0.18+; no padding).",
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
           "attention, delayed or tensorwise recipes)."),  # fmt: skip
    _model("fp4_format", str, "NVFP4 through Transformer Engine (Blackwell).", choices=("e2m1",)),
    _model("fp4_recipe", str, "FP4 recipe with --fp4-format (default nvfp4).",
           choices=("nvfp4", "custom")),  # fmt: skip
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
    # Parallel layout.
    _layout("tensor_model_parallel_size", int, "Tensor-parallel size.", aliases=("--tp",)),
    _layout("pipeline_model_parallel_size", int, "Pipeline-parallel size.", aliases=("--pp",)),
    _layout("data_parallel_size", int, "Data-parallel size.", aliases=("--dp",)),
    _layout("context_parallel_size", int, "Context-parallel size.", aliases=("--cp",)),
    _layout("expert_model_parallel_size", int, "Expert-parallel size.", aliases=("--ep",)),
    _layout("expert_tensor_parallel_size", int, "Tensor-parallel size inside each expert."),
    _layout(
        "num_layers_per_virtual_pipeline_stage",
        int,
        "Layers per virtual pipeline chunk (interleaved schedule).",
    ),
    _layout(
        "num_virtual_stages_per_pipeline_rank",
        int,
        "Virtual pipeline chunks per pipeline stage (interleaved schedule).",
    ),
    _layout("decoder_first_pipeline_num_layers", int, "Layers on the first pipeline stage."),
    _layout("decoder_last_pipeline_num_layers", int, "Layers on the last pipeline stage."),
    _layout(
        "account_for_embedding_in_pipeline_split",
        bool,
        "Count the embedding as one layer when splitting the pipeline.",
    ),
    _layout(
        "account_for_loss_in_pipeline_split",
        bool,
        "Count the loss as one layer when splitting the pipeline.",
    ),
    _layout(
        "pipeline_model_parallel_layout",
        str,
        'Megatron\'s layout string, e.g. "Et|tt|tt|ttL".',
    ),
    _layout(
        "sequence_parallel", bool, "Sequence parallelism (with tensor parallelism).",
        negatable=True,
    ),
    _layout(
        "use_tp_pp_dp_mapping", bool,
        "Megatron-LM's tp-pp-dp rank order (pipeline stages before data-parallel replicas).",
    ),
    _layout(
        "use_distributed_optimizer", bool, "Shard optimizer state over data-parallel ranks.",
        negatable=True,
    ),
    _layout(
        "num_distributed_optimizer_instances", int,
        "Distributed-optimizer instances: state sharded over dp / N ranks, all-reduced across them.",
    ),
    _layout(
        "use_megatron_fsdp", bool,
        "Megatron-FSDP: shard what --data-parallel-sharding-strategy names over data-parallel ranks.",
    ),
    _layout(
        "data_parallel_sharding_strategy", str,
        "What Megatron-FSDP shards (Megatron-LM's default: no_shard).",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
    ),
    _layout(
        "fsdp_double_buffer", bool,
        "Megatron-FSDP: keep two persistent all-gather/reduce-scatter buffers.",
    ),
    _training(
        "use_torch_fsdp2", bool, "PyTorch FSDP2: shard every parameter's rows over data-parallel ranks.",
    ),
    _layout(
        "ckpt_format", str, "Checkpoint format (Megatron-LM's default: torch_dist).",
        choices=("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"),
    ),
    _layout("overlap_grad_reduce", bool, "Overlap gradient reduction with backward (buckets)."),
    _layout("ddp_bucket_size", int, "Gradient bucket size in elements."),
    # Training (read by `memory` only; every command reads them from scripts without complaint).
    _training("micro_batch_size", int, "Sequences per micro-batch."),
    _training(
        "global_batch_size",
        int,
        "Sequences per iteration (default: micro x dp).",
    ),
    _training(
        "recompute_granularity",
        str,
        "Activation recomputation (none: keep everything).",
        choices=("none", "selective", "full"),
    ),
    _training(
        "use_flash_attn", bool, "Flash attention: no s x s score matrix is stored.",
        negatable=True,
    ),
    _training(
        "accumulate_allreduce_grads_in_fp32",
        bool,
        "Gradients in fp32 for fp16 models (bf16 models always have them).",
    ),
    # Megatron-LM's further training arguments that change what a GPU holds (docs/inputs.md, "Megatron-LM
    # arguments: modelled, refused, ignored"); the rest are classified in inspector/inputs/unmodelled.py.
    _training("recompute_activations", bool, "Megatron-LM's alias for --recompute-granularity selective."),
    _training(
        "recompute_method",
        str,
        "Full recomputation: uniform (groups of N layers) or block (first N layers of a chunk).",
        choices=("uniform", "block"),
    ),
    _training("recompute_num_layers", int, "N for --recompute-method (default 1 with full)."),
    _training("microbatch_group_size_per_virtual_pipeline_stage", int,
              "Micro-batches per group of the interleaved schedule (default --pp)."),
    _training(
        "recompute_modules",
        str,
        "Selective recomputation's modules (default core_attn): any of core_attn, mlp, moe, moe_act, "
        "layernorm, mla_up_proj, shared_experts (space- or comma-separated).",
        many=True,
    ),
    _training("moe_layer_recompute", bool, "Megatron-LM's alias for --recompute-modules ... moe."),
    _training(
        "attention_backend",
        str,
        "Megatron-LM's attention backend (auto: fused/flash under Transformer Engine in 16 bits).",
        choices=("auto", "flash", "fused", "unfused", "local"),
    ),
    _training(
        "cuda_graph_impl",
        str,
        "CUDA graphs: transformer_engine (per layer; `memory` counts their static inputs and "
        "memory pool), local (with --cuda-graph-scope full_iteration only) or none.",
        choices=("none", "local", "transformer_engine"),
    ),
    _training(
        "cuda_graph_warmup_steps",
        int,
        "Eager iterations before the graphs are captured (default 3); 0 captures them before the "
        "first optimizer step, before Adam's moments exist.",
    ),
    _training(
        "cuda_graph_scope",
        str,
        "What each layer's graph covers (default the whole layer): attn, mlp, moe_router, "
        "moe_preprocess, mamba (a hybrid's Mamba layers); full_iteration (with local): one graph "
        "of the whole forward and backward (moe is not modelled).",
        many=True,
    ),
    _training("sft", bool, "Packed sequences (Megatron-LM's SFT dataset): attention and RoPE per "
              "document, in Transformer Engine's thd format (--micro-batch-size 1)."),
    _training("packed_document_length", int, "With --sft: the documents' length in tokens, the rest "
              "one shorter (the tool's flag; default --seq-length: one document per sequence)."),
    _training("grad_reduce_in_bf16", bool, "bf16 models: gradients in bf16, not fp32."),
    # Megatron-LM's fusion switches (store_false flags): they change what the engine's run saves
    _training("no_bias_gelu_fusion", bool, "Bias and GeLU as separate kernels, not fused."),
    _training("no_bias_swiglu_fusion", bool, "Bias and SwiGLU as separate kernels, not fused."),
    _training("no_bias_dropout_fusion", bool, "Bias, dropout and residual add as separate kernels."),
    _training("no_rope_fusion", bool, "Unfused rotary embedding (Transformer Engine jobs)."),
    _training("no_masked_softmax_fusion", bool, "Unfused masked softmax (Transformer Engine jobs)."),
    _training(
        "no_gradient_accumulation_fusion", bool,
        "Weight gradients not accumulated in the GEMM (Transformer Engine jobs; FSDP2 needs it).",
    ),
    _training("attention_dropout", float, "Attention dropout (0: no mask stored; default 0.1)."),
    _training("hidden_dropout", float, "Hidden dropout (0: no masks stored; default 0.1)."),
    # Megatron-LM's choices (muon and dist_muon from 0.16, lion 0.17, soap and adaptive_muon 0.18):
    # adam, muon / dist_muon on megatron-core 0.16 and muon on 0.18-0.19 are modelled, the others
    # refused by name
    # (unmodelled.REFUSED_VALUES); a layout argument, as dist_muon decides who owns what (params)
    _layout("optimizer", str, "Optimizer: adam; muon, dist_muon (Muon on 2-D weights, Adam on the "
            "rest; dist_muon gives each whole matrix to one data-parallel rank).",
            choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon")),
    _training(
        "use_precision_aware_optimizer", bool,
        "Adam's state in Transformer Engine's FusedAdam in the dtypes below (distributed optimizer).",
    ),
    _training("main_grads_dtype", str, "With the precision-aware optimizer: gradients in bf16 or fp32.",
              choices=("fp32", "bf16")),
    _training("main_params_dtype", str, "With the precision-aware optimizer: master weights' dtype.",
              choices=("fp32", "fp16")),
    _training("exp_avg_dtype", str, "With the precision-aware optimizer: Adam's first moment.",
              choices=("fp32", "fp16", "bf16", "fp8")),
    _training("exp_avg_sq_dtype", str, "With the precision-aware optimizer: Adam's second moment.",
              choices=("fp32", "fp16", "bf16", "fp8")),
    _training("overlap_param_gather", bool, "Overlap the parameter all-gather (distributed optimizer)."),
    _layout("no_use_layer_wise_param_layout", bool, "megatron-core 0.18+: dist_muon's legacy "
              "layer-wise optimizer (whole matrices dealt over the ranks; no DDP layout)."),
    _training(
        "moe_token_dispatcher_type",
        str,
        "MoE token dispatcher (Megatron-LM's default: allgather; flex: DeepEP's or HybridEP's "
        "fused all-to-all, priced by `plan`).",
        choices=("allgather", "alltoall", "flex"),
    ),
    _training(
        "moe_flex_dispatcher_backend",
        str,
        "The flex dispatcher's kernels (megatron-core 0.16 and later; default deepep; `memory` "
        "counts each one's buffers outside PyTorch's allocator).",
        choices=("deepep", "hybridep"),
    ),
    _training("moe_enable_deepep", bool, "DeepEP for the flex dispatcher (older Megatron-LM's flag)."),
    _training(
        "moe_deepep_num_sms",
        int,
        "SMs DeepEP's kernels use (default 20; sizes its buffer; plan: overlapped compute loses them).",
    ),
    _training(
        "overlap_moe_expert_parallel_comm",
        bool,
        "Hide the MoE all-to-all behind another micro-batch's compute (megatron's combined 1F1B).",
    ),
    _training(
        "delay_wgrad_compute",
        bool,
        "With the all-to-all overlap: expert weight gradients after the dispatch backward starts.",
    ),
    _training(
        "cross_entropy_loss_fusion",
        bool,
        "megatron's fused cross entropy (torch.compile'd; its backward holds one more fp32 copy "
        "of the logits).",
    ),
    _training(
        "defer_embedding_wgrad_compute",
        bool,
        "With --pp: the output layer's weight gradients wait for the pipeline's drain, keeping "
        "each micro-batch's input and logits gradient until then.",
    ),
    _training(
        "wgrad_deferral_limit",
        int,
        "Micro-batches whose output-layer weight gradient is deferred (default 0: all).",
    ),
    _training(
        "tp_comm_overlap",
        bool,
        "Transformer Engine's userbuffers overlap tensor-parallel communication with GEMMs "
        "(their cuBLAS workspace: 3 more; the buffers are outside PyTorch's allocator).",
    ),
    _training(
        "moe_expert_capacity_factor",
        float,
        "MoE expert capacity: each expert keeps at most ceil(tokens x topk / experts x factor).",
    ),
    _training(
        "moe_router_padding_for_fp8",
        bool,
        "With fp8: the dispatcher pads each expert's token count to 16 (mxfp8: 32) rows, so "
        "Transformer Engine copies no padding (alltoall or flex dispatcher).",
    ),
    _training(
        "moe_router_padding_for_quantization",
        bool,
        "Megatron-LM 0.16's name for --moe-router-padding-for-fp8.",
    ),
    _training(
        "moe_pad_expert_input_to_capacity",
        bool,
        "Pad every expert's input to its capacity (needs --moe-expert-capacity-factor).",
    ),
)

GROUPS = ("model", "layout", "training")

BY_NAME: dict[str, ArgSpec] = {spec.name: spec for spec in ARGUMENTS}
