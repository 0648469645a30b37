"""The training job a command describes: the model, the parallel layout and the training settings.

A `Job` is made once, at the edge (resolve.py merges presets, config files, launch scripts and
flags into Megatron-LM arguments and calls `make_job`), validated on creation, and then read by
every command: `build` turns it into megatron modules, `params`, `memory`, `tree` and `topology`
turn those into records. Nothing downstream reads Megatron-LM arguments again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast, get_args

from inspector.errors import ConfigError
from inspector.job.attention_backend import flash_attention, scores_cause
from inspector.job.checks import (
    check_at_least_one,
    check_count,
    check_deterministic,
    check_op_fuser,
    check_paged_stash,
    check_rank_capacity,
    check_sequence_split,
)
from inspector.job.cuda_graphs import check_job_graphs, parse_scope
from inspector.job.device import Device, check_precision
from inspector.job.dims import ModelDims, num_microbatches
from inspector.job.dsa import check_dsa_layout
from inspector.job.ep_overlap import check_ep_overlap
from inspector.job.flex import check_flex, row_padding
from inspector.job.fp8 import check_legacy_gather, check_param_gather
from inspector.job.fsdp import fsdp_rules
from inspector.job.gdn import validate_gdn
from inspector.job.hash_once import hash_once
from inspector.job.hybrid_model import validate_hybrid
from inspector.job.layout import Layout, make_layout, validate_layout
from inspector.job.lora import check_lora
from inspector.job.model import ModelConfig
from inspector.job.model_args import make_model_config, validate_model
from inspector.job.offloading import Offloading, parse_offloading
from inspector.job.optimizer_precision import OptimizerPrecision, make_precision
from inspector.job.optimizers import FLAGS_READ, check_optimizer, layer_wise
from inspector.job.packing import check_packing, packed_document_length
from inspector.job.recompute_modules import DEFAULT_MODULES, check_modules, parse_modules
from inspector.job.rollout import RolloutContext, local_graphs_are_the_engine_s, make_rollout
from inspector.job.tp_overlap import check_tp_comm_overlap
from inspector.job.versions import router_padding_field

MAX_CAPACITY_FACTOR = 1024.0  # beyond it no expert drops a token anyway

# Megatron-LM's --recompute-granularity values, "none" when the flag is absent.
Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(Recompute)

@hash_once  # a planner's cache keys hold it: hashed once per object
@dataclass(frozen=True)
class Training:
    """Megatron-LM's training arguments (precision is the model's: it sets the params' dtype)."""

    micro_batch_size: int | None = None
    global_batch_size: int | None = None  # None: Megatron-LM's default, micro-batch x dp
    recompute: Recompute = "none"
    flash_attention: bool = False
    scores_cause: str = ""  # without flash attention: the argument that keeps it unfused
    fp32_grads: bool | None = None  # --accumulate-allreduce-grads-in-fp32 (None: the default)
    use_distributed_optimizer: bool = False
    optimizer: str = "adam"  # --optimizer: adam, or muon / dist_muon (job/optimizers.py)
    # dist_muon on megatron-core 0.18+ without --no-use-layer-wise-param-layout: its matrices
    # shard-aligned in DDP's buffers, the other parameters under a DistributedOptimizer
    layer_wise_param_layout: bool = False
    # --use-megatron-fsdp with its --data-parallel-sharding-strategy, or --use-torch-fsdp2
    megatron_fsdp: bool = False
    sharding_strategy: str = "no_shard"  # Megatron-LM's default
    fsdp_double_buffer: bool = False
    torch_fsdp2: bool = False
    overlap_grad_reduce: bool = False
    ddp_bucket_size: int | None = None
    recompute_method: str = "uniform"  # with full recomputation: uniform or block
    recompute_num_layers: int = 1
    microbatch_group_size: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage
    attention_dropout: float = 0.1  # Megatron-LM's defaults
    hidden_dropout: float = 0.1
    recompute_modules: tuple[str, ...] = DEFAULT_MODULES  # selective (job/recompute_modules.py)
    # MoE token routing, as megatron-core's TransformerConfig takes it (the engine runs it)
    moe_token_dispatcher_type: str = "allgather"  # Megatron-LM's default
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_pad_expert_input_to_capacity: bool = False
    # --moe-router-padding-for-fp8 / -for-quantization: each expert's count padded to fp8's rows
    moe_router_padding: bool = False
    moe_flex_backend: str = "deepep"  # the flex dispatcher's backend, DeepEP's SMs (job/flex.py)
    moe_enable_deepep: bool = False
    moe_deepep_num_sms: int = 20  # megatron-core's default
    # --overlap-moe-expert-parallel-comm, --delay-wgrad-compute (job/ep_overlap.py)
    ep_overlap: bool = False
    delay_wgrad: bool = False
    op_fuser: bool = False  # --use-transformer-engine-op-fuser: the experts' TE fused ops (world/te/ops.py)
    # --moe-expert-rank-capacity-factor: HybridEP's static budget of permuted tokens a rank
    # (megatron-core 0.18+ token_dispatcher.py _HybridEPManager.setup_metadata; None: dynamic)
    moe_expert_rank_capacity_factor: float | None = None
    moe_glu_interleave: int | None = None  # --moe-mlp-glu-interleave-size (0.18+)
    # --moe-paged-stash and its sizes (0.18+, memory/engine/paged_stash.py): TransformerConfig's
    # defaults (transformer_config.py, core_v0.19.2)
    moe_paged_stash: bool = False
    moe_paged_stash_page_size: int = 64
    moe_paged_stash_factor_cuda: float = 1.10
    moe_paged_stash_factor_cpu: float = 0.0
    cross_entropy_loss_fusion: bool = False  # megatron's torch.compile'd fused_cross_entropy.py
    # the output layer's weight gradients of the first --wgrad-deferral-limit (0: all) deferred
    defer_embedding_wgrad: bool = False
    wgrad_deferral_limit: int = 0
    tp_comm_overlap: bool = False  # --tp-comm-overlap: Transformer Engine's userbuffers
    deterministic_mode: bool = False  # --deterministic-mode (formulas/determinism.py)
    # --log-params-norm, --log-num-zeros-in-grad: passes over the rank's state each iteration
    # (formulas/optimizer.py `logged_passes`)
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    unfused: tuple[str, ...] = ()  # fusions turned off (--no-bias-gelu-fusion: bias_gelu_fusion)
    # --use-precision-aware-optimizer and its dtypes (job/optimizer_precision.py)
    optimizer_precision: OptimizerPrecision = field(default_factory=OptimizerPrecision)
    # --cuda-graph-impl and --cuda-graph-scope (job/cuda_graphs.py; () is the whole layer)
    cuda_graph_impl: str = "none"
    cuda_graph_scope: tuple[str, ...] = ()
    cuda_graph_warmup_steps: int = 3  # megatron-core's TransformerConfig default
    packed_document_length: int | None = None  # --sft: packed sequences (job/packing.py)
    train_iters: int | None = None  # --train-iters (None: not given); 1 peaks at the first step
    offloading: Offloading | None = None  # --fine-grained-activation-offloading (job/offloading.py)
    rollout: RolloutContext | None = None  # --perform-rl-step: the GRPO rollout engine (job/rollout.py)

    def __post_init__(self) -> None:
        """Reject counts below one and unknown recomputation modes."""
        check_at_least_one("--micro-batch-size", self.micro_batch_size)
        check_at_least_one("--global-batch-size", self.global_batch_size)
        check_at_least_one("--recompute-num-layers", self.recompute_num_layers)
        check_at_least_one("--microbatch-group-size-per-virtual-pipeline-stage",
                           self.microbatch_group_size)  # fmt: skip
        check_at_least_one("--moe-deepep-num-sms", self.moe_deepep_num_sms)
        check_at_least_one("--train-iters", self.train_iters)
        check_at_least_one("--moe-mlp-glu-interleave-size", self.moe_glu_interleave)
        check_at_least_one("--moe-paged-stash-page-size", self.moe_paged_stash_page_size)
        for flag, p in (("--attention-dropout", self.attention_dropout),
                        ("--hidden-dropout", self.hidden_dropout)):  # fmt: skip
            if not 0 <= p < 1:
                raise ConfigError(f"{flag} {p} is not a probability in [0, 1)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute-granularity {self.recompute!r} is not one of: "
                              f"{', '.join(RECOMPUTE_MODES)}")  # fmt: skip
        for flag, count in (("--ddp-bucket-size", self.ddp_bucket_size),
                            ("--wgrad-deferral-limit", self.wgrad_deferral_limit),
                            ("--cuda-graph-warmup-steps", self.cuda_graph_warmup_steps)):  # fmt: skip
            check_count(flag, count)
        self._check_routing()

    def _check_routing(self) -> None:
        """Reject what megatron-core's TransformerConfig rejects of the MoE routing flags."""
        factor = self.moe_expert_capacity_factor
        if factor is not None and not 0 < factor <= MAX_CAPACITY_FACTOR:
            raise ConfigError(
                f"--moe-expert-capacity-factor {factor} must be above 0 (tokens kept per expert: "
                f"ceil(tokens x topk / experts x factor)) and at most {MAX_CAPACITY_FACTOR}")  # fmt: skip
        if self.moe_pad_expert_input_to_capacity and factor is None:
            raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-"
                              "factor (megatron-core: \"moe_expert_capacity_factor must be set to "
                              "use moe_pad_expert_input_to_capacity\")")  # fmt: skip


@dataclass(frozen=True)
class Schedule:
    """One iteration's batches: what activations and FLOPs scale with."""

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int  # per pipeline, per iteration


_ONCE: dict[str, Any] = {}  # the model `checks_once` vouches for, and its layouts checked


@contextlib.contextmanager
def checks_once(model: ModelConfig) -> Iterator[None]:
    """Within the block, Jobs of `model` (this very object) check it, and each layout with it,
    once: a planner makes tens of thousands of jobs of one model over a few thousand layouts,
    and neither check reads anything else (the frozen model, the layout, the installed releases)."""
    saved = dict(_ONCE)
    validate_model(model)
    _ONCE.update(model=model, layouts=set())
    try:
        yield
    finally:
        _ONCE.clear()
        _ONCE.update(saved)


def check_layout(model: ModelConfig, layout: Layout) -> None:
    """Run validate_layout, once per layout inside `checks_once` for its model (a refusal is
    not remembered: it raises each time)."""
    once = _ONCE.get("model") is model
    if once and layout in _ONCE["layouts"]:
        return
    validate_layout(model, layout)
    if once:
        _ONCE["layouts"].add(layout)


@dataclass(frozen=True)
class Job:
    """A model, its parallel layout and its training settings, checked together."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: Layout = field(default_factory=Layout)
    training: Training = field(default_factory=Training)
    device: Device = field(default_factory=Device)  # the GPU it runs on (job/device.py)

    def __post_init__(self) -> None:
        """Reject a job megatron would refuse or silently change."""
        if _ONCE.get("model") is not self.model:  # `checks_once`
            validate_model(self.model)
        check_precision(self.model, self.device)
        check_layout(self.model, self.layout)
        check_dsa_layout(self.model, self.layout.cp)
        check_lora(self.model, self.layout.tp, self.training)
        if self.model.hybrid:
            uneven = (self.layout.decoder_first_pipeline_num_layers is not None
                      or self.layout.decoder_last_pipeline_num_layers is not None)  # fmt: skip
            validate_hybrid(self.model, self.layout.tp, self.layout.pp, uneven, self.layout.vpp)
        validate_gdn(self.model, self.layout.tp, self.layout.cp)
        if self.training.recompute == "selective":
            _check_fp8_recompute(self.model, self.training.recompute_modules)
            check_modules(self.training.recompute_modules, self.model)
        check_ep_overlap(self.model, self.layout, self.training)
        check_flex(self.model, self.layout, self.training)
        check_tp_comm_overlap(self.model, self.layout, self.training)
        check_packing(self)
        check_job_graphs(self.training, self.model)
        if self.training.flash_attention and self.model.dtype_name == "float32":
            raise ConfigError("--use-flash-attn needs --bf16 or --fp16: flash attention kernels "
                              "have no fp32 path")  # fmt: skip

    def schedule(self) -> Schedule:
        """Return the iteration's batches; --micro-batch-size is required for them."""
        micro = self.training.micro_batch_size
        if micro is None:
            raise ConfigError("--micro-batch-size is required: activations scale with it")
        # Megatron-LM arguments.py: --global-batch-size defaults to micro-batch size x dp.
        global_batch = self.training.global_batch_size or micro * self.layout.dp
        return Schedule(micro, global_batch, num_microbatches(global_batch, micro, self.layout.dp))

    def dims(self) -> ModelDims:
        """Return the formulas' view of the model: its sizes with Megatron-LM's defaults applied."""
        model, training = self.model, self.training
        if self.layout.cp > 1 and training.scores_cause:
            # Transformer Engine's DotProductAttention: "Context parallelism is only implemented
            # with Flash Attention and Fused Attention!" (a forward's check: a build passes)
            raise ConfigError(
                f"--context-parallel-size {self.layout.cp} needs flash or fused attention, which "
                f"{training.scores_cause} turns off: megatron runs context parallelism only "
                "through Transformer Engine's flash/fused attention"
            )
        if self.layout.sequence_parallel:
            check_sequence_split(model.seq_length, self.layout.tp, self.layout.cp)
        return ModelDims.from_fields(
            model.transformer_fields(),
            seq_length=model.seq_length,
            vocab_size=model.embedding_rows(self.layout.tp),
            attention_dropout=training.attention_dropout > 0,
            hidden_dropout=training.hidden_dropout > 0,
            rotary=model.position_embedding_type in ("rope", "mrope", "yarn")
            or model.multi_latent_attention,
            flash_attention=training.flash_attention,
            fused_kernels=model.use_apex or model.transformer_impl == "transformer_engine",
            moe_sorts_chunks=training.moe_token_dispatcher_type == "alltoall",
            moe_row_padding=row_padding(training),
            bias_fusions=bias_fusions(model, training),
            document_length=training.packed_document_length,
            grad_accumulation_fusion="gradient_accumulation_fusion" not in training.unfused,
            deterministic=training.deterministic_mode,
            te_attention=model.transformer_impl == "transformer_engine",
            # TransformerConfig.apply_rope_fusion as the engine sets it (memory/engine/runtime.py)
            rope_fusion=model.transformer_impl == "transformer_engine"
            and model.position_embedding_type in ("rope", "yarn") and "rope_fusion" not in training.unfused,
            tp_comm_overlap=training.tp_comm_overlap,
        )


def bias_fusions(model: ModelConfig, training: Training) -> tuple[bool, bool]:
    """Return TransformerConfig's bias_activation_fusion and bias_dropout_fusion for the job.

    Megatron-LM core_transformer_config_from_args: bias_swiglu_fusion with --swiglu, else
    bias_gelu_fusion, which validate_args turns off without linear biases ("Disable bias gelu
    fusion if we are disabling bias altogether"); bias_dropout_fusion as given. Each is on
    unless its `--no-` flag (Training.unfused).
    """
    on = {name: name not in training.unfused for name in FUSIONS}
    if model.swiglu:
        activation = on["bias_swiglu_fusion"]
    else:
        activation = on["bias_gelu_fusion"] and not model.disable_bias_linear
    return activation, on["bias_dropout_fusion"]


TRAINING_ARGS = {
    "micro_batch_size": "micro_batch_size",
    "global_batch_size": "global_batch_size",
    "recompute_granularity": "recompute",
    "use_flash_attn": "flash_attention",
    "accumulate_allreduce_grads_in_fp32": "fp32_grads",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "optimizer": "optimizer",
    "use_megatron_fsdp": "megatron_fsdp",
    "fsdp_double_buffer": "fsdp_double_buffer",
    "use_torch_fsdp2": "torch_fsdp2",
    "overlap_grad_reduce": "overlap_grad_reduce",
    "ddp_bucket_size": "ddp_bucket_size",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type",
    "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "moe_flex_dispatcher_backend": "moe_flex_backend",
    "moe_enable_deepep": "moe_enable_deepep",
    "moe_deepep_num_sms": "moe_deepep_num_sms",
    "overlap_moe_expert_parallel_comm": "ep_overlap",
    "delay_wgrad_compute": "delay_wgrad",
    "use_transformer_engine_op_fuser": "op_fuser",
    "moe_expert_rank_capacity_factor": "moe_expert_rank_capacity_factor",
    "moe_mlp_glu_interleave_size": "moe_glu_interleave",
    "moe_paged_stash": "moe_paged_stash",
    "moe_paged_stash_page_size": "moe_paged_stash_page_size",
    "moe_paged_stash_buffer_size_factor_cuda": "moe_paged_stash_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu": "moe_paged_stash_factor_cpu",
    "cross_entropy_loss_fusion": "cross_entropy_loss_fusion",
    "defer_embedding_wgrad_compute": "defer_embedding_wgrad",
    "wgrad_deferral_limit": "wgrad_deferral_limit",
    "tp_comm_overlap": "tp_comm_overlap",
    "deterministic_mode": "deterministic_mode",
    "log_params_norm": "log_params_norm",
    "log_num_zeros_in_grad": "log_num_zeros_in_grad",
    "cuda_graph_impl": "cuda_graph_impl",
    "cuda_graph_warmup_steps": "cuda_graph_warmup_steps",
    "train_iters": "train_iters",
    "microbatch_group_size_per_virtual_pipeline_stage": "microbatch_group_size",
}

# Megatron-LM's fusion switches, by their `args` names: each has a `--no-` flag that turns it off.
FUSIONS = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "rope_fusion",
           "masked_softmax_fusion", "gradient_accumulation_fusion")  # fmt: skip


def make_training(args: Mapping[str, Any]) -> Training:
    """Build the Training record from Megatron-LM arguments (absent: Megatron-LM's defaults)."""
    values = {field: args[name] for name, field in TRAINING_ARGS.items() if name in args}
    values["recompute"] = cast(Recompute, values.get("recompute") or "none")
    for name in ("moe_token_dispatcher_type", "moe_flex_backend", "moe_deepep_num_sms",
                 "wgrad_deferral_limit", "cuda_graph_warmup_steps"):  # fmt: skip
        if values.get(name) is None:
            values.pop(name, None)
    for flag in ("flash_attention", "use_distributed_optimizer", "overlap_grad_reduce",
                 "moe_pad_expert_input_to_capacity", "megatron_fsdp", "fsdp_double_buffer",
                 "torch_fsdp2", "ep_overlap", "delay_wgrad", "moe_enable_deepep",
                 "cross_entropy_loss_fusion", "defer_embedding_wgrad", "tp_comm_overlap",
                 "deterministic_mode", "op_fuser", "log_params_norm",
                 "log_num_zeros_in_grad"):  # fmt: skip
        values[flag] = bool(values.get(flag))
    values["moe_router_padding"] = router_padding(args)
    values["cuda_graph_impl"] = values.get("cuda_graph_impl") or "none"
    values["cuda_graph_scope"] = parse_scope(args)
    values["packed_document_length"] = packed_document_length(args)
    values["offloading"] = parse_offloading(args)
    values["rollout"] = make_rollout(args)
    if local_graphs_are_the_engine_s(args):  # the policy trains without graphs (job/rollout.py)
        values["cuda_graph_impl"] = "none"
    values["fp32_grads"] = values.get("fp32_grads") or None
    values["optimizer"] = values.get("optimizer") or "adam"
    values["unfused"] = tuple(name for name in FUSIONS if args.get("no_" + name))
    _megatron_training_rules(args, values)
    fsdp_rules(args, values)
    return Training(**values)


def _megatron_training_rules(args: Mapping[str, Any], values: dict[str, Any]) -> None:
    """Apply Megatron-LM's validate_args to the training arguments beyond the plain ones."""
    check_deterministic(args)
    check_op_fuser(args)
    check_rank_capacity(args)
    check_paged_stash(args)
    if args.get("recompute_activations"):
        # validate_args: "if args.recompute_activations: args.recompute_granularity = 'selective'"
        values["recompute"] = "selective"
    values["recompute"], values["recompute_modules"] = parse_modules(args, values["recompute"])
    method, layers = args.get("recompute_method"), args.get("recompute_num_layers")
    # validate_args refuses a method under selective recomputation, TransformerConfig a number
    # of layers; without --recompute-granularity neither reads them (nothing is recomputed)
    if values["recompute"] == "selective" and (method is not None or layers is not None):
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        raise ConfigError(f"{flag} needs --recompute-granularity full (megatron-core TransformerConfig: "
                          "\"recompute method is not yet supported for selective recomputing "
                          "granularity\", recompute_num_layers must be None otherwise)")  # fmt: skip
    values["recompute_method"] = method or "uniform"
    values["recompute_num_layers"] = 1 if layers is None else layers
    values["optimizer_precision"] = precision = make_precision(args)
    if args.get("bf16") and (args.get("grad_reduce_in_bf16") or precision.main_grads_dtype != "fp32"):
        # validate_args: "if args.grad_reduce_in_bf16: args.accumulate_allreduce_grads_in_fp32 =
        # False", and it sets it True only "elif ... args.main_grads_dtype == torch.float32"
        values["fp32_grads"] = False
    for name in ("attention_dropout", "hidden_dropout"):
        if args.get(name) is not None:
            values[name] = float(args[name])
    values["flash_attention"] = flash_attention(args)
    values["scores_cause"] = "" if values["flash_attention"] else scores_cause(args)
    factor = values.get("moe_expert_capacity_factor")
    if factor is not None and factor < 0:  # TransformerConfig: a negative factor is dropless
        values["moe_expert_capacity_factor"] = None
    check_param_gather(args)


def router_padding(args: Mapping[str, Any]) -> bool:
    """Return whether megatron pads each expert's token count for fp8, raising what megatron-core's
    TransformerConfig.__post_init__ raises of it (0.16.1: --moe-router-padding-for-fp8 turns on
    moe_router_padding_for_quantization; 0.13.1-0.15.3 name only the fp8 flag)."""
    given = [name for name in ("moe_router_padding_for_fp8", "moe_router_padding_for_quantization")
             if args.get(name)]  # fmt: skip
    if not given:
        return False
    flag = "--" + given[0].replace("_", "-")
    field = router_padding_field()
    if args.get("num_experts") is None:
        raise ConfigError(f"{flag} needs --num-experts (it pads the experts' token counts)")
    # 0.16.1's quantization padding takes fp4 too (moe_utils.py get_align_size_for_quantization)
    fp4 = field == "moe_router_padding_for_quantization" and args.get("fp4_format")
    if not args.get("fp8_format") and not fp4:
        formats = "--fp8-format or --fp4-format" if field.endswith("quantization") else "--fp8-format"
        raise ConfigError(f"{flag} needs {formats} (megatron-core's TransformerConfig: "
                          f"'{_PAD_NEEDS_FP8[field]}')")  # fmt: skip
    dispatcher = args.get("moe_token_dispatcher_type") or "allgather"
    if dispatcher == "allgather":
        raise ConfigError(
            f"{flag} needs --moe-token-dispatcher-type alltoall or flex, not allgather "
            "(megatron-core's TransformerConfig: 'allgather and alltoall_seq dispatcher does not "
            f"support {field}.')"
        )
    return True


# TransformerConfig's words, by the field a version names (0.16.1; 0.13.1-0.15.3)
_PAD_NEEDS_FP8 = {
    "moe_router_padding_for_quantization": "fp8/fp4 must be specified when "
    "moe_router_padding_for_quantization is True.",
    "moe_router_padding_for_fp8": "fp8 must be specified when moe_router_padding_for_fp8 is True.",
}




def _check_fp8_recompute(model: ModelConfig, modules: tuple[str, ...]) -> None:
    """Reject what megatron-core's TransformerConfig rejects of fp8 with module recomputation."""
    recomputed = [m for m in ("moe_act", "layernorm") if m in modules]
    if model.fp8_format is not None and model.fp8_recipe == "delayed" and recomputed:
        raise ConfigError(
            f"--recompute-modules {recomputed[0]} does not work with --fp8-recipe delayed "
            "(megatron-core TransformerConfig: \"Delayed scaling does not support moe_act and "
            "layernorm recompute for fp8.\"); pass --fp8-recipe tensorwise, blockwise or mxfp8"
        )


def make_job(args: Mapping[str, Any]) -> Job:
    """Turn merged Megatron-LM arguments into a validated Job."""
    model = make_model_config(args)
    layout = make_layout(args, model.num_layers)
    training = make_training(args)
    flags = {name: bool(args.get(name)) for name in FLAGS_READ}
    check_optimizer(training.optimizer, layout, flags)
    if layer_wise(training.optimizer, flags):  # 0.18+ validate_args: the layer-wise optimizer
        layout_on = not flags["no_use_layer_wise_param_layout"]  # Megatron-LM's default: on
        if not layout_on:
            check_legacy_gather(model, layout.dp * layout.cp, flags["overlap_param_gather"])
        training = replace(training, optimizer="dist_muon", use_distributed_optimizer=False,
                           layer_wise_param_layout=layout_on)  # fmt: skip
    return Job(model, layout, training)
