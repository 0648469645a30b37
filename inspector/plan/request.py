"""What a `plan` search is asked: the plan flags as one record, checked into a Request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from inspector.errors import ConfigError
from inspector.job.build_limits import expert_cap
from inspector.job.checks import check_at_least_one, check_built_layers
from inspector.job.cuda_graphs import check_job_graphs
from inspector.job.device import Device, check_precision
from inspector.job.flex import flex_backend
from inspector.job.fsdp import check_fsdp_pipeline
from inspector.job.hardware import (
    DEFAULT_EFFICIENCY,
    DEFAULT_GPU,
    Gpu,
    KernelTable,
    get_gpu,
    with_overrides,
)
from inspector.job.job import Training, make_training
from inspector.job.model import ModelConfig
from inspector.job.model_args import make_model_config, refuse_latent_moe
from inspector.job.versions import etp_bias_refused
from inspector.plan.flex import check_flex_request
from inspector.plan.hybrid import check_dsa_plan, check_hybrid_plan
from inspector.plan.split import PIN_FLAGS


@dataclass(frozen=True)
class PlanFlags:
    """The `plan` command's own flags, as the user typed them (None: the GPU type's figure)."""

    gpus: int
    gpu: str = DEFAULT_GPU
    gpu_memory: float | None = None  # GiB
    gpus_per_node: int | None = None
    gpu_tflops: float | None = None
    intra_node_bandwidth: float | None = None  # GB/s, one direction
    inter_node_bandwidth: float | None = None
    efficiency: float | None = DEFAULT_EFFICIENCY  # None: the measured kernel tables
    top: int = 5
    kernels: KernelTable | None = None  # --kernels FILE: the user's measured kernel table
    nccl_algo: str | None = None  # the job's NCCL_ALGO (plan/network.py `nvls_allowed`); None: unset


@dataclass(frozen=True)
class Request:
    """What the user asked: the model, the cluster, the batch, and any dimension they fixed."""

    model: ModelConfig
    gpus: int
    gpu: Gpu
    memory: int  # bytes per GPU
    global_batch_size: int
    efficiency: float | None = DEFAULT_EFFICIENCY  # None: the measured kernel tables
    fixed: dict[str, Any] = field(default_factory=dict)  # tp, pp, cp, ep, etp, vpp, mbs, ...
    top: int = 5
    flash_attention: bool | None = None  # None: on in 16-bit (Transformer Engine's kernels)
    training: Training = field(default_factory=Training)  # the user's dropout and grad dtype
    nccl_algo: str | None = None  # the job's NCCL_ALGO; None: NCCL's default

    @property
    def gpus_per_node(self) -> int:
        """Return the GPUs that share one NVLink domain."""
        return self.gpu.gpus_per_node

    @cached_property
    def local_experts_cap(self) -> int:
        """Return the most experts per expert-parallel rank that `memory` builds (a plan it
        cannot confirm is not offered): its cap over the MoE layers (docs/limits.md)."""
        return expert_cap(self.model)[0] // max(1, moe_layers(self.model))

    def pinned_text(self) -> str:
        """Return ` with FLAG VALUE ...` for the split flags the user pinned ('' for none)."""
        pin = dict(self.fixed.get("pin", {}))
        if "layers_per_chunk" in self.fixed:
            pin["num_layers_per_virtual_pipeline_stage"] = self.fixed["layers_per_chunk"]
        words = [
            "--" + name.replace("_", "-") + ("" if value is True else f" {value}")
            for name, value in pin.items()
        ]
        return " with " + " ".join(words) if words else ""

    @property
    def flash(self) -> bool:
        """Return whether the candidates run flash attention."""
        if self.model.transformer_impl != "transformer_engine":
            return False  # the local spec's attention is unfused (job/attention_backend.py flash_attention)
        if self.flash_attention is None:
            return self.model.dtype_name != "float32"
        return self.flash_attention


# Megatron-LM's argument -> the dimension it fixes in the search
FIXED = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
    "num_virtual_stages_per_pipeline_rank": "vpp",
    "micro_batch_size": "mbs",
    "recompute_granularity": "recompute",
    "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
}


# --recompute-modules whose saving the plan's closed forms count (memory/closed/activations.py) and
# whose recomputed forward its time prices (formulas/ops.py); a plan dropping others would be a
# different job
PLANNED_MODULES: tuple[str, ...] = ("core_attn", "mla_up_proj", "mlp", "shared_experts")


def _check_recompute_modules(modules: tuple[str, ...]) -> None:
    """Refuse recompute modules the plan would drop (PLANNED_MODULES)."""
    extra = [m for m in modules if m not in PLANNED_MODULES]
    if extra:
        raise ConfigError(
            f"--recompute-modules {' '.join(extra)}: plan prices selective recomputation of "
            f"{', '.join(PLANNED_MODULES)} only; `memory` measures these modules for a fixed layout"
        )


def make_request(args: dict[str, Any], flags: PlanFlags) -> Request:
    """Check the plan flags and return the search request (`args`: Megatron-LM's arguments)."""
    _check_counts(flags, args)
    batch = args.get("global_batch_size")
    check_at_least_one("--global-batch-size", batch)  # 0 is a size, not a missing one
    if batch is None:
        raise ConfigError("--global-batch-size is required: the plan splits it over data parallel")
    gpu = _plan_gpu(flags)
    fixed = {short: args[name] for name, short in FIXED.items() if args.get(name) is not None}
    fixed.update(pinned(args))
    gathered = args.get("fp8_param_gather") or args.get("fp4_param_gather")
    if (gathered or args.get("use_precision_aware_optimizer")) and args.get(
        "use_distributed_optimizer"
    ) is None:
        # Megatron-LM gathers fp8 parameters, and megatron-core keeps reduced-precision optimizer
        # state, only through a sharding optimizer (NVFP4 weights train without one, all-reduced
        # and unsharded): the plan keeps the distributed optimizer on (with dp 1 too, where it
        # shards nothing)
        fixed["distopt"] = True
        args = {**args, "use_distributed_optimizer": True}
    backend = flex_backend(args)  # megatron's rules for the flex dispatcher's flags
    training = _kept_training(args, backend)
    model = make_model_config(args)
    full = {"recompute_method", "recompute_num_layers"} & fixed.keys()  # candidates.recipes' least
    check_job_graphs(training, model, "full" if full else fixed.get("recompute", "none"))
    check_precision(model, Device(flags.gpu))  # a recipe TE refuses on --gpu (job/device.py)
    refuse_latent_moe(model, "plan")
    check_dsa_plan(model, flags.efficiency)
    check_hybrid_plan(model, fixed, training.ep_overlap, training.moe_token_dispatcher_type == "flex",
                      training.recompute_modules)  # fmt: skip
    _check_overlap(model, training)
    _check_sizes(model, flags.gpus)
    _check_expert_tp(model, fixed)
    check_flex_request(model, backend, fixed)
    return Request(
        model=model, gpus=flags.gpus, gpu=gpu,
        memory=round(gpu.memory_gib * (1 << 30)), global_batch_size=batch,
        efficiency=flags.efficiency, fixed=fixed,
        top=flags.top, training=training, flash_attention=_flash(args), nccl_algo=flags.nccl_algo,
    )


def _kept_training(args: dict[str, Any], backend: str | None) -> Training:
    """Return the training settings a plan keeps as given, after Megatron-LM's rules for them."""
    asked = make_training(args)
    _check_recompute_modules(asked.recompute_modules)
    return Training(
        fp32_grads=asked.fp32_grads,
        attention_dropout=asked.attention_dropout,
        hidden_dropout=asked.hidden_dropout,
        unfused=asked.unfused,
        optimizer_precision=asked.optimizer_precision,
        recompute_modules=asked.recompute_modules,
        moe_token_dispatcher_type=asked.moe_token_dispatcher_type,
        moe_flex_backend=backend or asked.moe_flex_backend,
        moe_enable_deepep=asked.moe_enable_deepep,
        moe_router_padding=asked.moe_router_padding,
        ep_overlap=asked.ep_overlap,
        delay_wgrad=asked.delay_wgrad, tp_comm_overlap=asked.tp_comm_overlap,
        op_fuser=asked.op_fuser,  # the experts' Transformer Engine fused operations (world/te/ops.py)
        moe_expert_rank_capacity_factor=asked.moe_expert_rank_capacity_factor,  # HybridEP's budget
        deterministic_mode=asked.deterministic_mode,
        log_params_norm=asked.log_params_norm,
        log_num_zeros_in_grad=asked.log_num_zeros_in_grad,
        packed_document_length=asked.packed_document_length,  # --sft: mbs 1, cp 1 (packing.py)
        cuda_graph_impl=asked.cuda_graph_impl, cuda_graph_scope=asked.cuda_graph_scope,
        cuda_graph_warmup_steps=asked.cuda_graph_warmup_steps,  # job/cuda_graphs.py
    )


def _check_overlap(model: Any, training: Training) -> None:
    """Raise ConfigError where no candidate could run the MoE all-to-all overlap whatever its
    layout (job/ep_overlap.py checks each candidate's: expert parallelism, a virtual pipeline)."""
    if not training.ep_overlap:
        return
    if model.num_experts is None:
        raise ConfigError("--overlap-moe-expert-parallel-comm needs an MoE model (--num-experts): "
                          "it overlaps the experts' all-to-all")  # fmt: skip
    if training.moe_token_dispatcher_type not in ("alltoall", "flex"):
        raise ConfigError(
            "--overlap-moe-expert-parallel-comm needs --moe-token-dispatcher-type alltoall or "
            f"flex, not {training.moe_token_dispatcher_type} (megatron-core's TransformerConfig)"
        )


# Megatron-LM's on/off arguments -> what `plan` keeps as given (absent: searched)
SWITCHES = {"use_distributed_optimizer": "distopt", "sequence_parallel": "sp"}


def _check_optimizer(args: dict[str, Any]) -> None:
    """Raise ConfigError for an optimizer the search does not price (Adam, one instance)."""
    instances = args.get("num_distributed_optimizer_instances") or 1
    if (args.get("optimizer") or "adam") != "adam" or instances > 1:
        raise ConfigError(
            "plan searches Adam with one distributed-optimizer instance; `memory` and `params` "
            "measure --optimizer muon / dist_muon and --num-distributed-optimizer-instances"
        )
    check_fsdp_pipeline(args, searched=True)  # a pinned --pp that megatron-core cannot run


def _check_offloading(args: dict[str, Any]) -> None:
    """Raise ConfigError for activation offloading, which the search does not price."""
    for offload in ("fine_grained_activation_offloading", "cpu_offloading"):
        if args.get(offload):
            raise ConfigError(
                f"plan does not price --{offload.replace('_', '-')}: its memory and step time "
                "know no copies to the host; `memory` measures the offloading on a layout you choose"
            )
    if args.get("moe_paged_stash"):  # megatron-core 0.18+ (memory/engine/paged_stash.py)
        raise ConfigError(
            "plan does not price --moe-paged-stash: its memory composes a stage's activations "
            "from closed forms that know no stash pages; `memory` measures the stash (its "
            "profiling iteration and buffers) on a layout you choose"
        )
    if args.get("lora_rank") is not None:  # Bridge's LoRA (job/lora.py, world/lora.py)
        raise ConfigError(
            "plan does not price --lora-rank: its memory composes a stage from trained pieces; "
            "`memory` and `params` measure LoRA's frozen model and adapters on a layout you choose"
        )


def pinned(args: dict[str, Any]) -> dict[str, Any]:
    """Return what the user fixed beyond the sizes: the optimizer and sequence parallelism on or
    off (`--no-...`, a config file's `false`), the layer split's flags, layers per chunk."""
    fixed: dict[str, Any] = {
        short: bool(args[name]) for name, short in SWITCHES.items() if args.get(name) is not None
    }
    if args.get("use_tp_pp_dp_mapping"):
        raise ConfigError(
            "plan does not search --use-tp-pp-dp-mapping jobs: it prices megatron's default rank "
            "order (tp-cp-ep-dp-pp); `memory` and `topology` read the tp-pp-dp order"
        )
    if args.get("microbatch_group_size_per_virtual_pipeline_stage") is not None:
        raise ConfigError(
            "plan prices megatron's default micro-batch group (--pp micro-batches per virtual "
            "stage); `memory` replays --microbatch-group-size-per-virtual-pipeline-stage"
        )
    if args.get("use_torch_fsdp2"):
        raise ConfigError(
            "plan does not search --use-torch-fsdp2 jobs; `memory` measures one, and plan tries "
            "Megatron-FSDP (--use-megatron-fsdp) beside the distributed optimizer"
        )
    _check_optimizer(args)
    _check_offloading(args)
    if args.get("use_megatron_fsdp"):  # a strategy as given, else searched (layouts.distopts)
        fixed["distopt"] = args.get("data_parallel_sharding_strategy") or "fsdp"
    pin = {
        name: args[name] for name in PIN_FLAGS
        if args.get(name) is not None and args[name] is not False
    }
    if pin:
        fixed["pin"] = pin
    if args.get("num_layers_per_virtual_pipeline_stage") is not None:
        if "decoder_first_pipeline_num_layers" in pin or "decoder_last_pipeline_num_layers" in pin:
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                "--decoder-first/last-pipeline-num-layers (Megatron-LM rejects it); use "
                "--num-virtual-stages-per-pipeline-rank"
            )
        fixed["layers_per_chunk"] = args["num_layers_per_virtual_pipeline_stage"]
    return fixed


def _flash(args: dict[str, Any]) -> bool | None:
    """Return flash attention as the user fixed it (None: searched as on in 16 bits).

    As `memory` reads them (job/attention_backend.py flash_attention): --use-flash-attn or --attention-backend
    flash/fused on, --attention-backend unfused/local or --no-use-flash-attn (a config file's
    `false`) off; auto, Megatron-LM's default, leaves it to the plan.
    """
    backend = args.get("attention_backend")
    if args.get("use_flash_attn") or backend in ("flash", "fused"):
        return True
    if args.get("use_flash_attn") is False or backend in ("unfused", "local"):
        return False
    return None


def divisors(n: int) -> list[int]:
    """Return n's divisors, ascending, in sqrt(n) steps (--gpus may be 2**31 - 1)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def moe_layers(model: ModelConfig) -> int:
    """Return the model's MoE layers (0 for a dense model)."""
    if model.num_experts is None:
        return 0
    return sum(model.is_moe_layer(layer) for layer in range(model.num_layers))


def expert_biases(model: ModelConfig) -> bool:
    """Return whether the model's experts carry biases that the installed megatron-core builds
    only at expert tensor parallel 1: TransformerConfig.__post_init__
    (transformer/transformer_config.py) asserts `expert_tensor_parallel_size == 1` ("Bias in
    Moe is only supported when ETP==1") when `num_moe_experts` and `add_bias_linear`; an unset
    expert tp is tp there (ModelParallelConfig.__post_init__)."""
    return model.num_experts is not None and not model.disable_bias_linear and etp_bias_refused()


def _check_expert_tp(model: ModelConfig, fixed: dict[str, Any]) -> None:
    """Raise ConfigError where the user fixed an expert tp megatron-core refuses with biases (a
    searched one is 1: layouts._expert_choices)."""
    if model.num_experts is not None and not model.disable_bias_linear and not etp_bias_refused():
        raise ConfigError(  # 0.13's TransformerConfig.__post_init__ asserts not add_bias_linear
            "--num-experts with biases (no --disable-bias-linear): the installed megatron-core "
            "builds no MoE biases (\"Bias is not supported for MoE\"); add --disable-bias-linear"
        )
    etp = fixed.get("etp", 1)
    if expert_biases(model) and etp > 1:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp} with --num-experts and biases (no "
            "--disable-bias-linear): megatron-core builds MoE biases only at expert tensor parallel 1 "
            "(add --expert-tensor-parallel-size 1 or --disable-bias-linear)"
        )


def _check_sizes(model: ModelConfig, gpus: int) -> None:
    """Raise ConfigError where no plan could be confirmed by `memory` (docs/limits.md)."""
    check_built_layers(model.num_layers)
    if model.num_experts is None:
        return
    ep = max(d for d in divisors(model.num_experts) if d <= gpus)
    cap, kind = expert_cap(model)
    least = model.num_experts // ep * moe_layers(model)
    if least > cap:
        raise ConfigError(
            f"--num-experts {model.num_experts} / the largest expert-parallel size that divides "
            f"it within --gpus {gpus} ({ep}) x {moe_layers(model)} MoE layers = {least:,} {kind} "
            f"per rank, more than the {cap:,} this tool builds (docs/limits.md)"
        )


def _check_counts(flags: PlanFlags, args: dict[str, Any]) -> None:
    """Raise ConfigError naming the first count or fraction out of range, or CUDA graphs."""
    for flag, value in (("--gpus", flags.gpus), ("--gpus-per-node", flags.gpus_per_node),
                        ("--top", flags.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value}")
    if flags.efficiency is not None and not 0 < flags.efficiency <= 1:
        raise ConfigError(f"--efficiency must lie in (0, 1], got {flags.efficiency}")
    if args.get("perform_rl_step"):  # job/rollout.py: `memory` runs megatron's context
        raise ConfigError("--perform-rl-step is not modelled by plan: it prices no GRPO rollouts "
                          "and its memory composition has no rollout KV cache; `memory` counts it "
                          "for one layout")  # fmt: skip
    if args.get("cuda_graph_impl") == "local":  # the search keeps no MoE capacity flags
        raise ConfigError("--cuda-graph-impl local is not modelled by plan: it searches Transformer "
                          "Engine's per-layer graphs (--cuda-graph-impl transformer_engine); "
                          "`memory` counts megatron-core's own graphs for one layout")  # fmt: skip


def _plan_gpu(flags: PlanFlags) -> Gpu:
    """Return the named GPU type with the figures the user gave."""
    gpu = with_overrides(
        get_gpu(flags.gpu), flags.gpu_tflops, flags.gpu_memory, flags.intra_node_bandwidth,
        flags.inter_node_bandwidth,
    )
    if flags.gpus_per_node is not None:
        gpu = replace(gpu, gpus_per_node=flags.gpus_per_node)
    if flags.kernels is not None:
        if flags.efficiency is not None:
            raise ConfigError("--efficiency prices every FLOP at one fraction of the peak; "
                              "--kernels prices each kernel from a measured table: pass one")
        gpu = replace(gpu, kernels=flags.kernels)
    return gpu
