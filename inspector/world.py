"""The simulated megatron world: build each pipeline stage's real GPTModel on the meta device.

Each stage (and, with virtual pipelining, each of its chunks) is built by megatron-core's own code in
its own simulated rank: torch.distributed's in-process "fake" backend, megatron's
`initialize_model_parallel`, a TransformerConfig carrying the parallel sizes, and the meta device, so
no weight memory is allocated. This is the only module that touches megatron's parallel_state.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any

from inspector.config import ModelConfig
from inspector.errors import ConfigError, FidelityError
from inspector.topology import Layout


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


@cache
def megatron() -> SimpleNamespace:
    """Import the megatron-core pieces this tool uses, once, with import-time warnings silenced.

    fastimport prepares the process first (torch.compile passing through, DTensor deferred, no
    dynamo import on meta kernels), installs the Transformer Engine stand-in (inspector.te) before
    megatron-core is imported, and keeps it so for as long as megatron is in use.
    """

    def names() -> SimpleNamespace:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.fusions import fused_layer_norm
        from megatron.core.models import backends
        from megatron.core.models.gpt import GPTModel, gpt_layer_specs
        from megatron.core.transformer import transformer_block
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_config import TransformerConfig
        from torch.testing._internal.distributed.fake_pg import FakeStore

        return SimpleNamespace(
            torch=torch,
            dist=dist,
            parallel_state=parallel_state,
            fused_layer_norm=fused_layer_norm,
            backends=backends,
            gpt_layer_specs=gpt_layer_specs,
            transformer_block=transformer_block,
            GPTModel=GPTModel,
            TransformerConfig=TransformerConfig,
            WrappedTorchNorm=WrappedTorchNorm,
            FakeStore=FakeStore,
        )

    from inspector.fastimport import import_megatron

    result: SimpleNamespace = import_megatron(names)
    return result


def simulate_apex(enabled: bool) -> None:
    """Make megatron pick apex's FusedLayerNorm (as on a cluster with apex), or torch norms.

    megatron-core chooses the norm class at import time in three places: the local layer spec
    (`gpt_layer_specs.LNImpl`, and `backends.LNImpl`, which RMSNorm specs rebind globally), and the
    block's `final_layernorm` (`transformer_block.LayerNormImpl`). FusedLayerNorm itself refuses to
    construct unless `HAVE_FUSED_LAYER_NORM` is set. All four are set here, on every build, so one
    build's choice never leaks into the next.
    """
    m = megatron()
    norm = m.fused_layer_norm.FusedLayerNorm if enabled else m.WrappedTorchNorm
    m.fused_layer_norm.HAVE_FUSED_LAYER_NORM = enabled
    m.gpt_layer_specs.LNImpl = norm
    m.backends.LNImpl = norm
    m.transformer_block.LayerNormImpl = norm


def simulate_grouped_gemm(enabled: bool) -> None:
    """Let megatron's GroupedMLP construct as on a cluster with the grouped_gemm package.

    GroupedMLP asserts `grouped_gemm_util.grouped_gemm` is importable when it is built; only its
    forward pass calls into it, and nothing here runs forward. A stand-in module object satisfies
    the check; without grouped GEMM it is reset to what the import found.
    """
    from megatron.core.transformer.moe import grouped_gemm_util

    if enabled:
        grouped_gemm_util.grouped_gemm = grouped_gemm_util.grouped_gemm or _GROUPED_GEMM_STANDIN
    elif grouped_gemm_util.grouped_gemm is _GROUPED_GEMM_STANDIN:
        grouped_gemm_util.grouped_gemm = None


_GROUPED_GEMM_STANDIN = SimpleNamespace(ops=None, __name__="grouped_gemm (simulated)")


def simulated_dp(layout: Layout) -> int:
    """Return the smallest data-parallel size that still lets megatron carve out the expert groups."""
    expert = layout.ep * layout.expert_tp
    dense = layout.tp * layout.cp
    return expert // math.gcd(expert, dense)


def _no_values(tensor: Any) -> Any:
    """Initialise nothing: a meta tensor holds no values."""
    return tensor


def _transformer_config(model: ModelConfig, layout: Layout, vpp: int | None) -> Any:
    """Return megatron's TransformerConfig as Megatron-LM builds it from these arguments."""
    m = megatron()
    torch = m.torch
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        model.dtype_name
    ]
    kwargs: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        add_bias_linear=not model.disable_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=model.bf16,
        fp16=model.fp16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=layout.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=layout.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=layout.account_for_loss_in_pipeline_split,
        use_cpu_initialization=True,
        perform_initialization=True,
        # On meta there are no values to initialise: megatron still runs its initialisation path
        # (which sets the tensor-parallel attributes), but torch's normal_ on meta would import
        # dynamo on first use (~1.2 s) for nothing.
        init_method=_no_values,
        output_layer_init_method=_no_values,
    )
    if layout.pipeline_model_parallel_layout is not None:
        kwargs["pipeline_model_parallel_layout"] = layout.pipeline_model_parallel_layout
    if model.swiglu:
        # Megatron-LM arguments.py: --swiglu sets a gated linear unit with SiLU.
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if model.num_experts is not None:
        kwargs.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_size,
            moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
            moe_grouped_gemm=model.moe_grouped_gemm,
        )
    if model.moe_shared_expert_gate:
        _check_shared_expert_gate(m.TransformerConfig)
        kwargs.update(moe_shared_expert_gate=True)
    kwargs.update(_deepseek_fields(model))
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        # Megatron-LM `core_transformer_config_from_args`: --multi-latent-attention picks
        # MLATransformerConfig and copies the MLA arguments into it.
        return MLATransformerConfig(**kwargs, **model.mla_args())
    return m.TransformerConfig(**kwargs)


def _deepseek_fields(model: ModelConfig) -> dict[str, Any]:
    """Return the TransformerConfig fields of MoE layer patterns, routers and MTP, where set."""
    fields: dict[str, Any] = {}
    if model.num_experts is not None:
        freq = model.moe_layer_freq
        fields.update(
            moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
            moe_router_score_function=model.moe_router_score_function,
            moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        )
    if model.mtp_num_layers is not None:
        fields.update(mtp_num_layers=model.mtp_num_layers)
    return fields


def _check_shared_expert_gate(config_class: Any) -> None:
    """Raise ConfigError where megatron-core cannot gate shared experts (before 0.16)."""
    import dataclasses

    if "moe_shared_expert_gate" not in {f.name for f in dataclasses.fields(config_class)}:
        from megatron.core import __version__

        raise ConfigError(
            f"--moe-shared-expert-gate needs megatron-core 0.16 or newer: {__version__} builds "
            "shared experts without a gate"
        )


@contextlib.contextmanager
def simulated_rank(layout: Layout, rank: int, vpp: int | None) -> Iterator[Any]:
    """Run megatron's parallel_state set-up for one rank of a fake world; tear it down after.

    Only the process groups this rank is a member of are made (inspector.groups); inside the
    block torch.cat of meta tensors skips torch's Python meta kernel (inspector.fastimport).
    """
    from inspector.fastimport import meta_cat
    from inspector.groups import scoped_groups

    m = megatron()
    world = layout.tp * layout.cp * simulated_dp(layout) * layout.pp
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=rank, world_size=world)
    try:
        with scoped_groups(m.dist, m.parallel_state):
            m.parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp,
                pipeline_model_parallel_size=layout.pp,
                virtual_pipeline_model_parallel_size=vpp,
                context_parallel_size=layout.cp,
                expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp,
                create_gloo_process_groups=False,
            )
        disable_embedding_group()
        with meta_cat():
            yield m.parallel_state
    finally:
        m.parallel_state.destroy_model_parallel()
        m.dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """Provide a one-rank fake world where none is set up (megatron's DDP logging asserts one)."""
    m = megatron()
    if m.dist.is_initialized():
        yield
        return
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        m.dist.destroy_process_group()


def disable_embedding_group() -> None:
    """Forget megatron's embedding group so tied-embedding set-up skips its .cuda() all-reduce.

    With pp > 1 and tied embeddings, LanguageModule.setup_embeddings_and_output_layer copies the
    word embedding to the last stage with `weight.data.cuda()` and an all-reduce over this group.
    Without the group it only marks the last stage's copy `shared_embedding=True`, as on a cluster.
    """
    ps = megatron().parallel_state
    ps._EMBEDDING_GROUP = None
    ps._EMBEDDING_GLOBAL_RANKS = None


def _stage_rank(layout: Layout, stage: int, expert_rank: int) -> int:
    """Return the simulated global rank holding (stage, expert rank) at tp/cp/dp index 0."""
    per_stage = layout.tp * layout.cp * simulated_dp(layout)
    return stage * per_stage + expert_rank * layout.expert_tp


def build_stage(
    model: ModelConfig, layout: Layout, stage: int, expert_rank: int = 0, checkpoint: bool = True
) -> list[StageModel]:
    """Build every chunk of one pipeline stage as megatron-core builds it on that stage's rank.

    `checkpoint` False leaves StageModel.checkpoint empty (a planner reads parameters only).
    """
    m = megatron()
    vpp = layout.vpp
    rank = _stage_rank(layout, stage, expert_rank)
    simulate_apex(model.use_apex)
    simulate_grouped_gemm(model.moe_grouped_gemm)
    chatter = io.StringIO()  # megatron prints to stdout in places (e.g. 0.13 parsing a layout)
    with (
        warnings.catch_warnings(),
        _quiet_megatron(),
        _megatron_errors(stage),
        contextlib.redirect_stdout(chatter),
    ):
        warnings.simplefilter("ignore")
        with simulated_rank(layout, rank, vpp) as ps:
            where = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank())
            if where != (stage, expert_rank):
                raise FidelityError(
                    f"rank {rank} is {where} in megatron, expected {(stage, expert_rank)}"
                )
            config = _transformer_config(model, layout, vpp)
            return [
                _build_chunk(m, model, config, layout, stage, chunk, vpp, expert_rank, checkpoint)
                for chunk in range(vpp or 1)
            ]


@contextlib.contextmanager
def _megatron_errors(stage: int) -> Iterator[None]:
    """Turn megatron-core's refusals (ValueError, assert) into one-sentence ConfigErrors.

    The checks in config.py and topology.py catch what we know of first; this is the net for the
    rest. The original exception stays chained, so `--debug` shows megatron's traceback.
    """
    try:
        yield
    except (ValueError, AssertionError, RuntimeError, TypeError, ArithmeticError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            f"megatron-core refused to build stage {stage}: {reason} (--debug shows its traceback)"
        ) from exc


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
    with m.torch.device("meta"), _cuda_for(model):
        spec = _layer_spec(m, model, config, vp_stage)
        gpt = m.GPTModel(
            mtp_block_spec=_mtp_block_spec(m, model, config, vp_stage),
            config=config,
            transformer_layer_spec=spec,
            vocab_size=model.padded_vocab_size(layout.tp),
            max_sequence_length=model.max_positions,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            vp_stage=vp_stage,
        )
    _check_mtp_placed(gpt, layout, stage, chunk)
    if model.bf16 or model.fp16:
        gpt = _cast_like_megatron_lm(config, gpt)
    layers = tuple(layer.layer_number for layer in gpt.decoder.layers)
    sizes = checkpoint_sizes(gpt) if checkpoint else {}
    return StageModel(stage, chunk, expert_rank, gpt, layers, pre, post, sizes)


def _check_mtp_placed(gpt: Any, layout: Layout, stage: int, chunk: int) -> None:
    """Raise ConfigError where megatron silently leaves out the MTP a layout string places here.

    megatron-core 0.14-0.15 accept an `m` in a virtual chunk of --pipeline-model-parallel-layout
    but build no MTP there (tests/test_versions.py); the job would lose its MTP layers unseen.
    """
    text = layout.pipeline_model_parallel_layout
    if text is None:
        return
    from inspector.topology import expand_layout

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
    Transformer Engine (simulated: inspector/te) megatron's block also takes its final norm
    from TE, as megatron chooses at import time when TE is installed (transformer_block.py).
    """
    use_te = model.transformer_impl == "transformer_engine"
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        m.transformer_block.LayerNormImpl = TENorm
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
        _one_layer_spec(m, model, last),
        use_transformer_engine=model.transformer_impl == "transformer_engine",
        vp_stage=vp_stage,
    )


def _cuda_for(model: ModelConfig) -> contextlib.AbstractContextManager[None]:
    """Answer megatron's CUDA queries while it builds Transformer Engine modules (on meta)."""
    if model.transformer_impl == "transformer_engine":
        from inspector.te.cuda import simulated_cuda

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
