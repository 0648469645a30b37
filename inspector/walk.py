"""Walk built stage models into plain records (records.py): the module tree, one per parameter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from inspector.records import ModuleNode, ParamRecord, StageTree

if TYPE_CHECKING:
    from inspector.build import BuiltJob
    from inspector.world import StageModel

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERTS = re.compile(r"\.mlp\.experts\.(weight\d)$")
_EXPERTS = ".mlp.experts."

# Parameters that are embedding tables: Shampoo gets no preconditioner for them (SPEC: precs).
EMBEDDING_PARAMS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


def module_tree(module: Any) -> ModuleNode:
    """Return the module hierarchy of a torch module."""
    children = tuple((name, module_tree(child)) for name, child in module.named_children())
    return ModuleNode(type(module).__name__, children)


def describe_module(module: Any) -> str:
    """Return a module's one-line description: str() for leaves, else ClassName(extra_repr)."""
    if any(True for _ in module.children()):
        text = f"{type(module).__name__}({module.extra_repr()})"
    else:
        text = str(module)
    return " ".join(text.split()).replace(";", ",")


def _owner(root: Any, local_name: str) -> Any:
    path = local_name.rsplit(".", 1)[0] if "." in local_name else ""
    return root.get_submodule(path)


def _expert_numbers(stage: StageModel) -> dict[int, list[int]]:
    """Return, per local layer index, the global expert number of each local expert."""
    numbers: dict[int, list[int]] = {}
    for index, layer in enumerate(stage.module.decoder.layers):
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices is not None:
            numbers[index] = list(indices)
    return numbers


def global_name(stage: StageModel, local_name: str, experts: dict[int, list[int]]) -> str:
    """Replace megatron's local layer (and local expert) index with the global number.

    SequentialMLP experts get their global expert number in place of the local one; a GroupedMLP
    tensor, which packs all of a rank's experts, gets their global range: `experts.4-7.weight1`.
    """
    match = _LAYER.match(local_name)
    if not match:
        return local_name
    index = int(match.group(1))
    layer = stage.layer_numbers[index] - 1
    name = f"decoder.layers.{layer}." + local_name[match.end() :]
    if index not in experts:
        return name
    numbers = experts[index]
    expert = _LOCAL_EXPERT.search(name)
    if expert:
        return name[: expert.start(1)] + str(numbers[int(expert.group(1))]) + name[expert.end(1) :]
    grouped = _GROUPED_EXPERTS.search(name)
    if grouped:
        return name[: grouped.start(1)] + f"{numbers[0]}-{numbers[-1]}." + grouped.group(1)
    return name


def _global_shape(param: Any, size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= size
    return tuple(shape)


def walk_params(stage: StageModel, tp: int, etp: int) -> Iterator[ParamRecord]:
    """Yield a record per parameter of a stage, in megatron's named_parameters() order."""
    experts = _expert_numbers(stage)
    for local_name, param in stage.module.named_parameters():
        name = global_name(stage, local_name, experts)
        match = _LAYER.match(name)
        expert = _LOCAL_EXPERT.search(name)
        is_expert = _EXPERTS in name
        sharded = bool(getattr(param, "tensor_model_parallel", False))
        tied = bool(getattr(param, "shared_embedding", False)) and name == "output_layer.weight"
        yield ParamRecord(
            stage=stage.stage,
            chunk=stage.chunk,
            local_name=local_name,
            name=name,
            module=describe_module(_owner(stage.module, local_name)),
            shape=tuple(param.shape),
            global_shape=_global_shape(param, etp if is_expert else tp),
            dtype=str(param.dtype).removeprefix("torch."),
            tensor_parallel=sharded,
            partition_dim=param.partition_dim if sharded else None,
            tied=tied,
            embedding=name in EMBEDDING_PARAMS or tied,
            layer=int(match.group(1)) if match else None,
            expert=int(expert.group(1)) if expert else None,
            expert_rank=stage.expert_rank if is_expert else None,
        )


def stage_trees(built: BuiltJob) -> list[StageTree]:
    """Return the module tree of every built stage and chunk (SPEC: `inspect-model tree`)."""
    chunks = built.chunks
    headed = not (built.job.layout.pp == 1 and len(chunks) == 1)
    return [
        StageTree(
            chunk.stage,
            chunk.chunk if built.interleaved else None,
            module_tree(chunk.module),
            headed,
        )
        for chunk in chunks
    ]
