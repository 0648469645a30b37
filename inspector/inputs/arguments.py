"""The Megatron-LM arguments this tool models: one table shared by the CLI, config files and scripts.

The architecture's arguments (and ArgSpec, the record of one) live in
inspector.inputs.model_arguments; the parallel layout's and training's are here. Names are
Megatron-LM's own, with underscores (`--num-layers` on the command line). This module imports
nothing heavy: `--help` reads it.
"""

from __future__ import annotations

from inspector.inputs.model_arguments import MODEL_ARGUMENTS, ArgSpec


def _layout(name: str, type_: type, help_: str, **kw: object) -> ArgSpec:
    return ArgSpec(name, type_, help_, "layout", **kw)  # type: ignore[arg-type]


def _training(name: str, type_: type, help_: str, **kw: object) -> ArgSpec:
    return ArgSpec(name, type_, help_, "training", **kw)  # type: ignore[arg-type]


_KV = "the GRPO rollout engine's KV cache (train_rl.py --perform-rl-step)"
# the rollout engine's context, as Megatron-LM sizes it (job/rollout.py): name -> (type, what)
_CONTEXT_SIZES: dict[str, tuple[type, str]] = {
    "inference_dynamic_batching_buffer_size_gb": (float, "GiB of blocks (default 40)"),
    "inference_dynamic_batching_paused_buffer_size_gb": (
        float, "more GiB of blocks with unified memory level 1 (default none)"),
    "inference_dynamic_batching_block_size": (int, "tokens a block holds (default 256)"),
    "inference_max_seq_length": (int, "longest rollout: the block table's width (default 2560)"),
    "inference_dynamic_batching_max_requests": (int, "requests tracked (default: one a block)"),
    "inference_dynamic_batching_max_tokens": (int, "tokens a step tracks (default 16384)"),
    "inference_dynamic_batching_unified_memory_level": (
        int, "1: in CUDA unified memory, counted all the same (default 0)"),
    "inference_dynamic_batching_num_cuda_graphs": (
        int, "its steps' CUDA graphs (--cuda-graph-impl local), kept through the training step"),
    "inference_dynamic_batching_cuda_graph_mixed_prefill_count": (
        int, "prefill requests of its mixed steps' CUDA graphs (default 16)"),
}
_GRAPHS = "the GRPO rollout engine's CUDA graphs (train_rl.py --perform-rl-step, --cuda-graph-impl local)"
RL_ARGUMENTS: tuple[ArgSpec, ...] = (
    _training("perform_rl_step", bool, "train_rl.py's GRPO step: megatron-core's dynamic inference "
              "engine generates the rollouts; `memory` counts the KV cache it keeps on the GPU "
              "through the training step."),  # fmt: skip
    *(_training(name, type_, f"{what[0].upper()}{what[1:]}: {_KV}.")
      for name, (type_, what) in _CONTEXT_SIZES.items()),  # fmt: skip
    _training("inference_dynamic_batching_cuda_graph_sizing_distribution", str,
              f"How the token counts of {_GRAPHS} are spaced (megatron-core 0.19+; default "
              "exponential).", choices=("exponential", "linear")),  # fmt: skip
    _training("decode_only_cuda_graphs", bool, f"Only decode steps in {_GRAPHS}."),
    _training("inference_cuda_graph_scope", str,
              f"What one of {_GRAPHS} holds: layer (each transformer layer, the default with local "
              "graphs; modelled), block, none.", choices=("none", "layer", "block")),  # fmt: skip
    _training("rl_training_cuda_graphs", bool,
              "GRPO: train the policy with its per-layer CUDA graphs (--cuda-graph-impl local) "
              f"instead of eagerly; {_GRAPHS} stay beside them.", negatable=True),  # fmt: skip
    _training("rl_reset_cuda_graphs", bool,
              f"GRPO (Megatron-LM 0.15-0.16): delete {_GRAPHS} before each training step.",
              negatable=True),  # fmt: skip
    _training("rl_kv_cache_management_mode", str,
              f"Where {_KV} goes for the training step: persist (kept on the GPU, modelled).",
              choices=("persist", "offload", "recompute")),  # fmt: skip
)


ARGUMENTS: tuple[ArgSpec, ...] = MODEL_ARGUMENTS + (
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
    _training("fine_grained_activation_offloading", bool,
              "Copy the inputs of --offload-modules to pinned host memory after their forward and "
              "back before their backward (megatron-core 0.16+)."),
    _training("offload_modules", str, "The modules whose inputs are offloaded: any of attn_norm, "
              "qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, and (megatron-core "
              "0.19+, with --use-transformer-engine-op-fuser) fused_group_mlp.", many=True),
    _training("min_offloaded_tensor_size", int,
              "The smallest saved tensor offloaded, in elements (default 1048576)."),
    _training("cpu_offloading", bool, "Transformer Engine's layer offload: the saved activations of "
              "the first --cpu-offloading-num-layers layers go to pinned host memory (one pipeline stage)."),
    _training("cpu_offloading_num_layers", int, "Layers --cpu-offloading offloads (default 0)."),
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
        "memory pool), local (megatron-core's own: whole layers, or the scope full_iteration) "
        "or none.",
        choices=("none", "local", "transformer_engine"),
    ),
    _training(
        "external_cuda_graph",
        bool,
        "Megatron-LM's deprecated spelling of --cuda-graph-impl transformer_engine.",
    ),
    _training(
        "enable_cuda_graph",
        bool,
        "Megatron-LM's deprecated spelling of --cuda-graph-impl local.",
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
    _training("train_iters", int, "Iterations to train; 1: the only iteration is the first, whose "
              "forward and backward run before the optimizer's first step makes Adam's moments."),
    _training("sft", bool, "Packed sequences (Megatron-LM's SFT dataset): attention and RoPE per "
              "document, in Transformer Engine's thd format (--micro-batch-size 1)."),
    _training("packed_document_length", int, "With --sft: the documents' length in tokens, the rest "
              "one shorter (the tool's flag; default --seq-length: one document per sequence)."),
    # Megatron-Bridge's LoRA (its `peft` config; job/lora.py): the tool's flags, no Megatron-LM argument
    ArgSpec("lora_rank", int, "Megatron-Bridge's LoRA: adapters of this rank (Bridge's dim) on a frozen "
            "model (the tool's flag; default none).", "model"),
    ArgSpec("lora_target_modules", str, "With --lora-rank: the linears that get adapters (Bridge's "
            "target_modules; default linear_qkv linear_proj linear_fc1 linear_fc2).", "model",
            many=True),
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
              "layer-wise optimizer (whole matrices dealt over the ranks) instead of its layout "
              "in DDP's buffers."),
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
        "deterministic_mode",
        bool,
        "megatron's deterministic code paths under torch's deterministic algorithms (memory: MoE "
        "routing by index_put_, unpermutation by index_add_; plan: Transformer Engine's "
        "deterministic attention backward).",
    ),
    _training(
        "use_transformer_engine_op_fuser",
        bool,
        "megatron-core 0.18+: the MoE experts' grouped MLP as Transformer Engine's fused "
        "operations (fc1, the scaled activation: SwiGLU, clamped quick-GEGLU or, from 0.19, "
        "squared ReLU; fc2 in one autograd function).",
    ),
    _training(
        "moe_mlp_glu_interleave_size",
        int,
        "megatron-core 0.18+: the routed experts' SwiGLU input as interleaved blocks of gates and "
        "linear units; 32 lets Transformer Engine's MXFP8 fused grouped MLP run (op fuser).",
    ),
    _training(
        "moe_expert_rank_capacity_factor",
        float,
        "megatron-core 0.18+, HybridEP with the op fuser: a static budget of tokens x topk x "
        "factor permuted tokens a rank (fixed-size expert buffers; tokens over it are dropped).",
    ),
    _training(
        "moe_paged_stash",
        bool,
        "megatron-core 0.18+, with the op fuser and a rank budget: the experts' activations kept "
        "for backward in pages of buffers sized after a first, profiling iteration.",
    ),
    _training(
        "moe_paged_stash_page_size",
        int,
        "megatron-core 0.18+: tokens a page of the MoE paged stash holds (default 64).",
    ),
    _training(
        "moe_paged_stash_buffer_size_factor_cuda",
        float,
        "megatron-core 0.18+: the GPU stash buffer as this times the profiled tokens (default "
        "1.1; negative: sized by the real counts rather than budget / factor).",
    ),
    _training(
        "moe_paged_stash_buffer_size_factor_cpu",
        float,
        "megatron-core 0.18+: a pinned host stash buffer as this times the profiled tokens "
        "(default 0: none).",
    ),
    _training(
        "log_params_norm",
        bool,
        "Megatron-LM's parameter norm, every iteration (plan: one read of the rank's fp32 "
        "master weights).",
    ),
    _training(
        "log_num_zeros_in_grad",
        bool,
        "The zeros of the gradients counted at every step (plan: one read of the rank's fp32 "
        "main gradients).",
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
) + RL_ARGUMENTS

GROUPS = ("model", "layout", "training")

BY_NAME: dict[str, ArgSpec] = {spec.name: spec for spec in ARGUMENTS}
