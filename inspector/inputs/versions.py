"""The installed megatron-core's version, read from package metadata (no torch import), and the
Megatron-LM meanings that depend on it; tests/test_versions.py checks each against megatron itself."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from functools import cache


@cache
def megatron_core_version() -> tuple[int, int]:
    """Return the installed megatron-core's (major, minor)."""
    text = importlib.metadata.version("megatron-core")
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def null_tokenizer_adds_eod() -> bool:
    """Whether NullTokenizer reports --vocab-size + 1 (its end-of-document token after the
    vocabulary): up to 0.17; from 0.18 megatron.core.tokenizers' NullTokenizer reports --vocab-size
    with the token inside it (megatron/core/tokenizers/text/libraries/null_tokenizer.py)."""
    return megatron_core_version() < (0, 18)


# The Megatron-LM arguments this tool reads whose presence differs between megatron-core versions:
# flag -> (first version whose Megatron-LM accepts it, first version that no longer does, or None).
# Read off the parser itself (`add_megatron_arguments` in megatron/training/arguments.py) at the
# tags core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0 and main (0.20); 0.13-0.15 by the
# argument's `add_argument` line at core_v0.13.1, core_v0.14.0, core_v0.15.3.
ARGUMENT_VERSIONS: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    # megatron-core's TransformerConfig grew overlap_moe_expert_parallel_comm in 0.14 (core_v0.14.0)
    "--overlap-moe-expert-parallel-comm": ((0, 14), None),
    # TransformerConfig.moe_flex_dispatcher_backend (HybridEP beside DeepEP) from core_v0.16.0
    "--moe-flex-dispatcher-backend": ((0, 16), None),
    # TransformerConfig.moe_router_padding_for_quantization (0.16; before it only the fp8 name)
    "--moe-router-padding-for-quantization": ((0, 16), None),
    "--inference-dynamic-batching-prefix-caching": ((0, 17), None),
    "--inference-text-gen-server-logging": ((0, 17), None),
    "--num-speculative-tokens": ((0, 17), None),
    "--rl-kv-cache-management-mode": ((0, 17), None),
    "--rl-persist-cuda-graphs": ((0, 17), None),
    "--inference-cuda-graph-all-prefills": ((0, 18), None),
    "--step-batch-size-schedule": ((0, 18), None),
    # arguments.py --padded-vocab-size from core_v0.14.0 (tokenizer.py pads only "if None" there);
    # 0.18 moved it into training_config.py TokenizerConfig
    "--padded-vocab-size": ((0, 14), None),
    # arguments.py (core_v0.18.0): the layer-wise optimizer's legacy path, without the DDP layout
    "--no-use-layer-wise-param-layout": ((0, 18), None),
    # TransformerConfig's gated delta net fields and --linear-attention-freq (core_v0.16.0)
    "--experimental-attention-variant": ((0, 16), None),
    "--linear-attention-freq": ((0, 16), None),
    "--linear-conv-kernel-dim": ((0, 16), None),
    "--linear-key-head-dim": ((0, 16), None),
    "--linear-value-head-dim": ((0, 16), None),
    "--linear-num-key-heads": ((0, 16), None),
    "--linear-num-value-heads": ((0, 16), None),
    "--attention-output-gate": ((0, 16), None),
    # TransformerConfig's MoE paged stash, HybridEP's static budget and TE's fused operations
    # (core_v0.18.0; none at core_v0.17.0): inputs/paged_stash.py
    **dict.fromkeys(("--moe-paged-stash", "--moe-paged-stash-page-size",
                     "--moe-paged-stash-buffer-size-factor-cuda",
                     "--moe-paged-stash-buffer-size-factor-cpu",
                     "--moe-expert-rank-capacity-factor", "--use-transformer-engine-op-fuser"),
                    ((0, 18), None)),  # fmt: skip
    # TransformerConfig.moe_latent_size (LatentMoE, core_v0.16.0 moe_layer.py)
    "--moe-latent-size": ((0, 16), None),
    "--freeze-all-layers": ((0, 19), None),
    "--inference-cuda-graph-max-tokens": ((0, 19), None),
    "--inference-shards": ((0, 19), None),
    "--rl-generation-lag": ((0, 19), None),
    "--rl-max-inflight-requests": ((0, 20), None),
    "--hybrid-attention-ratio": ((0, 13), (0, 17)),  # 0.17: --hybrid-layer-pattern
    "--hybrid-mlp-ratio": ((0, 13), (0, 17)),
    "--legacy-tokenizer": ((0, 15), (0, 17)),  # 0.17 builds megatron.core.tokenizers only
    "--moe-extended-tp": ((0, 13), (0, 17)),
    "--moe-use-legacy-grouped-gemm": ((0, 13), (0, 17)),  # 0.17 removed GroupedMLP
    "--no-async-tensor-model-parallel-allreduce": ((0, 13), (0, 17)),
    "--no-scatter-gather-tensors-in-pipeline": ((0, 13), (0, 18)),
    "--tiktoken-special-tokens": ((0, 13), (0, 18)),
    # 0.18 folded the tokenizer's arguments into TokenizerConfig (commit 40d024bc69)
    "--tokenizer-hf-include-special-tokens": ((0, 16), (0, 18)),
    "--use-legacy-models": ((0, 13), (0, 18)),
}

# Megatron-LM's other arguments whose presence differs, by (first version, first version without),
# read off the same parsers (core_v0.13.1, core_v0.14.0, core_v0.15.3, core_v0.16.1, core_v0.17.1,
# core_v0.18.2, core_v0.19.0, and main at d98e8a6 as 0.20; 0.13 stands for "0.13 or earlier");
# tests/test_argument_classes.py checks every span against those parsers' argument lists
_SPANS: dict[tuple[tuple[int, int], tuple[int, int] | None], str] = {
    ((0, 13), (0, 14)): (
        "--encoder-pipeline-model-parallel-size --encoder-tensor-model-parallel-size "
        "--keep-fp8-transpose-cache-when-using-custom-fsdp --pipeline-model-parallel-split-rank "
        "--use-custom-fsdp"
    ),
    ((0, 13), (0, 15)): (
        "--inference-dynamic-batching-chunk-size --load-model-opt-format"
    ),
    ((0, 13), (0, 16)): (
        "--inference-dynamic-batching-buffer-guaranteed-fraction "
        "--inference-dynamic-batching-buffer-overflow-factor "
        "--inference-dynamic-batching-max-requests-override "
        "--inference-dynamic-batching-max-tokens-override --kitchen-config-file "
        "--kitchen-recipe-number --retriever-seq-length --retro-add-retriever --retro-attention-gate "
        "--retro-cyclic-train-iters --retro-encoder-attention-dropout --retro-encoder-hidden-dropout "
        "--retro-encoder-layers --retro-no-verify-neighbor-count --retro-num-neighbors "
        "--retro-num-retrieved-chunks --retro-project-dir"
    ),
    ((0, 14), None): (
        "--cache-mla-latents --embedding-init-method-std --enable-full-sharding-in-hsdp "
        "--full-validation --inference-dynamic-batching-num-cuda-graphs --keep-fp8-transpose-cache "
        "--load-main-params-from-ckpt --moe-router-fusion --multiple-validation-sets "
        "--no-strict-fsdp-dtensor-load --rope-type --save-retain-interval --sharp-enabled-group "
        "--use-fused-weighted-squared-relu --use-megatron-fsdp"
    ),
    ((0, 15), (0, 16)): (
        "--grpo-default-temperature --grpo-default-top-p --no-rl-calculate-intra-group-similarity "
        "--rl-calculate-intra-group-similarity --rl-sequence-packing-bin-size"
    ),
    ((0, 15), (0, 17)): (
        "--disable-chunked-prefill --inference-max-batch-size --langrl-external-server "
        "--langrl-inference-server-conversation-template --langrl-inference-server-type "
        "--no-langrl-external-server --no-rl-offload-kv-cache-during-training "
        "--no-rl-remove-kv-cache-during-training --no-rl-reset-cuda-graphs "
        "--rl-offload-kv-cache-during-training --rl-remove-kv-cache-during-training "
        "--rl-reset-cuda-graphs"
    ),
    ((0, 15), None): (
        "--activation-func-clamp-value --cuda-graph-impl --decode-only-cuda-graphs "
        "--disable-symmetric-registration --dist-ckpt-optim-fully-reshardable "
        "--dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient "
        "--distributed-timeout-seconds-after-init --fp4-format --fp4-param-gather --fp4-recipe "
        "--glu-linear-offset --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight "
        "--grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations --grpo-kl-beta "
        "--grpo-prompts-per-step --inference-dynamic-batching-block-size "
        "--inference-dynamic-batching-track-paused-request-events "
        "--inference-dynamic-batching-unified-memory-level --langrl-env-config "
        "--moe-pad-experts-for-cuda-graph-inference --no-rl-inference-logprobs-is-correction "
        "--no-rl-partial-rollouts --override-opt-param-scheduler --perform-rl-step --quick-geglu "
        "--rl-importance-sampling-truncation-coef --rl-inference-logprobs-is-correction "
        "--rl-offload-optimizer-during-inference --rl-partial-rollouts --rl-prompts-per-eval "
        "--rl-sequence-packing-algo --rl-use-sequence-packing --softmax-type --tokenizer-metadata "
        "--trust-remote-code --use-checkpoint-opt-param-scheduler --use-te-activation-func "
        "--wandb-entity --window-attn-skip-freq --window-size"
    ),
    ((0, 16), (0, 17)): (
        "--disable-async-tensor-model-parallel-allreduce --disable-ckpt-fully-parallel-save"
    ),
    ((0, 16), (0, 18)): (
        "--inference-dynamic-batching-cuda-graph-max-tokens --muon-use-nesterov "
        "--tokenizer-hf-use-fast"
    ),
    ((0, 16), (0, 19)): (
        "--rl-parallel-generation-tasks"
    ),
    ((0, 16), None): (
        "--allow-ambiguous-pad-tokens --apply-wd-to-qk-layernorm --batch-invariant-mode "
        "--cpu-offloading-num-layers --create-all-gather-group --dataloader-defer-npy-index-mmap "
        "--dataloader-fast-cache-load --ddp-reduce-scatter-with-fp32-accumulation "
        "--disable-clone-scatter-output-in-embedding --disable-fp8-wgrad --disable-jit-fuser "
        "--disable-log-loss-scale-to-tensorboard --disable-manual-gc-eval "
        "--disable-strict-fsdp-dtensor-load --disable-use-tokenizer-model-from-checkpoint-args "
        "--dsa-indexer-head-dim --dsa-indexer-loss-coeff --dsa-indexer-n-heads --dsa-indexer-topk "
        "--dsa-indexer-use-sparse-loss --dump-param-to-param-group-map --enable-chunked-prefill "
        "--ep-overlap-early-attn-memory-release --exit-signal --exit-signal-handler-for-dataloader "
        "--fake-process-group --fim-data --fim-eod-token --fim-fragment-rate --fim-middle-token "
        "--fim-no-prefix --fim-pad-token --fim-prefix-token --fim-rate --fim-split-sample "
        "--fim-spm-rate --fim-suffix-token --fine-grained-activation-offloading "
        "--fp4-quantizer-factory --fp8-quantizer-factory --fsdp-manual-registration "
        "--ft-num-warmup-iters --hybrid-context-parallel --inference-coordinator-port "
        "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
        "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
        "--inference-dynamic-batching-paused-buffer-size-gb --inference-fuse-tp-communication "
        "--inference-logging-step-interval --inference-wandb-logging --kitchen-attention-backend "
        "--log-device-memory-used --log-max-attention-logit --log-memory-interval "
        "--max-seqlen-per-dp-cp-rank --min-offloaded-tensor-size --moe-enable-routing-replay "
        "--moe-hybridep-num-sms --moe-shared-expert-gate --mtp-standalone "
        "--muon-extra-scale-factor --muon-fp32-matmul-prec --muon-momentum --muon-no-split-qkv "
        "--muon-num-ns-steps --muon-scale-mode --muon-tp-mode --no-inference-wandb-logging "
        "--no-rl-offload-inference-model-weights-when-idle --no-rl-skip-bos-token "
        "--no-rl-training-cuda-graphs --no-rl-use-sequence-packing --no-rl-verify-model-weights-swap "
        "--no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag "
        "--no-tp-comm-overlap-rs --no-tp-comm-split-ag --no-tp-comm-split-rs "
        "--no-weight-decay-cond-type --offload-modules --outer-dp-sharding-strategy "
        "--per-dataset-sequences-path --phase-transition-iterations --qk-clip --qk-clip-alpha "
        "--qk-clip-threshold --refit-method --rl-default-temperature --rl-default-top-k "
        "--rl-default-top-p --rl-inference-expert-model-parallel-size "
        "--rl-inference-expert-tensor-model-parallel-size --rl-inference-model-unified-memory-level "
        "--rl-inference-pipeline-model-parallel-size --rl-inference-tensor-model-parallel-size "
        "--rl-offload-inference-model-weights-when-idle --rl-sequence-packing-max-sequences-per-bin "
        "--rl-skip-bos-token --rl-training-cuda-graphs --rl-verify-model-weights-swap "
        "--save-dgrads-interval --save-wgrads-interval --te-precision-config-file "
        "--tokenizer-sentencepiece-legacy --tokenizer-special-tokens --use-kitchen-attention "
        "--use-legacy-static-engine"
    ),
    ((0, 17), (0, 19)): (
        "--rl-generation-batch-size --rl-num-parallel-generation-batches "
        "--rl-num-parallel-generations"
    ),
    ((0, 17), None): (
        "--async-ckpt-cpu-priority --async-ckpt-io-priority --async-strategy "
        "--ckpt-fully-parallel-load-exchange-algo --ckpt-fully-parallel-load-process-group "
        "--ckpt-fully-parallel-save-process-group --cpu-offloading-retain-pinned-cpu-buffers "
        "--ddp-param-name-patterns-for-fp32-local-accumulation --disable-align-grad-reduce "
        "--disable-flight-recorder-dump-on-timeout --disable-flight-recorder-extra-dump-on-exec "
        "--disable-flight-recorder-include-only-active --dist-ckpt-workers "
        "--exit-signal-handler-for-training --flight-recorder-dump-path "
        "--flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size "
        "--fused-residual-rmsnorm --hybrid-layer-pattern --inference-disable-triton-nvls-kernels "
        "--inference-dynamic-batching-mamba-memory-ratio "
        "--inference-dynamic-batching-prefix-caching-coordinator-policy "
        "--inference-dynamic-batching-prefix-caching-eviction-policy "
        "--inference-dynamic-batching-prefix-caching-mamba-gb "
        "--inference-dynamic-batching-prefix-caching-routing-alpha "
        "--inference-dynamic-batching-track-generated-token-events --inference-grouped-gemm-backend "
        "--inference-moe-disable-fused-quant-kernels --inference-use-synchronous-zmq-collectives "
        "--lion-beta1 --lion-beta2 --mamba-inference-conv-states-dtype "
        "--mamba-inference-ssm-states-dtype --megatron-fsdp-grad-comm-dtype "
        "--megatron-fsdp-main-grads-dtype --megatron-fsdp-main-params-dtype --mla-down-proj-fusion "
        "--moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute "
        "--moe-permute-fusion-into-hybridep --moe-router-force-biased --mtp-hybrid-override-pattern "
        "--mtp-use-repeated-layer --muon-coefficient-type --muon-scalar-optimizer "
        "--mup-attn-scale-power --mup-base-head-dim --mup-base-hidden-size --mup-embedding-mult "
        "--mup-output-mult --mup-width-mult --no-flight-recorder-dump-on-timeout "
        "--no-flight-recorder-extra-dump-on-exec --no-flight-recorder-include-only-active "
        "--no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging "
        "--no-inference-use-synchronous-zmq-collectives --no-rl-persist-cuda-graphs "
        "--optimizer-cuda-graph --pytorch-profiler-collect-callstack "
        "--pytorch-profiler-collect-chakra --pytorch-profiler-collect-shapes --rl-inference-parsers "
        "--tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast --use-mup "
        "--verify-integrity"
    ),
    ((0, 18), None): (
        "--async-ckpt-use-cpu-shm --chat-template --cuda-graph-modules "
        "--disable-ckpt-load-validate-sharding-integrity --disable-pad-vocab-size "
        "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --enable-msc "
        "--eval-global-batch-size --eval-micro-batch-size --fault-injector-delay-start-iteration "
        "--fault-injector-fault-delay --fault-injector-fault-probabilities "
        "--fault-injector-fault-types --fault-injector-mtti-seconds --fault-injector-num-ranks "
        "--fault-injector-offset-seconds --fault-injector-ranks --fault-injector-seed "
        "--fine-grained-offloading-max-inflight-offloads --fp8-output-proj --gpu-sniff-test-interval "
        "--high-priority-a2a-comm-stream --inference-cuda-graph-scope "
        "--inference-disable-ep-consensus --inference-dynamic-batching-sampling-backend "
        "--inference-moe-token-dispatcher-type --megatron-fsdp-enable-fine-grained-param-gather "
        "--mlp-chunks-for-training --moe-hybridep-num-sms-preprocessing --moe-mlp-glu-interleave-size "
        "--moe-single-grouped-bias --moe-single-grouped-weight --muon-nesterov "
        "--no-ckpt-load-validate-sharding-integrity --no-inference-disable-ep-consensus "
        "--no-pad-vocab-size --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--null-tokenizer-eod-id --null-tokenizer-pad-id --nvtx-ranges "
        "--overlap-dispatch-backward-with-experts-wgrad --record-shapes --save-activations-interval "
        "--save-params-interval --save-tokens-per-expert-interval --start-eval-at-iter "
        "--use-grouped-gemm-for-dense-mlp --validation-set-names"
    ),
    ((0, 19), (0, 20)): (
        "--disable-stream-ckpt-dequant --moe-ncclep-static-shape --no-stream-ckpt-dequant"
    ),
    ((0, 19), None): (
        "--activation-offload-fraction --dataloader-inter-document-masking "
        "--delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks "
        "--disable-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu "
        "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --dsa-indexer-rope-interleaved "
        "--dsa-indexer-skip-topk-offset --dsa-indexer-topk-freq --dsa-kernel-backend "
        "--expert-tensor-parallel-num-weight-shards --flash-attention-version "
        "--fsdp-db-use-persist-buf-on-alloc-fail --inference-dynamic-batching-async-sched-mode "
        "--inference-dynamic-batching-cuda-graph-sizing-distribution "
        "--inference-dynamic-batching-logprobs-mode --logits-load-decode-threads --logits-load-dir "
        "--logits-load-ignore-errors --logits-load-kd-loss-alpha --logits-load-msc-prefetch-depth "
        "--logits-load-prefetch-factor --logits-save-dir --logits-save-dtype --logits-save-top-k "
        "--logits-save-top-p --logits-save-top-p-min-k --mamba-training-ssm-states-dtype "
        "--megatron-fsdp-max-pool-double-buffer --moe-flex-dispatcher-num-sms "
        "--moe-hybridep-pad-uneven-dispatch-inputs --moe-ncclep-zero-copy "
        "--moe-router-quantile-balancing-ema --moe-routing-trace-capture-hidden-states "
        "--moe-routing-trace-capture-logits --moe-routing-trace-dump-weights "
        "--moe-routing-trace-max-training-iters --moe-routing-trace-path "
        "--moe-shared-expert-glu-interleave-size --mtp-detach-heads "
        "--no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
        "--no-yarn-correction-range-round-to-int --override-ckpt-iteration "
        "--rl-consumption-granularity --rl-profile --rl-profile-dir --rl-submission-granularity "
        "--tensor-parallel-num-weight-shards --use-grouped-gemm-for-shared-expert "
        "--use-same-sampling-seed-across-dp-ranks --yarn-beta-fast --yarn-beta-slow "
        "--yarn-correction-range-round-to-int --yarn-original-max-position-embeddings"
    ),
    ((0, 20), None): (
        "--batch-invariant-backend --ckpt-drop-redundant-extra-state "
        "--ckpt-fully-parallel-load-per-rank-objects --ckpt-pg-tensors-cache-create "
        "--ckpt-pg-tensors-cache-path --disable-save-tokenizer-assets --enable-mhc-connections "
        "--gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute --gdp-num-householder "
        "--gtp-expert-remat-nccl-ub --gtp-remat-nccl-ub --gtp-remat-opt-in-modules "
        "--gtp-remat-reduce-scatter-with-fp32-accumulation --megatron-fsdp-version "
        "--mhc-init-gating-factor --mhc-num-residual-streams --mhc-recompute-layer-num "
        "--mhc-sinkhorn-iterations --moe-combine-bwd-dtype --moe-dispatch-fwd-dtype "
        "--moe-use-grouped-tensor --mtp-hsm --muon-use-syrk --no-save-tokenizer-assets --otel-enabled "
        "--otel-service-name --otel-span-groups --output-logit-dtype --rl-durable-rollout-bank "
        "--rl-rollout-bank-dir --rl-rollout-bank-max-bytes --use-gigatoken"
    ),
}
ARGUMENT_VERSIONS.update({flag: span for span, flags in _SPANS.items() for flag in flags.split()})


# Choices of a modelled argument that differ between megatron-core versions: (flag, value) -> the
# first version whose Megatron-LM accepts it (arguments.py's `choices` at core_v0.13.1, core_v0.14.0,
# core_v0.15.0, core_v0.16.0, core_v0.17.0, core_v0.18.0 and main): --optimizer was
# ['adam', 'sgd'] to 0.15; 0.16 added muon and dist_muon, 0.17 lion, 0.18 soap and adaptive_muon.
CHOICE_VERSIONS: dict[tuple[str, str], tuple[int, int]] = {
    ("--optimizer", "muon"): (0, 16),
    ("--optimizer", "dist_muon"): (0, 16),
    ("--optimizer", "lion"): (0, 17),
    ("--optimizer", "soap"): (0, 18),
    ("--optimizer", "adaptive_muon"): (0, 18),
}


# the megatron-core releases whose Muon this tool runs, as [first, stop) ranges: 0.16-0.17's
# optimizer/muon.py, and 0.18-0.19's optimizer/emerging_optimizers.py registry (muon.py a shim
# there). The layer-wise optimizer (dist_muon; from 0.18 also muon with --use-distributed-optimizer)
# as 0.16-0.17 build it, which 0.18+ keep behind --no-use-layer-wise-param-layout, and by default on
# 0.18+ with its matrices laid out in DDP's buffers (layer_wise_optimizer.py
# compute_full_param_layout) beside a DistributedOptimizer for the other parameters (world/ddp.py).
MUON_RELEASES = (((0, 16), (0, 20)),)
LAYER_WISE_RELEASES = (((0, 16), (0, 20)),)
MUON_REGISTRY_SINCE = (0, 18)
# the megatron-core releases whose --fp4-param-gather this tool runs (DistributedDataParallelConfig's
# fp4_param_gather, the DistributedOptimizer's NVFP4 cast through Transformer Engine 2.14's
# quantize_master_weights): 0.18 on, whose DDP lays the packed bytes out in a param buffer of their
# own (`_compute_nvfp4_packed_layout`); 0.17 runs it with the param buffer's offsets packed and the
# grad buffer's apart (`nvfp4_unpacked_param_index_map`), not modelled; 0.16 cannot (unmodelled.py)
FP4_PARAM_RELEASES = (((0, 18), (0, 20)),)  # optimizer/emerging_optimizers.py builds Muon
# the megatron-core releases whose --use-transformer-engine-op-fuser this tool runs: 0.18 on, whose
# TransformerConfig has the field and whose TEGroupedMLP._fused_forward runs Transformer Engine
# 2.14's fused operations (world/te/ops.py); 0.17 and before have no such argument
OP_FUSER_RELEASES = (((0, 18), (0, 20)),)
# the megatron-core releases whose TransformerConfig has `mtp_use_repeated_layer` (core_v0.17.0 on;
# 0.16 has no such field): MultiTokenPredictionBlock builds one MTP layer and runs it
# --mtp-num-layers times (multi_token_prediction.py), which this tool runs as megatron does
MTP_REPEATED_RELEASES = (((0, 17), (0, 20)),)
# the megatron-core releases whose TransformerConfig has DSA's top-k sharing across layers,
# `dsa_indexer_topk_freq` and `dsa_indexer_skip_topk_offset` (core_v0.19.0 on; Megatron-LM's
# arguments of the same names): DSAttention builds no indexer on a layer that reuses the top-k
DSA_INDEX_SHARE_RELEASES = (((0, 19), (0, 20)),)


def within(ranges: tuple[tuple[tuple[int, int], tuple[int, int]], ...], version: tuple[int, int]) -> bool:
    """Return whether `version` is in one of the [first, stop) `ranges`."""
    return any(first <= version < stop for first, stop in ranges)


def choice_version_fact(flag: str, value: str) -> tuple[str, bool] | None:
    """Return the version fact of a choice some Megatron-LM versions lack ("muon is a choice of
    Megatron-LM 0.16+; this tool builds with megatron-core 0.16"), and whether the installed
    megatron-core's Megatron-LM accepts it; None for a choice every version has."""
    first = CHOICE_VERSIONS.get((flag, value))
    if first is None:
        return None
    installed = megatron_core_version()
    fact = (f"{flag} {value} is a choice of Megatron-LM {_dotted(first)}+; this tool builds with "
            f"megatron-core {_dotted(installed)}")  # fmt: skip
    return fact, installed >= first


def argument_unknown_note(flag: str) -> str | None:
    """Return a note when the installed megatron-core's Megatron-LM does not know `flag`, else None."""
    span = ARGUMENT_VERSIONS.get(flag)
    if span is None:
        return None
    first, gone = span
    installed = megatron_core_version()
    if first <= installed and (gone is None or installed < gone):
        return None
    since = (f"removed in {_dotted(gone)}" if gone is not None and installed >= gone
             else f"added in {_dotted(first)}")  # fmt: skip
    return (f"{flag} is not an argument of Megatron-LM {_dotted(installed)} (the installed "
            f"megatron-core; {since}): its pretrain_gpt.py would stop with 'unrecognized "
            "arguments'")  # fmt: skip


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def unknown_argument_notes(flags: Iterable[str]) -> list[str]:
    """Return one note per flag (each once, in order) the installed Megatron-LM does not know."""
    notes = (argument_unknown_note(flag) for flag in dict.fromkeys(flags))
    return [note for note in notes if note is not None]
