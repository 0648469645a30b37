"""How many experts one build may hold: megatron-core builds each expert's weights one by one.

Measured on one core with megatron-core's meta-device build (docs/limits.md): a SequentialMLP
expert takes about 2 ms, an expert of Transformer Engine's grouped GEMM (TEGroupedMLP, a weight
per expert) about 0.5 ms, an expert of the local grouped GEMM (GroupedMLP, one weight for all)
about 0.03 ms. Each cap keeps a build's experts within about 15 seconds.
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.hybrid_model import layer_symbols
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig

MAX_SEQUENTIAL_EXPERTS = 8_192  # local experts x MoE layers, SequentialMLP
MAX_TE_GROUPED_EXPERTS = 32_768  # TEGroupedMLP: DeepSeek-V3's 256 x 58 at ep 1 is 14,848
MAX_GROUPED_EXPERTS = 524_288  # the local GroupedMLP


def expert_cap(model: ModelConfig) -> tuple[int, str]:
    """Return the cap on local experts x MoE layers for the model's expert module, and its name."""
    if not model.moe_grouped_gemm:
        return MAX_SEQUENTIAL_EXPERTS, "sequential experts (SequentialMLP, about 2 ms each)"
    if model.transformer_impl == "transformer_engine":
        return MAX_TE_GROUPED_EXPERTS, "TEGroupedMLP experts (a weight each, about 0.5 ms)"
    return MAX_GROUPED_EXPERTS, "grouped-GEMM experts (GroupedMLP)"


def check_expert_builds(model: ModelConfig, layout: Layout, ep_ranks: int) -> None:
    """Raise ConfigError when a build of `ep_ranks` expert-parallel ranks per stage holds more
    experts than its cap, naming the flags."""
    if model.num_experts is None:
        return
    if model.hybrid and model.hybrid_override_pattern is not None:
        moe_layers = layer_symbols(model).count("E")  # a hybrid's MoE layers are its E symbols
    else:
        moe_layers = sum(model.is_moe_layer(layer) for layer in range(model.num_layers))
    experts = model.num_experts // layout.ep * ep_ranks
    cap, kind = expert_cap(model)
    if experts * moe_layers > cap:
        which = f"--num-experts {model.num_experts}"
        if ep_ranks < layout.ep:
            which += f" / --expert-model-parallel-size {layout.ep} x {ep_ranks} rank(s) = {experts}"
        raise ConfigError(
            f"{which} experts x {moe_layers} MoE layers = {experts * moe_layers:,} {kind} to "
            f"build, more than the {cap:,} this tool builds (docs/limits.md)"
        )
