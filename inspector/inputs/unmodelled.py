"""Megatron-LM's arguments that this tool does not model: refused, or ignored with a reason.

Every argument of Megatron-LM's `megatron/training/arguments.py` that changes what a GPU holds or
computes is either modelled (inspector.inputs.arguments) or refused here with the reason; the ignored ones
change nothing a GPU holds (paths, logging, data, schedules, learning rate, numerics of the same
tensors). A script argument in none of the tables is reported as not recognised. This module
imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# megatron-core 0.16.1's DDP points each quantized weight into its param buffer through TE's
# replace_raw_data, which TE 2.11 (the newest 0.16.1 accepts) refuses for an NVFP4Tensor
# (tensor/utils.py 50-51); megatron-core 0.19 gathers packed NVFP4 bytes and casts the main
# shards with TE's `quantize_master_weights`, which TE 2.11 does not have
_FP4_PARAMS = (
    "megatron-core 0.16's DDP points each NVFP4 weight into its param buffer, which Transformer "
    "Engine 2.11 refuses (tensor/utils.py replace_raw_data: 'not supported yet'), and "
    "megatron-core 0.19 casts them with Transformer Engine's quantize_master_weights (2.12+), "
    "which this tool does not simulate; --fp4-format without it is modelled"
)
_FP8_PART = (
    "fp8 for only part of the model (16-bit weight gradients, fp8 multi-head attention) is not "
    "modelled; "
    "--fp8-format runs every Transformer Engine linear in fp8 (but the layers "
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
    "this variant of DeepSeek sparse attention's indexer (megatron-core 0.19: top-k shared "
    "across layers, GLM-5's indexer without rotation or ReLU) is not modelled; DeepSeek-V3.2's is"
)
_DSA_KERNELS = (
    "DSA's fused TileLang and cuDNN kernels are not simulated; megatron's own PyTorch path "
    "(--dsa-kernel-backend none) is"
)
_QUANTIZERS = "ModelOpt's quantizers (fake-quantized weights and inputs) are not counted"
_OPTIMIZER = "this optimizer's state is not counted (Adam's two fp32 moments are)"
_MUON_LATER = (
    "this megatron-core's Muon is not run by this tool (it runs megatron-core 0.16-0.19's "
    "--optimizer muon, and 0.16-0.17's layer-wise dist_muon; 0.18 lays the layer-wise optimizer's "
    "matrices out in the DDP buffers beside a distributed Adam)"
)
_MFSDP_DTYPE = (
    "Megatron-FSDP's buffer dtypes other than the default are not modelled (the buffers are "
    "counted as megatron-core 0.16 allocates them)"
)
_MFSDP_POOL = "Megatron-FSDP's double-buffer allocator options are not modelled"
_FROZEN = "frozen parameters hold no gradients or optimizer state, which this tool does not model"

REFUSED: dict[str, Refusal] = {
    "--fp4-param-gather": Refusal("training", _FP4_PARAMS),
    "--no-fp8-wgrad": Refusal("training", _FP8_PART),
    "--fp8-multi-head-attention": Refusal("training", _FP8_PART),
    "--torch-fsdp2-no-reshard-after-forward": Refusal("layout", _FSDP),
    "--use-legacy-models": Refusal("model", "this tool builds megatron-core (mcore) models only"),
    "--spec": Refusal("model", "a custom layer spec module cannot be imported here",
                      (MAMBA_STACK_SPEC, HYBRID_STACK_SPEC)),  # fmt: skip
    # megatron/training/checkpointing.py load_args_from_checkpoint: num_layers, hidden_size, ...
    # from the checkpoint's args, most with force=True (over the script's own values)
    "--use-checkpoint-args": Refusal(
        "model", "Megatron-LM then takes the model's architecture from the checkpoint it loads "
        "(over the script's own arguments), which this tool cannot read; drop it and give the "
        "model's arguments"),  # fmt: skip
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
    "--dsa-indexer-topk-freq": Refusal("model", _DSA, ("1",)),
    "--dsa-indexer-skip-topk-offset": Refusal("model", _DSA, ("0",)),
    "--dsa-kernel-backend": Refusal("training", _DSA_KERNELS, ("none",)),
    "--dsa-indexer-rope-interleaved": Refusal("model", _DSA),
    "--no-dsa-indexer-rotate-activation": Refusal("model", _DSA),
    "--disable-dsa-indexer-rotate-activation": Refusal("model", _DSA),
    "--no-dsa-indexer-scoring-relu": Refusal("model", _DSA),
    "--disable-dsa-indexer-scoring-relu": Refusal("model", _DSA),
    "--dsa-indexer-k-norm-epsilon": Refusal("model", _DSA),
    "--dsa-indexer-k-norm-fp32": Refusal("model", _DSA),
    # TransformerConfig.moe_latent_size (0.16; moe_layer.py 170-190: h -> latent -> h around the
    # routed experts) and mtp_use_repeated_layer (0.19: MultiTokenPredictionBlock, one layer)
    "--moe-latent-size": Refusal("model", "latent MoE (routed experts in a smaller latent space, "
                                 "with the projections around them) is not modelled yet"),
    "--mtp-use-repeated-layer": Refusal("model", "one MTP layer repeated over the MTP depths "
                                        "(megatron-core 0.19) is not modelled; megatron-core "
                                        "0.16.1 has none"),  # fmt: skip
    "--vocab-extra-ids": Refusal("model", "extra ids change the vocabulary; pass --vocab-size"),
    "--fine-grained-activation-offloading": Refusal(  # TransformerConfig, megatron-core 0.16
        "training", "activation offloading to the CPU (--offload-modules) is not modelled"),
    "--moe-use-legacy-grouped-gemm": Refusal(
        "model", "the legacy GroupedMLP under Transformer Engine is not modelled"),
    "--moe-extended-tp": Refusal("layout", "removed from Megatron-LM; use "
                                 "--expert-tensor-parallel-size"),  # fmt: skip
    "--distribute-saved-activations": Refusal(
        "training", "checkpoints split across tensor-parallel ranks are not modelled"),
    "--cpu-offloading": Refusal("training", "activation offloading to the CPU is not modelled"),
    "--cpu-offloading-num-layers": Refusal(
        "training", "activation offloading to the CPU is not modelled", ("0",)),
    "--optimizer-cpu-offload": Refusal("training", "optimizer state on the CPU is not modelled"),
    "--fp32-residual-connection": Refusal(
        "training", "an fp32 residual stream changes activations, which are counted in 16 bits"),
    "--fp16-lm-cross-entropy": Refusal(
        "training", "16-bit logits of the loss are not modelled (they are counted in fp32)"),
    "--ddp-num-buckets": Refusal("layout", "pass --ddp-bucket-size (buckets decide the padding)"),
    "--ddp-pad-buckets-for-high-nccl-busbw": Refusal(
        "layout", "bucket padding for NCCL bus bandwidth is not modelled"),
    # megatron-core TransformerConfig.__post_init__ turns them into --cuda-graph-impl local and
    # transformer_engine
    "--enable-cuda-graph": Refusal(
        "training", "megatron-core runs it as --cuda-graph-impl local, whose graphs "
        "(CudaGraphManager) are not counted"),  # fmt: skip
    "--external-cuda-graph": Refusal(
        "training", "megatron-core runs it as --cuda-graph-impl transformer_engine: pass that"),
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
}

# Arguments that change nothing a GPU holds or computes, by why.
IGNORED_BECAUSE: dict[str, str] = {
    "numerics only (same tensors)": (
        "--norm-epsilon --apply-layernorm-1p --apply-residual-connection-post-layernorm "
        "--openai-gelu --squared-relu --onnx-safe "
        "--rotary-base --rotary-percent --rotary-interleaved --rotary-seq-len-interpolation-factor "
        "--use-rope-scaling --rope-scaling-factor --no-rope-freq --yarn-original-max-position-embeddings "
        "--yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int "
        "--no-yarn-correction-range-round-to-int "
        "--apply-query-key-layer-scaling --attention-softmax-in-fp32 "
        # with rope only: validate_args refuses it otherwise (inspector.inputs.refusals)
        "--no-position-embedding "
        "--init-method-std --embedding-init-method-std --init-method-xavier-uniform --seed "
        "--data-parallel-random-init --loss-scale --initial-loss-scale --min-loss-scale "
        "--loss-scale-window --hysteresis --disable-bf16-reduced-precision-matmul "
        "--deterministic-mode --calculate-per-token-loss "
                "--no-persist-layer-norm --use-te-activation-func "
        "--use-fused-weighted-squared-relu --no-gradient-reduce-div-fusion --te-rng-tracker "
        "--use-mcore-models --transformer-impl-fallback --use-cpu-initialization "
        "--init-model-with-meta-device --no-clone-scatter-output-in-embedding "
        "--fp8-margin --fp8-interval --fp8-amax-compute-algo"
    ),
    "routing math (balanced routing is counted)": (
        "--moe-router-topk-scaling-factor "
        "--moe-router-bias-update-rate "
        "--moe-router-force-load-balancing --moe-aux-loss-coeff --moe-z-loss-coeff "
        "--moe-input-jitter-eps "
        "--moe-permute-fusion --moe-router-fusion --moe-router-dtype "
        "--moe-token-drop-policy --moe-shared-expert-overlap --moe-per-layer-logging "
        "--moe-apply-probs-on-input"
    ),
    "communication scheduling (buffers not counted)": (
        "--no-overlap-p2p-communication --overlap-p2p-communication-warmup-flush "
        "--no-align-grad-reduce "
        "--no-align-param-gather --overlap-param-gather-with-optimizer-step "
        "--ddp-average-in-collective --ddp-reduce-scatter-with-fp32-accumulation "
        "--no-scatter-gather-tensors-in-pipeline --use-ring-exchange-p2p "
        "--tp-comm-overlap-cfg --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
        "--tp-comm-overlap-rs-dgrad --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad "
        "--tp-comm-bootstrap-backend --disable-tp-comm-split-ag --disable-tp-comm-split-rs "
        "--no-async-tensor-model-parallel-allreduce --cp-comm-type "
        "--hierarchical-context-parallel-sizes --use-nccl-ub --disable-symmetric-registration "
        "--use-sharp --sharp-enabled-group --high-priority-stream-groups "
        "--pipeline-model-parallel-comm-backend --nccl-communicator-config-path "
        "--distributed-backend --distributed-timeout-minutes "
        "--distributed-timeout-seconds-after-init --local-rank --lazy-mpu-init "
        "--disable-gloo-process-groups --empty-unused-memory-level --manual-gc --manual-gc-interval "
        "--no-manual-gc-eval --suggested-communication-unit-size"
    ),
    "only with a refused argument": (
        # --optimizer muon/lion's hyper-parameters (arguments.py, core_v0.16.1 and main)
        "--muon-momentum --muon-no-split-qkv --muon-use-nesterov --muon-nesterov "
        "--muon-scale-mode --muon-fp32-matmul-prec --muon-num-ns-steps --muon-tp-mode "
        "--muon-extra-scale-factor --muon-coefficient-type --muon-scalar-optimizer "
        "--muon-use-syrk --lion-beta1 --lion-beta2 "
        "--keep-fp8-transpose-cache --enable-full-sharding-in-hsdp "
        "--optimizer-offload-fraction "
        # --fine-grained-activation-offloading's modules
        "--offload-modules "
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads "
        "--no-pin-cpu-params"
    ),
    "optimizer hyper-parameters and schedules": (
        "--lr --lr-decay-style --lr-wsd-decay-style --lr-decay-iters --lr-decay-samples "
        "--lr-wsd-decay-samples --lr-wsd-decay-iters --lr-warmup-fraction --lr-warmup-iters "
        "--lr-warmup-samples --lr-warmup-init --min-lr --override-opt_param-scheduler "
        "--use-checkpoint-opt_param-scheduler --decoupled-lr --decoupled-min-lr --weight-decay "
        "--start-weight-decay --end-weight-decay --weight-decay-incr-style --clip-grad "
        "--adam-beta1 --adam-beta2 --adam-eps --sgd-momentum --rampup-batch-size "
        "--step-batch-size-schedule --decrease-batch-size-if-needed --train-iters --train-samples "
        "--exit-interval "
        "--exit-duration-in-mins --exit-signal-handler --train-sync-interval --skip-train "
        "--eval-iters --eval-interval --full-validation --multiple-validation-sets"
    ),
    "data, tokenizer files, paths": (
        "--data-path --split --train-data-path --valid-data-path --test-data-path --data-args-path "
        "--per-split-data-args-path --data-cache-path --no-mmap-bin-files --mock-data --num-workers "
        "--reset-position-ids --reset-attention-mask --eod-mask-loss "
        "--no-create-attention-mask-in-dataloader --num-dataset-builder-threads "
        "--object-storage-cache-path --mid-level-dataset-surplus --allow-ambiguous-pad-tokens "
        "--dataloader-type --merge-file --vocab-file --tokenizer-type --tokenizer-model "
        "--tokenizer-metadata --tiktoken-pattern --tiktoken-num-special-tokens "
        "--tokenizer-hf-include-special-tokens "
        "--tiktoken-special-tokens --legacy-tokenizer --sample-rate --mask-prob --short-seq-prob "
        "--decoder-seq-length --retriever-seq-length --sft-tokenizer-prompt-format "
        "--disable-msc"
    ),
    "inference and RL (pretrain_gpt.py builds no inference engine; train_rl.py's is refused)": (
        "--inference-batch-times-seqlen-threshold --max-tokens-to-oom --use-legacy-static-engine "
        "--inference-max-requests --inference-max-seq-length --inference-dynamic-batching "
        "--inference-dynamic-batching-buffer-size-gb "
        "--inference-dynamic-batching-paused-buffer-size-gb --inference-dynamic-batching-block-size "
        "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
        "--inference-dynamic-batching-num-cuda-graphs --decode-only-cuda-graphs "
        "--inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens "
        "--inference-dynamic-batching-unified-memory-level --enable-chunked-prefill "
        "--num-speculative-tokens --inference-dynamic-batching-prefix-caching "
        "--inference-logging-step-interval --inference-text-gen-server-logging "
        "--inference-wandb-logging --inference-shards --perform-rl-step --rl-prompts-per-eval "
        "--grpo-prompts-per-step --grpo-group-size --rl-generation-lag --rl-max-inflight-requests "
        "--grpo-iterations --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-kl-beta "
        "--grpo-entropy-term-weight --grpo-filter-groups-with-same-reward --langrl-env-config "
        "--rl-default-temperature --rl-default-top-p --rl-default-top-k "
        "--rl-offload-optimizer-during-inference --rl-kv-cache-management-mode "
        "--rl-persist-cuda-graphs --rl-partial-rollouts --rl-inference-logprobs-is-correction "
        "--rl-importance-sampling-truncation-coef --rl-use-sequence-packing "
        "--rl-sequence-packing-max-sequences-per-bin --rl-sequence-packing-algo "
        "--rl-training-cuda-graphs --rl-inference-tensor-model-parallel-size "
        "--rl-inference-pipeline-model-parallel-size --rl-inference-expert-model-parallel-size "
        "--rl-inference-expert-tensor-model-parallel-size "
        "--rl-inference-model-unified-memory-level --rl-offload-inference-model-weights-when-idle"
    ),
    "checkpoints": (
        "--save --save-interval --save-retain-interval --no-save-optim --no-save-rng --load "
        "--no-load-optim --load-main-params-from-ckpt --no-load-rng --no-strict-fsdp-dtensor-load "
        "--non-persistent-save-interval --non-persistent-ckpt-type --non-persistent-global-ckpt-dir "
        "--non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo --finetune "
        "--pretrained-checkpoint --ckpt-step --no-initialization "
        "--use-mp-args-from-checkpoint-args --no-use-tokenizer-model-from-checkpoint-args "
        "--exit-on-missing-checkpoint --use-dist-ckpt --use-persistent-ckpt-worker "
        "--auto-detect-ckpt-format --dist-ckpt-format --ckpt-convert-format "
        "--ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format "
        "--ckpt-fully-parallel-save --no-ckpt-fully-parallel-save --async-save "
        "--ckpt-fully-parallel-load --ckpt-assume-constant-structure --dist-ckpt-strictness "
        "--dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable "
        "--distrib-optim-fully-reshardable-mem-efficient --replication --replication-jump "
        "--replication-factor --moe-use-upcycling --moe-upcycling-granularity"
    ),
    # megatron/post_training/arguments.py: data, checkpoint key mapping, numerics; the teacher's
    # config only acts with --export-kd-teacher-load (refused)
    "ModelOpt's data, checkpoint and numerics options": (
        "--finetune-hf-dataset --finetune-data-split --finetune-data-files --export-te-mcore-model "
        "--export-default-te-spec --export-legacy-megatron --modelopt-enabled "
        "--export-kd-teacher-model-config --export-kd-teacher-ckpt-format --export-kd-cfg "
        "--export-moe-apply-probs-on-input --enable-gpt-oss --trust-remote-code "
        # read only by ModelOpt's model provider; refusals.py refuses it where that builds
        "--export-force-local-attention"
    ),
    "logging, profiling, fault tolerance": (
        "--log-interval --log-params-norm --log-num-zeros-in-grad --log-throughput --log-progress "
        "--timing-log-level --log-energy --no-barrier-with-level-1-timing --timing-log-option "
        "--tensorboard-dir --tensorboard-log-interval --tensorboard-queue-size "
        "--log-timers-to-tensorboard --no-log-loss-scale-to-tensorboard "
        "--log-validation-ppl-to-tensorboard --log-memory-to-tensorboard "
        "--log-world-size-to-tensorboard --wandb-project --wandb-entity --wandb-exp-name "
        "--wandb-save-dir --logging-level --profile --profile-step-start --profile-step-end "
        "--profile-ranks --use-pytorch-profiler --record-memory-history --memory-snapshot-path "
        "--no-check-for-nan-in-loss-and-grad --check-for-spiky-loss --check-for-large-grads "
        "--check-weight-hash-across-dp-replicas-interval --iterations-to-skip "
        "--result-rejected-tracker-filename --rerun-mode --error-injection-rate "
        "--error-injection-type --log-straggler --disable-straggler-on-startup "
        "--straggler-ctrlr-port --straggler-minmax-count --run-workload-inspector-server "
        "--no-one-logger --one-logger-project --one-logger-run-name --one-logger-async "
        "--app-tag-run-name --app-tag-run-version --enable-ft-package --calc-ft-timeouts "
        "--config-logger-dir --adlr-autoresume --adlr-autoresume-interval --inprocess-restart "
        "--enable-experimental --dump-param-to-param-group-map"
    ),
}

IGNORED: dict[str, str] = {
    flag: reason for reason, flags in IGNORED_BECAUSE.items() for flag in flags.split()
}

# Ignored arguments that change what a command does not count: a note says what (inputs/resolve).
IGNORED_NOTES: dict[str, str] = {
    # Megatron-LM validate_args: deterministic_mode sets NCCL_ALGO to a fixed ring/tree and
    # Transformer Engine's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 picks deterministic attention
    # backward kernels; the tensors (memory) are the same
    "--deterministic-mode": "--deterministic-mode changes no memory; `plan`'s step time prices "
    "the default kernels, not the deterministic ones it selects (Transformer Engine's "
    "deterministic attention backward, a fixed NCCL algorithm), whose cost is not modelled",
}

# Megatron-LM spellings that mean one of the modelled arguments: flag -> (name, value).
RENAMED: dict[str, tuple[str, object]] = {
    "--use-rotary-position-embeddings": ("position_embedding_type", "rope"),  # validate_args
    "--encoder-seq-length": ("seq_length", None),  # validate_args: seq_length = encoder_seq_length
    # Megatron-LM after megatron-core 0.16 (arguments.py, 0.19.2): --cuda-graph-modules names what
    # --cuda-graph-scope did, which stays as its deprecated spelling (TransformerConfig's
    # cuda_graph_modules, enums.CudaGraphModule)
    "--cuda-graph-modules": ("cuda_graph_scope", None),
}


# Values of modelled arguments that this tool does not model (Megatron-LM accepts them).
# megatron-core's CudaGraphManager (transformer/cuda_graphs.py): graphs recorded lazily in the
# first iterations, a memory pool per micro-batch under a pipeline; `local` with the scope
# full_iteration is megatron-core's FullCudaGraphWrapper instead, which is modelled
LOCAL_GRAPHS = Refusal(
    "training", "megatron-core's own per-layer CUDA graphs (CudaGraphManager) and their memory "
    "pools are not counted; transformer_engine's per-layer graphs and --cuda-graph-scope "
    "full_iteration are")  # fmt: skip

REFUSED_VALUES: dict[str, dict[str, Refusal]] = {
    # megatron-core's optimizer/__init__.py: Muon (emerging_optimizers' orthogonalised momentum on
    # the linear weights, Adam on the rest), Lion, SOAP; versions.CHOICE_VERSIONS has when each came.
    # Muon is modelled as megatron-core 0.16 builds it (optimizer/muon.py, layer_wise_optimizer.py);
    # 0.17+ moved it into optimizer/emerging_optimizers.py with a layer-wise parameter layout
    "--optimizer": {
        **{name: Refusal("training", _OPTIMIZER) for name in ("lion", "soap", "adaptive_muon")},
        "muon": Refusal("training", _MUON_LATER, modelled=MUON_RELEASES),  # engine/muon.py
        "dist_muon": Refusal("training", _MUON_LATER, modelled=LAYER_WISE_RELEASES),
    },  # fmt: skip
}


def refusal_message(flag: str, value: str | None) -> str | None:
    """Return the error for a refused argument with this value, or None when it is harmless."""
    refusal = REFUSED.get(flag)
    if refusal is None or (value is not None and value in refusal.harmless and (
            value != HYBRID_STACK_SPEC or megatron_core_version() >= HYBRID_SPEC_SINCE)):
        return None  # before 0.18 megatron-core has no models/hybrid to import the spec from
    shown = f"{flag} {value}" if value is not None else flag
    return f"{shown} is not modelled: {refusal.reason}"
