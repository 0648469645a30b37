"""Walk built stage models into plain records (records.py): the module tree, one per parameter."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from inspector.records import ModuleNode, ParamRecord

if TYPE_CHECKING:
    from inspector.world.stage import StageModel

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# A multi-token-prediction layer's transformer layer (Megatron-LM later renamed it mtp_model_layer).
_MTP_LAYER = re.compile(r"^mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERTS = re.compile(r"\.mlp\.experts\.(weight\d)$")
# TEGroupedMLP: one TE GroupedLinear per projection, `weight{i}` / `bias{i}` per local expert.
_TE_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.(?:weight|bias)(\d+)$")
_EXPERTS = ".mlp.experts."

# Parameters that are embedding tables: Shampoo gets no preconditioner for them (docs/params-table.md: precs).
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


def _expert_numbers(stage: StageModel) -> dict[str, list[int]]:
    """Return, per local layer prefix (`decoder.layers.0.`), the global number of each expert.

    Multi-token-prediction layers hold a transformer layer of their own, with its own experts.
    """
    numbers: dict[str, list[int]] = {}
    layers = [(f"decoder.layers.{i}.", layer) for i, layer in enumerate(stage.module.decoder.layers)]
    mtp = getattr(stage.module, "mtp", None)
    for i, mtp_layer in enumerate(mtp.layers if mtp is not None else ()):
        for inner in ("transformer_layer", "mtp_model_layer"):
            if hasattr(mtp_layer, inner):
                layers.append((f"mtp.layers.{i}.{inner}.", getattr(mtp_layer, inner)))
    for prefix, layer in layers:
        indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
        if indices is not None:
            numbers[prefix] = list(indices)
    return numbers


def global_name(stage: StageModel, local_name: str, experts: dict[str, list[int]]) -> str:
    """Replace megatron's local layer (and local expert) index with the global number.

    SequentialMLP and TEGroupedMLP experts get their global expert number in place of the local
    one; a GroupedMLP tensor, which packs all of a rank's experts, gets their global range:
    `experts.4-7.weight1`. Multi-token-prediction layers keep their names (they follow the
    decoder, on the last stage); only their experts are numbered globally.
    """
    match = _LAYER.match(local_name) or _MTP_LAYER.match(local_name)
    if not match:
        return local_name
    prefix = match.group(0)
    name = local_name
    if match.re is _LAYER:
        layer = stage.layer_numbers[int(match.group(1))] - 1
        name = f"decoder.layers.{layer}." + local_name[match.end() :]
    if prefix not in experts:
        return name
    numbers = experts[prefix]
    expert = _LOCAL_EXPERT.search(name) or _TE_GROUPED_EXPERT.search(name)
    if expert:
        return name[: expert.start(1)] + str(numbers[int(expert.group(1))]) + name[expert.end(1) :]
    grouped = _GROUPED_EXPERTS.search(name)
    if grouped:
        return name[: grouped.start(1)] + f"{numbers[0]}-{numbers[-1]}." + grouped.group(1)
    return name


def _duplicated(owner: Any, is_expert: bool) -> bool:
    """Return whether a TE linear is megatron's "duplicated" mode: whole on every TP rank.

    megatron's TELinear passes TE `parallel_mode=None` for it (MLA's down projections in 0.16),
    and TE still marks the weight `tensor_model_parallel` (linear.py `reset_parameters`), so the
    attribute alone would double its global shape. Expert linears also pass None to TE, but are
    split by megatron itself over the expert tensor-parallel group.
    """
    te_linear = getattr(owner, "parallel_mode", "column") is None and hasattr(owner, "tp_size")
    return te_linear and not is_expert


def _tensor_parallel(param: Any, owner: Any) -> bool:
    """Return whether megatron splits this parameter over the tensor-parallel ranks.

    Mamba's gated norm holds this rank's slice of d_inner on every megatron-core version
    (`ExtendedRMSNorm.sharded_state_dict`: axis 0), but only 0.16+ marks its weight
    `tensor_model_parallel` (ssm/mamba_mixer.py `setattr(self.norm.weight, ...)`).
    """
    marked = bool(getattr(param, "tensor_model_parallel", False))
    return marked or type(owner).__name__ == "ExtendedRMSNorm"


def _partition_dim(param: Any) -> int:
    """Return the axis a tensor-parallel parameter is split along.

    megatron's MambaMixer marks conv1d, dt_bias, A_log, D and its gated norm's weight
    `tensor_model_parallel` without a `partition_dim`; its sharded_state_dict splits each along
    axis 0 (ssm/mamba_mixer.py `sharded_state_dict`, `ExtendedRMSNorm.sharded_state_dict`).
    """
    return int(getattr(param, "partition_dim", 0))


def _global_shape(param: Any, size: int, sharded: bool) -> tuple[int, ...]:
    shape = list(param.shape)
    if sharded:
        shape[_partition_dim(param)] *= size
    return tuple(shape)


def walk_params(stage: StageModel, tp: int, etp: int) -> Iterator[ParamRecord]:
    """Yield a record per parameter of a stage, in megatron's named_parameters() order."""
    from inspector.world.te.float8_tensor import stored_bytes

    experts = _expert_numbers(stage)
    for local_name, param in stage.module.named_parameters():
        name = global_name(stage, local_name, experts)
        match = _LAYER.match(name)
        expert = _LOCAL_EXPERT.search(name) or _TE_GROUPED_EXPERT.search(name)
        is_expert = _EXPERTS in name
        owner = _owner(stage.module, local_name)
        sharded = _tensor_parallel(param, owner) and not _duplicated(owner, is_expert)
        # The last stage's copy of the word embeddings: the tied output layer, or the embedding
        # that multi-token prediction keeps on a stage without the embedding (language_module.py
        # `setup_embeddings_and_output_layer`).
        tied = bool(getattr(param, "shared_embedding", False)) and (
            name == "output_layer.weight"
            or (name == EMBEDDING_PARAMS[0] and not stage.has_embedding)
        )
        yield ParamRecord(
            stage=stage.stage,
            chunk=stage.chunk,
            local_name=local_name,
            name=name,
            module=describe_module(owner),
            shape=tuple(param.shape),
            global_shape=_global_shape(param, etp if is_expert else tp, sharded),
            dtype=str(param.dtype).removeprefix("torch."),
            tensor_parallel=sharded,
            partition_dim=_partition_dim(param) if sharded else None,
            tied=tied,
            embedding=name in EMBEDDING_PARAMS or tied,
            layer=int(match.group(1)) if match else None,
            expert=int(expert.group(1)) if expert else None,
            expert_rank=stage.expert_rank if is_expert else None,
            stored=stored_bytes(param),  # None but for TE's quantized weights
            trainable=param.requires_grad,
        )

