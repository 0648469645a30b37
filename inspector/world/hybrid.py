"""Build a hybrid model's stage: megatron-core's MambaModel (0.13-0.17) or HybridModel (0.18+).

As Megatron-LM's pretrain_mamba.py builds it (`mamba_builders.py` `mamba_builder` at
core_v0.16.1): the layer stack spec named by `--spec megatron.core.models.mamba.mamba_layer_specs
mamba_stack_spec` (the one Megatron-LM's examples/mamba/train.sh passes), the padded vocabulary,
`max_position_embeddings`, the hybrid ratios and layer pattern, and the embedding tie. megatron's
MambaStack itself turns the pattern into layers (ssm/mamba_hybrid_layer_allocation.py) and picks
this stage's slice of them. The Mamba mixers' CUDA packages are stand-ins (world/ssm).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.world.ssm.triton_import import import_mamba_mixer


def build_hybrid_model(
    model: ModelConfig, config: Any, layout: Layout, pre: bool, post: bool,
    vp_stage: int | None = None,
) -> Any:
    """Return megatron's hybrid model for one stage (inside the stage's simulated rank, on meta).

    megatron-core 0.18+ builds HybridModel (Megatron-LM's hybrid_builders.py `hybrid_builder`,
    which pretrain_mamba.py runs too, with `hybrid_layer_pattern`: validate_args forwards
    --hybrid-override-pattern to it); 0.13-0.17 MambaModel (mamba_builders.py).
    """
    import_mamba_mixer()
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    common = dict(
        config=config,
        vocab_size=model.embedding_rows(layout.tp),
        max_sequence_length=model.max_positions,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        position_embedding_type=model.position_embedding_type,
    )
    if vp_stage is not None:  # only a pattern's `|` segments make chunks (job/hybrid_model.py)
        common["vp_stage"] = vp_stage
    with rng_forks_nothing():
        try:
            from megatron.core.models.hybrid.hybrid_model import HybridModel
        except ImportError:  # megatron-core 0.13-0.17
            from megatron.core.models.mamba import MambaModel

            return MambaModel(
                mamba_stack_spec=mamba_stack_spec,
                hybrid_attention_ratio=model.hybrid_attention_ratio or 0.0,
                hybrid_mlp_ratio=model.hybrid_mlp_ratio or 0.0,
                hybrid_override_pattern=model.hybrid_override_pattern,
                **common,
            )
        ratios = {name: getattr(model, name) for name in ("hybrid_attention_ratio", "hybrid_mlp_ratio")
                  if getattr(model, name)}  # fmt: skip
        return HybridModel(hybrid_stack_spec=mamba_stack_spec,
                           hybrid_layer_pattern=model.hybrid_override_pattern, **ratios, **common)


@contextlib.contextmanager
def rng_forks_nothing() -> Iterator[None]:
    """Let MambaMixer's (and GatedDeltaNet's) `get_cuda_rng_tracker().fork()` run while it
    builds, drawing nothing.

    MambaMixer draws its conv1d weights, `dt_bias` and `A_log` inside the model-parallel RNG
    stream (ssm/mamba_mixer.py ~293-338; GatedDeltaNet.reset_parameters alike), which
    Megatron-LM adds before building the model (megatron/training/initialize.py
    `_set_random_seed` -> `model_parallel_cuda_manual_seed`). On meta nothing is drawn, so the
    fork switches to no stream at all.
    """
    from megatron.core.tensor_parallel import random

    fork = random.CudaRNGStatesTracker.fork
    random.CudaRNGStatesTracker.fork = _no_fork
    try:
        yield
    finally:
        random.CudaRNGStatesTracker.fork = fork


@contextlib.contextmanager
def _no_fork(self: Any, name: str = "") -> Iterator[None]:
    yield
