"""The range checks every record makes of a size or count, each naming the flag the user typed
(and the few flag combinations Megatron-LM refuses before any size)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.job.flex import DEFAULT_BACKEND
from inspector.job.versions import megatron_version

# The largest size or count a flag may give: shapes beyond it overflow torch's index type (and no
# GPU holds a dimension that long), so a larger value is an error naming the flag, not C++ frames.
MAX_SIZE = 2**31 - 1
MAX_BUILT_LAYERS = 1024  # 8x the deepest published model; megatron builds ~15 ms a layer


def check_at_least_one(flag: str, value: int | None) -> None:
    """Raise ConfigError when a size or count given as `flag` is below one or too large to build.

    None means not given.
    """
    if value is None:
        return
    if value < 1:
        raise ConfigError(f"{flag} must be at least 1, got {value}")
    check_at_most(flag, value)


def check_count(flag: str, value: int | None) -> None:
    """Raise ConfigError for a count (0 allowed) below 0 or larger than this tool can simulate."""
    if value is not None and value < 0:
        raise ConfigError(f"{flag} {value} must not be negative")
    check_at_most(flag, value)


def check_at_most(flag: str, value: int | None) -> None:
    """Raise ConfigError when `flag`'s integer is larger than this tool can simulate."""
    if value is not None and value > MAX_SIZE:
        raise ConfigError(
            f"{flag} {value} is larger than this tool can simulate (at most {MAX_SIZE})"
        )


def check_heads(hidden: int, heads: int, kv_channels: int | None) -> None:
    """Raise ConfigError unless heads split the hidden size (or --kv-channels sets the head size)."""
    if kv_channels is None and hidden % heads:
        raise ConfigError(
            f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads} "
            f"({hidden} % {heads} = {hidden % heads}); pass --kv-channels to set the head size"
        )


def check_query_groups(heads: int, groups: int) -> None:
    """Raise ConfigError unless the key/value groups split the attention heads."""
    if heads % groups:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups} "
            f"({heads} % {groups} = {heads % groups})"
        )


def check_ffn_split(ffn: int, tp: int) -> None:
    """Raise ConfigError unless the dense MLP's hidden size splits over tensor-parallel ranks."""
    if ffn % tp:
        raise ConfigError(
            f"--ffn-hidden-size {ffn} is not divisible by --tp {tp} ({ffn} % {tp} = {ffn % tp}): "
            "megatron splits the MLP's columns over tensor-parallel ranks"
        )


def check_built_layers(num_layers: int) -> None:
    """Raise ConfigError for more layers than this tool builds in reasonable time."""
    if num_layers > MAX_BUILT_LAYERS:
        raise ConfigError(
            f"--num-layers {num_layers} is more than this tool builds (at most "
            f"{MAX_BUILT_LAYERS}: megatron-core takes about 15 ms to build each layer; "
            "docs/limits.md)"
        )


def check_cp_chunks(seq: int, cp: int) -> None:
    """Raise ConfigError unless every sequence splits into 2 x cp equal chunks."""
    chunks = 2 * cp
    if cp > 1 and seq % chunks:
        # megatron-core utils.get_batch_on_this_cp_rank and rope_utils.get_pos_emb_on_this_cp_rank
        # view each sequence as 2 x cp equal chunks (rank r takes chunks r and 2cp-1-r).
        raise ConfigError(
            f"--seq-length {seq} is not divisible by 2 x --context-parallel-size {cp} = "
            f"{chunks} ({seq} % {chunks} = {seq % chunks}): megatron splits every sequence into "
            "2 x cp equal chunks"
        )


def check_sequence_split(seq: int, tp: int, cp: int) -> None:
    """Raise ConfigError unless each context-parallel rank's tokens split over the tensor-parallel
    ranks, as sequence parallelism's first forward needs (megatron-core tensor_parallel/mappings.py
    _split_along_first_dim: "First dimension of the tensor should be divisible by tensor parallel
    size"; a build passes)."""
    if (seq // cp) % tp:
        local = f"--seq-length {seq} / --context-parallel-size {cp} = {seq // cp}" if cp > 1 else (
            f"--seq-length {seq}")
        raise ConfigError(
            f"{local} is not divisible by --tp {tp} ({seq // cp} % {tp} = {(seq // cp) % tp}): "
            "--sequence-parallel splits each sequence's tokens over the tensor-parallel ranks"
        )


def check_expert_groups(ep: int, etp: int, tp: int, cp: int, dp: int, pp: int = 1) -> None:
    """Megatron carves expert groups (ep x etp ranks) out of the tp x cp x dp dense ranks of each
    pipeline stage (parallel_state.initialize_model_parallel, 0.16-0.19: "world_size (W) is not
    divisible by expert_tensor_model_pipeline_parallel size (etp x ep x pp)")."""
    dense = tp * cp * dp
    if dense % (ep * etp):
        raise ConfigError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} "
            f"does not divide --tp {tp} x --context-parallel-size {cp} x --dp "
            f"{dp} = {dense} (megatron carves expert groups out of those ranks; megatron-core's "
            f"initialize_model_parallel raises 'world_size ({dense * pp}) is not divisible by "
            f"expert_tensor_model_pipeline_parallel size ({etp * ep * pp})')"
        )


def check_deterministic(args: Mapping[str, Any]) -> None:
    """Refuse what Megatron-LM's validate_args refuses with --deterministic-mode (0.13-0.19:
    `assert not args.use_flash_attn`, `assert not args.cross_entropy_loss_fusion`)."""
    if not args.get("deterministic_mode"):
        return
    for name, why in (("use_flash_attn", "Flash attention can not be used in deterministic mode."),
                      ("cross_entropy_loss_fusion",
                       "Cross Entropy Fusion is currently not deterministic.")):  # fmt: skip
        if args.get(name):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"--deterministic-mode with {flag}: Megatron-LM's validate_args "
                              f"refuses it ('{why}')")  # fmt: skip


# megatron-core 0.19 locks Transformer Engine 2.17 (the stand-in declares it, world/te): its
# ScaledSReLU, `activation_recompute_in_mlp` and fused grouped MLP with the clamped quick-GEGLU,
# squared ReLU and biases (world/te/ops.py, fused_mlp.py); 0.18 locks 2.16, which has none
TE_217_SINCE = (0, 19)


def check_op_fuser(args: Mapping[str, Any]) -> None:
    """Refuse what --use-transformer-engine-op-fuser would run that is not simulated: the MoE
    experts' fused operations (world/te/ops.py: SwiGLU, clamped quick-GEGLU or squared ReLU,
    with or without biases) run in 16 bits or as MXFP8's fused grouped MLP (fused_mlp.py), with
    or without delayed weight gradients."""
    if not args.get("use_transformer_engine_op_fuser") or not args.get("num_experts"):
        return  # megatron-core 0.18-0.19 read it in TEGroupedMLP only
    te_217 = megatron_version() >= TE_217_SINCE
    mxfp8 = args.get("fp8_format") and args.get("fp8_recipe") == "mxfp8" and not args.get("fp4_format")
    if args.get("recompute_granularity") == "selective" and "moe_act" in (
        args.get("recompute_modules") or ()
    ):  # experts.py `_make_fused_ops` (0.19.2 484): TE's own activation recompute
        if not te_217:
            raise ConfigError(
                "--use-transformer-engine-op-fuser with --recompute-modules moe_act is not "
                "modelled before megatron-core 0.19 (Transformer Engine 2.17's "
                "activation_recompute_in_mlp)")  # fmt: skip
        if not mxfp8:  # v2.17.1 ops/basic/swiglu.py 426-430, activation.py 396-400
            raise ConfigError(
                "--use-transformer-engine-op-fuser with --recompute-modules moe_act needs "
                "--fp8-recipe mxfp8: megatron-core passes activation_recompute_in_mlp to "
                "Transformer Engine's fused activation (experts.py _make_fused_ops), and TE "
                "2.17's basic operations refuse it ('activation_recompute_in_mlp=True requires "
                "the fused grouped MLP path.'), which runs in MXFP8 only")  # fmt: skip
    if not args.get("swiglu") and not args.get("quick_geglu") and not te_217:
        # experts.py `_is_fused_impl_supported` (0.19.2): squared ReLU fuses through TE 2.17's
        # ScaledSReLU when --use-fused-weighted-squared-relu
        raise ConfigError(
            "--use-transformer-engine-op-fuser with experts other than SwiGLU or --quick-geglu "
            "(squared ReLU) is not modelled before megatron-core 0.19: megatron-core fuses them "
            "through Transformer Engine 2.17's ScaledSReLU (experts.py "
            "_is_fused_impl_supported)")  # fmt: skip
    quantized = [name for name in ("fp8_format", "fp4_format") if args.get(name)]
    # MXFP8 runs TE's fused grouped MLP where TE's fuser takes it (world/te/fused_mlp.py `taken`;
    # where it does not, the run stops naming TE's basic quantized operations)
    gated_biased = args.get("quick_geglu") or not args.get("disable_bias_linear")
    if quantized == ["fp8_format"] and gated_biased and not te_217:
        what = "--quick-geglu" if args.get("quick_geglu") else "biased experts (no --disable-bias-linear)"
        raise ConfigError(
            f"--use-transformer-engine-op-fuser with --fp8-format and {what} is not modelled "
            "before megatron-core 0.19: Transformer Engine 2.17 runs them through its fused "
            "grouped MLP (ops/fused/grouped_mlp.py); 2.14's takes MXFP8 SwiGLU without biases "
            "only; in 16 bits they are modelled")  # fmt: skip
    if quantized and not mxfp8:
        flag = "--" + quantized[0].replace("_", "-")
        raise ConfigError(
            f"--use-transformer-engine-op-fuser with {flag} {args[quantized[0]]} is not modelled "
            "beyond Transformer Engine's CuTe DSL fused grouped MLP (--fp8-recipe mxfp8, "
            "Blackwell GPUs: ops/fused/forward_grouped_mlp.py, 2.17 grouped_mlp.py): its basic "
            "operations quantizing each expert GEMM's input (ops/basic/grouped_linear.py "
            "split_quantize) are not simulated; the op fuser in 16 bits is modelled")  # fmt: skip
    etp = args.get("expert_tensor_parallel_size") or args.get("tensor_model_parallel_size") or 1
    if etp > 1:  # Megatron-LM's validate_args: the experts' tp defaults to --tp
        raise ConfigError(
            f"--use-transformer-engine-op-fuser with an expert tensor-parallel size of {etp} "
            "(--expert-tensor-parallel-size, else --tp): megatron-core's TEGroupedMLP asserts "
            "'Fused GroupedMLP is not supported for this configuration' (experts.py "
            "_is_fused_impl_supported: tensor parallelism is not supported); pass "
            "--expert-tensor-parallel-size 1")  # fmt: skip


def check_rank_capacity(args: Mapping[str, Any]) -> None:
    """Refuse --moe-expert-rank-capacity-factor where megatron-core 0.18+'s TransformerConfig
    refuses it (transformer_config.py __post_init__: the flex dispatcher's hybridep backend, the
    only one this tool runs that takes it, and there with the op fuser), or a factor that gives
    no budget (setup_metadata: int(tokens x topk x factor) permuted tokens a rank)."""
    factor = args.get("moe_expert_rank_capacity_factor")
    if factor is None or not args.get("num_experts"):
        return
    if not factor >= 1:  # balanced routing sends each rank tokens x topk rows
        raise ConfigError(f"--moe-expert-rank-capacity-factor {factor} below 1 is not modelled: "
                          "HybridEP's budget of int(tokens x topk x factor) permuted tokens a rank "
                          "is under what balanced routing sends it, and which tokens HybridEP's "
                          "kernel drops is not simulated")  # fmt: skip
    backend = args.get("moe_flex_dispatcher_backend") or DEFAULT_BACKEND
    if args.get("moe_token_dispatcher_type") != "flex" or backend != "hybridep":
        raise ConfigError("--moe-expert-rank-capacity-factor needs --moe-token-dispatcher-type flex "
                          "with --moe-flex-dispatcher-backend hybridep (megatron-core's "
                          "TransformerConfig: 'moe_expert_rank_capacity_factor requires "
                          "moe_flex_dispatcher_backend to be 'hybridep' or 'ncclep'.'; ncclep is "
                          "not modelled)")  # fmt: skip
    if not args.get("use_transformer_engine_op_fuser"):
        raise ConfigError("--moe-expert-rank-capacity-factor with the hybridep backend needs "
                          "--use-transformer-engine-op-fuser (megatron-core's TransformerConfig: "
                          "'moe_expert_rank_capacity_factor with the 'hybridep' backend requires "
                          "use_transformer_engine_op_fuser to be enabled.')")  # fmt: skip


def check_paged_stash(args: Mapping[str, Any]) -> None:
    """Refuse --moe-paged-stash where megatron-core 0.18+'s TransformerConfig refuses it (no rank
    budget: transformer_config.py __post_init__), and buffer factors that leave the stash short:
    `allocate_stash_buffers` sizes the GPU buffer |cuda| and the host one |cpu| times the tokens
    the profiling iteration counted, balanced routing sends that many again, and what overflows
    sends megatron's PagedStashRunner to rerun the step without the stash (not simulated)."""
    if not args.get("moe_paged_stash") or not args.get("num_experts"):
        return
    if args.get("moe_expert_rank_capacity_factor") is None:
        raise ConfigError("--moe-paged-stash needs --moe-expert-rank-capacity-factor (megatron-core's "
                          "TransformerConfig: 'moe_paged_stash requires moe_expert_rank_capacity_factor "
                          "to be set; there is no need to use paged stashing without it.')")  # fmt: skip
    if args.get("train_iters") == 1:
        raise ConfigError("--train-iters 1 with --moe-paged-stash is not modelled: megatron's only "
                          "iteration is then the stash's profiling one (no page buffers, the rows "
                          "received kept whole), and `memory` reports the iterations after it")  # fmt: skip
    cuda = args.get("moe_paged_stash_buffer_size_factor_cuda")
    cpu = args.get("moe_paged_stash_buffer_size_factor_cpu")
    cuda, cpu = 1.10 if cuda is None else cuda, 0.0 if cpu is None else cpu  # TransformerConfig's
    if not abs(cuda) + abs(cpu) >= 1:
        raise ConfigError(f"--moe-paged-stash-buffer-size-factor-cuda {cuda:g} with "
                          f"--moe-paged-stash-buffer-size-factor-cpu {cpu:g} is not modelled: the "
                          f"stash's buffers hold |{cuda:g}| + |{cpu:g}| = {abs(cuda) + abs(cpu):g} "
                          "times the tokens its profiling iteration counted, under 1, so balanced "
                          "routing overflows them and megatron reruns the step without the stash "
                          "(PagedStashRunner), which is not simulated")  # fmt: skip
