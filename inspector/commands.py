"""Each command's work, from merged arguments to the text it prints (no typer, no printing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inspector.engine import Target, check_rank, check_stage, coords, positions, resolve
from inspector.errors import ConfigError
from inspector.render.params import Block, Row

Owners = tuple[int, ...]

PARTITIONINGS = ("layers", "cost", "distopt")
PARAMS_FORMATS = ("csv", "json", "table")
TOPOLOGY_FORMATS = ("line", "table")


def cached(
    command: str, args: Mapping[str, Any], options: dict[str, Any], use_cache: bool, produce: Any
) -> str:
    """Return a command's output from the result cache, or produce (and store) it."""
    from inspector import cache

    if not (use_cache and cache.enabled()):
        return str(produce())
    entry = cache.key(command, dict(args), options)
    hit = cache.load(entry)
    if hit is not None:
        return hit
    text = str(produce())
    cache.store(entry, text)
    return text


def _choice(flag: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(allowed)}")


def _stages_for(target: Target, stage: int | None, rank: int | None) -> tuple[list[int], Any]:
    """Return the stages a view covers, and the rank's coordinates for a --rank view."""
    layout = target.layout
    if stage is not None and rank is not None:
        raise ConfigError("--stage and --rank select the same thing two ways; pass one of them")
    if stage is not None:
        check_stage(layout, stage)
        return [stage], None
    if rank is not None:
        check_rank(layout, rank)
        coord = coords(layout)[rank]
        return [coord.pipe], coord
    return list(range(layout.pp)), None


def tree_text(args: Mapping[str, Any], stage: int | None, rank: int | None) -> str:
    """Return the module tree of each requested stage (SPEC: `inspect-model tree`)."""
    from inspector.engine import build
    from inspector.render.tree import render_tree, stage_heading
    from inspector.walk import module_tree

    target = resolve(args)
    stages, coord = _stages_for(target, stage, rank)
    expert_rank = coord.expert if coord is not None else 0
    built = build(target, stages, expert_rank)
    single = target.layout.pp == 1 and len(built) == 1
    parts = []
    for model in built:
        if not single:
            chunk = model.chunk if len(built) > len(stages) else None
            parts.append(stage_heading(model.stage, chunk) + "\n")
        parts.append(render_tree(module_tree(model.module)))
    return "".join(parts)


def topology_text(args: Mapping[str, Any], fmt: str) -> str:
    """Return the rank map as the ProcessCoord line or a per-rank table."""
    from inspector.render.topology import render_topology_table, topology_line

    _choice("--format", fmt, TOPOLOGY_FORMATS)
    target = resolve(args)
    if fmt == "table":
        return render_topology_table(coords(target.layout), target.layout)
    return topology_line(positions(target.layout), target.layout) + "\n"


def _stage_blocks(target: Target, stage: int, partitioning: str, block_size: int) -> list[Block]:
    """Build one stage (every expert-parallel rank of it) and return its blocks of rows."""
    from inspector import fidelity, partition
    from inspector.engine import build
    from inspector.walk import walk_params

    layout = target.layout
    chunks_by_rank = [build(target, [stage], e) for e in range(layout.ep)]
    blocks = []
    for chunk_index, chunk in enumerate(chunks_by_rank[0]):
        walks = [
            list(walk_params(ranks[chunk_index], layout.tp, layout.expert_tp))
            for ranks in chunks_by_rank
        ]
        records = merge_expert_ranks(walks)
        layers = tuple(n - 1 for n in chunk.layer_numbers)
        label = chunk.chunk if len(chunks_by_rank[0]) > 1 else None
        blocks.append((label, layers, records))
    all_records = [r for _, _, records in blocks for r in records]
    precs = [partition.precs_for(r, block_size) for r in all_records]
    if partitioning == "cost":
        owners = partition.owners_by_cost([partition.precs_cost(p) for p in precs], layout.dp)
    elif partitioning == "layers":
        owners = partition.owners_by_layers(all_records, layout.dp)
    else:
        owners = _distopt_owners(target, chunks_by_rank, all_records)
    rows = iter(Row(r, o, p) for r, o, p in zip(all_records, owners, precs))
    result = [
        Block(stage, label, layers, [next(rows) for _ in records])
        for label, layers, records in blocks
    ]
    checkpoint = {
        k: v for ranks in chunks_by_rank for chunk in ranks for k, v in chunk.checkpoint.items()
    }
    fidelity.check_totals(result, {stage: checkpoint})
    return result


def _distopt_owners(
    target: Target, chunks_by_rank: list[list[Any]], records: list[Any]
) -> list[Owners]:
    """Return each row's owners under megatron's DistributedOptimizer (its own DDP bucket layout).

    Dense parameters are sharded over data x context parallel ranks, expert parameters over the
    expert data-parallel ranks; each chunk of each expert-parallel rank is laid out by its own DDP,
    as Megatron-LM wraps each model chunk.
    """
    from inspector.distopt import DistOptSettings, distopt_owners

    layout = target.layout
    settings = DistOptSettings.for_layout(layout)
    owners: dict[tuple[int, int, str], Owners] = {}
    for expert_rank, chunks in enumerate(chunks_by_rank):
        for chunk in chunks:
            found = distopt_owners(
                chunk.module, settings, pipeline_rank=chunk.stage, chunk=chunk.chunk
            )
            for name, ranks in found.items():
                owners[(expert_rank, chunk.chunk, name)] = ranks
    return [owners[(r.expert_rank or 0, r.chunk, r.local_name)] for r in records]


def merge_expert_ranks(walks: list[list[Any]]) -> list[Any]:
    """Merge the walks of a stage's expert-parallel ranks: every expert once, in rank order.

    Rank 0's rows come in megatron's order; after the last expert row of each layer, the other
    ranks' experts of that layer follow, rank by rank.
    """
    if len(walks) == 1:
        return walks[0]
    others: dict[int | None, list[Any]] = {}
    for walk in walks[1:]:
        for record in walk:
            if record.expert_rank is not None:
                others.setdefault(record.layer, []).append(record)
    merged = []
    base = walks[0]
    for index, record in enumerate(base):
        merged.append(record)
        following = base[index + 1] if index + 1 < len(base) else None
        is_last_expert = record.expert_rank is not None and (
            following is None or following.expert_rank is None or following.layer != record.layer
        )
        if is_last_expert:
            merged.extend(others.pop(record.layer, []))
    return merged


def _rank_view(blocks: list[Block], coord: Any, distopt_experts: bool) -> list[Block]:
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


def params_text(
    args: Mapping[str, Any],
    stage: int | None,
    rank: int | None,
    partitioning: str,
    block_size: int,
    fmt: str,
) -> str:
    """Return the params table for the requested view and format."""
    from inspector import fidelity
    from inspector.render import params as render
    from inspector.render.topology import topology_line

    _choice("--partitioning", partitioning, PARTITIONINGS)
    _choice("--format", fmt, PARAMS_FORMATS)
    if block_size < 0:
        raise ConfigError(f"--block-size must be 0 (off) or positive, got {block_size}")
    target = resolve(args)
    stages, coord = _stages_for(target, stage, rank)
    blocks = [b for s in stages for b in _stage_blocks(target, s, partitioning, block_size)]
    fidelity.check_layers(blocks, target.model.num_layers, complete=len(stages) == target.layout.pp)
    if coord is not None:
        blocks = _rank_view(blocks, coord, partitioning == "distopt" and target.layout.ep > 1)
    with_topology = rank is None or rank == 0
    line = topology_line(positions(target.layout), target.layout) if with_topology else None
    if fmt == "json":
        return render.render_json(_json_header(target, line), blocks)
    if fmt == "table":
        return render.render_human(blocks)
    return render.render_csv(line, blocks, comments=coord is None)


def _json_header(target: Target, line: str | None) -> dict[str, Any]:
    layout = target.layout
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
    config = target.model.to_args()
    config["padded_vocab_size"] = target.model.padded_vocab_size(layout.tp)
    return {"config": config, "topology": topology}


DIFF_FORMATS = ("text", "markdown", "json")


def diff_text(old_path: str, new_path: str, fmt: str) -> tuple[str, bool]:
    """Compare two params tables (files or `-`); return (report, equal)."""
    from inspector.diff import diff_tables
    from inspector.output import read_text
    from inspector.render.diff import render_diff
    from inspector.tables import read_table

    _choice("--format", fmt, DIFF_FORMATS)
    if old_path == "-" and new_path == "-":
        raise ConfigError("only one of OLD and NEW can be - (standard input)")
    old = read_table(read_text(old_path), old_path)
    new = read_table(read_text(new_path), new_path)
    result = diff_tables(old, new)
    return render_diff(result, fmt, old_path, new_path), result.equal


def check_text(text: str, path: str) -> tuple[str, bool]:
    """Compare a regenerated table with the committed one; return (report, equal).

    Equal means byte-identical; otherwise the report is the diff from the file to the fresh table.
    """
    from inspector.diff import diff_tables
    from inspector.output import read_text
    from inspector.render.diff import render_text
    from inspector.tables import read_table

    committed = read_text(path)
    if committed == text:
        return f"{path} is up to date\n", True
    result = diff_tables(read_table(committed, path), read_table(text, "regenerated"))
    if result.equal:
        return f"{path} differs from the regenerated table in formatting only\n", False
    return render_text(result, path, "regenerated"), False


def models_text() -> str:
    """Return the preset list with each preset's key sizes."""
    from tabulate import tabulate

    from inspector.presets import PRESETS

    rows = [[p.name, p.summary] for p in PRESETS.values()]
    return tabulate(rows, headers=["preset", "summary"]) + "\n"


MEMORY_FORMATS = ("text", "table", "json")


def memory_text(
    args: Mapping[str, Any],
    fmt: str,
    gpu_memory: float | None,
    gpu_tflops: float | None,
    mfu: float | None,
    ulysses_degree: int | None,
    walkthrough: bool,
) -> str:
    """Return the per-stage memory report, or with `walkthrough` one attention layer's steps."""
    from inspector.memory import make_hardware, make_training, measure
    from inspector.render import memory as render

    _choice("--format", fmt, MEMORY_FORMATS)
    target = resolve(args)
    training = make_training(args, target.layout)
    hardware = make_hardware(gpu_memory, gpu_tflops, mfu)
    if walkthrough:
        return _walkthrough_text(target, training.micro_batch_size, ulysses_degree, fmt)
    if ulysses_degree is not None:
        raise ConfigError(
            "--ulysses-degree only shapes --attention-walkthrough: megatron-core trains with "
            "tensor and context parallelism, not Ulysses"
        )
    report = measure(target, training, hardware)
    if fmt == "json":
        return render.render_json(report)
    if fmt == "table":
        return render.render_table(report)
    return render.render_text(report)


def _walkthrough_text(
    target: Target, micro_batch_size: int, ulysses_degree: int | None, fmt: str
) -> str:
    """Return the attention walkthrough under tp, and Ulysses / context parallel when asked."""
    from inspector.memory import model_dims
    from inspector.render import memory as render
    from inspector.walkthrough import Mode, attention_walkthrough

    layout = target.layout
    dims = model_dims(target.model, layout)
    modes: list[tuple[Mode, int]] = [("tp", layout.tp)]
    if ulysses_degree is not None:
        modes.append(("ulysses", ulysses_degree))
    if layout.cp > 1:
        modes.append(("cp", layout.cp))
    walks = [
        (
            mode,
            degree,
            attention_walkthrough(
                dims, mode, degree, micro_batch_size, mode == "tp" and layout.sequence_parallel
            ),
        )
        for mode, degree in modes
    ]
    if fmt == "json":
        return render.walkthrough_json(walks)
    title = (
        f"N = {dims.seq_length}, b = {micro_batch_size}, "
        f"{8 * dims.activation_bytes}-bit activations"
    )
    return render.render_walkthrough(walks, title)
