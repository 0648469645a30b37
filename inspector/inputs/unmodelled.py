"""Megatron-LM's arguments that this tool does not model and refuses by name, with the reason.

Every argument of Megatron-LM's `megatron/training/arguments.py` (megatron-core 0.13 to 0.19) that
changes what a GPU holds or computes is either modelled (inspector.inputs.arguments) or refused
here; the others are ignored with their reason (inspector.inputs.ignored).
tests/test_argument_classes.py walks Megatron-LM's own argument lists and checks each is classified.
A script argument in none of the tables is reported as not recognised. This module imports nothing
heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from inspector.inputs import versions
from inspector.inputs.paged_stash import PAGED_STASH_REFUSED
from inspector.inputs.versions import LAYER_WISE_RELEASES, MUON_RELEASES, megatron_core_version


@dataclass(frozen=True)
class Refusal:
    """Why an argument cannot be modelled; `harmless` values change nothing (the default)."""

    group: str  # the argument group (inspector.inputs.arguments) whose commands it would change
    reason: str
    harmless: tuple[str, ...] = ()
    # modelled on the megatron-core releases of these [first, stop) ranges (a value)
    modelled: tuple[tuple[tuple[int, int], tuple[int, int]], ...] | None = None



# train_rl.py --perform-rl-step (job/rollout.py, Megatron-LM d98e8a6): what would change the GPU's
# memory at the training step beyond the rollout engine's KV cache in the policy's own layout
_SECOND_COPY = (
    "a second copy of the model in another parallel layout for the rollouts (training.py "
    "L1838-1900) is not modelled; without it the rollouts run the policy itself")
_KV_AWAY = ("the KV cache moved off the GPU for the training step is not modelled; "
            "--rl-kv-cache-management-mode persist (the default) is")
_KV_LAYOUT = "a rollout KV cache other than megatron-core's standard block pool is not modelled"
_GRAPH_SIZES = ("the rollout engine's CUDA graphs with another token bound than megatron-core's "
                "default are not modelled: the graphs it keeps through the training step are counted "
                "from the default list")
RL_REFUSED: dict[str, Refusal] = {
    **{flag: Refusal("training", _SECOND_COPY) for flag in (
        "--rl-inference-tensor-model-parallel-size", "--rl-inference-pipeline-model-parallel-size",
        "--rl-inference-expert-model-parallel-size",
        "--rl-inference-expert-tensor-model-parallel-size",
        "--rl-inference-model-unified-memory-level", "--rl-offload-inference-model-weights-when-idle")},
    **{flag: Refusal("training", _KV_AWAY) for flag in (
        "--rl-offload-kv-cache-during-training", "--rl-remove-kv-cache-during-training")},
    **{flag: Refusal("training", _KV_LAYOUT) for flag in (
        "--cache-mla-latents", "--num-speculative-tokens", "--inference-dynamic-batching-prefix-caching",
        "--inference-dynamic-batching-mamba-memory-ratio",
        "--inference-dynamic-batching-prefix-caching-mamba-gb", "--mamba-inference-conv-states-dtype",
        "--mamba-inference-ssm-states-dtype", "--use-legacy-static-engine",
        "--inference-dynamic-batching-buffer-guaranteed-fraction",
        "--inference-dynamic-batching-buffer-overflow-factor",
        "--inference-dynamic-batching-chunk-size",
        "--inference-dynamic-batching-max-requests-override",
        "--inference-dynamic-batching-max-tokens-override")},
    # what sizes the rollout engine's CUDA graphs beyond the flags read (job/rollout.py): the
    # token bound of its prefill and mixed graphs (megatron-core's dynamic_context.py
    # `cuda_graph_max_tokens`, `cuda_graph_all_prefills`)
    **{flag: Refusal("training", _GRAPH_SIZES) for flag in (
        "--inference-cuda-graph-max-tokens", "--inference-dynamic-batching-cuda-graph-max-tokens",
        "--inference-cuda-graph-all-prefills")},
    "--rl-sequence-packing-bin-size": Refusal(
        "training", "GRPO bins of another length than --seq-length are not modelled: the "
        "training micro-batches are counted as --seq-length tokens"),
}

# megatron-core 0.16.1's DDP points each quantized weight at a one-byte-an-element uint8 view
# through TE's replace_raw_data, which TE 2.11 refuses for an NVFP4Tensor (tensor/utils.py 50-51;
# TE 2.14's NVFP4 branch copies packed [M, K/2] bytes, no fit for an [M, K] view either)
_FP4_PARAMS = (
    "megatron-core 0.13-0.16's DDP points each NVFP4 weight into a one-byte-per-element param "
    "buffer through Transformer Engine's replace_raw_data, which Transformer Engine 2.11 (the "
    "newest megatron-core 0.16 accepts) refuses ('not supported yet'), and its distributed "
    "optimizer has no NVFP4 cast; megatron-core 0.17 or later runs it with Transformer Engine "
    "2.14, and from 0.18 it is modelled; --fp4-format without it is modelled"
)
_FP8_PART = (
    "fp8 for only part of the model (16-bit weight gradients, fp8 multi-head attention) is not "
    "modelled; --fp8-format runs every Transformer Engine linear in fp8 (but the layers "
    "--first-last-layers-bf16 keeps in 16 bits)"
)
_FSDP = (
    "FSDP2 keeping the gathered parameters from the forward to the backward (ZeRO-2) is not "
    "modelled; --use-torch-fsdp2 alone (resharding after the forward) is"
)
# the layer spec Megatron-LM's examples/mamba/train.sh gives pretrain_mamba.py: what is built
MAMBA_STACK_SPEC = "megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec"
# its home from megatron-core 0.18 (models/hybrid/hybrid_layer_specs.py: `mamba_stack_spec =
# hybrid_stack_spec`, the same spec), as pretrain_hybrid.py's functional tests name it
HYBRID_STACK_SPEC = "megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec"
HYBRID_SPEC_SINCE = (0, 18)
_QK_L2 = (
    "Llama 4's L2 norm of queries and keys (megatron-core L2Norm, no weights, in place of "
    "--qk-layernorm's norms) is not modelled"
)
_DSA = (
    "this variant of DeepSeek sparse attention's indexer (megatron-core 0.19: GLM-5's indexer "
    "without rotation or ReLU) is not modelled; DeepSeek-V3.2's is"
)
_DSA_SHARE = (
    "DSA's top-k shared across layers (GLM-5.2's IndexShare) is megatron-core 0.19's "
    "(TransformerConfig.dsa_indexer_topk_freq); this megatron-core has no such field"
)
_DSA_KERNELS = (
    "DSA's fused TileLang and cuDNN kernels are not simulated; megatron's own PyTorch path "
    "(--dsa-kernel-backend none) is"
)
_QUANTIZERS = "ModelOpt's quantizers (fake-quantized weights and inputs) are not counted"
_OPTIMIZER = "this optimizer's state is not counted (Adam's two fp32 moments are)"
_MUON_LATER = (
    "this megatron-core's Muon is not run by this tool (it runs megatron-core 0.16-0.19's "
    "--optimizer muon and layer-wise dist_muon)"
)
_MFSDP_DTYPE = (
    "Megatron-FSDP's buffer dtypes other than the default are not modelled (the buffers are "
    "counted as megatron-core 0.16 allocates them)"
)
_MFSDP_POOL = "Megatron-FSDP's double-buffer allocator options are not modelled"
_FROZEN = "frozen parameters hold no gradients or optimizer state, which this tool does not model"
_FACTORY = "a custom quantizer factory (a Python import) is not run by this tool"
_HYBRIDEP = (
    "HybridEP's buffers are counted for megatron-core 0.16's defaults (16 SMs, no fused permute); "
    "other kernel settings are not modelled"
)
_ENCODER = "an encoder's own parallel grid (megatron-core 0.13's encoder-decoder models) is not modelled"
_EVAL = "evaluation's own micro-batch size (its forward-only peak) is not modelled"
_GTP = "weights sharded further than tensor parallelism (Megatron-LM's GTP) are not modelled"
_FUSION = "this fused kernel (its own saved tensors) is not modelled"
_GROUPED = "weights held as Transformer Engine grouped parameters are not modelled"
_NO_PAD = "an unpadded vocabulary is not modelled; pass --padded-vocab-size"

REFUSED: dict[str, Refusal] = {
    "--fp4-param-gather": Refusal("training", _FP4_PARAMS, modelled=versions.FP4_PARAM_RELEASES),
    "--no-fp8-wgrad": Refusal("training", _FP8_PART),
    "--fp8-multi-head-attention": Refusal("training", _FP8_PART),
    "--torch-fsdp2-no-reshard-after-forward": Refusal("layout", _FSDP),
    "--use-legacy-models": Refusal("model", "this tool builds megatron-core (mcore) models only"),
    "--spec": Refusal("model", "a custom layer spec module cannot be imported here",
                      (MAMBA_STACK_SPEC, HYBRID_STACK_SPEC)),  # fmt: skip
    **RL_REFUSED,
    "--yaml-cfg": Refusal("model", "arguments in a Megatron-LM YAML config are not read; pass them"),
    "--heterogeneous-layers-config-path": Refusal("model", "heterogeneous layers are not modelled"),
    "--heterogeneous-layers-config-encoded-json": Refusal(
        "model", "heterogeneous layers are not modelled"),
    # TransformerConfig.use_mamba_mem_eff_path False: MambaMixer's `_ssm_prefill` in training
    "--disable-mamba-mem-eff-path": Refusal(
        "training", "Mamba's non-memory-efficient path (causal_conv1d and the chunked scan as "
        "separate kernels) is not simulated"),  # fmt: skip
    # megatron-core gpt_layer_specs: `L2Norm if qk_l2_norm else (qk_norm if qk_layernorm ...)`
    "--qk-l2-norm": Refusal("model", _QK_L2),
    # ModelOpt's arguments (megatron/post_training/arguments.py), read by its finetune.py
    "--export-qk-l2-norm": Refusal("model", _QK_L2),
    # megatron/post_training/model_builder.py: MambaModel gets ModelOpt's own layer spec
    "--export-model-type": Refusal(
        "model", "ModelOpt's builder for a model other than GPTModel (its own MambaModel layer "
        "spec) is not modelled", ("GPTModel",)),  # fmt: skip
    "--export-kd-teacher-load": Refusal(
        "model", "ModelOpt's distillation holds a teacher model beside the one trained, which "
        "this tool does not build"),  # fmt: skip
    "--export-offline-model": Refusal(
        "model", "ModelOpt's offline speculative-decoding model has no decoder layers, which "
        "this tool does not build"),  # fmt: skip
    "--export-quant-cfg": Refusal("training", _QUANTIZERS, ("None",)),
    "--export-real-quant-cfg": Refusal("training", _QUANTIZERS, ("None",)),
    "--export-kv-cache-quant": Refusal("training", _QUANTIZERS, ("none",)),
    "--qad-train-target": Refusal("training", _FROZEN),
    "--freeze-base-for-mtp": Refusal("training", _FROZEN),
    # megatron-core 0.19's further DSA fields (transformer_config.py 312-343 at 0.19.2), read by
    # Megatron-LM as arguments: indexer top-k shared across layers, fused kernels, GLM-5's indexer
    "--dsa-indexer-topk-freq": Refusal("model", _DSA_SHARE, ("1",),
                                       modelled=versions.DSA_INDEX_SHARE_RELEASES),
    "--dsa-indexer-skip-topk-offset": Refusal("model", _DSA_SHARE, ("0",),
                                              modelled=versions.DSA_INDEX_SHARE_RELEASES),
    "--dsa-kernel-backend": Refusal("training", _DSA_KERNELS, ("none",)),
    "--dsa-indexer-rope-interleaved": Refusal("model", _DSA),
    "--no-dsa-indexer-rotate-activation": Refusal("model", _DSA),
    "--disable-dsa-indexer-rotate-activation": Refusal("model", _DSA),
    "--no-dsa-indexer-scoring-relu": Refusal("model", _DSA),
    "--disable-dsa-indexer-scoring-relu": Refusal("model", _DSA),
    "--dsa-indexer-k-norm-epsilon": Refusal("model", _DSA),
    "--dsa-indexer-k-norm-fp32": Refusal("model", _DSA),
    "--vocab-extra-ids": Refusal("model", "extra ids change the vocabulary; pass --vocab-size"),
    "--moe-use-legacy-grouped-gemm": Refusal(
        "model", "the legacy GroupedMLP under Transformer Engine is not modelled"),
    "--moe-extended-tp": Refusal("layout", "removed from Megatron-LM; use "
                                 "--expert-tensor-parallel-size"),  # fmt: skip
    "--distribute-saved-activations": Refusal(
        "training", "checkpoints split across tensor-parallel ranks are not modelled"),
    "--optimizer-cpu-offload": Refusal("training", "optimizer state on the CPU is not modelled"),
    "--fp32-residual-connection": Refusal(
        "training", "an fp32 residual stream changes activations, which are counted in 16 bits"),
    "--fp16-lm-cross-entropy": Refusal(
        "training", "16-bit logits of the loss are not modelled (they are counted in fp32)"),
    "--ddp-num-buckets": Refusal("layout", "pass --ddp-bucket-size (buckets decide the padding)"),
    "--ddp-pad-buckets-for-high-nccl-busbw": Refusal(
        "layout", "bucket padding for NCCL bus bandwidth is not modelled"),
    # megatron-core 0.18+'s MoE paged stash and what it needs (inputs/paged_stash.py)
    **{flag: Refusal(*row) for flag, row in PAGED_STASH_REFUSED.items()},
    # Megatron-LM main (megatron/training/arguments.py, after core_v0.19.0): Megatron-FSDP's
    # buffer dtypes and allocators; its default values are the buffers megatron-core 0.16 holds
    # fp32 main gradients reduced in fp32 are what megatron-core 0.16's Megatron-FSDP allocates
    # for a 16-bit model (its ParamAndGradBuffer: fp32 unless --grad-reduce-in-bf16): Megatron-LM
    # main's functional tests ask for them by these values
    "--megatron-fsdp-main-grads-dtype": Refusal("layout", _MFSDP_DTYPE, ("auto", "fp32")),
    "--megatron-fsdp-main-params-dtype": Refusal("layout", _MFSDP_DTYPE, ("fp32",)),
    "--megatron-fsdp-grad-comm-dtype": Refusal("layout", _MFSDP_DTYPE, ("auto", "fp32")),
    "--megatron-fsdp-max-pool-double-buffer": Refusal("layout", _MFSDP_POOL),
    "--fsdp-db-use-persist-buf-on-alloc-fail": Refusal("layout", _MFSDP_POOL),
    "--megatron-fsdp-enable-fine-grained-param-gather": Refusal(
        "layout", "Megatron-FSDP's fine-grained parameter gather changes the gathered buffers, "
        "which are counted per FSDP unit"),  # fmt: skip
    # core_v0.16.1 arguments.py: HSDP's outer sharding of the optimizer state
    "--outer-dp-sharding-strategy": Refusal(
        "layout", "optimizer state sharded over the outer data-parallel group (HSDP) is not "
        "modelled", ("no_shard",)),  # fmt: skip
    "--ddp-param-name-patterns-for-fp32-local-accumulation": Refusal(
        "layout", "fp32 local gradient accumulation buffers for some parameters are not counted"),
    "--te-precision-config-file": Refusal(
        "training", "per-module precision overrides are not modelled; --fp8-format applies to "
        "every Transformer Engine linear"),  # fmt: skip
    "--kitchen-config-file": Refusal("training", _QUANTIZERS),
    "--kitchen-recipe-number": Refusal("training", _QUANTIZERS),
    # megatron-core language_module.py: "te" runs Transformer Engine's Triton cross entropy
    "--cross-entropy-fusion-impl": Refusal(
        "training", "Transformer Engine's cross entropy kernels are not modelled (native is: "
        "megatron's torch.compile'd fused_cross_entropy.py)", ("native",)),  # fmt: skip
    "--output-logit-dtype": Refusal(
        "training", "the output layer's logits dtype is not modelled (they are counted as "
        "megatron-core 0.16 computes them)"),  # fmt: skip
    "--freeze-all-layers": Refusal(
        "training", "frozen parameters hold no gradients or optimizer state, and Megatron-LM then "
        "turns off --use-distributed-optimizer, which this tool does not model"),  # fmt: skip
    # TransformerConfig.ep_overlap_early_attn_memory_release: frees attention activations early
    # under the MoE all-to-all overlap
    "--ep-overlap-early-attn-memory-release": Refusal(
        "training", "releasing attention activations early under "
        "--overlap-moe-expert-parallel-comm changes the peak, which is not modelled"),  # fmt: skip
    # validate_args/training.py: packed samples of varying lengths balanced over the cp ranks
    "--hybrid-context-parallel": Refusal(
        "layout", "hybrid context parallelism (packed samples of varying lengths balanced over "
        "the context-parallel ranks) is not modelled"),  # fmt: skip
    "--use-kitchen-attention": Refusal("training", _QUANTIZERS),
    # megatron/core/jit.py disable_jit_fuser: jit_fuser becomes a no-op, so the fused functions
    # called outside an autograd.Function (bias_dropout_add, ...) run eagerly, op by op
    "--disable-jit-fuser": Refusal(
        "training", "megatron's fused functions run eagerly (each op's saved tensors kept), "
        "which is not modelled"),  # fmt: skip
    "--fp8-quantizer-factory": Refusal("training", _FACTORY),
    "--fp4-quantizer-factory": Refusal("training", _FACTORY),
    # TransformerConfig.moe_hybridep_num_sms: the SMs HybridEPBuffer is built with (job/hybrid_ep.py)
    "--moe-hybridep-num-sms": Refusal("training", _HYBRIDEP, ("16",)),
    "--disable-fp8-wgrad": Refusal("training", _FP8_PART),  # --no-fp8-wgrad's other spelling
    # megatron-core 0.13: the encoder's own grid (removed in 0.14), which GPT training leaves at 0
    "--encoder-tensor-model-parallel-size": Refusal("layout", _ENCODER, ("0",)),
    "--encoder-pipeline-model-parallel-size": Refusal("layout", _ENCODER, ("0",)),
    "--pipeline-model-parallel-split-rank": Refusal("layout", _ENCODER),
    "--use-custom-fsdp": Refusal(
        "layout", "megatron-core 0.13's custom FSDP (Megatron-FSDP's earlier name) is not modelled "
        "under that name; --use-megatron-fsdp is"),  # fmt: skip
    # Megatron-LM 0.17-0.19's further arguments that change what a GPU holds
    "--mlp-chunks-for-training": Refusal(
        "training", "the MLP run in chunks along the sequence changes the activations kept, "
        "which is not modelled", ("1",)),  # fmt: skip
    "--eval-micro-batch-size": Refusal("training", _EVAL),
    "--tensor-parallel-num-weight-shards": Refusal("layout", _GTP),
    "--expert-tensor-parallel-num-weight-shards": Refusal("layout", _GTP),
    "--fp8-output-proj": Refusal(
        "training", "the output layer under MXFP8 (its input kept in fp8) is not modelled"),
    "--fused-residual-rmsnorm": Refusal("training", _FUSION),
    "--mla-down-proj-fusion": Refusal("model", _FUSION),
    "--mamba-training-ssm-states-dtype": Refusal(
        "training", "the dtype of Mamba's materialised inter-chunk states is not modelled"),
    "--moe-flex-dispatcher-num-sms": Refusal("training", _HYBRIDEP),
    "--moe-hybridep-num-blocks-permute": Refusal("training", _HYBRIDEP),
    "--moe-hybridep-num-blocks-unpermute": Refusal("training", _HYBRIDEP),
    "--moe-hybridep-num-sms-preprocessing": Refusal("training", _HYBRIDEP, ("108",)),
    "--moe-permute-fusion-into-hybridep": Refusal("training", _HYBRIDEP),
    "--moe-hybridep-pad-uneven-dispatch-inputs": Refusal("training", _HYBRIDEP),
    "--moe-single-grouped-weight": Refusal("model", _GROUPED),
    "--moe-single-grouped-bias": Refusal("model", _GROUPED),
    "--use-grouped-gemm-for-dense-mlp": Refusal("model", _GROUPED),
    "--use-grouped-gemm-for-shared-expert": Refusal("model", _GROUPED),
    "--mtp-hybrid-override-pattern": Refusal(
        "model", "a hybrid layer pattern of its own for the MTP layers is not modelled"),
    "--mtp-use-repeated-layer": Refusal(
        "model", "megatron-core before 0.17 has no repeated MTP layer (TransformerConfig's "
        "mtp_use_repeated_layer)", modelled=versions.MTP_REPEATED_RELEASES),  # fmt: skip
    "--optimizer-cuda-graph": Refusal(
        "training", "a CUDA graph of the optimizer step (its static inputs and memory pool) is "
        "not counted"),  # fmt: skip
    "--overlap-dispatch-backward-with-experts-wgrad": Refusal(
        "training", "expert weight gradients computed later on a side stream change the peak, "
        "which is not modelled"),  # fmt: skip
    "--dataloader-inter-document-masking": Refusal(
        "training", "attention per document (cu_seqlens) is modelled only under --sft"),
    "--disable-pad-vocab-size": Refusal("model", _NO_PAD),
    "--no-pad-vocab-size": Refusal("model", _NO_PAD),
    # Megatron-LM main (after core_v0.19.0; 0.20): mHC residual streams, Megatron-FSDP 2,
    # Transformer Engine's grouped tensors, MTP hidden-state mixing
    "--enable-mhc-connections": Refusal(
        "model", "mHC's several residual streams (and their mixing weights) are not modelled"),
    "--megatron-fsdp-version": Refusal(
        "layout", "Megatron-FSDP's second implementation is not modelled", ("1",)),
    "--moe-use-grouped-tensor": Refusal("model", _GROUPED),
    "--mtp-hsm": Refusal(
        "training", "hidden-state mixing of the MTP layers' inputs is not modelled"),
    "--logits-load-dir": Refusal(
        "training", "distillation from cached top-k logits (loaded beside each micro-batch) is "
        "not modelled"),  # fmt: skip
}

_UNRECOGNISED = "pretrain_gpt.py stops with 'unrecognized arguments'"
_MULTIMODAL = (
    f"{_UNRECOGNISED}: only Megatron-LM's multimodal entry points (pretrain_vlm.py, "
    "examples/multimodal/train.py) define it, and this tool builds GPT models only"
)

# Arguments Megatron-LM itself stops on (arguments.py, validate_args), in its own words; they stop
# every command, as the job would not start.
MEGATRON_LM_REFUSES: dict[str, str] = {
    "--checkpoint-activations": "validate_args: '--checkpoint-activations is no longer valid, use "
    "--recompute-activations, or, for more control, --recompute-granularity and "
    "--recompute-method'",
    "--batch-size": "validate_args: '--batch-size argument is no longer valid, use "
    "--micro-batch-size instead'",
    "--warmup": "validate_args: '--warmup argument is no longer valid, use --lr-warmup-fraction "
    "instead'",
    "--model-parallel-size": "validate_args: '--model-parallel-size is no longer valid, use "
    "--tensor-model-parallel-size instead'",
    "--DDP-impl": f"{_UNRECOGNISED} (removed in 2023: megatron-core's DistributedDataParallel is "
    "the only one)",
    "--activations-checkpoint-method": f"{_UNRECOGNISED} (renamed --recompute-method in 2022)",
    "--activations-checkpoint-num-layers": f"{_UNRECOGNISED} (renamed --recompute-num-layers in "
    "2022)",
    "--distribute-checkpointed-activations": f"{_UNRECOGNISED} (renamed "
    "--distribute-saved-activations in 2022)",
    "--freeze-LM": _MULTIMODAL,
    "--freeze-ViT": _MULTIMODAL,
    "--help": "argparse prints pretrain_gpt.py's help and exits: nothing trains",
}

# Megatron-LM spellings that mean one of the modelled arguments: flag -> (name, value).
RENAMED: dict[str, tuple[str, object]] = {
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope"),  # validate_args
    "--encoder-seq-length": ("seq_length", None),  # validate_args: seq_length = encoder_seq_length
    # Megatron-LM after megatron-core 0.16 (arguments.py, 0.19.2): --cuda-graph-modules names what
    # --cuda-graph-scope did, which stays as its deprecated spelling (TransformerConfig's
    # cuda_graph_modules, enums.CudaGraphModule)
    "--cuda-graph-modules": ("cuda_graph_scope", None),
    # validate_args: num_layers = encoder_num_layers when --num-layers is not given
    "--encoder-num-layers": ("num_layers", None),
    # BooleanOptionalAction's `--no-` spellings of the switches read (job/rollout.py)
    "--no-rl-training-cuda-graphs": ("rl_training_cuda_graphs", False),
    "--no-rl-reset-cuda-graphs": ("rl_reset_cuda_graphs", False),
}


# Values of modelled arguments that this tool does not model (Megatron-LM accepts them).
# megatron-core's CudaGraphManager (transformer/cuda_graphs.py) with a partial scope (two managers
# per MoE layer with moe_router, `_forward_mlp_router` / `_forward_mlp_postprocess`) or graphing a
# MoE layer whole: not modelled; whole dense and Mamba layers are (memory/engine/local_graphs.py)
LOCAL_GRAPHS = Refusal(
    "training", "megatron-core's own per-layer CUDA graphs (CudaGraphManager) are counted for "
    "whole layers only (no --cuda-graph-scope): dense, Mamba, and MoE layers whose shapes stay on "
    "the GPU (--moe-pad-expert-input-to-capacity, or HybridEP's --moe-expert-rank-capacity-factor; "
    "otherwise the dispatcher copies token counts to the host, which a graph's capture cannot "
    "hold); transformer_engine's per-layer graphs and --cuda-graph-scope full_iteration are "
    "counted with these too")  # fmt: skip

REFUSED_VALUES: dict[str, dict[str, Refusal]] = {
    "--rl-kv-cache-management-mode": {mode: Refusal("training", _KV_AWAY)
                                      for mode in ("offload", "recompute")},  # fmt: skip
    # megatron-core's optimizer/__init__.py: Muon (emerging_optimizers' orthogonalised momentum on
    # the linear weights, Adam on the rest), Lion, SOAP; versions.CHOICE_VERSIONS has when each came.
    # Muon is modelled as megatron-core 0.16-0.17 build it (optimizer/muon.py,
    # layer_wise_optimizer.py) and 0.18-0.19 (optimizer/emerging_optimizers.py, and the layer-wise
    # optimizer's parameter layout in DDP's buffers, world/ddp.py)
    "--optimizer": {
        **{name: Refusal("training", _OPTIMIZER) for name in ("lion", "soap", "adaptive_muon")},
        "muon": Refusal("training", _MUON_LATER, modelled=MUON_RELEASES),  # engine/muon.py
        "dist_muon": Refusal("training", _MUON_LATER, modelled=LAYER_WISE_RELEASES),
    },  # fmt: skip
}


def refusal_message(flag: str, value: str | None) -> str | None:
    """Return the error for a refused argument with this value, or None when it is harmless."""
    refusal = REFUSED.get(flag)
    if refusal is not None and versions.within(refusal.modelled or (), megatron_core_version()):
        return None  # modelled on this megatron-core (its Megatron-LM argument is modelled too)
    if refusal is None or (value is not None and value in refusal.harmless and (
            value != HYBRID_STACK_SPEC or megatron_core_version() >= HYBRID_SPEC_SINCE)):
        return None  # before 0.18 megatron-core has no models/hybrid to import the spec from
    shown = f"{flag} {value}" if value is not None else flag
    return f"{shown} is not modelled: {refusal.reason}"
