"""One Megatron-Bridge recipe's ConfigContainer (bridge_reader.Record) as Megatron-LM's arguments.

Bridge's config fields carry megatron-core's names (TransformerConfig, DistributedDataParallelConfig,
OptimizerConfig), which are Megatron-LM's argument names for the most part; where they differ the
table below says how Megatron-LM spells it (megatron/training/arguments.py) and where Bridge
applies it (src/megatron/bridge/training/...). LoRA adapters become the tool's own --lora-rank and
--lora-target-modules; what nothing expresses (another PEFT, a model the tool has no preset for)
is returned as a refusal of the bench's own, with its reason.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from bridge_eval import Opaque, Record

# Hugging Face ids Bridge's recipes load (AutoBridge.from_hf_pretrained) -> the tool's preset
PRESETS = {
    "meta-llama/Meta-Llama-3-8B": "llama3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama3-70b",
    "meta-llama/Meta-Llama-3.1-405B": "llama3.1-405b",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
    "moonshotai/Kimi-K2-Instruct": "kimi-k2",
    "zai-org/GLM-5": "glm-5",
    "zai-org/GLM-5.1": "glm-5",
    "zai-org/GLM-5.2": "glm-5.2",
    "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "nemotron-3-super-120b-a12b",
    "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": "nemotron-3-ultra-550b-a55b",
}

# Hugging Face ids (by prefix) of models whose layers no megatron-core this tool builds with has:
# Bridge's bridge names what it needs from megatron-core (deepseek/deepseek_v4_bridge.py, its
# docstring's "Megatron-Core prerequisites" and provider_bridge: experimental_attention_variant
# "dsv4_hybrid", enable_hyper_connections, moe_n_hash_layers), none of which megatron-core 0.19.2
# has (TransformerConfig.experimental_attention_variant is 'gated_delta_net' or 'dsa'; no
# HyperConnectionModule, no hash router); tests/test_bridge_recipes.py reads megatron-core's source
NOT_IN_MEGATRON_CORE = {
    "deepseek-ai/DeepSeek-V4-": (
        "DeepSeek-V4's compressed sparse attention (DSv4HybridSelfAttention, "
        "experimental_attention_variant dsv4_hybrid), hyper-connections (HyperConnectionModule) "
        "and hash-routed MoE layers are not in megatron-core {version}"
    ),
}

# Training switches Bridge's model bridge sets on the provider (provider_bridge), by preset:
# gpt_oss/gpt_oss_bridge.py `provider.bias_dropout_fusion = False` (megatron-core's TEGroupedMLP
# refuses the fusion with gpt-oss's expert biases)
_BRIDGE_SETS = {
    "gpt-oss-20b": {"no_bias_dropout_fusion": True},
    "gpt-oss-120b": {"no_bias_dropout_fusion": True},
}

# model (TransformerConfig) fields whose name is Megatron-LM's argument's
_SAME_MODEL = (
    "tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size "
    "expert_model_parallel_size expert_tensor_parallel_size sequence_parallel seq_length "
    "account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split "
    "recompute_granularity recompute_method recompute_num_layers recompute_modules "
    "transformer_impl moe_token_dispatcher_type moe_flex_dispatcher_backend moe_grouped_gemm "
    "moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_expert_capacity_factor "
    "moe_pad_expert_input_to_capacity mtp_num_layers cuda_graph_impl cuda_graph_scope "
    "fine_grained_activation_offloading offload_modules cpu_offloading cpu_offloading_num_layers "
    "moe_paged_stash external_cuda_graph num_layers hidden_size ffn_hidden_size "
    "num_attention_heads num_query_groups kv_channels vocab_size moe_layer_recompute "
    "delay_wgrad_compute overlap_moe_expert_parallel_comm "
    "is_hybrid_model position_embedding_type moe_ffn_hidden_size moe_shared_expert_intermediate_size "
    "moe_router_topk moe_router_score_function moe_router_enable_expert_bias moe_router_num_groups "
    "moe_router_group_topk moe_latent_size mamba_num_heads mamba_head_dim mamba_num_groups "
    "mamba_state_dim mtp_use_repeated_layer"
).split()
# Bridge's name -> Megatron-LM's (arguments.py; validate_args copies them onto the config)
_RENAMED_MODEL = {
    "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "num_moe_experts": "num_experts",
}
# megatron-core 0.18+'s fields (Megatron-LM's arguments of the same name) that the paged-stash
# recipes set beside moe_paged_stash: modelled from 0.18, refused by version before
# (inputs/paged_stash.py)
_SAME_MODEL_018 = (
    "use_transformer_engine_op_fuser moe_expert_rank_capacity_factor moe_paged_stash_page_size "
    "moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_buffer_size_factor_cpu "
    "moe_mlp_glu_interleave_size"
).split()
_SAME_DDP = ("use_distributed_optimizer overlap_grad_reduce overlap_param_gather use_megatron_fsdp "
             "fsdp_double_buffer num_distributed_optimizer_instances").split()  # fmt: skip
_SAME_OPTIMIZER = ("optimizer use_precision_aware_optimizer optimizer_cpu_offload").split()
_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
           "torch.uint8": "fp8"}  # fmt: skip
_FP8_SWITCHES = ("fp8_param_gather", "fp8_dot_product_attention", "fp8_multi_head_attention")
_LAYOUT_WORDS = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
# megatron-core's DistributedDataParallelConfig data_parallel_sharding_strategy -> Megatron-LM
_FSDP_STRATEGY = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def recipe_args(cfg: Record, gpus: int) -> tuple[str | None, dict[str, Any], list[str]]:
    """Return (preset, Megatron-LM arguments, the bench's refusals) for a recipe on `gpus` GPUs."""
    model = _section(cfg, "model")
    refusals: list[str] = []
    pattern = _hybrid_pattern(model)
    preset = PRESETS.get(model.fields.get("hf_id") or "") or _hybrid_preset(pattern)
    if preset is None:
        refusals.append(_model_refusal(model))
    args: dict[str, Any] = dict(_BRIDGE_SETS.get(preset or "", {}))
    if model.fields.get("bias_dropout_fusion") is False:
        args["no_bias_dropout_fusion"] = True
    elif model.fields.get("bias_dropout_fusion"):
        args.pop("no_bias_dropout_fusion", None)
    for name in _SAME_MODEL + _SAME_MODEL_018:
        _put(args, name, model.fields.get(name))
    for name, flag in _RENAMED_MODEL.items():
        _put(args, flag, model.fields.get(name))
    if preset and args.get("position_embedding_type") == "rope" and \
            _preset_args(preset).get("position_embedding_type") == "yarn":  # fmt: skip
        # gpt-oss 20B's perf recipes turn YaRN into plain RoPE: the same tensors (YaRN only
        # scales RoPE's cos/sin), a numerics-only change, and the preset's YaRN factor then
        # has no meaning Megatron-LM reads; the preset's YaRN stands
        args.pop("position_embedding_type")
    if pattern and "E" not in pattern and not model.fields.get("num_moe_experts"):
        # a hybrid provider without MoE layers keeps NemotronH's MoE defaults (sigmoid router,
        # grouped GEMM): megatron-core reads none of them without experts; Megatron-LM refuses
        # some of them as arguments
        for name in [name for name in args if name.startswith("moe_")]:
            args.pop(name)
    if pattern:
        # the older name where both mean the same string (no MTP depths, no stage boundaries):
        # megatron-core 0.16's Megatron-LM has only --hybrid-override-pattern
        plain = "/" not in pattern and "|" not in pattern
        args["hybrid_override_pattern" if plain else "hybrid_layer_pattern"] = pattern
    _layout(args, model)
    if args.get("cuda_graph_impl") == "full_iteration":
        # newer megatron-core's spelling of megatron-core 0.16's `local` with scope full_iteration
        # (Bridge's _benchmark_common: "mcore may auto-promote cuda_graph_impl ... to
        # full_iteration")
        args["cuda_graph_impl"], args["cuda_graph_scope"] = "local", ["full_iteration"]
    if args.get("cuda_graph_impl") == "none":
        args.pop("cuda_graph_impl")
        if not args.get("external_cuda_graph"):
            # megatron-core reads external_cuda_graph as cuda_graph_impl transformer_engine,
            # with the scope (TransformerConfig.__post_init__)
            args.pop("cuda_graph_scope", None)
    elif not args.get("cuda_graph_scope"):
        args.pop("cuda_graph_scope", None)
    if not args.get("fine_grained_activation_offloading"):
        args.pop("offload_modules", None)
    if not args.get("cpu_offloading"):
        # TransformerConfig reads cpu_offloading_num_layers only with cpu_offloading (gpt-oss
        # 20B's perf recipes set 95 with offloading off)
        args.pop("cpu_offloading_num_layers", None)
    if args.get("mtp_num_layers") == 0:  # Bridge's "no MTP"; Megatron-LM's is no argument
        args.pop("mtp_num_layers")
    if args.get("recompute_granularity") != "selective":
        # a field a recipe keeps from its base recipe after turning recomputation off (Qwen3-Next's
        # perf recipes): megatron-core reads recompute_modules only under selective recomputation
        args.pop("recompute_modules", None)
    # models/gpt_provider.py provide(): `padded_vocab_size = calculate_padded_vocab_size(vocab,
    # make_vocab_size_divisible_by, tp) if self.should_pad_vocab else self.vocab_size`
    if model.fields.get("should_pad_vocab") or _vocab_from_tokenizer(model):
        _put(args, "make_vocab_size_divisible_by", model.fields.get("make_vocab_size_divisible_by"))
    else:
        args["make_vocab_size_divisible_by"] = 1
    null_vocab = _section(cfg, "tokenizer").fields.get("vocab_size")
    if _vocab_from_tokenizer(model) and _section(cfg, "tokenizer").fields.get(
            "tokenizer_type") == "NullTokenizer" and null_vocab:  # fmt: skip
        args["vocab_size"] = null_vocab
    if model.fields.get("apply_rope_fusion") is False:
        args["no_rope_fusion"] = True
    if model.fields.get("attention_backend") not in (None, "auto"):
        args["attention_backend"] = str(model.fields["attention_backend"]).split(".")[-1]
    _precision(args, _section(cfg, "mixed_precision"))
    _ddp(args, _section(cfg, "ddp"), _section(cfg, "mixed_precision"))
    _optimizer(args, _section(cfg, "optimizer"))
    _comm_overlap(args, cfg.fields.get("comm_overlap"), gpus)
    _checkpoint(args, _section(cfg, "checkpoint"))
    train = _section(cfg, "train")
    _put(args, "micro_batch_size", train.fields.get("micro_batch_size"))
    _put(args, "global_batch_size", train.fields.get("global_batch_size"))
    if "seq_length" not in args:
        _put(args, "seq_length", _section(cfg, "dataset").fields.get("seq_length"))
    refusals += _peft(args, cfg) + _param_gather_refusals(args)
    if _packed(cfg):
        # Bridge's packed sequences: Megatron-LM's --sft (THD, attention per document); the
        # documents' length is the data's, so one document per sequence (the tool's default)
        args["sft"] = True
    return preset, args, refusals


def _param_gather_refusals(args: dict[str, Any]) -> list[str]:
    """fp8 weights without a sharding optimizer (Kimi-K2's fp8cs recipes, dist_muon): Bridge runs
    no validate_args. megatron-core 0.18+ runs them on the layer-wise optimizer's legacy path (DDP
    without a param buffer, each fp8 weight in its own storage; optimizer/layer_wise_optimizer.py
    wraps each base optimizer in Float16OptimizerWithFloat16Params, whose fp32 main params are
    the weights' dequantized copies, copied back by TE's `copy_`). That is Megatron-LM 0.18+'s
    `--optimizer muon --use-distributed-optimizer` (validate_args turns it, like dist_muon, into
    muon with the layer-wise optimizer and the distributed optimizer off), the one spelling whose
    --fp8-param-gather check passes: it checks the flag before that turn. Before 0.18, and
    without Muon, no Megatron-LM command line gives the job (NVFP4 weights need no such spelling:
    validate_args does not check --fp4-param-gather)."""
    if not args.get("fp8_param_gather") or any(
            args.get(name) for name in ("use_distributed_optimizer", "use_megatron_fsdp",
                                        "use_torch_fsdp2")):  # fmt: skip
        return []
    from inspector.inputs.versions import megatron_core_version  # the checkout's (main's path)

    if args.get("optimizer") == "dist_muon" and megatron_core_version() >= (0, 18):
        args.update(optimizer="muon", use_distributed_optimizer=True)
        return []
    return ["--fp8-param-gather without --use-distributed-optimizer: megatron-core keeps the fp8 "
            "weights in their own storage, which Megatron-LM's validate_args refuses (muon takes "
            "--use-distributed-optimizer from megatron-core 0.18) and Bridge does not check"]


def _section(cfg: Record, name: str) -> Record:
    value = cfg.fields.get(name)
    return value if isinstance(value, Record) else Record(name)


def _put(args: dict[str, Any], name: str, value: Any) -> None:
    if value is None or value is False:  # Megatron-LM's switches are off by default
        return
    if isinstance(value, Opaque):
        value = _DTYPES.get(value.name, value.name.split(".")[-1])
    if isinstance(value, list) and not value:
        return
    if isinstance(value, list):
        value = [(v.name if isinstance(v, Opaque) else str(v)).split(".")[-1] for v in value]
    args[name] = value


def _model_refusal(model: Record) -> str:
    """The refusal of a model without a preset: what megatron-core lacks for it (its cause), or
    `model` with its name."""
    hf_id = str(model.fields.get("hf_id") or "")
    for prefix, missing in NOT_IN_MEGATRON_CORE.items():
        if hf_id.startswith(prefix):
            version = importlib.metadata.version("megatron-core")
            return f"{missing.format(version=version)}: Bridge builds {hf_id} with them"
    if hf_id:
        return f"model: {hf_id} has no preset here (Megatron-Bridge loads its HF config)"
    return f"model: {model.kind} is not a model this tool builds"


def _hybrid_pattern(model: Record) -> str | None:
    """The provider's hybrid pattern as HybridModelProvider.finalize() makes it: the MTP pattern
    appended once per depth after `/` (at least once with mtp_use_repeated_layer)."""
    f = model.fields
    pattern = f.get("hybrid_layer_pattern") or f.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        return None
    mtp = f.get("mtp_hybrid_override_pattern")
    if mtp:
        depths = int(f.get("mtp_num_layers") or 0)
        copies = max(1, depths) if f.get("mtp_use_repeated_layer") else depths
        pattern = "/".join([pattern.split("/")[0]] + [mtp] * copies)
    return pattern


def _preset_args(name: str) -> Any:
    from inspector.inputs.presets import PRESETS as TOOL_PRESETS

    return TOOL_PRESETS[name].args


def _hybrid_preset(pattern: str | None) -> str | None:
    """The preset of a model a recipe builds inline (HybridModelProvider(...), no HF id): the one
    whose hybrid layer pattern is the provider's main pattern (its other fields are carried)."""
    from inspector.inputs.presets import PRESETS as TOOL_PRESETS

    main = (pattern or "").split("/")[0]
    found = [p.name for p in TOOL_PRESETS.values() if main and
             p.args.get("hybrid_override_pattern") == main]  # fmt: skip
    return found[0] if found else None


def _vocab_from_tokenizer(model: Record) -> bool:
    """Whether Bridge takes the vocabulary from the tokenizer, padded (training/setup.py
    `_validate_and_set_vocab_size`: a provider built inline with vocab_size None)."""
    return "hf_id" not in model.fields and "vocab_size" in model.fields and \
        model.fields["vocab_size"] is None  # fmt: skip


def _layout(args: dict[str, Any], model: Record) -> None:
    """Bridge's list-of-stages layout in Megatron-LM's string form (pipeline_parallel_layout.py)."""
    layout = model.fields.get("pipeline_model_parallel_layout")
    if isinstance(layout, list):
        layout = "|".join("".join(_LAYOUT_WORDS[w] for w in stage) for stage in layout)
    if layout:
        args["pipeline_model_parallel_layout"] = layout
        # the layout gives the virtual size (Megatron-LM validate_args derives it from the layout)
        args.pop("num_virtual_stages_per_pipeline_rank", None)


def _precision(args: dict[str, Any], mp: Record) -> None:
    """Bridge's MixedPrecisionConfig, applied to the model config (training/mixed_precision.py)."""
    f = mp.fields
    if f.get("bf16"):
        args["bf16"] = True
    if f.get("fp16"):
        args["fp16"] = True
    for kind, switches in (("fp8", _FP8_SWITCHES), ("fp4", ("fp4_param_gather",))):
        if f.get(kind):
            args[f"{kind}_format"] = f[kind]
            _put(args, f"{kind}_recipe", f.get(f"{kind}_recipe"))
            args.update({name: True for name in switches if f.get(name)})
    if f.get("fp8") and f.get("fp8_wgrad") is False:
        args["no_fp8_wgrad"] = True
    if f.get("first_last_layers_bf16") and (f.get("fp8") or f.get("fp4")):
        args["first_last_layers_bf16"] = True
    if f.get("reuse_grad_buf_for_mxfp8_param_ag"):
        args["reuse_grad_buf_for_mxfp8_param_ag"] = True


def _ddp(args: dict[str, Any], ddp: Record, mp: Record) -> None:
    for name in _SAME_DDP:
        _put(args, name, ddp.fields.get(name))
    if args.get("num_distributed_optimizer_instances") == 1:
        args.pop("num_distributed_optimizer_instances")
    _put(args, "ddp_bucket_size", ddp.fields.get("bucket_size"))
    if ddp.fields.get("use_megatron_fsdp"):
        strategy = ddp.fields.get("data_parallel_sharding_strategy")
        if strategy in _FSDP_STRATEGY:
            args["data_parallel_sharding_strategy"] = strategy
    # Bridge's `grad_reduce_in_fp32` (ddp and mixed precision, the latter applied last,
    # mixed_precision.py update_config_with_precision_overrides) is Megatron-LM's
    # --accumulate-allreduce-grads-in-fp32; False with bf16 is --grad-reduce-in-bf16
    fp32 = mp.fields.get("grad_reduce_in_fp32", ddp.fields.get("grad_reduce_in_fp32"))
    if fp32 is False and args.get("bf16"):
        args["grad_reduce_in_bf16"] = True


def _optimizer(args: dict[str, Any], opt: Record) -> None:
    for name in _SAME_OPTIMIZER:
        _put(args, name, opt.fields.get(name))
    if args.get("optimizer") in (False, None):
        args.pop("optimizer", None)
    # Bridge wraps the model in DDP without asking for the layer-wise parameter layout
    # (training/setup.py _build_distributed_model and models/model_provider.py get_model call
    # Megatron-LM's dist_utils._ddp_wrap, whose use_layer_wise_distributed_optimizer is False), so
    # megatron-core 0.18+'s get_megatron_optimizer builds dist_muon on its legacy path: Megatron-LM's
    # --no-use-layer-wise-param-layout, an argument of 0.18+
    from inspector.inputs.versions import megatron_core_version  # the checkout's (main's path)

    if args.get("optimizer") == "dist_muon" and megatron_core_version() >= (0, 18):
        args["no_use_layer_wise_param_layout"] = True
    if not args.get("optimizer_cpu_offload"):
        args.pop("optimizer_cpu_offload", None)
    if opt.fields.get("use_precision_aware_optimizer"):
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            _put(args, name, opt.fields.get(name))


def _comm_overlap(args: dict[str, Any], overlap: Any, gpus: int) -> None:
    """CommOverlapConfig.setup (training/comm_overlap.py): with the distributed optimizer, DDP's
    overlap_grad_reduce and overlap_param_gather become `data_parallel_size > 1`
    (_get_optimizer_overlap_cfgs), then the recipe's own CommOverlapConfig values win."""
    if not isinstance(overlap, Record):
        return
    f = overlap.fields
    if args.get("use_distributed_optimizer"):
        replica = 1
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size"):  # fmt: skip
            replica *= int(args.get(name) or 1)
        for name in ("overlap_grad_reduce", "overlap_param_gather"):
            args[name] = gpus // replica > 1
    if f.get("tp_comm_overlap") and int(args.get("tensor_model_parallel_size") or 1) > 1:
        args["tp_comm_overlap"] = True
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "overlap_grad_reduce",
                 "overlap_param_gather"):  # fmt: skip
        if f.get(name) is not None:
            args[name] = f[name]
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "overlap_grad_reduce",
                 "overlap_param_gather"):  # fmt: skip
        if args.get(name) is False:
            args.pop(name)
    if args.get("overlap_param_gather") and not args.get("overlap_grad_reduce"):
        # DeepSeek-V3's H100 recipes overlap the param all-gather but not the grad reduce:
        # megatron-core's DDP runs that (distributed_data_parallel.py registers the forward
        # pre-hooks on overlap_param_gather alone; param_and_grad_buffer.py asserts nothing of
        # overlap_grad_reduce for it) and Bridge checks nothing of it; only Megatron-LM's
        # validate_args refuses it ("Must use --overlap-param-gather with --overlap-grad-reduce").
        # The tool builds megatron's DDP without overlap_param_gather in every job (it models
        # when the all-gather runs in neither), so the job without it is the one it models
        args.pop("overlap_param_gather")


def _checkpoint(args: dict[str, Any], checkpoint: Record) -> None:
    """The checkpoint format, as the job reads it. Bridge asks Megatron-FSDP for fsdp_dtensor only
    when it saves or loads (training/config.py _validate_and_apply_megatron_fsdp_v1_configs: "if
    self.checkpoint.save is not None or self.checkpoint.load is not None: assert ckpt_format ==
    'fsdp_dtensor'"); a perf recipe does neither (_benchmark_common: save and load None), so its
    format is never read. Megatron-LM's validate_args asks for it always ("Megatron FSDP only
    supports fsdp_dtensor checkpoint format"): the same job is --ckpt-format fsdp_dtensor."""
    _put(args, "ckpt_format", checkpoint.fields.get("ckpt_format"))
    saves = any(checkpoint.fields.get(name) is not None for name in ("save", "load"))
    if args.get("use_megatron_fsdp") and not saves:
        args["ckpt_format"] = "fsdp_dtensor"


def _peft(args: dict[str, Any], cfg: Record) -> list[str]:
    """Bridge's LoRA (peft/lora.py 142-157) as the tool's --lora-rank and --lora-target-modules
    (inspector/job/lora.py); what it does not model (another PEFT, dropout's masks, a
    sequence-parallel re-gather, MoE adapter options) stays the bench's refusal."""
    peft = cfg.fields.get("peft")
    if not isinstance(peft, Record):
        return []
    f = peft.fields
    if peft.kind != "LoRA":
        return [f"PEFT: {peft.kind} (Bridge's peft) is not modelled; LoRA is"]
    unmodelled = {"dropout": 0.0, "sequence_parallel_input_regather": False,
                  "a2a_experimental": False, "exclude_modules": [], "lora_dtype": None}  # fmt: skip
    differ = [name for name, value in unmodelled.items() if f.get(name, value) != value]
    if differ:
        return [f"PEFT: LoRA's {', '.join(differ)} not modelled"]
    args["lora_rank"] = f.get("dim", 32)
    args["lora_target_modules"] = " ".join(f.get("target_modules") or
                                           ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    return []


def _packed(cfg: Record) -> bool:
    """Return whether the recipe trains on packed sequences (GPTSFTDatasetConfig: offline packing,
    enable_offline_packing and offline_packing_specs, or the older packed_sequence_specs)."""
    dataset = _section(cfg, "dataset")
    specs = dataset.fields.get("offline_packing_specs") or dataset.fields.get("packed_sequence_specs")
    packed = isinstance(specs, Record) and (specs.fields.get("packed_sequence_size") or 0) > 0
    return bool(packed and dataset.fields.get("enable_offline_packing", True))
