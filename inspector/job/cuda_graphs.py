"""`--cuda-graph-impl` and `--cuda-graph-scope`: the CUDA graphs a job captures, checked as
megatron-core's TransformerConfig checks them (transformer/transformer_config.py __post_init__,
0.16.1).

Transformer Engine's per-layer graphs (`transformer_engine`) are modelled by `memory`
(memory/engine/cuda_graphs.py): their static inputs and their memory pool, whole layers or the scopes
attn, mlp, moe_router, moe_preprocess and mamba (a hybrid model's Mamba layers, whole); with the
MoE all-to-all overlap (`--overlap-moe-expert-parallel-comm`) the scopes megatron-core allows
there (attn, moe_router, moe_preprocess), captured layer by layer in the overlap's order.
megatron's own CudaGraphManager (`local`, refused in inputs/unmodelled.py) and full-iteration
graphs are not.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.inputs.refusals import DYNAMIC_MOE, static_moe_layers
from inspector.inputs.unmodelled import LOCAL_GRAPHS
from inspector.inputs.versions import megatron_core_version

# megatron-core's CudaGraphScope (transformer/enums.py), "full" its deprecated empty scope
SCOPES = ("full", "full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def parse_scope(args: Mapping[str, Any]) -> tuple[str, ...]:
    """Return the scope words (empty: the whole layer, as megatron-core turns "full" into [])."""
    raw = args.get("cuda_graph_scope")
    if raw is None:
        return ()
    words = raw if isinstance(raw, (list, tuple)) else re.split(r"[\s,]+", str(raw).strip())
    scope = tuple(str(w) for w in words if str(w))
    unknown = [w for w in scope if w not in SCOPES]
    if unknown:
        raise ConfigError(f"--cuda-graph-scope {' '.join(unknown)} is not one of: {', '.join(SCOPES)}")
    return tuple(w for w in scope if w != "full")


def check_cuda_graphs(impl: str, scope: tuple[str, ...], recompute: str, num_experts: int | None,
                      every_layer_moe: bool, ep_overlap: bool = False, syncs: bool = False,
                      static_moe: bool = False) -> None:  # fmt: skip
    """Refuse what megatron-core's TransformerConfig refuses, and the scopes not modelled
    (`static_moe`: the MoE layers keep their shapes on the GPU, inputs/refusals.py
    `static_moe_layers`)."""
    if impl == "none":  # the scope acts only with an implementation
        return
    installed = megatron_core_version()
    if installed < (0, 16):
        raise ConfigError(f"--cuda-graph-impl {impl} is modelled with megatron-core 0.16 or later "
                          f"(the installed {installed[0]}.{installed[1]} has no TECudaGraphHelper "
                          "sample buffers to run)")  # fmt: skip
    if impl == "local" and "full_iteration" not in scope and (scope or num_experts and not static_moe):
        what = f"--cuda-graph-scope {' '.join(scope)}" if scope else DYNAMIC_MOE
        raise ConfigError(f"--cuda-graph-impl local with {what} is not modelled: "
                          f"{LOCAL_GRAPHS.reason}")  # fmt: skip
    if impl == "local" and scope and scope != ("full_iteration",):
        raise ConfigError(f"--cuda-graph-scope {' '.join(scope)} is not modelled: with "
                          "full_iteration the whole forward and backward is one graph; pass "
                          "full_iteration alone")  # fmt: skip
    if impl == "transformer_engine" and "full_iteration" in scope:
        raise ConfigError("--cuda-graph-scope full_iteration with --cuda-graph-impl "
                          "transformer_engine: megatron-core refuses it ('To use full iteration "
                          "cuda graph, please use cuda_graph_impl=local instead of "
                          "cuda_graph_impl=transformer_engine.')")  # fmt: skip
    if "moe_preprocess" in scope and "moe_router" not in scope:
        raise ConfigError("--cuda-graph-scope moe_preprocess needs moe_router (megatron-core: "
                          "'moe_preprocess cuda graph is only supported with moe_router cuda "
                          "graph.')")  # fmt: skip
    if "moe_preprocess" in scope and syncs:
        raise ConfigError("--cuda-graph-scope moe_preprocess with the alltoall dispatcher and "
                          "--moe-expert-capacity-factor or router padding for fp8: megatron-core "
                          "refuses it ('moe_preprocess cuda graph is not supported when there are "
                          "DtoH copies and synchronizations in the preprocess step.')")  # fmt: skip
    if "moe_router" in scope and not num_experts:
        raise ConfigError("--cuda-graph-scope moe_router needs MoE layers (megatron-core: 'moe "
                          "cuda graph is only supported for MoE.')")  # fmt: skip
    if "moe" in scope and not num_experts:
        raise ConfigError("--cuda-graph-scope moe needs MoE layers (megatron-core: 'moe cuda "
                          "graph is only supported for MoE.')")  # fmt: skip
    if "mlp" in scope and every_layer_moe:
        raise ConfigError("--cuda-graph-scope mlp needs dense layers (megatron-core: 'mlp cuda "
                          "graph is only supported for dense layers, but not found in the "
                          "model.')")  # fmt: skip
    if ep_overlap:
        _check_overlap(scope)
    if "moe" in scope:
        raise ConfigError("--cuda-graph-scope moe is not modelled: megatron-core graphs the MoE "
                          "layer only with drop-and-pad routing, whose padded buffers the graph "
                          "keeps")  # fmt: skip
    if recompute == "full" and scope != ("full_iteration",):
        raise ConfigError("--recompute-granularity full with --cuda-graph-impl: megatron-core "
                          "refuses it ('full recompute is only supported with full iteration "
                          "CUDA graph.')")  # fmt: skip


def check_job_graphs(training: Any, model: Any, recompute: str | None = None) -> None:
    """Run `check_cuda_graphs` on a job's training settings and model (`recompute`: the job's
    own unless given, as a plan search asks before it picks one). Without graphs nothing is
    read: every Job a search builds passes here."""
    if training.cuda_graph_impl == "none":
        return
    check_cuda_graphs(training.cuda_graph_impl, training.cuda_graph_scope,
                      training.recompute if recompute is None else recompute, model.num_experts,
                      bool(model.num_experts) and model.every_layer_moe(), training.ep_overlap,
                      preprocess_syncs(training), static_moe_layers(vars(training)))  # fmt: skip


def _check_overlap(scope: tuple[str, ...]) -> None:
    """Refuse the graphs megatron-core refuses with the MoE all-to-all overlap, whose combined
    1F1B step runs a layer's attention, dispatch, MLP and combine apart
    (models/gpt/fine_grained_callables.py): the graph may end after the attention, router or
    preprocessing, not after the MLP."""
    both = [word for word in ("moe", "mlp") if word in scope]
    if both:
        raise ConfigError(f"--cuda-graph-scope {' '.join(both)} with "
                          "--overlap-moe-expert-parallel-comm: megatron-core refuses it "
                          "(TransformerConfig: 'CUDA graph scope on moe and mlp is not supported "
                          "with overlap_moe_expert_parallel_comm')")  # fmt: skip
    if not scope:
        raise ConfigError("--cuda-graph-impl transformer_engine graphs whole layers without "
                          "--cuda-graph-scope, which megatron-core refuses with "
                          "--overlap-moe-expert-parallel-comm (TransformerLayer."
                          "_te_cuda_graph_replay: 'EP overlap must be disabled when CUDA graph "
                          "captures the whole MLP/MoE part.'); pass --cuda-graph-scope attn "
                          "moe_router moe_preprocess")  # fmt: skip


def preprocess_syncs(training: Any) -> bool:
    """Return whether the MoE preprocessing copies to the host (megatron-core TransformerConfig:
    alltoall with a capacity factor or router padding for fp8, unless padded to capacity)."""
    factor = training.moe_expert_capacity_factor
    return (
        (factor is None or not training.moe_pad_expert_input_to_capacity)
        and training.moe_token_dispatcher_type == "alltoall"
        and (factor is not None or training.moe_router_padding)
    )
