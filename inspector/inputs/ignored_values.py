"""The values Megatron-LM's argparse takes for the arguments this tool ignores.

Read off Megatron-LM core_v0.16.1's own parser (megatron/training/arguments.py
`add_megatron_arguments`, built with `allow_abbrev=False`): its actions' kinds, types and
choices for every argument of unmodelled.IGNORED it defines. A script's value for one of them is
checked as argparse checks it (a switch takes no value, an int must read as int(), a choice must
be listed); arguments added after 0.16.1 or by other programs are not checked.
"""

from __future__ import annotations

from inspector.errors import ConfigError

# store_true / store_false / BooleanOptionalAction: no value
SWITCHES = frozenset((
    "--adlr-autoresume --allow-ambiguous-pad-tokens --apply-layernorm-1p "
    "--apply-query-key-layer-scaling --apply-residual-connection-post-layernorm --async-save "
    "--attention-softmax-in-fp32 --auto-detect-ckpt-format --calc-ft-timeouts "
    "--calculate-per-token-loss --check-for-large-grads --check-for-spiky-loss "
    "--ckpt-assume-constant-structure --ckpt-convert-update-legacy-dist-opt-format "
    "--ckpt-fully-parallel-load --ckpt-fully-parallel-save --cross-entropy-loss-fusion "
    "--data-parallel-random-init --ddp-average-in-collective "
    "--ddp-reduce-scatter-with-fp32-accumulation --decode-only-cuda-graphs "
    "--decrease-batch-size-if-needed --defer-embedding-wgrad-compute --deterministic-mode "
    "--disable-bf16-reduced-precision-matmul --disable-gloo-process-groups --disable-msc "
    "--disable-straggler-on-startup --disable-symmetric-registration --disable-tp-comm-bulk-dgrad "
    "--disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag --disable-tp-comm-overlap-rs "
    "--disable-tp-comm-split-ag --disable-tp-comm-split-rs --dist-ckpt-optim-fully-reshardable "
    "--dist-ckpt-save-pre-mcore-014 --distrib-optim-fully-reshardable-mem-efficient "
    "--enable-chunked-prefill --enable-experimental --enable-ft-package "
    "--enable-full-sharding-in-hsdp --eod-mask-loss --exit-on-missing-checkpoint "
    "--exit-signal-handler --finetune --full-validation --grpo-filter-groups-with-same-reward "
    "--inference-dynamic-batching --inference-wandb-logging --init-method-xavier-uniform "
    "--init-model-with-meta-device --inprocess-restart --keep-fp8-transpose-cache --legacy-tokenizer "
    "--load-main-params-from-ckpt --log-energy --log-memory-to-tensorboard --log-num-zeros-in-grad "
    "--log-params-norm --log-progress --log-straggler --log-throughput --log-timers-to-tensorboard "
    "--log-validation-ppl-to-tensorboard --log-world-size-to-tensorboard --manual-gc --mock-data "
    "--moe-apply-probs-on-input --moe-per-layer-logging --moe-permute-fusion "
    "--moe-router-force-load-balancing --moe-router-fusion --moe-shared-expert-overlap "
    "--moe-use-upcycling --multiple-validation-sets --muon-no-split-qkv --muon-use-nesterov "
    "--no-align-grad-reduce --no-align-param-gather --no-async-tensor-model-parallel-allreduce "
    "--no-barrier-with-level-1-timing --no-check-for-nan-in-loss-and-grad "
    "--no-ckpt-fully-parallel-save --no-clone-scatter-output-in-embedding "
    "--no-create-attention-mask-in-dataloader --no-gradient-reduce-div-fusion --no-initialization "
    "--no-load-optim --no-load-rng --no-log-loss-scale-to-tensorboard --no-manual-gc-eval "
    "--no-mmap-bin-files --no-one-logger --no-overlap-p2p-communication --no-persist-layer-norm "
    "--no-pin-cpu-grads --no-pin-cpu-params --no-position-embedding --no-save-optim --no-save-rng "
    "--no-scatter-gather-tensors-in-pipeline --no-strict-fsdp-dtensor-load "
    "--no-use-tokenizer-model-from-checkpoint-args --one-logger-async --openai-gelu "
    "--overlap-cpu-optimizer-d2h-h2d --overlap-p2p-communication-warmup-flush "
    "--overlap-param-gather-with-optimizer-step --override-opt_param-scheduler --perform-rl-step "
    "--profile --record-memory-history --replication --reset-attention-mask --reset-position-ids "
    "--rl-inference-logprobs-is-correction --rl-offload-inference-model-weights-when-idle "
    "--rl-offload-optimizer-during-inference --rl-partial-rollouts --rl-training-cuda-graphs "
    "--rl-use-sequence-packing --rotary-interleaved --run-workload-inspector-server --sft "
    "--skip-train --squared-relu --te-rng-tracker --tokenizer-hf-include-special-tokens "
    "--tp-comm-overlap --tp-comm-overlap-rs-dgrad --trust-remote-code "
    "--use-checkpoint-opt_param-scheduler --use-cpu-initialization --use-dist-ckpt "
    "--use-fused-weighted-squared-relu --use-legacy-static-engine --use-mcore-models "
    "--use-mp-args-from-checkpoint-args --use-nccl-ub --use-persistent-ckpt-worker "
    "--use-pytorch-profiler --use-ring-exchange-p2p --use-rope-scaling --use-sharp "
    "--use-te-activation-func --use-torch-optimizer-for-cpu-offload "
).split())

# type=int, one value
INTS = frozenset((
    "--adlr-autoresume-interval --check-weight-hash-across-dp-replicas-interval --ckpt-step "
    "--decoder-seq-length --distributed-timeout-minutes --distributed-timeout-seconds-after-init "
    "--error-injection-rate --eval-interval --eval-iters --exit-duration-in-mins --exit-interval "
    "--fp8-interval --fp8-margin --grpo-group-size --grpo-iterations --grpo-prompts-per-step "
    "--hysteresis --inference-batch-times-seqlen-threshold --inference-dynamic-batching-block-size "
    "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
    "--inference-dynamic-batching-num-cuda-graphs --inference-logging-step-interval "
    "--inference-max-requests --inference-max-seq-length --local-rank --log-interval --logging-level "
    "--lr-decay-iters --lr-decay-samples --lr-warmup-iters --lr-warmup-samples --lr-wsd-decay-iters "
    "--lr-wsd-decay-samples --manual-gc-interval --max-tokens-to-oom --moe-upcycling-granularity "
    "--muon-num-ns-steps --non-persistent-save-interval --num-dataset-builder-threads --num-workers "
    "--profile-step-end --profile-step-start --replication-factor --replication-jump "
    "--rl-default-top-k --rl-inference-expert-model-parallel-size "
    "--rl-inference-expert-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size "
    "--rl-inference-tensor-model-parallel-size --rl-prompts-per-eval "
    "--rl-sequence-packing-max-sequences-per-bin --rotary-base --rotary-seq-len-interpolation-factor "
    "--save-interval --save-retain-interval --seed --straggler-ctrlr-port --straggler-minmax-count "
    "--suggested-communication-unit-size --tensorboard-log-interval --tensorboard-queue-size "
    "--tiktoken-num-special-tokens --train-iters --train-samples --train-sync-interval "
    "--wgrad-deferral-limit "
).split())

# type=float, one value
FLOATS = frozenset((
    "--adam-beta1 --adam-beta2 --adam-eps --clip-grad --decoupled-lr --decoupled-min-lr "
    "--embedding-init-method-std --end-weight-decay --grpo-clamp-eps-lower --grpo-clamp-eps-upper "
    "--grpo-entropy-term-weight --grpo-kl-beta --inference-dynamic-batching-buffer-size-gb "
    "--inference-dynamic-batching-paused-buffer-size-gb --init-method-std --initial-loss-scale "
    "--loss-scale --loss-scale-window --lr --lr-warmup-fraction --lr-warmup-init --mask-prob "
    "--mid-level-dataset-surplus --min-loss-scale --min-lr --moe-input-jitter-eps "
    "--moe-router-bias-update-rate --moe-router-topk-scaling-factor --moe-z-loss-coeff "
    "--muon-extra-scale-factor --muon-momentum --norm-epsilon --optimizer-offload-fraction "
    "--rl-default-temperature --rl-default-top-p --rl-importance-sampling-truncation-coef "
    "--rope-scaling-factor --rotary-percent --sample-rate --sgd-momentum --short-seq-prob "
    "--start-weight-decay --weight-decay "
).split())

# any other type (str, ...), one value
STRINGS = frozenset((
    "--app-tag-run-name --app-tag-run-version --ckpt-convert-save --config-logger-dir "
    "--data-args-path --data-cache-path --dist-ckpt-format --dump-param-to-param-group-map "
    "--langrl-env-config --lazy-mpu-init --load --memory-snapshot-path --merge-file "
    "--nccl-communicator-config-path --no-rope-freq --non-persistent-global-ckpt-dir "
    "--non-persistent-local-ckpt-dir --object-storage-cache-path --one-logger-project "
    "--one-logger-run-name --onnx-safe --per-split-data-args-path --pretrained-checkpoint "
    "--result-rejected-tracker-filename --save --sft-tokenizer-prompt-format --split "
    "--tensorboard-dir --tiktoken-pattern --tokenizer-metadata --tokenizer-model "
    "--tp-comm-overlap-cfg --vocab-file --wandb-entity --wandb-exp-name --wandb-project "
    "--wandb-save-dir "
).split())

# nargs='+' (or a count) of int / float
MANY_INTS = frozenset((
    "--hierarchical-context-parallel-sizes --iterations-to-skip --profile-ranks --rampup-batch-size "
).split())

MANY_FLOATS = frozenset((
    "--moe-aux-loss-coeff "
).split())

# the rest of that parser's option strings (in none of this tool's tables: "not recognised"),
# so that a real argument is never mistaken for an abbreviation
OTHER_ARGUMENTS = frozenset((
    "--apply-wd-to-qk-layernorm --attention-output-gate --batch-invariant-mode --batch-size "
    "--bert-embedder-type --bert-load --bert-no-binary-head --biencoder-projection-dim "
    "--biencoder-shared-query-context-model --block-data-path --cache-mla-latents "
    "--checkpoint-activations --classes-fraction --create-all-gather-group --cuda-graph-warmup-steps "
    "--data-per-class-fraction --dataloader-defer-npy-index-mmap --dataloader-fast-cache-load "
    "--decoder-num-layers --dino-bottleneck-size --dino-freeze-last-layer --dino-head-hidden-size "
    "--dino-local-crops-number --dino-local-img-size --dino-norm-last-layer --dino-teacher-temp "
    "--dino-warmup-teacher-temp --dino-warmup-teacher-temp-epochs "
    "--disable-async-tensor-model-parallel-allreduce --disable-chunked-prefill "
    "--disable-ckpt-fully-parallel-save --disable-clone-scatter-output-in-embedding "
    "--disable-fp8-wgrad --disable-jit-fuser --disable-log-loss-scale-to-tensorboard "
    "--disable-manual-gc-eval --disable-strict-fsdp-dtensor-load "
    "--disable-use-tokenizer-model-from-checkpoint-args --embedding-path --encoder-num-layers "
    "--ep-overlap-early-attn-memory-release --evidence-data-path --exit-signal "
    "--exit-signal-handler-for-dataloader --fake-process-group --fim-data --fim-eod-token "
    "--fim-fragment-rate --fim-middle-token --fim-no-prefix --fim-pad-token --fim-prefix-token "
    "--fim-rate --fim-split-sample --fim-spm-rate --fim-suffix-token --flash-decode "
    "--fp4-quantizer-factory --fp8-quantizer-factory --fsdp-manual-registration --ft-num-warmup-iters "
    "--head-lr-mult --hybrid-context-parallel --ict-head-size --ict-load --img-h --img-w "
    "--indexer-batch-size --indexer-log-interval --inference-coordinator-port "
    "--inference-dynamic-batching-cuda-graph-max-tokens "
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
    "--inference-dynamic-batching-track-paused-request-events --inference-fuse-tp-communication "
    "--inference-max-batch-size --inference-rng-tracker --inprocess-active-world-size "
    "--inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-empty-cuda-cache "
    "--inprocess-granularity --inprocess-hard-timeout --inprocess-heartbeat-interval "
    "--inprocess-heartbeat-timeout --inprocess-last-call-wait --inprocess-max-iterations "
    "--inprocess-monitor-process-interval --inprocess-monitor-thread-interval "
    "--inprocess-progress-watchdog-interval --inprocess-soft-timeout "
    "--inprocess-termination-grace-time --iter-per-epoch --kitchen-attention-backend "
    "--langrl-external-server --langrl-inference-server-conversation-template "
    "--langrl-inference-server-type --linear-attention-freq --linear-conv-kernel-dim "
    "--linear-key-head-dim --linear-num-key-heads --linear-num-value-heads --linear-value-head-dim "
    "--log-device-memory-used --log-max-attention-logit --log-memory-interval --mask-factor "
    "--mask-type --max-seqlen-per-dp-cp-rank --min-offloaded-tensor-size --mlp-chunks-for-prefill "
    "--model-parallel-size --moe-enable-routing-replay --moe-hybridep-num-sms "
    "--moe-pad-experts-for-cuda-graph-inference --mrope-section --mtp-loss-scaling-factor "
    "--mtp-standalone --nccl-all-reduce-for-prefill --no-data-sharding --no-inference-wandb-logging "
    "--no-langrl-external-server --no-rl-inference-logprobs-is-correction "
    "--no-rl-offload-inference-model-weights-when-idle --no-rl-offload-kv-cache-during-training "
    "--no-rl-partial-rollouts --no-rl-remove-kv-cache-during-training --no-rl-reset-cuda-graphs "
    "--no-rl-skip-bos-token --no-rl-training-cuda-graphs --no-rl-use-sequence-packing "
    "--no-rl-verify-model-weights-swap --no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad "
    "--no-tp-comm-overlap-ag --no-tp-comm-overlap-rs --no-tp-comm-split-ag --no-tp-comm-split-rs "
    "--no-weight-decay-cond-type --num-channels --num-classes --output-bert-embeddings "
    "--override-opt-param-scheduler --patch-dim --per-dataset-sequences-path "
    "--persistent-save-interval --phase-transition-iterations --qk-clip --qk-clip-alpha "
    "--qk-clip-threshold --query-in-block-prob --refit-method --relative-attention-max-distance "
    "--relative-attention-num-buckets --retriever-report-topk-accuracies --retriever-score-scaling "
    "--rl-offload-kv-cache-during-training --rl-parallel-generation-tasks "
    "--rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --rl-skip-bos-token "
    "--rl-verify-model-weights-swap --save-dgrads-interval --save-wgrads-interval "
    "--swin-backbone-type --symmetric-ar-type --test-mode --titles-data-path --tokenizer-hf-use-fast "
    "--tokenizer-sentencepiece-legacy --tokenizer-special-tokens --use-checkpoint-opt-param-scheduler "
    "--use-kitchen-attention --use-one-sent-docs --vision-backbone-type --vision-pretraining "
    "--vision-pretraining-type --warmup "
).split())

# choices=... (int choices compared after int(), as argparse converts before it compares)
CHOICES: dict[str, tuple[str, ...]] = {
    "--ckpt-convert-format": ("torch", "torch_dist"),
    "--cross-entropy-fusion-impl": ("native", "te"),
    "--dataloader-type": ("single", "cyclic", "external"),
    "--dist-ckpt-strictness": (
        "assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
        "return_unexpected", "return_all", "ignore_all",
    ),
    "--distributed-backend": ("nccl", "gloo"),
    "--empty-unused-memory-level": ("0", "1", "2"),
    "--error-injection-type": ("correct_result", "transient_error", "persistent_error"),
    "--fp4-recipe": ("nvfp4", "custom"),
    "--fp8-amax-compute-algo": ("most_recent", "max"),
    "--inference-dynamic-batching-unified-memory-level": ("0", "1"),
    "--lr-decay-style": ("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    "--lr-wsd-decay-style": ("exponential", "linear", "cosine", "minus_sqrt"),
    "--moe-router-dtype": ("fp32", "fp64"),
    "--moe-token-drop-policy": ("probs", "position"),
    "--muon-fp32-matmul-prec": ("low", "medium", "high"),
    "--muon-scale-mode": ("spectral", "unit_rms_norm", "shape_scaling"),
    "--muon-tp-mode": ("blockwise", "duplicated", "distributed"),
    "--non-persistent-ckpt-type": ("global", "local", "in_memory"),
    "--non-persistent-local-ckpt-algo": ("fully_parallel", "atomic"),
    "--pipeline-model-parallel-comm-backend": ("nccl", "ucc"),
    "--rerun-mode": ("disabled", "validate_results", "report_stats"),
    "--rl-inference-model-unified-memory-level": ("0", "1"),
    "--rl-sequence-packing-algo": ("fifo", "round-robin"),
    "--sharp-enabled-group": ("dp", "dp_replica"),
    "--timing-log-level": ("0", "1", "2"),
    "--timing-log-option": ("max", "minmax", "all"),
    "--tokenizer-type": (
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
        "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer",
    ),
    "--tp-comm-bootstrap-backend": ("nccl", "mpi", "gloo"),
    "--weight-decay-incr-style": ("constant", "linear", "cosine"),
}

INT_CHOICES = frozenset((
    "--empty-unused-memory-level --inference-dynamic-batching-unified-memory-level "
    "--rl-inference-model-unified-memory-level --timing-log-level "
).split())


MANY = MANY_INTS | MANY_FLOATS


def checked(flag: str) -> bool:
    """Return whether `flag` takes one value this module checks (an int, a float, a choice): a
    word after it is refused as argparse refuses it."""
    return flag in INTS | FLOATS | CHOICES.keys()


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
