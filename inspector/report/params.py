"""The params command's records: per stage block, each parameter with its owners and precs.

From a BuiltJob: the records megatron's modules give (build.py), ownership by the chosen policy
(partition.py, or megatron's own DistributedOptimizer layout via ddp.py), Shampoo preconditioner
sizes, megatron's own checks (fidelity.py), and the --rank view. Renderers turn the result into
text (table.py for the semicolon and JSON forms, render/params.py for people).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inspector.job.layout import RankCoord
from inspector.job.optimizers import MUON
from inspector.records import ParamRecord
from inspector.report.formats import Partitioning
from inspector.report.table import Block, Row, block_comment, topology_line
from inspector.world.build import BuiltJob, BuiltStage

Owners = tuple[int, ...]


@dataclass(frozen=True)
class ParamsResult:
    """The params table as records: topology line, the json header, the stage blocks."""

    topology: str | None  # None in a --rank view of a rank other than 0
    header: dict[str, Any]
    blocks: list[Block]
    comments: bool  # stage comment lines (not in --rank files: the params table format)


def params_result(built: BuiltJob, partitioning: Partitioning, block_size: int) -> ParamsResult:
    """Return the table of every built stage, viewed as the BuiltJob's view asks."""
    from inspector.errors import ConfigError
    from inspector.job.checks import check_at_most
    from inspector.report import fidelity
    from inspector.world.ranks import rank_positions

    if block_size < 0:
        raise ConfigError(f"--block-size must be 0 (off) or positive, got {block_size}")
    check_at_most("--block-size", block_size)
    job, view = built.job, built.view
    blocks = [b for stage in built.stages for b in _stage_blocks(built, stage, partitioning, block_size)]
    complete = len(view.stages) == job.layout.pp
    fidelity.check_layers(blocks, job.model.num_layers, complete=complete)
    coord = view.coord
    if coord is not None:
        distopt_experts = partitioning is Partitioning.distopt and job.layout.ep > 1
        blocks = _rank_view(blocks, coord, distopt_experts)
    line = None
    if coord is None or coord.rank == 0:
        line = topology_line(rank_positions(job.layout), job.layout)
    return ParamsResult(line, _json_header(built, line), blocks, comments=coord is None)


def chunk_comments(built: BuiltJob) -> list[str]:
    """Return each built chunk's `# stage` comment (layers, parameters, bytes), as params writes it.

    The tree command heads each stage with it; its numbers are those of the chunk's records, the
    rows `params` would print for the same view.
    """
    interleaved = built.interleaved
    return [
        block_comment(
            Block(
                chunk.stage,
                chunk.chunk if interleaved else None,
                chunk.layers,
                [Row(record, (), None) for record in chunk.records],
            )
        )
        for chunk in built.chunks
    ]


def _stage_blocks(
    built: BuiltJob, stage: BuiltStage, partitioning: Partitioning, block_size: int
) -> list[Block]:
    """Return one stage's blocks of rows (one per chunk), owners and precs filled in."""
    from inspector.report import fidelity, partition

    dp = built.job.layout.dp
    records = [r for chunk in stage.chunks for r in chunk.records]
    precs = [partition.precs_for(r, block_size) for r in records]
    if partitioning is Partitioning.cost:
        owners = partition.owners_by_cost([partition.precs_cost(p) for p in precs], dp)
    elif partitioning is Partitioning.layers:
        owners = partition.owners_by_layers(records, dp)
    else:
        owners = _distopt_owners(built, stage, records)
    # a frozen parameter (LoRA) has no optimizer work: no owner, as in megatron's buffers
    owners = [o if r.trainable else () for r, o in zip(records, owners, strict=True)]
    rows = iter(Row(r, o, p) for r, o, p in zip(records, owners, precs))
    interleaved = len(stage.chunks) > 1
    blocks = [
        Block(
            stage.stage,
            chunk.chunk if interleaved else None,
            chunk.layers,
            [next(rows) for _ in chunk.records],
        )
        for chunk in stage.chunks
    ]
    fidelity.check_totals(blocks, {stage.stage: stage.checkpoint})
    return blocks


def _distopt_owners(
    built: BuiltJob, stage: BuiltStage, records: list[ParamRecord]
) -> list[Owners]:
    """Return each row's owners under megatron's DistributedOptimizer (its own DDP bucket layout).

    Dense parameters are sharded over data x context parallel ranks, expert parameters over the
    expert data-parallel ranks; each chunk of each expert-parallel rank is laid out by its own DDP,
    as Megatron-LM wraps each model chunk.
    """
    from inspector.world.ddp import distopt_owners
    from inspector.world.shards import DistOptSettings

    job = built.job
    training = job.training
    if training.megatron_fsdp and training.sharding_strategy == "no_shard":
        lay = job.layout  # positions in one instance's group under HSDP, as the other shards
        every = tuple(range(lay.dp * lay.cp // lay.num_distributed_optimizer_instances))
        return [every for _ in records]  # no_shard: every rank updates every parameter
    if training.optimizer in MUON and not training.layer_wise_param_layout:
        return _muon_owners(built, stage, records)
    # the layer-wise layout (0.18+ dist_muon): each matrix whole in one rank's shard of its
    # buffer, the other parameters in the DistributedOptimizer's shards (world/ddp.py)
    settings = DistOptSettings.for_job(job)
    owners: dict[tuple[int, int, str], Owners] = {}
    for chunk in stage.chunks:
        for expert_rank, model in zip(built.expert_ranks, chunk.models):
            if training.megatron_fsdp or training.torch_fsdp2:  # FSDP's shards (world/fsdp.py)
                found = {}
                for bucket in chunk.fsdp_of(model.module).buckets:
                    found.update(bucket.owners())
            else:
                found = distopt_owners(
                    model.module, settings, pipeline_rank=stage.stage, chunk=chunk.chunk
                )
            for name, ranks in found.items():
                owners[(expert_rank, chunk.chunk, name)] = ranks
    return [owners[(r.expert_rank or 0, r.chunk, r.local_name)] for r in records]


def _rank_view(blocks: list[Block], coord: RankCoord, distopt_experts: bool) -> list[Block]:
    """Keep the rows rank R holds, with precs left empty where R does not own the row.

    R's data-parallel index decides ownership; for expert rows under the distributed optimizer
    with expert parallelism it is R's index in the expert data-parallel group.
    """
    viewed = []
    for block in blocks:
        rows = []
        for row in block.rows:
            expert_rank = row.record.expert_rank
            if expert_rank is not None and expert_rank != coord.expert:
                continue
            index = coord.expert_data if distopt_experts and expert_rank is not None else coord.data
            rows.append(Row(row.record, row.owners, row.precs if index in row.owners else None))
        viewed.append(Block(block.stage, block.chunk, block.layers, rows))
    return viewed


def _json_header(built: BuiltJob, line: str | None) -> dict[str, Any]:
    model, layout = built.job.model, built.job.layout
    topology: dict[str, Any] = {
        "line": line,
        "world_size": layout.world_size,
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "data_parallel_size": layout.dp,
        "context_parallel_size": layout.cp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.expert_tp,
    }
    config = model.to_args()
    config["padded_vocab_size"] = model.embedding_rows(layout.tp)
    return {"config": config, "topology": topology}


def _muon_owners(built: BuiltJob, stage: BuiltStage, records: list[ParamRecord]) -> list[Owners]:
    """Return each row's owners under megatron's Muon (memory/engine/muon.py): with dist_muon the
    one rank its layer-wise optimizer gives the whole parameter, else every rank."""
    from inspector.memory.engine.muon_stage import stage_muon

    layout = built.job.layout
    found = {(p.chunk, p.name): p for p in stage_muon(built.job, stage.stage)}
    every = tuple(range(layout.dp * layout.cp)), tuple(range(layout.expert_dp))
    owners = []
    for record in records:
        param = found[(record.chunk, record.local_name)]
        owners.append(every[param.expert] if param.owner is None else (param.owner,))
    return owners
