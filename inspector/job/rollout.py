"""The GRPO step's rollout engine (`train_rl.py --perform-rl-step`): what it keeps on the GPU.

Megatron-LM's `train_rl.py` with --perform-rl-step (training.py branches on `args.perform_rl_step`)
generates each step's rollouts with megatron-core's dynamic inference engine, then trains the
policy on them as pretrain_gpt.py trains (the training step's micro-batches are --micro-batch-size
sequences of --seq-length tokens; the packed GRPO bins with --rl-use-sequence-packing). Read from
Megatron-LM d98e8a6 (the functional tests' goldens) and core_v0.16.1:
- the engine's context allocates a KV-cache block pool of --inference-dynamic-batching-buffer-
  size-gb (default 40) once; with --rl-kv-cache-management-mode persist (the default, arguments.py
  L2760) it stays on the GPU through the training step (dynamic_context.py
  `deallocate_inference_state_buffers` returns early): counted with the rank's static memory
  (memory/engine/inference_context.py runs megatron-core's own context);
- the engine's CUDA graphs (`--cuda-graph-impl local`, one per transformer layer and batch
  size of the context's list) are not deleted when the engine is suspended with the KV cache
  persisted (megatron-core 0.17+ dynamic_engine.py `suspend`: only another
  --rl-kv-cache-management-mode without static pointers deletes them; 0.16: only unified memory
  level 0 without --rl-training-cuda-graphs): what they hold stays through the training step
  (memory/engine/rollout_graphs.py);
- the policy trains without graphs (rl_utils.py L2269-2273 and L2936-2950 toggle its
  CudaGraphManagers off for the training step) unless --rl-training-cuda-graphs keeps them on:
  then megatron-core's per-layer training graphs are captured beside the engine's, in the same
  pool (memory/engine/local_graphs.py);
- the optimizer and gradient buffers go to the host during rollouts only
  (--rl-offload-optimizer-during-inference, rl_utils.py L777-788): back for the training step.
What the rollouts hold while they run (activations, logits, graphs) is not counted: `memory`
reports the training step, which the functional tests' goldens show to hold the lifetime peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version
from inspector.job.checks import check_at_least_one, check_count

# what `memory` says of the rollout engine's bytes (render/memory.py)
HELD = ("the rollout engine keeps through the training step (megatron-core's dynamic inference "
        "context: KV cache, tables, sampling; its CUDA graphs' outputs); the rollouts' own peak is "
        "not counted.")
# megatron-core 0.16's DynamicInferenceContext keywords, as core_v0.16.1's megatron/rl passes them;
# 0.17+ takes (model config, InferenceConfig) (memory/engine/inference_context.py)
ROLLOUTS_SINCE = (0, 16)
# Megatron-LM's --rl-kv-cache-management-mode choices (arguments.py, d98e8a6); persist is modelled
KV_CACHE_MODES = ("persist", "offload", "recompute")


@dataclass(frozen=True)
class RolloutContext:
    """The dynamic inference context's arguments: Megatron-LM's flags, with their defaults."""

    buffer_size_gb: float = 40.0  # --inference-dynamic-batching-buffer-size-gb
    paused_buffer_size_gb: float | None = None  # --inference-dynamic-batching-paused-buffer-size-gb
    block_size_tokens: int = 256  # --inference-dynamic-batching-block-size
    max_sequence_length: int = 2560  # --inference-max-seq-length
    max_requests: int | None = None  # --inference-dynamic-batching-max-requests
    max_tokens: int | None = None  # --inference-dynamic-batching-max-tokens
    unified_memory_level: int = 0  # --inference-dynamic-batching-unified-memory-level
    num_cuda_graphs: int = 16  # --inference-dynamic-batching-num-cuda-graphs (with local graphs)
    mixed_prefill_count: int = 16  # --inference-dynamic-batching-cuda-graph-mixed-prefill-count
    # --inference-dynamic-batching-cuda-graph-sizing-distribution (megatron-core 0.19+; before it,
    # the spacing `linear` names)
    graph_sizing: str | None = None
    cuda_graphs: bool = False  # --cuda-graph-impl local: the engine captures its steps
    decode_only_graphs: bool = False  # --decode-only-cuda-graphs
    training_graphs: bool = False  # --rl-training-cuda-graphs (0.16: the context's persist flag)
    reset_graphs: bool = False  # --rl-reset-cuda-graphs (Megatron-LM 0.15-0.16)

    def __post_init__(self) -> None:
        """Reject what Megatron-LM's argparse or the context would."""
        if self.buffer_size_gb <= 0:
            raise ConfigError(f"--inference-dynamic-batching-buffer-size-gb {self.buffer_size_gb} "
                              "must be above 0 (GiB of KV-cache blocks)")  # fmt: skip
        if self.block_size_tokens < 1 or self.max_sequence_length < 1:
            raise ConfigError("--inference-dynamic-batching-block-size and --inference-max-seq-"
                              "length must be at least 1")  # fmt: skip
        if self.unified_memory_level not in (0, 1):
            raise ConfigError(f"--inference-dynamic-batching-unified-memory-level "
                              f"{self.unified_memory_level} is not one of: 0, 1")  # fmt: skip


# Megatron-LM argument name -> RolloutContext field
ROLLOUT_ARGS = {
    "inference_dynamic_batching_buffer_size_gb": "buffer_size_gb",
    "inference_dynamic_batching_paused_buffer_size_gb": "paused_buffer_size_gb",
    "inference_dynamic_batching_block_size": "block_size_tokens",
    "inference_max_seq_length": "max_sequence_length",
    "inference_dynamic_batching_max_requests": "max_requests",
    "inference_dynamic_batching_max_tokens": "max_tokens",
    "inference_dynamic_batching_unified_memory_level": "unified_memory_level",
    "inference_dynamic_batching_num_cuda_graphs": "num_cuda_graphs",
    "inference_dynamic_batching_cuda_graph_mixed_prefill_count": "mixed_prefill_count",
    "inference_dynamic_batching_cuda_graph_sizing_distribution": "graph_sizing",
}
# the switches (RolloutContext field -> Megatron-LM argument name)
_SWITCHES = {"decode_only_graphs": "decode_only_cuda_graphs",
             "training_graphs": "rl_training_cuda_graphs", "reset_graphs": "rl_reset_cuda_graphs"}
assert set(ROLLOUT_ARGS.values()) | set(_SWITCHES) == {f.name for f in fields(RolloutContext)} - {
    "cuda_graphs"}


# the context's sizes and counts: at least 1, or (0 allowed) not negative; checked whether or not
# the job runs rollouts, as every size a user types is
_AT_LEAST_ONE = ("inference_dynamic_batching_block_size", "inference_max_seq_length",
                 "inference_dynamic_batching_max_requests", "inference_dynamic_batching_max_tokens")
_COUNTS = ("inference_dynamic_batching_unified_memory_level",
           "inference_dynamic_batching_num_cuda_graphs",
           "inference_dynamic_batching_cuda_graph_mixed_prefill_count")  # fmt: skip


def make_rollout(args: Mapping[str, Any]) -> RolloutContext | None:
    """Return the rollout engine's context for --perform-rl-step, None without it."""
    for names, check in ((_AT_LEAST_ONE, check_at_least_one), (_COUNTS, check_count)):
        for name in names:
            check("--" + name.replace("_", "-"), args.get(name))
    if not args.get("perform_rl_step"):
        return None
    installed = megatron_core_version()
    if installed < ROLLOUTS_SINCE:
        raise ConfigError(f"--perform-rl-step is modelled with megatron-core 0.16 or later (the "
                          f"installed {installed[0]}.{installed[1]}'s DynamicInferenceContext takes "
                          "other arguments than Megatron-LM's RL set-up passes it)")  # fmt: skip
    cp = int(args.get("context_parallel_size") or 1)
    if cp > 1:  # training.py L1838-1847: `force_cp1_inference_model`
        raise ConfigError(f"--perform-rl-step with --context-parallel-size {cp} is not modelled: "
                          "Megatron-LM builds a second copy of the model without context "
                          "parallelism for the rollouts")  # fmt: skip
    mode = args.get("rl_kv_cache_management_mode") or "persist"
    if mode != "persist":
        raise ConfigError(f"--rl-kv-cache-management-mode {mode} is not modelled: the KV cache "
                          "moved off the GPU (offload) or freed (recompute) for the training step; "
                          "persist (the default) keeps it there and is")  # fmt: skip
    values = {field: args[name] for name, field in ROLLOUT_ARGS.items() if args.get(name) is not None}
    values |= {field: bool(args.get(name)) for field, name in _SWITCHES.items()}
    return RolloutContext(**values, cuda_graphs=_engine_graphs(args))


def _engine_graphs(args: Mapping[str, Any]) -> bool:
    """Return whether the rollout engine captures its steps: `--cuda-graph-impl local` with
    --inference-cuda-graph-scope layer (local's default, megatron-core 0.18+
    `normalize_inference_cuda_graph_scope`); `none` captures none (Megatron-LM passes
    num_cuda_graphs None: training/config/inference_config.py `enable_cuda_graphs`)."""
    if args.get("cuda_graph_impl") != "local":
        return False
    scope = args.get("inference_cuda_graph_scope") or "layer"
    if scope == "block":
        raise ConfigError("--inference-cuda-graph-scope block is not modelled for the GRPO rollout "
                          "engine: its graphs are counted one per transformer layer (layer, the "
                          "default with --cuda-graph-impl local)")  # fmt: skip
    return scope == "layer"


def local_graphs_are_the_engine_s(args: Mapping[str, Any]) -> bool:
    """Return whether `--cuda-graph-impl local` only graphs the rollout engine: the GRPO step
    turns the policy's graphs off for the training step (rl_utils.py L2269-2273, L2936-2950)
    unless --rl-training-cuda-graphs keeps them on."""
    return (bool(args.get("perform_rl_step")) and args.get("cuda_graph_impl") == "local"
            and not args.get("rl_training_cuda_graphs"))  # fmt: skip
