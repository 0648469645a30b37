"""The values Megatron-LM's argparse takes for the arguments this tool ignores.

Read off Megatron-LM's own parser (megatron/training/arguments.py `add_megatron_arguments`,
built with `allow_abbrev=False`) at core_v0.16.1, and for the arguments it lacks at core_v0.19.0,
main (d98e8a6, 0.20) or core_v0.13.1: its actions' kinds, types and choices for every argument of
ignored.IGNORED it defines. A script's value for one of them is checked as argparse checks it (a
switch takes no value, an int must read as int(), a choice must be listed); arguments of other
programs (ModelOpt's) are not checked.
"""

from __future__ import annotations

from inspector.errors import ConfigError

# store_true / store_false / BooleanOptionalAction: no value
SWITCHES = frozenset((
    "--adlr-autoresume --allow-ambiguous-pad-tokens --apply-layernorm-1p "
    "--apply-query-key-layer-scaling --apply-residual-connection-post-layernorm "
    "--apply-wd-to-qk-layernorm --async-ckpt-use-cpu-shm --async-save --attention-softmax-in-fp32 "
    "--auto-detect-ckpt-format --batch-invariant-mode --bert-no-binary-head "
    "--biencoder-shared-query-context-model --cache-mla-latents --calc-ft-timeouts "
    "--calculate-per-token-loss --check-for-large-grads --check-for-spiky-loss "
    "--ckpt-assume-constant-structure --ckpt-convert-update-legacy-dist-opt-format "
    "--ckpt-drop-redundant-extra-state --ckpt-fully-parallel-load "
    "--ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-save "
    "--ckpt-pg-tensors-cache-create --cpu-offloading-retain-pinned-cpu-buffers "
    "--create-all-gather-group --data-parallel-random-init --dataloader-defer-npy-index-mmap "
    "--dataloader-fast-cache-load --ddp-average-in-collective "
    "--ddp-reduce-scatter-with-fp32-accumulation --decode-only-cuda-graphs "
    "--decrease-batch-size-if-needed --delay-offload-until-cuda-graph "
    "--dino-norm-last-layer --disable-align-grad-reduce "
    "--disable-async-tensor-model-parallel-allreduce --disable-bf16-reduced-precision-matmul "
    "--disable-chunked-prefill --disable-ckpt-fully-parallel-save "
    "--disable-ckpt-load-validate-sharding-integrity --disable-clone-scatter-output-in-embedding "
    "--disable-flight-recorder-dump-on-timeout --disable-flight-recorder-extra-dump-on-exec "
    "--disable-flight-recorder-include-only-active --disable-gloo-process-groups "
    "--disable-log-loss-scale-to-tensorboard --disable-manual-gc-eval --disable-msc "
    "--disable-save-tokenizer-assets --disable-straggler-on-startup --disable-stream-ckpt-dequant "
    "--disable-strict-fsdp-dtensor-load --disable-symmetric-registration "
    "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --disable-tp-comm-bulk-dgrad "
    "--disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
    "--disable-tp-comm-split-ag --disable-tp-comm-split-rs "
    "--disable-use-tokenizer-model-from-checkpoint-args --dist-ckpt-optim-fully-reshardable "
    "--dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient "
    "--enable-chunked-prefill --enable-experimental --enable-ft-package "
    "--enable-full-sharding-in-hsdp --enable-msc --eod-mask-loss --exit-on-missing-checkpoint "
    "--exit-signal-handler --exit-signal-handler-for-dataloader --exit-signal-handler-for-training "
    "--fake-process-group --fim-data --finetune --flash-decode --flight-recorder-include-stack-trace "
    "--fsdp-manual-registration --full-validation --gdp-cutedsl-kernel "
    "--grpo-filter-groups-with-same-reward --gtp-expert-remat-nccl-ub --gtp-remat-nccl-ub "
    "--gtp-remat-reduce-scatter-with-fp32-accumulation --high-priority-a2a-comm-stream "
    "--inference-cuda-graph-all-prefills --inference-disable-ep-consensus "
    "--inference-disable-triton-nvls-kernels --inference-dynamic-batching "
    "--inference-dynamic-batching-prefix-caching "
    "--inference-dynamic-batching-track-generated-token-events "
    "--inference-dynamic-batching-track-paused-request-events --inference-fuse-tp-communication "
    "--inference-moe-disable-fused-quant-kernels --inference-rng-tracker "
    "--inference-text-gen-server-logging --inference-use-synchronous-zmq-collectives "
    "--inference-wandb-logging --init-method-xavier-uniform --init-model-with-meta-device "
    "--inprocess-empty-cuda-cache --inprocess-restart --keep-fp8-transpose-cache "
    "--keep-fp8-transpose-cache-when-using-custom-fsdp --langrl-external-server --legacy-tokenizer "
    "--load-main-params-from-ckpt --load-model-opt-format --log-device-memory-used --log-energy "
    "--log-max-attention-logit --log-memory-to-tensorboard "
    "--log-progress --log-straggler --log-throughput --log-timers-to-tensorboard "
    "--log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard --logits-load-ignore-errors "
    "--manual-gc --mock-data --moe-apply-probs-on-input --moe-enable-routing-replay "
    "--moe-ncclep-static-shape --moe-ncclep-zero-copy --moe-pad-experts-for-cuda-graph-inference "
    "--moe-per-layer-logging --moe-router-force-load-balancing "
    "--moe-router-fusion --moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits "
    "--moe-routing-trace-dump-weights --moe-shared-expert-overlap --moe-use-upcycling "
    "--mtp-detach-heads --mtp-standalone --multiple-validation-sets --muon-nesterov "
    "--muon-no-split-qkv --muon-use-nesterov --muon-use-syrk --nccl-all-reduce-for-prefill "
    "--no-align-grad-reduce --no-align-param-gather --no-async-tensor-model-parallel-allreduce "
    "--no-barrier-with-level-1-timing --no-check-for-nan-in-loss-and-grad "
    "--no-ckpt-fully-parallel-save --no-ckpt-load-validate-sharding-integrity "
    "--no-clone-scatter-output-in-embedding --no-create-attention-mask-in-dataloader "
    "--no-data-sharding --no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec "
    "--no-flight-recorder-include-only-active --no-gradient-reduce-div-fusion "
    "--no-inference-disable-ep-consensus --no-inference-dynamic-batching-prefix-caching "
    "--no-inference-text-gen-server-logging --no-inference-use-synchronous-zmq-collectives "
    "--no-inference-wandb-logging --no-initialization --no-langrl-external-server --no-load-optim "
    "--no-load-rng --no-log-loss-scale-to-tensorboard --no-manual-gc-eval --no-mmap-bin-files "
    "--no-one-logger --no-overlap-p2p-communication --no-persist-layer-norm --no-pin-cpu-grads "
    "--no-pin-cpu-params --no-position-embedding --no-rl-calculate-intra-group-similarity "
    "--no-rl-inference-logprobs-is-correction --no-rl-offload-inference-model-weights-when-idle "
    "--no-rl-offload-kv-cache-during-training --no-rl-partial-rollouts --no-rl-persist-cuda-graphs "
    "--no-rl-remove-kv-cache-during-training --no-rl-reset-cuda-graphs --no-rl-skip-bos-token "
    "--no-rl-training-cuda-graphs --no-rl-use-sequence-packing --no-rl-verify-model-weights-swap "
    "--no-save-optim --no-save-rng --no-save-tokenizer-assets --no-scatter-gather-tensors-in-pipeline "
    "--no-stream-ckpt-dequant --no-strict-fsdp-dtensor-load "
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces --no-tp-comm-bulk-dgrad "
    "--no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs --no-tp-comm-split-ag "
    "--no-tp-comm-split-rs --no-use-tokenizer-model-from-checkpoint-args "
    "--no-yarn-correction-range-round-to-int --nvtx-ranges --one-logger-async --openai-gelu "
    "--otel-enabled --output-bert-embeddings --overlap-cpu-optimizer-d2h-h2d "
    "--overlap-p2p-communication-warmup-flush --overlap-param-gather-with-optimizer-step "
    "--override-opt-param-scheduler --override-opt_param-scheduler --perform-rl-step --profile "
    "--pytorch-profiler-collect-callstack --pytorch-profiler-collect-chakra "
    "--pytorch-profiler-collect-shapes --qk-clip --record-memory-history --record-shapes "
    "--replication --reset-attention-mask --reset-position-ids --retriever-score-scaling "
    "--retro-add-retriever --retro-no-verify-neighbor-count --rl-calculate-intra-group-similarity "
    "--rl-durable-rollout-bank --rl-inference-logprobs-is-correction "
    "--rl-offload-inference-model-weights-when-idle --rl-offload-kv-cache-during-training "
    "--rl-offload-optimizer-during-inference --rl-partial-rollouts --rl-persist-cuda-graphs "
    "--rl-profile --rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --rl-skip-bos-token "
    "--rl-training-cuda-graphs --rl-use-sequence-packing --rl-verify-model-weights-swap "
    "--rotary-interleaved --run-workload-inspector-server --skip-train --squared-relu "
    "--te-rng-tracker --test-mode --tokenizer-hf-include-special-tokens "
    "--tokenizer-hf-no-include-special-tokens --tokenizer-hf-no-use-fast --tokenizer-hf-use-fast "
    "--tokenizer-sentencepiece-legacy --tp-comm-overlap-rs-dgrad --trust-remote-code "
    "--use-checkpoint-opt-param-scheduler --use-checkpoint-opt_param-scheduler "
    "--use-cpu-initialization --use-dist-ckpt --use-fused-weighted-squared-relu --use-gigatoken "
    "--use-legacy-static-engine --use-mcore-models --use-mp-args-from-checkpoint-args --use-mup "
    "--use-nccl-ub --use-one-sent-docs --use-persistent-ckpt-worker --use-pytorch-profiler "
    "--use-ring-exchange-p2p --use-rope-scaling --use-same-sampling-seed-across-dp-ranks --use-sharp "
    "--use-te-activation-func --use-torch-optimizer-for-cpu-offload --verify-integrity "
    "--vision-pretraining --yarn-correction-range-round-to-int "
).split())

# type=int, one value
INTS = frozenset((
    "--adlr-autoresume-interval --async-ckpt-cpu-priority --async-ckpt-io-priority "
    "--biencoder-projection-dim --check-weight-hash-across-dp-replicas-interval --ckpt-step "
    "--decoder-num-layers --decoder-seq-length --delta-offload-bytes-across-pp-ranks "
    "--dino-bottleneck-size --dino-head-hidden-size --dino-local-crops-number --dino-local-img-size "
    "--dino-warmup-teacher-temp-epochs --dist-ckpt-workers --distributed-timeout-minutes "
    "--distributed-timeout-seconds-after-init --error-injection-rate --eval-global-batch-size "
    "--eval-interval --eval-iters --exit-duration-in-mins --exit-interval "
    "--fault-injector-delay-start-iteration --fault-injector-num-ranks --fault-injector-seed "
    "--fine-grained-offloading-max-inflight-offloads --flight-recorder-trace-buffer-size "
    "--fp8-interval --fp8-margin --ft-num-warmup-iters --gdp-num-chunk-states-to-recompute "
    "--gdp-num-householder --gpu-sniff-test-interval --grpo-group-size --grpo-iterations "
    "--grpo-prompts-per-step --hysteresis --ict-head-size --img-h --img-w --indexer-batch-size "
    "--indexer-log-interval --inference-batch-times-seqlen-threshold --inference-coordinator-port "
    "--inference-cuda-graph-max-tokens --inference-dynamic-batching-block-size "
    "--inference-dynamic-batching-chunk-size --inference-dynamic-batching-cuda-graph-max-tokens "
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
    "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-requests-override "
    "--inference-dynamic-batching-max-tokens --inference-dynamic-batching-max-tokens-override "
    "--inference-dynamic-batching-num-cuda-graphs --inference-logging-step-interval "
    "--inference-max-batch-size --inference-max-requests --inference-max-seq-length "
    "--inprocess-active-world-size --inprocess-max-iterations --iter-per-epoch --local-rank "
    "--log-interval --log-memory-interval --logging-level --logits-load-decode-threads "
    "--logits-load-msc-prefetch-depth --logits-load-prefetch-factor --logits-save-top-k "
    "--logits-save-top-p-min-k --lr-decay-iters --lr-decay-samples --lr-warmup-iters "
    "--lr-warmup-samples --lr-wsd-decay-iters --lr-wsd-decay-samples --manual-gc-interval "
    "--max-seqlen-per-dp-cp-rank --max-tokens-to-oom --mhc-num-residual-streams "
    "--mhc-recompute-layer-num --mhc-sinkhorn-iterations "
    "--mlp-chunks-for-prefill --moe-routing-trace-max-training-iters "
    "--moe-shared-expert-glu-interleave-size --moe-upcycling-granularity --muon-num-ns-steps "
    "--mup-base-hidden-size --non-persistent-save-interval --null-tokenizer-eod-id "
    "--null-tokenizer-pad-id --num-channels --num-classes --num-dataset-builder-threads "
    "--num-speculative-tokens --num-workers --override-ckpt-iteration --patch-dim "
    "--persistent-save-interval --profile-step-end --profile-step-start "
    "--relative-attention-max-distance --relative-attention-num-buckets --replication-factor "
    "--replication-jump --retriever-seq-length --retro-cyclic-train-iters --retro-encoder-layers "
    "--retro-num-neighbors --retro-num-retrieved-chunks --rl-default-top-k --rl-generation-batch-size "
    "--rl-generation-lag --rl-inference-expert-model-parallel-size "
    "--rl-inference-expert-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size "
    "--rl-inference-tensor-model-parallel-size --rl-max-inflight-requests "
    "--rl-num-parallel-generation-batches --rl-num-parallel-generations "
    "--rl-parallel-generation-tasks --rl-prompts-per-eval --rl-rollout-bank-max-bytes "
    "--rl-sequence-packing-bin-size --rl-sequence-packing-max-sequences-per-bin --rotary-base "
    "--rotary-seq-len-interpolation-factor --save-activations-interval --save-dgrads-interval "
    "--save-interval --save-params-interval --save-retain-interval --save-tokens-per-expert-interval "
    "--save-wgrads-interval --seed --start-eval-at-iter --straggler-ctrlr-port "
    "--straggler-minmax-count --suggested-communication-unit-size --tensorboard-log-interval "
    "--tensorboard-queue-size --tiktoken-num-special-tokens --train-samples "
    "--train-sync-interval --yarn-original-max-position-embeddings "
).split())

# type=float, one value
FLOATS = frozenset((
    "--activation-offload-fraction --adam-beta1 --adam-beta2 --adam-eps --classes-fraction "
    "--clip-grad --data-per-class-fraction --decoupled-lr --decoupled-min-lr --dino-freeze-last-layer "
    "--dino-teacher-temp --dino-warmup-teacher-temp --embedding-init-method-std --end-weight-decay "
    "--fault-injector-fault-delay --fault-injector-mtti-seconds --fault-injector-offset-seconds "
    "--fim-fragment-rate --fim-rate --fim-spm-rate --grpo-clamp-eps-lower --grpo-clamp-eps-upper "
    "--grpo-default-temperature --grpo-default-top-p --grpo-entropy-term-weight --grpo-kl-beta "
    "--head-lr-mult --inference-dynamic-batching-buffer-guaranteed-fraction "
    "--inference-dynamic-batching-buffer-overflow-factor --inference-dynamic-batching-buffer-size-gb "
    "--inference-dynamic-batching-mamba-memory-ratio "
    "--inference-dynamic-batching-paused-buffer-size-gb "
    "--inference-dynamic-batching-prefix-caching-mamba-gb "
    "--inference-dynamic-batching-prefix-caching-routing-alpha --init-method-std --initial-loss-scale "
    "--inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-hard-timeout "
    "--inprocess-heartbeat-interval --inprocess-heartbeat-timeout --inprocess-last-call-wait "
    "--inprocess-monitor-process-interval --inprocess-monitor-thread-interval "
    "--inprocess-progress-watchdog-interval --inprocess-soft-timeout "
    "--inprocess-termination-grace-time --lion-beta1 --lion-beta2 --logits-load-kd-loss-alpha "
    "--logits-save-top-p --loss-scale --loss-scale-window --lr --lr-warmup-fraction --lr-warmup-init "
    "--mask-factor --mask-prob --mhc-init-gating-factor --mid-level-dataset-surplus --min-loss-scale "
    "--min-lr --moe-input-jitter-eps --moe-router-bias-update-rate --moe-router-force-biased "
    "--moe-router-quantile-balancing-ema --moe-router-topk-scaling-factor --moe-z-loss-coeff "
    "--mtp-loss-scaling-factor --muon-extra-scale-factor --muon-momentum --mup-attn-scale-power "
    "--mup-base-head-dim --mup-embedding-mult --mup-output-mult --mup-width-mult --norm-epsilon "
    "--optimizer-offload-fraction --qk-clip-alpha --qk-clip-threshold --query-in-block-prob "
    "--retro-attention-gate --retro-encoder-attention-dropout --retro-encoder-hidden-dropout "
    "--rl-default-temperature --rl-default-top-p --rl-importance-sampling-truncation-coef "
    "--rope-scaling-factor --rotary-percent --sample-rate --sgd-momentum --short-seq-prob "
    "--start-weight-decay --weight-decay --yarn-beta-fast --yarn-beta-slow "
).split())

# any other type (str, ...), one value
STRINGS = frozenset((
    "--app-tag-run-name --app-tag-run-version --bert-load --block-data-path --chat-template "
    "--ckpt-convert-save --ckpt-pg-tensors-cache-path --config-logger-dir --data-args-path "
    "--data-cache-path --dist-ckpt-format --dump-param-to-param-group-map --embedding-path "
    "--evidence-data-path --exit-signal --fault-injector-fault-probabilities "
    "--fault-injector-fault-types --fault-injector-ranks --fim-eod-token --fim-middle-token "
    "--fim-no-prefix --fim-pad-token --fim-prefix-token --fim-split-sample --fim-suffix-token "
    "--flight-recorder-dump-path --ict-load --inference-shards --langrl-env-config "
    "--langrl-inference-server-conversation-template --lazy-mpu-init --load --logits-save-dir "
    "--memory-snapshot-path --merge-file --moe-routing-trace-path --muon-coefficient-type "
    "--nccl-communicator-config-path --no-rope-freq --non-persistent-global-ckpt-dir "
    "--non-persistent-local-ckpt-dir --object-storage-cache-path --one-logger-project "
    "--one-logger-run-name --onnx-safe --otel-service-name --otel-span-groups "
    "--per-dataset-sequences-path --per-split-data-args-path --phase-transition-iterations "
    "--pretrained-checkpoint --result-rejected-tracker-filename --retro-project-dir --rl-profile-dir "
    "--rl-rollout-bank-dir --save --sft-tokenizer-prompt-format --split --step-batch-size-schedule "
    "--tensorboard-dir --tiktoken-pattern --titles-data-path --tokenizer-metadata --tokenizer-model "
    "--tp-comm-overlap-cfg --vocab-file --wandb-entity --wandb-exp-name --wandb-project "
    "--wandb-save-dir "
).split())

# nargs='+' (or a count) of int / float
MANY_INTS = frozenset((
    "--hierarchical-context-parallel-sizes --iterations-to-skip --mrope-section --profile-ranks "
    "--rampup-batch-size --retriever-report-topk-accuracies "
).split())

MANY_FLOATS = frozenset((
    "--moe-aux-loss-coeff "
).split())

# nargs='+' or '*' of strings (their words are not checked)
MANY_STRINGS = frozenset((
    "--cp-comm-type --data-path --gtp-remat-opt-in-modules --high-priority-stream-groups "
    "--rl-inference-parsers --test-data-path --tiktoken-special-tokens "
    "--tokenizer-special-tokens --train-data-path --valid-data-path --validation-set-names "
).split())

# choices=... (int choices compared after int(), as argparse converts before it compares)
CHOICES: dict[str, tuple[str, ...]] = {
    "--async-strategy": ("nvrx", "mcore"),
    "--batch-invariant-backend": ("te_native", "deepgemm", "triton"),
    "--bert-embedder-type": ("megatron", "huggingface"),
    "--ckpt-convert-format": ("torch", "torch_dist"),
    "--ckpt-fully-parallel-load-exchange-algo": ("broadcast", "gather_rounds", "gather_object"),
    "--ckpt-fully-parallel-load-process-group": ("dp", "ep_dp"),
    "--ckpt-fully-parallel-save-process-group": ("dp", "ep_dp"),
    "--dataloader-type": ("single", "cyclic", "external"),
    "--dist-ckpt-strictness": (
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all",
    ),
    "--distributed-backend": ("nccl", "gloo"),
    "--empty-unused-memory-level": ("0", "1", "2"),
    "--error-injection-type": ("correct_result", "transient_error", "persistent_error"),
    "--flash-attention-version": ("2", "3", "4"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
    "--inference-cuda-graph-scope": ("none", "layer", "block"),
    "--inference-dynamic-batching-async-sched-mode": ("legacy", "async"),
    "--inference-dynamic-batching-cuda-graph-sizing-distribution": ("exponential", "linear"),
    "--inference-dynamic-batching-logprobs-mode": ("raw_logprobs", "processed_logprobs"),
    "--inference-dynamic-batching-prefix-caching-coordinator-policy": (
        "longest_prefix", "first_prefix_block", "load_balanced",
    ),
    "--inference-dynamic-batching-prefix-caching-eviction-policy": ("ref_zero", "lru"),
    "--inference-dynamic-batching-sampling-backend": ("torch", "flashinfer"),
    "--inference-dynamic-batching-unified-memory-level": ("0", "1"),
    "--inference-grouped-gemm-backend": ("flashinfer", "torch", "vllm"),
    "--inference-moe-token-dispatcher-type": ("nccl", "nvls"),
    "--inprocess-granularity": ("node", "rank"),
    "--kitchen-attention-backend": ("sdpa", "fa"),
    "--langrl-inference-server-type": ("inplace_megatron", "inplace_megatron_chat"),
    "--logits-save-dtype": ("fp16", "bf16", "fp32"),
    "--lr-decay-style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "--lr-wsd-decay-style": ("exponential", "linear", "cosine", "minus_sqrt"),
    "--mamba-inference-conv-states-dtype": ("bf16", "fp16", "fp32"),
    "--mamba-inference-ssm-states-dtype": ("bf16", "fp16", "fp32"),
    "--mask-type": ("random", "row"),
    "--moe-combine-bwd-dtype": ("bf16", "mxfp8"),
    "--moe-dispatch-fwd-dtype": ("bf16", "mxfp8"),
    "--moe-token-drop-policy": ("probs", "position"),
    "--muon-fp32-matmul-prec": ("low", "medium", "high"),
    "--muon-scalar-optimizer": ("adam", "lion"),
    "--muon-scale-mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "--muon-tp-mode": ("blockwise", "duplicated", "distributed"),
    "--no-weight-decay-cond-type": ("apply_wd_to_qk_layernorm",),
    "--non-persistent-ckpt-type": ("global", "local", "in_memory"),
    "--non-persistent-local-ckpt-algo": ("fully_parallel", "atomic"),
    "--pipeline-model-parallel-comm-backend": ("nccl", "ucc"),
    "--refit-method": ("nccl", "gloo", "nvshmem"),
    "--rerun-mode": ("disabled", "validate_results", "report_stats"),
    "--rl-consumption-granularity": ("R", "G", "B"),
    "--rl-inference-model-unified-memory-level": ("0", "1"),
    "--rl-kv-cache-management-mode": ("persist", "offload", "recompute"),
    "--rl-sequence-packing-algo": ("fifo", "round-robin"),
    "--rl-submission-granularity": ("R", "G", "B"),
    "--sharp-enabled-group": ("dp", "dp_replica"),
    "--swin-backbone-type": ("tiny", "base", "h3"),
    "--symmetric-ar-type": ("two_shot", "one_shot", "multimem_all_reduce"),
    "--timing-log-level": ("0", "1", "2"),
    "--timing-log-option": ("max", "minmax", "all"),
    "--tokenizer-type": (
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
        "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
    ),
    "--tp-comm-bootstrap-backend": ("nccl", "mpi", "gloo"),
    "--vision-backbone-type": ("vit", "mit", "swin"),
    "--vision-pretraining-type": ("classify", "inpaint", "dino"),
    "--weight-decay-incr-style": ("constant", "linear", "cosine"),
}

INT_CHOICES = frozenset((
    "--empty-unused-memory-level --flash-attention-version "
    "--inference-dynamic-batching-unified-memory-level --rl-inference-model-unified-memory-level "
    "--timing-log-level "
).split())


MANY = MANY_INTS | MANY_FLOATS | MANY_STRINGS


def one_value(flag: str) -> bool:
    """Return whether argparse reads exactly one value after `flag` (an int, a float, a choice, a
    string): a plain word after that value is refused as argparse refuses it."""
    return flag in INTS | FLOATS | STRINGS | CHOICES.keys()


def switch(flag: str) -> bool:
    """Return whether Megatron-LM's argparse reads `flag` as a switch (it takes no value)."""
    return flag in SWITCHES


def check_value(flag: str, value: str | None, where: str) -> None:
    """Raise ConfigError where Megatron-LM's argparse would refuse `value` for the ignored
    `flag` (invalid int/float value, invalid choice, expected one argument: a value a script
    leaves out, `--tokenizer-model $UNSET --vocab-size 8`, is not the next flag)."""
    ints, floats = INTS | MANY_INTS | INT_CHOICES, FLOATS | MANY_FLOATS
    kind = "int" if flag in ints else "float" if flag in floats else ""
    if not (kind or flag in CHOICES or flag in STRINGS):
        return
    if value is None:
        raise ConfigError(f"{where}: {flag} needs a value (Megatron-LM's argparse: expected one argument)")
    words = value.split() if flag in MANY_INTS | MANY_FLOATS else [value]
    for word in words:
        try:
            read = str(int(word)) if kind == "int" else str(float(word)) if kind == "float" else word
        except ValueError:
            raise ConfigError(f"{where}: {flag} needs {kind} value, got {word!r} (Megatron-LM's "
                              f"argparse refuses it: invalid {kind} value)") from None  # fmt: skip
        if flag in CHOICES and read not in CHOICES[flag]:
            raise ConfigError(f"{where}: {flag} {word!r} is not one of: {', '.join(CHOICES[flag])} "
                              "(Megatron-LM's argparse refuses it: invalid choice)")  # fmt: skip
