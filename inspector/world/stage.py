"""The simulated megatron world: build each pipeline stage's real GPTModel on the meta device.

Each stage (and, with virtual pipelining, each of its chunks) is built by megatron-core's own code in
its own simulated rank (setup.py): torch.distributed's in-process "fake" backend, megatron's
`initialize_model_parallel`, a TransformerConfig carrying the parallel sizes (config.py), and the
meta device, so no weight memory is allocated. This module and setup.py are the only ones that
touch megatron's parallel_state.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from inspector.errors import ConfigError, FidelityError
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.world.config import flags_named, transformer_config
from inspector.world.dsa import dsa_block_spec, dsa_mtp_layer_spec, fresh_dsa_state
from inspector.world.environment import (
    attention_environment,
    deterministic,
    fresh_attention_env,
    op_fuser_environment,
)
from inspector.world.gdn import gdn_block_spec, gdn_building, is_gdn_layer
from inspector.world.hybrid import build_hybrid_model
from inspector.world.setup import (
    megatron,
    simulate_apex,
    simulate_fused_mla_rope,
    simulate_grad_accum_fusion,
    simulate_grouped_gemm,
    simulated_dp,
    simulated_rank,
)


@dataclass
class StageModel:
    """One pipeline stage's (one chunk's) GPTModel, as one of the stage's ranks builds it."""

    stage: int
    chunk: int
    expert_rank: int  # the expert-parallel rank that was simulated (0 without expert parallelism)
    module: Any  # megatron.core.models.gpt.GPTModel on the meta device
    layer_numbers: tuple[int, ...]  # megatron's 1-based global layer numbers, in local order
    has_embedding: bool
    has_output: bool
    # megatron's checkpoint view of the same module: (key, offsets along prepended axes) -> the
    # unsharded element count of that one tensor (sharded_state_dict's global shape).
    checkpoint: dict[tuple[str, tuple[int, ...]], int]
    # a hybrid stack's layer kinds in local order (megatron's MambaStack.layer_type_list: M, *, -,
    # E); empty for a GPTModel
    symbols: tuple[str, ...] = ()
    # a hybrid model's MTP depth's layer kinds (the pattern after `/`), as megatron built them
    mtp_symbols: tuple[str, ...] = ()


def stage_rank(layout: Layout, stage: int, expert_rank: int) -> int:
    """Return the simulated global rank holding (stage, expert rank) at tp/cp/dp index 0."""
    per_stage = layout.tp * layout.cp * simulated_dp(layout)
    return stage * per_stage + expert_rank * layout.expert_tp


def build_stage(
    model: ModelConfig,
    layout: Layout,
    stage: int,
    expert_rank: int = 0,
    checkpoint: bool = True,
) -> list[StageModel]:
    """Build every chunk of one pipeline stage as megatron-core builds it on that stage's rank.

    `checkpoint` False leaves StageModel.checkpoint empty (a planner reads parameters only).
    """
    with stage_world(model, layout, stage, expert_rank, checkpoint) as chunks:
        return chunks


@contextlib.contextmanager
def stage_world(
    model: ModelConfig,
    layout: Layout,
    stage: int,
    expert_rank: int = 0,
    checkpoint: bool = True,
    runtime: dict[str, Any] | None = None,
) -> Iterator[list[StageModel]]:
    """Build one stage's chunks and keep its simulated rank set up while the block runs.

    `runtime` holds TransformerConfig fields for a model that will run (config.py): the
    engine (inspector/memory/engine) runs megatron's forward and backward inside the block.
    """
    m = megatron()
    vpp = layout.vpp
    rank = stage_rank(layout, stage, expert_rank)
    simulate_apex(model.use_apex)
    simulate_grouped_gemm(model.moe_grouped_gemm)
    simulate_grad_accum_fusion(bool(runtime and runtime.get("gradient_accumulation_fusion")))
    simulate_fused_mla_rope()
    fresh_dsa_state()
    chatter = io.StringIO()  # megatron prints to stdout in places (e.g. 0.13 parsing a layout)
    with (
        warnings.catch_warnings(),
        _quiet_megatron(),
        contextlib.redirect_stdout(chatter),
        deterministic(bool(runtime and runtime.get("deterministic_mode"))),
        op_fuser_environment(bool(runtime and runtime.get("use_transformer_engine_op_fuser"))),
        attention_environment(),
    ):
        warnings.simplefilter("ignore")
        with _megatron_errors(stage) as net, simulated_rank(layout, rank, vpp) as ps:
            where = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank())
            if where != (stage, expert_rank):
                raise FidelityError(
                    f"rank {rank} is {where} in megatron, expected {(stage, expert_rank)}"
                )
            config = transformer_config(model, layout, vpp, runtime)
            chunks = [
                _build_chunk(m, model, config, layout, stage, chunk, vpp, expert_rank, checkpoint)
                for chunk in range(vpp or 1)
            ]
            net.built = True  # what the block runs (the engine) names its own failures
            yield chunks


@contextlib.contextmanager
def _megatron_errors(stage: int) -> Iterator[SimpleNamespace]:
    """Turn megatron-core's refusals (ValueError, assert) into one-sentence ConfigErrors.

    The checks in config.py and topology.py catch what we know of first; this is the net for the
    rest. The original exception stays chained, so `--debug` shows megatron's traceback. Once the
    caller sets `built`, errors pass through: they are not refusals to build.
    """
    net = SimpleNamespace(built=False)
    try:
        yield net
    except (ValueError, AssertionError, RuntimeError, TypeError, ArithmeticError) as exc:
        if net.built:
            raise
        reason = " ".join(str(exc).split()) or type(exc).__name__
        flags = flags_named(reason)
        change = f"the flags it names: {', '.join(flags)}; " if flags else ""
        raise ConfigError(f"megatron-core refused to build stage {stage}: {reason} ({change}--debug "
                          "shows its traceback)") from exc  # fmt: skip


def _build_chunk(
    m: SimpleNamespace,
    model: ModelConfig,
    config: Any,
    layout: Layout,
    stage: int,
    chunk: int,
    vpp: int | None,
    expert_rank: int,
    checkpoint: bool,
) -> StageModel:
    ps = m.parallel_state
    vp_stage = chunk if vpp is not None else None
    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    with m.torch.device("meta"), _cuda_for(model, config), gdn_building(model):
        fresh_attention_env()
        if model.hybrid:
            hybrid = build_hybrid_model(model, config, layout, pre, post, vp_stage)
            return _finish_chunk(model, config, hybrid, stage, chunk, expert_rank, checkpoint)
        spec = _layer_spec(m, model, config, vp_stage)
        gpt = m.GPTModel(
            mtp_block_spec=_mtp_block_spec(m, model, config, vp_stage),
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.embedding_rows(layout.tp),
            max_sequence_length=model.max_positions,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            vp_stage=vp_stage,
        )
    _check_mtp_placed(gpt, layout, stage, chunk)
    return _finish_chunk(model, config, gpt, stage, chunk, expert_rank, checkpoint)


def _finish_chunk(model: ModelConfig, config: Any, gpt: Any, stage: int, chunk: int,
                  expert_rank: int, checkpoint: bool) -> StageModel:  # fmt: skip
    """Cast the built model as Megatron-LM does and record what the stage holds."""
    if model.lora_rank is not None:  # Bridge's pre-wrap hook, before the cast (world/lora.py)
        from inspector.world.lora import apply_lora

        gpt = apply_lora(gpt, model.lora_rank, model.lora_target_modules)
    if model.bf16 or model.fp16:
        gpt = _cast_like_megatron_lm(config, gpt)
    layers = tuple(layer.layer_number for layer in gpt.decoder.layers)
    sizes = checkpoint_sizes(gpt) if checkpoint else {}
    symbols = tuple(_symbol(layer) for layer in gpt.decoder.layers) if model.hybrid else ()
    mtp = getattr(gpt, "mtp", None)  # HybridModel's MultiTokenPredictionBlock: one depth a layer
    inner = getattr(mtp.layers[0], "mtp_model_layer", None) if mtp is not None else None
    depth = tuple(_symbol(layer) for layer in inner.layers) if model.hybrid and inner else ()
    return StageModel(stage, chunk, expert_rank, gpt, layers, gpt.pre_process, gpt.post_process,
                      sizes, symbols, depth)  # fmt: skip


def _symbol(layer: Any) -> str:
    """Return a hybrid stack's layer kind as its pattern writes it, from the module megatron built
    (MambaStack keeps its `layer_type_list` only from megatron-core 0.16)."""
    kind = type(layer).__name__
    if kind == "MambaLayer":
        return "M"
    if kind == "MLPLayer":
        return "-"
    if is_gdn_layer(layer):
        return "G"
    mlp = type(getattr(layer, "mlp", None)).__name__
    core = type(getattr(getattr(layer, "self_attention", None), "core_attention", None)).__name__
    return "E" if mlp == "MoELayer" else "D" if core == "DSAttention" else "*"


def _check_mtp_placed(gpt: Any, layout: Layout, stage: int, chunk: int) -> None:
    """Raise ConfigError where megatron silently leaves out the MTP a layout string places here.

    megatron-core 0.14-0.15 accept an `m` in a virtual chunk of --pipeline-model-parallel-layout
    but build no MTP there (tests/test_versions.py); the job would lose its MTP layers unseen.
    """
    text = layout.pipeline_model_parallel_layout
    if text is None:
        return
    from inspector.job.pipeline_layout import expand_layout

    stages = expand_layout(text)
    wanted = stages[chunk * layout.pp + stage].count("m")  # megatron's order: chunk-major
    built = len(gpt.mtp.layers) if getattr(gpt, "mtp", None) is not None else 0
    if wanted and not built:
        from megatron.core import __version__

        raise ConfigError(
            f"megatron-core {__version__} builds no multi-token prediction layer where "
            f"--pipeline-model-parallel-layout puts its 'm' (stage {stage}, chunk {chunk}); "
            "megatron-core 0.16 does: use it, or place the MTP on the last stage"
        )


def _layer_spec(m: SimpleNamespace, model: ModelConfig, config: Any, vp_stage: int | None) -> Any:
    """Return megatron's spec for --transformer-impl, as Megatron-LM's gpt_builder picks it.

    An MoE model gets megatron's decoder block spec (`get_gpt_decoder_block_spec`: dense and MoE
    layers by `moe_layer_freq`, sliced to this stage), any other model one layer spec. With
    Transformer Engine (simulated: inspector/world/te) megatron's block also takes its final norm
    from TE, as megatron chooses at import time when TE is installed (transformer_block.py).
    """
    use_te = model.transformer_impl == "transformer_engine"
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        m.transformer_block.LayerNormImpl = TENorm
    if model.dsa:
        return dsa_block_spec(config, vp_stage)
    if model.experimental_attention_variant == "gated_delta_net":
        return gdn_block_spec(config, vp_stage)
    if model.num_experts is not None:
        return m.gpt_layer_specs.get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=use_te,
            normalization=model.normalization,
            vp_stage=vp_stage,
        )
    return _one_layer_spec(m, model, model.num_experts)


def _one_layer_spec(m: SimpleNamespace, model: ModelConfig, num_experts: int | None) -> Any:
    """Return megatron's spec of one layer, dense (`num_experts` None) or MoE."""
    if model.transformer_impl == "transformer_engine":
        return m.gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=model.moe_grouped_gemm if num_experts else False,
            qk_layernorm=model.qk_layernorm,
            multi_latent_attention=model.multi_latent_attention,
        )
    return m.gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=model.moe_grouped_gemm if num_experts else False,
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
    )


def _mtp_block_spec(
    m: SimpleNamespace, model: ModelConfig, config: Any, vp_stage: int | None
) -> Any:
    """Return megatron's MTP block spec on the stage megatron puts it on, else None.

    Megatron-LM's gpt_builder gives the MTP layers the spec of the decoder's last layer (MoE
    when that layer is); `get_gpt_mtp_block_spec` returns None on stages that hold no MTP.
    """
    if model.mtp_num_layers is None:
        return None
    last = model.num_experts if model.is_moe_layer(model.num_layers - 1) else None
    return m.gpt_layer_specs.get_gpt_mtp_block_spec(
        config,
        dsa_mtp_layer_spec(config, model) or _one_layer_spec(m, model, last),
        use_transformer_engine=model.transformer_impl == "transformer_engine",
        vp_stage=vp_stage,
    )


def _cuda_for(model: ModelConfig, config: Any) -> contextlib.AbstractContextManager[None]:
    """Answer megatron's CUDA queries while it builds Transformer Engine modules (on meta), and
    HybridEP's dispatcher under either implementation (0.19's `_HybridEPManager` makes a flag
    tensor on the GPU when it is built: token_dispatcher.py `over_budget`)."""
    hybridep = getattr(config, "moe_flex_dispatcher_backend", None) == "hybridep"
    if model.transformer_impl == "transformer_engine" or model.hybrid or hybridep:
        from inspector.world.te.cuda import simulated_cuda

        return simulated_cuda()
    return contextlib.nullcontext()


def _cast_like_megatron_lm(config: Any, gpt: Any) -> Any:
    """Cast a bf16/fp16 model whole, with megatron's Float16Module, as Megatron-LM's get_model does.

    Without it norms built in fp32 would keep that dtype (and a separate fp32 grad buffer).
    The returned module is the wrapped GPTModel, so parameter names stay megatron's own.
    """
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, gpt).module


def checkpoint_sizes(gpt: Any) -> dict[tuple[str, tuple[int, ...]], int]:
    """Return each tensor's unsharded size as megatron's own sharded_state_dict() reports it.

    Factories (SwiGLU's split fc1, GroupedMLP's packed experts) are expanded by megatron's own
    `apply_factories`. Layers are stacked along prepended axes under one key: the offsets along
    those axes tell tensors apart, and the remaining axes are the tensor's own global shape (one
    entry per key and offsets, however many pieces megatron cuts it into).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    with _unchecked_mtp_output_tie(gpt):
        state = gpt.sharded_state_dict(metadata=_checkpoint_metadata(gpt))
    apply_factories(state)
    # Persistent buffers (the router's `expert_bias` with --moe-router-enable-expert-bias) are
    # checkpointed too, but are not parameters: leave them out.
    buffers = {name.rsplit(".", 1)[-1] for name, _ in gpt.named_buffers()}
    sizes = {}
    for entry in nested_values(state):
        if isinstance(entry, ShardedTensor) and entry.key.rsplit(".", 1)[-1] not in buffers:
            prepend = entry.prepend_axis_num
            sizes[(entry.key, tuple(entry.global_offset[:prepend]))] = math.prod(
                entry.global_shape[prepend:]
            )
    return sizes


@contextlib.contextmanager
def _unchecked_mtp_output_tie(gpt: Any) -> Iterator[None]:
    """Skip the one assert megatron's checkpoint map fails on for a tied-embedding MTP stage.

    With tied embeddings, a multi-token-prediction stage after the first (--mtp-num-layers with
    --pp > 1) gets an output-layer weight from gpt_model.py (`skip_weight_param_allocation` only
    where `pre_process`) that its forward never uses, and language_module.py's
    `tie_embeddings_and_output_weights_state_dict` asserts that weight absent, then returns
    without changing the map. Megatron-LM trains such a job (the assert runs only when it saves a
    distributed checkpoint), so the map is read as megatron builds it, without the assert.
    """
    untied = not gpt.share_embeddings_and_output_weights or gpt.pre_process
    if untied or not getattr(gpt, "mtp_process", False) or gpt.output_layer.weight is None:
        yield
        return
    gpt.tie_embeddings_and_output_weights_state_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del gpt.tie_embeddings_and_output_weights_state_dict


def _checkpoint_metadata(gpt: Any) -> dict[str, Any] | None:
    """Return the metadata megatron's checkpointing passes where a stage needs it, else None.

    A stage with multi-token prediction but no embedding keeps a copy of the word embeddings
    and ties it in the checkpoint over the data x context parallel group (gpt_model.py
    `sharded_state_dict`), which Megatron-LM's checkpointing passes as `dp_cp_group`.
    """
    if not getattr(gpt, "mtp_process", False) or gpt.pre_process:
        return None
    ps = megatron().parallel_state
    return {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


@contextlib.contextmanager
def _quiet_megatron() -> Iterator[None]:
    """Keep megatron's informational logging off stderr while building."""
    logger = logging.getLogger("megatron")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
