"""megatron-core's Muon, built and stepped on a stage: which rank owns which whole matrix.

Megatron-LM's `--optimizer muon` / `dist_muon` (core_v0.16 training.py) calls
megatron/core/optimizer/muon.py `get_megatron_muon_optimizer(config, model_chunks,
layer_wise_distributed_optimizer="dist" in config.optimizer)`: its TensorParallelMuon (Emerging
Optimizers' orthogonalised momentum, world/emerging.py stands in for the package) takes every 2-D
weight that is not an embedding or the output layer; Adam (megatron's own get_megatron_optimizer)
takes the rest: embeddings, the output layer, norms, biases. With `dist_muon`,
layer_wise_optimizer.py `LayerWiseDistributedOptimizer.shard_params` gives each whole parameter to
one data-parallel rank: sorted by size, dealt ping-pong (0, 1, .., d-1, d-1, .., 0) over the
data x context parallel ranks (expert parameters over the expert data-parallel ranks), so the
largest, the embedding and the output layer, land on the last ranks dealt (Megatron-LM #2163).

megatron-core 0.18-0.19 build `--optimizer muon` through get_megatron_optimizer instead
(optimizer/__init__.py `_get_megatron_emerging_optimizer`, the registry of
optimizer/emerging_optimizers.py; muon.py is a shim): the same TensorParallelMuon on the same
parameters (`_is_nonlinear_or_embedding`), Adam on the rest, each in megatron's Float16 wrapper.

Here megatron's own function builds it on the stage's chunks in megatron's DDP, in the simulated
rank's world; the data-parallel groups it shards over are stand-ins of the job's sizes
(world/ddp.py), and its all-gather of the updated weights (`allgather_params`) allocates its
buffers and moves nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inspector.errors import ConfigError
from inspector.job.job import Job
from inspector.job.optimizers import muon_bytes_per_element
from inspector.job.versions import megatron_version, muon_modelled, muon_registry

# the parameters Megatron-LM #2163 asks about: the largest, dealt last (a chunk's local names)
LARGEST = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class MuonParam:
    """One parameter under megatron's Muon: who updates it, with what."""

    chunk: int
    name: str  # the chunk's local parameter name
    numel: int
    muon: bool  # TensorParallelMuon's (momentum, 4 bytes) or Adam's (two moments, 8 bytes)
    expert: bool  # sharded over the expert data-parallel ranks
    owner: int | None  # the data-parallel (or expert data-parallel) rank; None: every rank
    sixteen_bit: bool  # a 16-bit weight: megatron keeps an fp32 master copy for its owner

    def owned_by(self, dense_index: int, expert_index: int) -> bool:
        """Return whether the rank at these data-parallel positions updates this parameter."""
        if self.owner is None:
            return True
        return self.owner == (expert_index if self.expert else dense_index)

    @property
    def optimizer_bytes(self) -> int:
        """Return the owner's optimizer bytes: fp32 master copy, momentum or Adam's moments."""
        if self.muon:
            return self.numel * muon_bytes_per_element(2 if self.sixteen_bit else 4)
        return self.numel * ((4 if self.sixteen_bit else 0) + 8)


def muon_config(job: Job, config: Any) -> Any:
    """Return the OptimizerConfig Megatron-LM makes for --optimizer muon / dist_muon: the Adam
    config (core_v0.16 training.py `get_megatron_optimizer_config`) with Muon's defaults; 0.18+
    spell dist_muon as muon with `use_layer_wise_distributed_optimizer` (validate_args)."""
    config.optimizer = job.training.optimizer
    if muon_registry() and config.optimizer == "dist_muon":  # 0.18+ validate_args' spelling
        config.optimizer, config.use_layer_wise_distributed_optimizer = "muon", True
    return config


def build_muon(job: Job, ddps: Sequence[Any], config: Any, dense_index: int = 0,
               expert_index: int = 0) -> Any:  # fmt: skip
    """Build megatron's Muon over `ddps` for the rank at these data-parallel positions, from the
    OptimizerConfig Megatron-LM makes (engine/optimizer.py `optimizer_config`)."""
    layer_wise = job.training.optimizer == "dist_muon"
    if not muon_modelled(layer_wise):  # inputs/ and job/optimizers.py refuse it before a job is made
        version = ".".join(map(str, megatron_version()))
        raise ConfigError(f"--optimizer {job.training.optimizer} is not modelled on megatron-core "
                          f"{version}")
    from megatron.core.process_groups_config import ProcessGroupCollection

    from inspector.world.ddp import StandInGroup
    from inspector.world.emerging import install

    install()
    layout = job.layout
    groups = ProcessGroupCollection.use_mpu_process_groups()
    groups.dp_cp = StandInGroup(layout.dp * layout.cp, dense_index)
    groups.expt_dp = StandInGroup(layout.expert_dp, expert_index)
    # one distributed-optimizer instance: the partial data-parallel groups are the whole ones
    # (parallel_state); 0.19's LayerWiseDistributedOptimizer checks their sizes agree
    groups.intra_dp_cp, groups.intra_expt_dp = groups.dp_cp, groups.expt_dp
    if muon_registry():
        return _registry_muon(muon_config(job, config), ddps, groups)
    return muon_module().get_megatron_muon_optimizer(
        muon_config(job, config), list(ddps), use_gloo_process_groups=False,
        layer_wise_distributed_optimizer=job.training.optimizer == "dist_muon",
        pg_collection=groups,
    )  # fmt: skip


def muon_module() -> Any:
    """Return megatron's optimizer/muon.py (0.16-0.17). 0.17's imports, at its import,
    HAVE_EMERGING_OPTIMIZERS and HAVE_EO_V02 from the optimizer package, which reads them from the
    installed package's metadata (emerging-optimizers >= 0.1, >= 0.2); the stand-in
    (world/emerging.py) has none and speaks 0.2's names, so both are answered for that import."""
    import importlib

    from megatron.core import optimizer as package

    flags = ("HAVE_EMERGING_OPTIMIZERS", "HAVE_EO_V02")
    real = {name: getattr(package, name) for name in flags if hasattr(package, name)}
    package.__dict__.update(dict.fromkeys(real, True))
    try:
        module = importlib.import_module("megatron.core.optimizer.muon")
        if not all(getattr(module, name, True) for name in flags):  # imported before, without
            module = importlib.reload(module)
    finally:
        package.__dict__.update(real)
    return module


def _registry_muon(config: Any, ddps: Sequence[Any], groups: Any) -> Any:
    """megatron-core 0.18+: Megatron-LM's setup_model_and_optimizer calls get_megatron_optimizer,
    which hands --optimizer muon to optimizer/__init__.py `_get_megatron_emerging_optimizer`
    (the registry's TensorParallelMuon on the 2-D weights, `muon_scalar_optimizer` Adam on the
    rest). It asks the installed package's metadata for emerging-optimizers >= 0.2
    (HAVE_EMERGING_OPTIMIZERS); the stand-in (world/emerging.py) has none, so the answer is given
    for the call."""
    from megatron.core import optimizer as package

    real = package.HAVE_EMERGING_OPTIMIZERS
    package.HAVE_EMERGING_OPTIMIZERS = True
    try:
        return package.get_megatron_optimizer(config, list(ddps), use_gloo_process_groups=False,
                                              pg_collection=groups)  # fmt: skip
    finally:
        package.HAVE_EMERGING_OPTIMIZERS = real


def layer_wise_part(optimizer: Any) -> Any:
    """Return megatron's LayerWiseDistributedOptimizer in the built optimizer, or None: the whole
    of it, or (0.18+'s layer-wise layout) the first of a chain whose others are the
    DistributedOptimizer of the other parameters (optimizer/__init__.py
    `_get_megatron_emerging_optimizer`)."""
    for part in [optimizer, *getattr(optimizer, "chained_optimizers", ())]:
        if hasattr(part, "dp_cp_params_list"):
            return part
    return None


def muon_params(job: Job, ddps: Sequence[Any], optimizer: Any, muon: set[int]) -> tuple[MuonParam, ...]:
    """Return every parameter of the chunks with its owner under the built optimizer (`muon`:
    the ids of the parameters TensorParallelMuon took, `muon_taken`). Under 0.18+'s layer-wise
    layout only Muon's matrices have one owner: the others' are the DistributedOptimizer's
    shards (None here; world/ddp.py lays them out)."""
    layer_wise = layer_wise_part(optimizer)
    owners: dict[int, int] = {}
    for lists in (getattr(layer_wise, "dp_cp_params_list", None),
                  getattr(layer_wise, "expt_dp_params_list", None)):  # fmt: skip
        for rank, params in enumerate(lists or ()):
            owners.update({id(p): rank for p in params})
    dealt = job.training.optimizer == "dist_muon" and job.layout.dp * job.layout.cp > 1
    apart = job.training.layer_wise_param_layout
    found = []
    for chunk, ddp in enumerate(ddps):
        for name, p in ddp.module.named_parameters():
            expert = not getattr(p, "allreduce", True)
            owner = owners.get(id(p), 0) if dealt else None  # 0: an expert group of one
            owner = None if apart and id(p) not in muon else owner
            found.append(MuonParam(chunk, name.removeprefix("module."), p.numel(), id(p) in muon,
                                   expert, owner, p.dtype in (torch.bfloat16, torch.float16)))  # fmt: skip
    return tuple(found)


def heaviest_index(optimizer: Any, taken: set[int]) -> int:
    """Return the data-parallel rank whose layer-wise share holds the most optimizer bytes (the
    first of equals; 0 where megatron does not deal: plain muon, one data-parallel rank)."""
    lists = getattr(layer_wise_part(optimizer), "dp_cp_params_list", None)
    if not lists:
        return 0
    loads = [sum(MuonParam(0, "", p.numel(), id(p) in taken, False, None,
                           p.dtype in (torch.bfloat16, torch.float16)).optimizer_bytes
                 for p in params) for params in lists]  # fmt: skip
    return loads.index(max(loads))


@contextlib.contextmanager
def muon_taken() -> Iterator[set[int]]:
    """Record the ids of the parameters megatron gives TensorParallelMuon, whether or not the
    layer-wise optimizer then keeps them on this rank (it shards each optimizer's groups in
    `shard_params`, before which they are read here)."""
    from inspector.world.emerging import install

    install()
    from megatron.core.optimizer import layer_wise_optimizer

    if muon_registry():
        from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    else:
        TensorParallelMuon = muon_module().TensorParallelMuon

    taken: set[int] = set()
    owner = layer_wise_optimizer.LayerWiseDistributedOptimizer
    real = owner.shard_params

    def recording(self: Any, optimizers: Any, *rest: Any) -> Any:  # 0.18+: full_param_layouts
        for part in optimizers:
            if isinstance(inner(part), TensorParallelMuon):
                taken.update(id(p) for p in model_params(part))
        return real(self, optimizers, *rest)

    owner.shard_params = recording
    try:
        yield taken
    finally:
        owner.shard_params = real


def inner(part: Any) -> Any:
    return getattr(part, "optimizer", part)


def model_params(part: Any) -> list[Any]:
    """Return the model's parameters a wrapped optimizer updates (its fp16 groups, or its own)."""
    groups = getattr(part, "float16_groups", None)
    if groups is not None:
        return [p for group in groups for p in group] + [
            p for group in getattr(part, "fp32_from_fp32_groups", []) for p in group
        ]
    return [p for group in inner(part).param_groups for p in group["params"]]


@contextlib.contextmanager
def stand_in_gathers() -> Iterator[None]:
    """Let `allgather_params` all-gather over the stand-in data-parallel groups: the outputs it
    allocated are the memory; nothing moves on meta tensors."""
    from inspector.world.ddp import StandInGroup

    dist = torch.distributed
    real = dist.all_gather

    def gather(outputs: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
        if isinstance(group, StandInGroup):
            return None
        return real(outputs, tensor, group=group, async_op=async_op)

    dist.all_gather = gather  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_gather = real
