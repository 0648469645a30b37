"""Checks of a hybrid (Mamba) model's arguments, before megatron-core builds it.

megatron-core's MambaStack turns `--hybrid-override-pattern` into layers with
ssm/mamba_hybrid_layer_allocation.py `allocate_layers` (one symbol a layer: `Symbols.VALID`) and
MambaMixer asserts its sizes divide (ssm/mamba_mixer.py `__init__`); these checks say the same in
one sentence naming the flag, before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from inspector.errors import ConfigError
from inspector.job.gdn import gdn_layers
from inspector.job.model import ModelConfig
from inspector.job.versions import (
    hybrid_gdn_layers,
    hybrid_moe_layers,
    hybrid_pattern_separators,
    megatron_version,
)

# megatron-core ssm/mamba_hybrid_layer_allocation.py `Symbols`: Mamba, attention, MLP, from 0.16
# MoE, from 0.17 gated delta net (LATER_SYMBOLS: the versions that have them; D and + not
# modelled yet)
LAYER_SYMBOLS = {"M": "Mamba", "*": "attention", "-": "MLP", "E": "MoE", "G": "gated delta net"}
_SINCE = {"E": hybrid_moe_layers, "G": hybrid_gdn_layers}
# later megatron-core's `Symbols` this tool does not build yet, and the first version with each
# (ssm/mamba_hybrid_layer_allocation.py core_v0.17.0; models/hybrid/ core_v0.18.0, core_v0.19.0)
LATER_SYMBOLS = {"G": ("gated delta net", (0, 17)), "D": ("DeepSeek sparse attention", (0, 18)),
                 "+": ("multi-latent attention", (0, 19))}  # fmt: skip
DSA_SYMBOL = "D"  # built where the installed megatron-core has it (job/dsa.py)


PIPE, MTP_SEPARATOR = "|", "/"  # megatron-core 0.17+ `Symbols.PIPE`, `MTP_SEPARATOR`


def main_layers(pattern: str) -> str:
    """Return the decoder's layer symbols of a pattern: before the first `/` (MTP depths follow
    it), without the `|` stage boundaries (hybrid_layer_allocation.py
    `get_hybrid_total_layer_count`)."""
    return pattern.split(MTP_SEPARATOR)[0].replace(PIPE, "")


def mtp_symbols(config: ModelConfig) -> str:
    """Return one MTP depth's layer symbols: the pattern after its first `/` (megatron's
    parse_hybrid_pattern requires every depth's to be the same), "" without MTP depths."""
    parts = (config.hybrid_override_pattern or "").split(MTP_SEPARATOR)
    return parts[1] if len(parts) > 1 else ""


def layer_symbols(config: ModelConfig) -> str:
    """Return each decoder layer's symbol, as megatron's allocation gives them: the pattern's
    layers, or all Mamba for `--is-hybrid-model` alone (allocate_layers with both ratios 0).
    Ratios without a pattern are megatron's own arithmetic (`allocate_layers`), not repeated here."""
    pattern = config.hybrid_override_pattern
    if pattern is not None:
        return main_layers(pattern) if hybrid_pattern_separators() else pattern
    if config.hybrid_attention_ratio or config.hybrid_mlp_ratio:
        raise ConfigError(
            "--hybrid-attention-ratio / --hybrid-mlp-ratio without --hybrid-override-pattern: "
            "plan needs the pattern (memory and params build it as megatron allocates it)"
        )
    return "M" * config.num_layers


def layer_kinds(config: ModelConfig) -> tuple[bool | str, ...]:
    """Return each layer's kind as the planner keys its pieces: a GPT layer's is whether its MLP
    is MoE, a hybrid layer's its pattern symbol (megatron's MambaStack builds one module a layer);
    with gated delta nets (`--experimental-attention-variant`) its mixer and MLP (`gpt_kind`)."""
    if config.hybrid:
        return tuple(layer_symbols(config))
    if config.gdn:
        gdn = gdn_layers(config)
        return tuple(gpt_kind(gdn[i], config.is_moe_layer(i)) for i in range(config.num_layers))
    return tuple(config.is_moe_layer(i) for i in range(config.num_layers))


def gpt_kind(gdn: bool, moe: bool) -> str:
    """Return a GPT layer's kind when its mixer varies: `G` or `*`, then `E` or `-`."""
    return ("G" if gdn else "*") + ("E" if moe else "-")


def pipe_segments(pattern: str | None) -> int:
    """Return the pipeline segments `|` cuts the decoder's pattern into (1 without `|`:
    `get_hybrid_total_pipeline_segment_count`)."""
    return (pattern or "").split(MTP_SEPARATOR)[0].count(PIPE) + 1


def validate_hybrid(
    config: ModelConfig, tp: int = 1, pp: int = 1, uneven: bool = False, vpp: int | None = None
) -> None:
    """Raise ConfigError for hybrid arguments megatron would refuse (tp, pp, vpp: the tensor-,
    pipeline- and virtual-pipeline sizes; uneven: --decoder-first/last-pipeline-num-layers given)."""
    pattern = config.hybrid_override_pattern
    _validate_virtual(pattern, pp, vpp)
    if pattern is not None:
        _validate_separators(pattern, pp, uneven)
        _validate_pattern(main_layers(pattern) if hybrid_pattern_separators() else pattern, config)
    if config.transformer_impl != "transformer_engine":
        raise ConfigError(
            f"--transformer-impl {config.transformer_impl} cannot build a hybrid model: "
            "megatron-core's mamba_stack_spec (the --spec pretrain_mamba.py is given) is made of "
            "Transformer Engine modules; drop --transformer-impl"
        )
    if pattern is None or "M" in pattern:  # MambaMixer's asserts run where it is built
        _validate_mamba_sizes(config, tp)


def check_ratios(config: ModelConfig) -> None:
    """Raise ConfigError for a hybrid ratio outside [0, 1] (Megatron-LM's help: "in the range
    [0.0, 1.0]"; allocate_layers asserts it), hybrid or not."""
    for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio"):
        value = getattr(config, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"--{name.replace('_', '-')} {value} is not in [0.0, 1.0]")


def _validate_separators(pattern: str, pp: int, uneven: bool) -> None:
    """Megatron-LM 0.17+'s rules for `|` and `/` (arguments.py `validate_args`, core_v0.19.0):
    the segments divide among --pp stages, more of them than stages are virtual stages."""
    if not hybrid_pattern_separators():
        return  # `|` and `/` are then unknown symbols (_validate_pattern)
    segments = pipe_segments(pattern)
    if segments == 1:
        return
    if segments % pp:
        raise ConfigError(
            f"--hybrid-layer-pattern has {segments} pipeline segments, not divisible by --pp "
            f"{pp} ({segments} % {pp} = {segments % pp}); Megatron-LM needs them to divide"
        )
    if uneven:
        raise ConfigError(
            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers with '|' in "
            "--hybrid-layer-pattern: the pattern's segments already place the layers; drop them"
        )


def _validate_virtual(pattern: str | None, pp: int, vpp: int | None) -> None:
    """A hybrid model's virtual stages are its pattern's `|` segments (megatron-core 0.17+
    `select_pipeline_segment`: chunk c of pipeline rank r builds segment c x pp + r); without
    them megatron refuses virtual stages (0.17+: "Virtual pipeline parallelism (vp_stage != None)
    is not supported when hybrid_layer_pattern has no pipe ('|') separators"; before 0.17
    MambaStack's _select_layers_for_pipeline_parallel)."""
    segments = pipe_segments(pattern) if hybrid_pattern_separators() else 1
    if vpp is None and segments > pp and segments % pp == 0:  # (not dividing: _validate_separators)
        # validate_args: the segments are virtual stages, and "When interleaved schedule is used,
        # pipeline-model-parallel size should be greater than 1"; with more than one stage, a job
        # built without them would hold only each rank's first segment
        need = ("the interleaved schedule needs --pp larger than 1 (give --pp, or drop the '|' "
                "boundaries)" if pp == 1 else "the job must have them")
        raise ConfigError(
            f"--hybrid-layer-pattern has {segments} pipeline segments for --pp {pp}: Megatron-LM "
            f"makes them {segments // pp} virtual stages a rank, and "
            + need
        )
    if vpp is None:
        return
    if segments == 1:
        raise ConfigError(
            "a hybrid model without '|' in its --hybrid-layer-pattern cannot be interleaved: "
            "megatron-core refuses virtual pipeline stages there (add '|' stage boundaries, "
            "megatron-core 0.17+, or drop the virtual-pipeline flag)"
        )
    if segments != vpp * pp:
        raise ConfigError(
            f"--hybrid-layer-pattern has {segments} pipeline segments, but --pp {pp} x {vpp} "
            f"virtual stages per pipeline rank = {vpp * pp} model chunks; megatron-core builds "
            "one segment a chunk (drop the virtual-pipeline flag: the pattern sets it)"
        )


def _validate_pattern(pattern: str, config: ModelConfig) -> None:
    symbols = {s: kind for s, kind in LAYER_SYMBOLS.items() if s not in _SINCE or _SINCE[s]()}
    if megatron_version() >= LATER_SYMBOLS[DSA_SYMBOL][1]:
        symbols[DSA_SYMBOL] = LATER_SYMBOLS[DSA_SYMBOL][0]
    unknown = sorted({symbol for symbol in pattern if symbol not in symbols})
    later = [f"{s} ({LATER_SYMBOLS[s][0]}, megatron-core {'.'.join(map(str, LATER_SYMBOLS[s][1]))}+)"
             for s in unknown if s in LATER_SYMBOLS]  # fmt: skip
    installed = ".".join(map(str, megatron_version()))
    for s in unknown:
        if s in LATER_SYMBOLS and s in LAYER_SYMBOLS:  # modelled where megatron-core builds it
            since = ".".join(map(str, LATER_SYMBOLS[s][1]))
            raise ConfigError(
                f"--hybrid-override-pattern {pattern}: {s} ({LAYER_SYMBOLS[s]}) layers need "
                f"megatron-core {since} or newer (the installed megatron-core is {installed})"
            )
    if later:
        raise ConfigError(
            f"--hybrid-override-pattern {pattern}: {', '.join(later)} layers are not modelled yet "
            f"(the installed megatron-core is {installed})"
        )
    if unknown:
        known = ", ".join(f"{s} {kind}" for s, kind in symbols.items())
        raise ConfigError(
            f"--hybrid-override-pattern {pattern}: {' '.join(unknown)} is not a layer symbol of "
            f"this megatron-core ({known})"
        )
    if len(pattern) != config.num_layers:
        raise ConfigError(
            f"--hybrid-override-pattern has {len(pattern)} layers but --num-layers is "
            f"{config.num_layers}; megatron-core needs one symbol per layer"
        )
    if "E" in pattern and config.num_experts is None:
        raise ConfigError("--hybrid-override-pattern has MoE layers (E): they need --num-experts")


@dataclass(frozen=True)
class MambaShape:
    """The sizes MambaMixer derives from the config (ssm/mamba_mixer.py `__init__`):
    TransformerConfig's defaults where unset (state 128, head size 64, 8 groups), d_inner =
    heads x head size, or expand (2) x h without --mamba-num-heads."""

    d_inner: int
    heads: int
    groups: int
    state: int

    @property
    def in_width(self) -> int:
        """Return in_proj's output: z, x (d_inner each), B, C (G N each) and dt (H)."""
        return 2 * self.d_inner + 2 * self.groups * self.state + self.heads


def mamba_shape(config: ModelConfig) -> MambaShape:
    """Return MambaMixer's sizes for the model (validate_hybrid has checked they divide)."""
    head_dim = config.mamba_head_dim or 64
    heads = config.mamba_num_heads
    d_inner = heads * head_dim if heads else 2 * config.hidden_size
    return MambaShape(d_inner, heads or d_inner // head_dim, config.mamba_num_groups or 8,
                      config.mamba_state_dim or 128)  # fmt: skip


def _validate_mamba_sizes(config: ModelConfig, tp: int) -> None:
    """MambaMixer's asserts (ssm/mamba_mixer.py): heads and groups divide by tp, heads by groups."""
    head_dim = config.mamba_head_dim or 64  # TransformerConfig's defaults
    groups = config.mamba_num_groups or 8
    heads = config.mamba_num_heads
    if heads is None:
        inner = 2 * config.hidden_size  # MambaMixer's d_inner = expand (2) x d_model
        if inner % head_dim:
            raise ConfigError(
                f"2 x --hidden-size {config.hidden_size} = {inner} is not divisible by "
                f"--mamba-head-dim {head_dim} ({inner} % {head_dim} = {inner % head_dim}); "
                "pass --mamba-num-heads"
            )
        heads = inner // head_dim
    for what, value in (("Mamba heads", heads), ("--mamba-num-groups", groups)):
        if value % tp:
            raise ConfigError(
                f"{what} {value} is not divisible by --tp {tp} ({value} % {tp} = {value % tp})"
            )
    if heads % groups:
        raise ConfigError(
            f"Mamba heads {heads} are not divisible by --mamba-num-groups {groups} "
            f"({heads} % {groups} = {heads % groups})"
        )
