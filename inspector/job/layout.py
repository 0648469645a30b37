"""The parallel layout, and the words this tool uses for it.

- size: how many ranks one parallel dimension spans (tensor-parallel size `tp`, pipeline `pp`, data
  `dp`, context `cp`, expert `ep`, expert-tensor `etp`), as in Megatron-LM's `--*-parallel-size`.
- rank: a global rank of the simulated world, 0 .. world_size-1 (world_size = tp*cp*dp*pp).
- stage: a pipeline stage, 0 .. pp-1; every rank belongs to one.
- chunk: a virtual-pipeline model chunk of a stage, 0 .. vpp-1 (just 0 without interleaving).
- RankCoord: a rank's coordinates and groups, as megatron's parallel_state lays them out.

The coordinates themselves come from megatron (world.py); this module only holds and validates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.job.checks import (
    check_at_least_one,
    check_built_layers,
    check_cp_chunks,
    check_expert_groups,
    check_ffn_split,
)
from inspector.job.hybrid_model import pipe_segments
from inspector.job.model import ModelConfig
from inspector.job.pipeline_layout import check_layout_string, expand_layout

# Beyond this many simulated ranks the topology line alone runs to megabytes; no real job is larger.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class Layout:
    """The parallel layout in Megatron-LM's terms: sizes and how the pipeline is split.

    This one record is what every part of the tool reads: megatron's build (world.py), the rank
    map (ranks.py) and the closed-form estimates (formulas.py, activations.py, flops.py).
    `vpp` is the virtual pipeline size resolved from Megatron-LM's two ways of asking for one
    (`make_layout`); None without interleaving. `etp` None means megatron's default, tp.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    sequence_parallel: bool = False
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: str | None = None
    # Megatron-LM's --use-tp-pp-dp-mapping (training/initialize.py): initialize_model_parallel's
    # order "tp-cp-ep-pp-dp" in place of the default "tp-cp-ep-dp-pp"
    use_tp_pp_dp_mapping: bool = False
    # --num-distributed-optimizer-instances: parallel_state's partial data-parallel groups, each
    # dp x cp / N consecutive data-parallel ranks sharding the optimizer (job/optimizers.py)
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self) -> None:
        """Reject sizes below one (the flags' own words)."""
        for flag, value in (
            ("--tp", self.tp),
            ("--pp", self.pp),
            ("--dp", self.dp),
            ("--context-parallel-size", self.cp),
            ("--expert-model-parallel-size", self.ep),
            ("--expert-tensor-parallel-size", self.etp),
            ("--num-virtual-stages-per-pipeline-rank", self.vpp),
            ("--num-distributed-optimizer-instances", self.num_distributed_optimizer_instances),
        ):
            check_at_least_one(flag, value)

    @property
    def rank_order(self) -> str:
        """Return the order megatron's initialize_model_parallel lays the ranks out in."""
        return "tp-cp-ep-pp-dp" if self.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"

    @property
    def world_size(self) -> int:
        """Return the number of ranks in the world."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        """Return the expert tensor-parallel size (megatron defaults it to tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Return the expert data-parallel size, as megatron's parallel_state derives it."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def chunks(self) -> int:
        """Return the model chunks per pipeline rank (1 without interleaving)."""
        return self.vpp or 1

    @property
    def sp_divisor(self) -> int:
        """Return t with sequence parallelism, else 1: the split of tensors outside TP regions."""
        return self.tp if self.sequence_parallel else 1

    @property
    def uses_cp_axis(self) -> bool:
        """Return whether the topology line carries a `context` coordinate."""
        return self.cp > 1


LAYOUT_ARGS = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "data_parallel_size": "dp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "expert_tensor_parallel_size": "etp",
}
LAYOUT_FIELDS = frozenset(Layout.__dataclass_fields__) - {"vpp"}


def make_layout(args: Mapping[str, Any], num_layers: int) -> Layout:
    """Build a Layout from Megatron-LM arguments, resolving the virtual pipeline size."""
    values = {LAYOUT_ARGS.get(name, name): value for name, value in args.items()}
    sizes = {k: v for k, v in values.items() if k in LAYOUT_FIELDS}
    layout = Layout(**sizes)
    per_chunk = args.get("num_layers_per_virtual_pipeline_stage")
    chunks = args.get("num_virtual_stages_per_pipeline_rank")
    _check_virtual(layout, num_layers, per_chunk, chunks)
    return dataclasses.replace(layout, vpp=virtual_size(layout, num_layers, per_chunk, chunks))


@dataclass(frozen=True)
class RankCoord:
    """One rank's coordinates and the ranks of each group it belongs to."""

    rank: int
    pipe: int
    data: int
    context: int
    model: int
    tensor_group: tuple[int, ...]
    pipeline_group: tuple[int, ...]
    data_group: tuple[int, ...]
    embedding_group: tuple[int, ...]
    expert_group: tuple[int, ...] | None = None  # expert-parallel group, when ep > 1
    expert: int = 0  # position in the expert-parallel group: which experts the rank holds
    expert_data: int = 0  # position in the expert data-parallel group (distopt expert shards)


def validate_rank_map(layout: Layout, num_experts: int | None) -> None:
    """Raise ConfigError for a layout whose rank map megatron cannot lay out (no model needed)."""
    world = layout.world_size
    if world > MAX_WORLD_SIZE:
        raise ConfigError(
            f"the world of --tp {layout.tp} x --context-parallel-size {layout.cp} x --dp {layout.dp} "
            f"x --pp {layout.pp} = {world} ranks is larger than the {MAX_WORLD_SIZE} this tool "
            "simulates"
        )
    if layout.ep > 1 and num_experts is None:
        raise ConfigError(f"--expert-model-parallel-size {layout.ep} needs --num-experts")
    check_expert_groups(layout.ep, layout.expert_tp, layout.tp, layout.cp, layout.dp,
                        layout.pp)
    if layout.use_tp_pp_dp_mapping and layout.pp > 1 and layout.expert_dp != layout.dp:
        # megatron-core parallel_state.initialize_model_parallel, for an order not ending in pp
        raise ConfigError(
            f"--use-tp-pp-dp-mapping with --pp {layout.pp} needs the same data-parallel size for "
            f"attention ({layout.dp}) and experts ({layout.expert_dp}: --tp {layout.tp} x "
            f"--context-parallel-size {layout.cp} x --dp {layout.dp} / (--expert-model-parallel-"
            f"size {layout.ep} x --expert-tensor-parallel-size {layout.expert_tp})), as megatron "
            "asserts: \"When not using pp-last rank ordering, the data parallel size of the "
            "attention and moe layers must be the same\""
        )


def rank_map_layout(args: Mapping[str, Any]) -> Layout:
    """Return the layout `topology` draws: only what a rank map needs is checked (no model)."""
    layout = make_layout(args, int(args.get("num_layers") or ModelConfig.num_layers))
    validate_rank_map(layout, args.get("num_experts"))
    return layout


def validate_layout(model: ModelConfig, layout: Layout) -> None:
    """Raise ConfigError for a layout megatron cannot build for this model."""
    validate_rank_map(layout, model.num_experts)
    tp, heads = layout.tp, model.num_attention_heads
    if heads % tp:
        raise ConfigError(
            f"--num-attention-heads {heads} is not divisible by --tp {tp} ({heads} % {tp} = {heads % tp})"
        )
    groups = model.query_groups
    if groups % tp:
        raise ConfigError(
            f"--num-query-groups {groups} is not divisible by --tp {tp} ({groups} % {tp} = {groups % tp})"
        )
    if model.vocab_size < tp:
        raise ConfigError(f"--vocab-size {model.vocab_size} is smaller than --tp {tp}")
    rows = model.padded_vocab_size
    if rows is not None and rows % tp:
        # megatron-core VocabUtility.vocab_range_from_global_vocab_size: divide(vocab, tp)
        raise ConfigError(
            f"--padded-vocab-size {rows} is not divisible by --tp {tp} ({rows} % {tp} = "
            f"{rows % tp}); megatron splits the embedding rows evenly over tensor-parallel ranks"
        )
    if model.num_experts is None:
        check_ffn_split(model.ffn_size, tp)
    _check_pipeline(model, layout)
    _check_experts(model, layout)
    _check_sequence_parallel(model, layout)


def _check_sequence_parallel(model: ModelConfig, layout: Layout) -> None:
    if not layout.sequence_parallel:
        return
    if layout.tp == 1:
        raise ConfigError(
            "--sequence-parallel needs --tp larger than 1 (it splits along tensor-parallel ranks)"
        )
    if model.transformer_impl == "local" and not model.use_apex:
        raise ConfigError(
            "--sequence-parallel cannot build with torch norms (--no-apex or RMSNorm): megatron-core's "
            "WrappedTorchNorm refuses sequence parallelism; it needs apex's FusedLayerNorm (LayerNorm "
            "models) or --transformer-impl transformer_engine"
        )


def check_buildable(model: ModelConfig, layout: Layout) -> None:
    """Raise ConfigError for layouts megatron-core's local spec cannot build (rank maps still can)."""
    check_built_layers(model.num_layers)
    if layout.cp > 1 and model.transformer_impl == "local":
        raise ConfigError(
            f"--context-parallel-size {layout.cp} needs --transformer-impl transformer_engine: "
            "megatron-core's local DotProductAttention refuses context parallelism"
        )
    check_cp_chunks(model.seq_length, layout.cp)


def virtual_size(
    layout: Layout, num_layers: int, per_chunk: int | None, chunks: int | None
) -> int | None:
    """Return the virtual pipeline size from Megatron-LM's two ways of asking for one.

    Megatron-LM arguments.py: --num-virtual-stages-per-pipeline-rank is the size itself; with
    --num-layers-per-virtual-pipeline-stage it is (layers per stage) // (layers per virtual stage).
    A --pipeline-model-parallel-layout with more stages than --pp implies it too.
    """
    if chunks is not None:
        return chunks
    if per_chunk is not None:
        return (num_layers // layout.pp) // per_chunk
    if layout.pipeline_model_parallel_layout is not None:
        stages = len(expand_layout(layout.pipeline_model_parallel_layout))
        return stages // layout.pp if stages > layout.pp else None
    return None


def _check_pipeline(model: ModelConfig, layout: Layout) -> None:
    if layout.pipeline_model_parallel_layout is not None:
        _check_layout_string(model, layout)
    elif (
        layout.decoder_first_pipeline_num_layers is not None
        or layout.decoder_last_pipeline_num_layers is not None
    ):
        _check_first_last(model, layout)
    elif (
        layout.account_for_embedding_in_pipeline_split or layout.account_for_loss_in_pipeline_split
    ):
        _check_accounted(model, layout)
    elif pipe_segments(model.hybrid_override_pattern) == 1:
        _check_even(model, layout)  # a hybrid pattern's `|` segments place the layers themselves


def _check_virtual(
    layout: Layout, num_layers: int, per_chunk: int | None, chunks: int | None
) -> None:
    """Check Megatron-LM's two virtual-pipeline flags before they become one size."""
    if per_chunk is not None and chunks is not None:
        raise ConfigError(
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
            "both set the virtual pipeline size; pass one of them"
        )
    for flag, value in (
        ("--num-layers-per-virtual-pipeline-stage", per_chunk),
        ("--num-virtual-stages-per-pipeline-rank", chunks),
    ):
        if value is None:
            continue
        check_at_least_one(flag, value)
        if layout.pp == 1:
            raise ConfigError(f"{flag} needs --pp larger than 1 (the interleaved schedule)")
    if per_chunk is not None:
        uneven = layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers
        if any(v is not None for v in uneven):
            raise ConfigError(
                "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                "--decoder-first/last-pipeline-num-layers (Megatron-LM rejects it); use "
                "--num-virtual-stages-per-pipeline-rank"
            )
        per_stage = num_layers // layout.pp
        if num_layers % layout.pp == 0 and per_stage % per_chunk:
            raise ConfigError(
                f"--num-layers {num_layers} / --pp {layout.pp} = {per_stage} layers per stage "
                f"do not split into chunks of --num-layers-per-virtual-pipeline-stage {per_chunk} "
                f"({per_stage} % {per_chunk} = {per_stage % per_chunk})"
            )


def _check_even(model: ModelConfig, layout: Layout) -> None:
    layers, pp = model.num_layers, layout.pp
    if layers % pp:
        raise ConfigError(
            f"--num-layers {layers} cannot be split evenly over --pp {pp} stages "
            f"({layers} % {pp} = {layers % pp}); use --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers or --pipeline-model-parallel-layout for an uneven split"
        )
    vpp = layout.vpp
    if vpp is not None and layers % (pp * vpp):
        raise ConfigError(
            f"--num-layers {layers} cannot be split evenly over --pp {pp} x {vpp} virtual stages "
            f"= {pp * vpp} chunks ({layers} % {pp * vpp} = {layers % (pp * vpp)})"
        )


def _check_first_last(model: ModelConfig, layout: Layout) -> None:
    """Megatron-core TransformerConfig's uneven-pipeline rules, with our flags named."""
    layers, stages, taken = model.num_layers, layout.pp, []
    vpp = layout.vpp
    for flag, value in (
        ("--decoder-first-pipeline-num-layers", layout.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", layout.decoder_last_pipeline_num_layers),
    ):
        if value is None:
            continue
        check_at_least_one(flag, value)
        if vpp is not None and value % vpp:
            raise ConfigError(
                f"{flag} {value} is not divisible by the {vpp} virtual stages per pipeline rank "
                f"({value} % {vpp} = {value % vpp})"
            )
        layers -= value
        stages -= 1
        taken.append(f"{flag} {value}")
    spent = " and ".join(taken)
    if layers < 0 or bool(layers) != bool(stages):
        raise ConfigError(
            f"--num-layers {model.num_layers} minus {spent} leaves {layers} layers for "
            f"{stages} middle stages of --pp {layout.pp}"
        )
    if stages and layers % stages:
        raise ConfigError(
            f"--num-layers {model.num_layers} minus {spent} leaves {layers} layers, which do not "
            f"split evenly over the {stages} middle stages ({layers} % {stages} = {layers % stages})"
        )
    if stages and vpp is not None and (layers // stages) % vpp:
        raise ConfigError(
            f"each middle stage gets {layers // stages} layers, which do not split into the {vpp} "
            f"virtual stages per pipeline rank ({layers // stages} % {vpp} = {(layers // stages) % vpp})"
        )


def _check_accounted(model: ModelConfig, layout: Layout) -> None:
    counted, flags = model.num_layers, []
    if layout.account_for_embedding_in_pipeline_split:
        counted += 1
        flags.append("1 for --account-for-embedding-in-pipeline-split")
    if layout.account_for_loss_in_pipeline_split:
        counted += 1
        flags.append("1 for --account-for-loss-in-pipeline-split")
    pp = layout.pp
    if counted % pp:
        raise ConfigError(
            f"--num-layers {model.num_layers} plus {' and '.join(flags)} = {counted} cannot be split "
            f"evenly over --pp {pp} stages ({counted} % {pp} = {counted % pp})"
        )
    vpp = layout.vpp
    if vpp is not None and (counted // pp) % vpp:
        raise ConfigError(
            f"{counted // pp} layers per stage (counting the embedding/loss) do not split into the "
            f"{vpp} virtual stages per pipeline rank ({counted // pp} % {vpp} = {(counted // pp) % vpp})"
        )


def _check_layout_string(model: ModelConfig, layout: Layout) -> None:
    text = layout.pipeline_model_parallel_layout or ""
    others = (
        layout.decoder_first_pipeline_num_layers is not None
        or layout.decoder_last_pipeline_num_layers is not None
        or layout.account_for_embedding_in_pipeline_split
        or layout.account_for_loss_in_pipeline_split
    )
    if others:
        raise ConfigError(
            "--pipeline-model-parallel-layout cannot be combined with --decoder-first/last-"
            "pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split"
        )
    mtp = model.mtp_num_layers or 0
    check_layout_string(text, layout.pp, model.num_layers, mtp)


def _check_experts(model: ModelConfig, layout: Layout) -> None:
    ep = layout.ep
    if model.num_experts is None:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    if model.num_experts % ep:
        raise ConfigError(
            f"--num-experts {model.num_experts} is not divisible by --expert-model-parallel-size "
            f"{ep} ({model.num_experts} % {ep} = {model.num_experts % ep})"
        )
    if ep > 1 and layout.tp > 1 and not layout.sequence_parallel:
        # Megatron-LM arguments.py asserts it; megatron-core 0.13-0.14 refuse it, 0.15.3 crashes
        # (NameError in its own warning), 0.16 warns.
        raise ConfigError(
            f"--expert-model-parallel-size {ep} with --tp {layout.tp} needs --sequence-parallel "
            "(Megatron-LM requires it when experts and tensor parallelism are combined)"
        )
    check_expert_groups(layout.ep, layout.expert_tp, layout.tp, layout.cp, layout.dp,
                        layout.pp)

