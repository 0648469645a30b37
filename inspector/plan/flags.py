"""The Megatron-LM flags that reproduce a plan, in Megatron-LM's spelling."""

from __future__ import annotations

from inspector.job import fp8
from inspector.job.job import Job, Training
from inspector.job.model import ModelConfig
from inspector.job.recompute_modules import DEFAULT_MODULES
from inspector.job.versions import FLEX_BACKEND_SINCE, megatron_version, router_padding_field
from inspector.plan.split import Split


def megatron_flags(job: Job, split: Split) -> list[str]:
    """Return the launch-script flags of a plan: parallel sizes, split, batch, recompute, dtype,
    and the model's own flags where Megatron-LM's default would build a different job."""
    training = job.training
    out = _parallel_flags(job) + _split_flags(job)
    out += [f"--micro-batch-size {training.micro_batch_size}",
            f"--global-batch-size {training.global_batch_size}"]
    out += _recompute_flags(training) + _dtype_flags(job) + _model_flags(job) + _dropout_flags(training)
    out += [f"--no-{name.replace('_', '-')}" for name in training.unfused]
    if training.flash_attention:
        out.append("--use-flash-attn")
    elif job.model.transformer_impl == "transformer_engine" and job.model.dtype_name != "float32":
        # Megatron-LM's default backend (auto) would pick flash/fused attention here
        out.append("--attention-backend unfused")
    if job.model.num_experts is not None and training.moe_token_dispatcher_type != "allgather":
        out.append(f"--moe-token-dispatcher-type {training.moe_token_dispatcher_type}")
        if training.moe_token_dispatcher_type == "flex":  # job/flex.py: the backend's spelling
            out.append(f"--moe-flex-dispatcher-backend {training.moe_flex_backend}"
                       if megatron_version() >= FLEX_BACKEND_SINCE else "--moe-enable-deepep")
        if training.moe_router_padding:  # the version's own spelling (job/versions.py)
            out.append("--" + router_padding_field().replace("_", "-"))
    out += _feature_flags(training)
    if training.megatron_fsdp:
        out += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {training.sharding_strategy}",
                "--use-distributed-optimizer", "--ckpt-format fsdp_dtensor"]  # fmt: skip
    elif training.use_distributed_optimizer:
        out += ["--use-distributed-optimizer", "--overlap-param-gather"]
    out += _optimizer_precision_flags(training)
    out.append("--overlap-grad-reduce")
    if training.packed_document_length is not None:  # packed sequences (the documents' length
        out.append("--sft")  # is the data's: no Megatron-LM flag)
    return out


def _feature_flags(training: Training) -> list[str]:
    """Return the overlaps, fusions, CUDA graphs and capacity the job was asked with."""
    out = [flag for flag, on in (("--overlap-moe-expert-parallel-comm", training.ep_overlap),
                                 ("--delay-wgrad-compute", training.delay_wgrad),
                                 ("--tp-comm-overlap", training.tp_comm_overlap),
                                 ("--use-transformer-engine-op-fuser", training.op_fuser)) if on]  # fmt: skip
    if training.cuda_graph_impl != "none":  # job/cuda_graphs.py: () graphs whole layers
        out.append(f"--cuda-graph-impl {training.cuda_graph_impl}")
        if training.cuda_graph_scope:
            out.append(f"--cuda-graph-scope {' '.join(training.cuda_graph_scope)}")
    if training.moe_expert_rank_capacity_factor is not None:
        out.append(f"--moe-expert-rank-capacity-factor {training.moe_expert_rank_capacity_factor:g}")
    return out


def _parallel_flags(job: Job) -> list[str]:
    lay = job.layout
    out = [
        f"--tensor-model-parallel-size {lay.tp}",
        f"--pipeline-model-parallel-size {lay.pp}",
    ]
    if lay.cp > 1:
        out.append(f"--context-parallel-size {lay.cp}")
    if lay.ep > 1:
        out.append(f"--expert-model-parallel-size {lay.ep}")
    if lay.etp is not None:
        out.append(f"--expert-tensor-parallel-size {lay.etp}")
    if lay.sequence_parallel:
        out.append("--sequence-parallel")
    return out


def _split_flags(job: Job) -> list[str]:
    """Return the layout's own split flags (layouts.layout_for put them there), as typed."""
    lay = job.layout
    if lay.pipeline_model_parallel_layout is not None:
        return [f"--pipeline-model-parallel-layout {lay.pipeline_model_parallel_layout!r}"]
    out = [f"--num-virtual-stages-per-pipeline-rank {lay.chunks}"] if lay.chunks > 1 else []
    for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if getattr(lay, name) is not None:
            out.append(f"--{name.replace('_', '-')} {getattr(lay, name)}")
    for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(lay, name):
            out.append("--" + name.replace("_", "-"))
    return out


def _recompute_flags(training: Training) -> list[str]:
    if training.recompute == "none":
        return []
    out = [f"--recompute-granularity {training.recompute}"]
    if training.recompute == "selective" and training.recompute_modules != DEFAULT_MODULES:
        out.append(f"--recompute-modules {' '.join(training.recompute_modules)}")
    if training.recompute == "full":
        out += [f"--recompute-method {training.recompute_method}",
                f"--recompute-num-layers {training.recompute_num_layers}"]
    return out


def _dtype_flags(job: Job) -> list[str]:
    dtype, fp32_grads = job.model.dtype_name, job.training.fp32_grads
    if dtype == "bfloat16":
        return ["--bf16"] + (["--grad-reduce-in-bf16"] if fp32_grads is False else [])
    if dtype == "float16":
        return ["--fp16"] + (["--accumulate-allreduce-grads-in-fp32"] if fp32_grads else [])
    return []


def _low_precision_flags(model: ModelConfig) -> list[str]:
    """Return NVFP4's and the 16-bit first and last layers' flags (job/fp4.py)."""
    out = []
    if model.fp4_format is not None:
        out += [f"--fp4-format {model.fp4_format}", f"--fp4-recipe {model.fp4_recipe}"]
        out += ["--fp4-param-gather"] if model.fp4_param_gather else []
    if model.first_last_layers_bf16:
        out += ["--first-last-layers-bf16",
                f"--num-layers-at-start-in-bf16 {model.num_layers_at_start_in_bf16}",
                f"--num-layers-at-end-in-bf16 {model.num_layers_at_end_in_bf16}"]  # fmt: skip
    return out


def _model_flags(job: Job) -> list[str]:
    """Return the model's implementation flags the priced job needs in Megatron-LM's words: its
    default is Transformer Engine (`--transformer-impl`), grouped GEMM off, no fp8 (TransformerConfig's
    `fp8_recipe` delayed and `fp8_amax_history_len` 1 unless given)."""
    model = job.model
    out = ["--transformer-impl local"] if model.transformer_impl == "local" else []
    if model.num_experts is not None and model.moe_grouped_gemm:
        out.append("--moe-grouped-gemm")
    out += _low_precision_flags(model)
    if model.fp8_format is None:
        return out
    out += [f"--fp8-format {model.fp8_format}", f"--fp8-recipe {model.fp8_recipe}"]
    if model.fp8_amax_history_len != fp8.DEFAULT_AMAX_HISTORY_LEN:
        out.append(f"--fp8-amax-history-len {model.fp8_amax_history_len}")
    if model.fp8_param_gather:
        out.append("--fp8-param-gather")
    if model.reuse_grad_buf_for_mxfp8_param_ag:
        out.append("--reuse-grad-buf-for-mxfp8-param-ag")
    if model.fp8_dot_product_attention:
        out.append("--fp8-dot-product-attention")
    return out


def _dropout_flags(training: Training) -> list[str]:
    defaults = Training()
    return [
        f"--{name.replace('_', '-')} {getattr(training, name)}"
        for name in ("attention_dropout", "hidden_dropout")
        if getattr(training, name) != getattr(defaults, name)
    ]


def _optimizer_precision_flags(training: Training) -> list[str]:
    """Return --use-precision-aware-optimizer and its dtypes that are not Megatron-LM's fp32."""
    precision = training.optimizer_precision
    if not precision.precision_aware:
        return []
    out = ["--use-precision-aware-optimizer"]
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(precision, name) != "fp32":
            out.append(f"--{name.replace('_', '-')} {getattr(precision, name)}")
    return out
