"""The simulated Transformer Engine (inspector/world/te): TE's registration facts, and megatron's TE spec.

Facts are from transformer_engine 2.11.0's source (the version the stand-in declares); the line
numbers are the ones each stand-in class's docstring cites. megatron-core's own TE code
(extensions/transformer_engine.py, the TE spec provider, MoE, MLA, MTP) runs unmodified on top.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch

from inspector.world import te

# megatron-core decides HAVE_TE when it is first imported: tests/conftest.py installs the stand-in
# before any test module imports megatron-core (this call is a no-op then). `_megatron` below
# fails loudly if megatron-core was imported without it.
te.install()

from inspector.job.layout import Layout  # noqa: E402
from inspector.job.model import ModelConfig  # noqa: E402
from inspector.job.versions import megatron_version  # noqa: E402
from inspector.world import config as world_config  # noqa: E402
from inspector.world import setup as world_setup  # noqa: E402
from inspector.world import stage as world  # noqa: E402
from inspector.world.te import attention, grouped_linear, linear, norm  # noqa: E402
from inspector.world.te.cuda import simulated_cuda  # noqa: E402

BF16 = torch.bfloat16


# --- install() ---------------------------------------------------------------------------------


def test_install_is_scoped() -> None:
    # Importing the tool (and the stand-in's package) must not make transformer_engine importable.
    code = (
        "import importlib.util, sys\n"
        "import inspector, inspector.world.te, inspector.world.stage, inspector.cli\n"
        "assert 'transformer_engine' not in sys.modules\n"
        "assert importlib.util.find_spec('transformer_engine') is None\n"
        "assert 'torch' not in sys.modules, 'importing inspector.world.te must stay free'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_is_idempotent_and_declares_the_version() -> None:
    te.install()
    _megatron()
    import transformer_engine
    from megatron.core.utils import get_te_version
    from packaging.version import Version

    # 2.11.0 under megatron-core 0.13-0.16, 2.14.0 under 0.17, 2.16.0 under 0.18, 2.17.1 under
    # 0.19 (tests/test_fp4_params.py)
    version = megatron_version()
    release = {(0, 17): "2.14.0", (0, 18): "2.16.0", (0, 19): "2.17.1"}.get(version[:2], "2.11.0")
    assert te.installed() and transformer_engine.__version__ == te.VERSION == release
    assert importlib.util.find_spec("transformer_engine") is not None
    assert get_te_version() == Version(release)
    # A submodule TE has and the stand-in leaves out is a ModuleNotFoundError, which megatron's
    # fallbacks catch (e.g. fused RoPE, TE's optimizers).
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine.pytorch.optimizers")


def test_install_refuses_to_replace_an_imported_real_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    with pytest.raises(RuntimeError, match="already imported"):
        te.install()


# --- Each stand-in class against the TE source it cites -----------------------------------------


def _names(module: torch.nn.Module) -> list[str]:
    return [name for name, _ in module.named_parameters()]


def _shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def _tp_attrs(tensor: torch.Tensor) -> tuple[Any, Any, Any]:
    return tuple(  # type: ignore[return-value]
        getattr(tensor, a, None)
        for a in ("tensor_model_parallel", "partition_dim", "partition_stride")
    )


def test_linear_column_divides_out_features() -> None:
    # linear.py 1133-1134: column mode divides out_features by tp; 1331-1344: weight and bias
    # get tensor_model_parallel=True on dim 0.
    layer = linear.Linear(
        64, 128, tp_size=4, parallel_mode="column", params_dtype=BF16, device="cpu"
    )
    assert _shapes(layer) == {"weight": (32, 64), "bias": (32,)}
    assert (layer.in_features, layer.out_features, layer.tp_size) == (64, 32, 4)
    assert layer.use_bias and layer.parallel_mode == "column"
    assert all(p.dtype == BF16 and p.device.type == "meta" for p in layer.parameters())
    assert _tp_attrs(layer.weight) == (True, 0, 1) and _tp_attrs(layer.bias) == (True, 0, 1)


def test_linear_row_divides_in_features() -> None:
    # linear.py 1135-1136; 1341-1342: a row-parallel bias is whole and flagged sequence_parallel.
    layer = linear.Linear(
        64, 128, tp_size=4, parallel_mode="row", sequence_parallel=True, device="cpu"
    )
    assert _shapes(layer) == {"weight": (128, 16), "bias": (128,)}
    assert _tp_attrs(layer.weight) == (True, 1, 1)
    assert _tp_attrs(layer.bias) == (None, None, None) and layer.bias.sequence_parallel is True
    assert layer.sequence_parallel and layer.gemm_bias_unfused_add


def test_linear_without_bias_keeps_an_empty_plain_tensor() -> None:
    # linear.py 1289-1292: bias=False sets `bias` to an empty tensor, not a parameter.
    layer = linear.Linear(64, 128, bias=False, params_dtype=BF16, device="cpu")
    assert _names(layer) == ["weight"] and not layer.use_bias
    assert not isinstance(layer.bias, torch.nn.Parameter)
    assert layer.bias.numel() == 0 and layer.bias.dtype == BF16


def test_linear_on_meta_defers_the_parallel_attributes() -> None:
    # linear.py 1297: device="meta" defers reset_parameters, which is what sets the attributes.
    layer = linear.Linear(64, 128, tp_size=2, parallel_mode="column", device="meta")
    assert _tp_attrs(layer.weight) == (None, None, None)
    assert layer.state_dict()["_extra_state"].numel() == 0  # base.py 839-841, no fp8


def test_layernorm_linear_registers_the_norm_first() -> None:
    # layernorm_linear.py 1259-1275 then 1358-1382: the norm's parameters precede weight/bias;
    # layer_norm_bias only for LayerNorm, and the norm spans the undivided input.
    ln = linear.LayerNormLinear(
        64, 96, tp_size=2, parallel_mode="column", sequence_parallel=True, device="cpu"
    )
    assert _shapes(ln) == {
        "layer_norm_weight": (64,),
        "layer_norm_bias": (64,),
        "weight": (48, 64),
        "bias": (48,),
    }
    assert ln.layer_norm_weight.sequence_parallel and ln.layer_norm_bias.sequence_parallel
    rms = linear.LayerNormLinear(
        64, 96, normalization="RMSNorm", bias=False, params_dtype=BF16, device="cpu"
    )
    assert _names(rms) == ["layer_norm_weight", "weight"] and rms.layer_norm_bias is None
    assert all(p.dtype == BF16 for p in rms.parameters())


def test_grouped_linear_has_one_weight_per_gemm() -> None:
    # grouped_linear.py 668-700: weight{i} (and bias{i} only with bias) for each GEMM.
    layer = grouped_linear.GroupedLinear(3, 64, 32, params_dtype=BF16, device="cpu")
    assert _names(layer) == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    assert layer.weight1.shape == (32, 64) and layer.weight1.dtype == BF16
    no_bias = grouped_linear.GroupedLinear(2, 64, 32, bias=False, parallel_mode="row", device="cpu")
    assert _names(no_bias) == ["weight0", "weight1"] and no_bias.bias1.numel() == 0
    assert _tp_attrs(no_bias.weight0) == (True, 1, 1)
    # grouped_linear.py 650-654: TE refuses bias with tp > 1.
    with pytest.raises(ValueError, match="doesn't support bias when TP > 1"):
        grouped_linear.GroupedLinear(2, 64, 32, tp_size=2, parallel_mode="column", device="cpu")


def test_norms_register_like_te_and_print_bare() -> None:
    # ops/basic/rmsnorm.py 96-103 (weight) and layer_norm.py 98-113 (weight, bias); megatron's
    # TENorm passes the deprecated hidden_size/params_dtype (module/rmsnorm.py 75-98).
    rms = norm.RMSNorm(
        hidden_size=64, eps=1e-6, sequence_parallel=True, params_dtype=BF16, device="cpu"
    )
    ln = norm.LayerNorm(hidden_size=64, sequence_parallel=False, device="meta")
    assert _shapes(rms) == {"weight": (64,)} and rms.weight.dtype == BF16
    assert _shapes(ln) == {"weight": (64,), "bias": (64,)}
    assert (repr(rms), repr(ln)) == ("RMSNorm()", "LayerNorm()")
    # reset_parameters sets it (module/rmsnorm.py 119-138); meta defers it (ops rmsnorm.py 90-105).
    assert rms.weight.sequence_parallel is True
    assert not hasattr(ln.weight, "sequence_parallel")
    with pytest.raises(RuntimeError, match="Neither"):
        norm.RMSNorm()


def test_dot_product_attention_softmax_offset() -> None:
    # dot_product_attention.py 425-437: only the learnable softmax has a parameter, n/tp long.
    vanilla = attention.DotProductAttention(8, 16, num_gqa_groups=2, tp_size=2)
    assert _names(vanilla) == [] and vanilla.softmax_offset is None
    assert vanilla.num_gqa_groups_per_partition == 1
    assert [n for n, _ in vanilla.named_children()] == [
        "flash_attention",
        "fused_attention",
        "unfused_attention",
    ]
    learnable = attention.DotProductAttention(8, (24, 16), tp_size=2, softmax_type="learnable")
    assert _shapes(learnable) == {"softmax_offset": (4,)}
    assert learnable.softmax_offset.dtype == torch.get_default_dtype()
    assert (
        learnable.hidden_size_per_attention_head_k,
        learnable.hidden_size_per_attention_head_v,
    ) == (24, 16)
    off_by_one = attention.DotProductAttention(8, 16, softmax_type="off-by-one")
    assert _names(off_by_one) == [] and off_by_one.softmax_offset.shape == (8,)


# --- megatron-core's own TE spec, built on the stand-in -----------------------------------------


def _megatron() -> Any:
    m = world_setup.megatron()
    from megatron.core.extensions import transformer_engine as te_ext

    if not te_ext.HAVE_TE:
        pytest.fail("megatron-core was imported before inspector.world.te.install()")
    return m


def _model(**kwargs: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000
    )
    return ModelConfig(**{**base, **kwargs})


def _te_spec(model: ModelConfig) -> Any:
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt import gpt_layer_specs

    # megatron picks the block's final norm at import: TENorm whenever TE imports
    # (transformer/transformer_block.py ~54-58); world_setup.simulate_apex overrides it per build.
    world_setup.megatron().transformer_block.LayerNormImpl = TENorm
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm,
        multi_latent_attention=model.multi_latent_attention,
    )


def _local_spec(model: ModelConfig) -> Any:
    world_setup.simulate_apex(model.use_apex)
    world_setup.simulate_grouped_gemm(model.moe_grouped_gemm)
    return world_setup.megatron().gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts,
        moe_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
    )


class Built(NamedTuple):
    gpt: Any
    checkpoint: dict[tuple[str, tuple[int, ...]], int]


def build(model: ModelConfig, layout: Layout, spec: str = "te", rank: int = 0, **extra: Any) -> Any:
    """Build the whole model (pp=1) on one simulated rank and return the GPTModel."""
    return build_checkpoint(model, layout, spec, rank, **extra).gpt


def _config(model: ModelConfig, layout: Layout, extra: dict[str, Any]) -> Any:
    """Return world's TransformerConfig, remade with `extra` fields (and `config_class`)."""
    config = world_config.transformer_config(model, layout, None)
    config_class = extra.pop("config_class", type(config))
    if not extra and config_class is type(config):
        return config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return config_class(**{**fields, **extra})


def build_checkpoint(
    model: ModelConfig, layout: Layout, spec: str = "te", rank: int = 0, **extra: Any
) -> Built:
    """Build as world.build_stage does; also return megatron's checkpoint keys and shapes.

    `extra` sets TransformerConfig fields the tool does not pass yet (`config_class` picks
    e.g. MLATransformerConfig); `mtp_num_layers` adds megatron's TE MTP block spec.
    """
    m = _megatron()
    with world_setup.simulated_rank(layout, rank, None), simulated_cuda(), world._quiet_megatron():
        transformer_config = _config(model, layout, dict(extra))
        with torch.device("meta"):
            layer_spec = _te_spec(model) if spec == "te" else _local_spec(model)
            mtp = _mtp_spec(transformer_config, layer_spec, spec == "te")
            gpt = m.GPTModel(
                mtp_block_spec=mtp,
                config=transformer_config,
                transformer_layer_spec=layer_spec,
                vocab_size=model.embedding_rows(layout.tp),
                max_sequence_length=model.max_positions,
                pre_process=True,
                post_process=True,
                share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
                position_embedding_type=model.position_embedding_type,
            )
        # What the tool does with every built model: sharded_state_dict() + apply_factories.
        return Built(gpt, world.checkpoint_sizes(gpt))


def _mtp_spec(config: Any, layer_spec: Any, use_te: bool) -> Any:
    if not getattr(config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_te)


def _layer(gpt: Any, index: int = 0) -> dict[str, tuple[int, ...]]:
    prefix = f"decoder.layers.{index}."
    return {
        name[len(prefix) :]: tuple(p.shape)
        for name, p in gpt.named_parameters()
        if name.startswith(prefix)
    }


def _expected_dense_layer(model: ModelConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """The TE spec's parameters per dense layer (TE-NOTES.md's table, from TE's source)."""
    h, n, g, d, f = (
        model.hidden_size,
        model.num_attention_heads,
        model.query_groups,
        model.head_dim,
        model.ffn_size,
    )
    fc1 = 2 * f if model.swiglu else f
    bias = not model.disable_bias_linear
    shapes = {
        "self_attention.linear_qkv.layer_norm_weight": (h,),
        "self_attention.linear_qkv.weight": ((n + 2 * g) * d // tp, h),
        "self_attention.linear_proj.weight": (h, n * d // tp),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (fc1 // tp, h),
        "mlp.linear_fc2.weight": (h, f // tp),
    }
    if model.normalization == "LayerNorm":
        shapes["self_attention.linear_qkv.layer_norm_bias"] = (h,)
        shapes["mlp.linear_fc1.layer_norm_bias"] = (h,)
    if bias or model.add_qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = ((n + 2 * g) * d // tp,)
    if bias:
        shapes["self_attention.linear_proj.bias"] = (h,)
        shapes["mlp.linear_fc1.bias"] = (fc1 // tp,)
        shapes["mlp.linear_fc2.bias"] = (h,)
    if model.qk_layernorm:
        shapes["self_attention.q_layernorm.weight"] = (d,)
        shapes["self_attention.k_layernorm.weight"] = (d,)
        if model.normalization == "LayerNorm":
            shapes["self_attention.q_layernorm.bias"] = (d,)
            shapes["self_attention.k_layernorm.bias"] = (d,)
    return shapes


DENSE = {
    "gpt2-layernorm": _model(),
    "rmsnorm-swiglu-gqa-nobias": _model(
        normalization="RMSNorm",
        swiglu=True,
        group_query_attention=True,
        num_query_groups=2,
        disable_bias_linear=True,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
    ),
    "qk-layernorm-qkv-bias": _model(
        normalization="RMSNorm", qk_layernorm=True, disable_bias_linear=True, add_qkv_bias=True
    ),
    "layernorm-qk-layernorm-bf16": _model(qk_layernorm=True, bf16=True),
}


@pytest.mark.parametrize("name", DENSE)
def test_dense_te_build_matches_te_facts(name: str) -> None:
    model = DENSE[name]
    gpt = build(model, Layout())
    assert _layer(gpt) == _expected_dense_layer(model, tp=1)
    layer = gpt.decoder.layers[0]
    assert type(layer.self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear"
    assert type(layer.self_attention.core_attention).__name__ == "TEDotProductAttention"
    assert repr(gpt.decoder.final_layernorm) == f"{model.normalization}()"
    # params_dtype reaches every TE module (megatron's embeddings are cast later, by Float16Module).
    dtype = BF16 if model.bf16 else torch.float32
    assert {p.dtype for p in gpt.decoder.parameters()} == {dtype}


def test_tp2_sequence_parallel_rmsnorm_builds() -> None:
    # The local spec refuses this (torch norms refuse SP; apex's FusedLayerNorm is LayerNorm only).
    model = DENSE["rmsnorm-swiglu-gqa-nobias"]
    gpt = build(model, Layout(tp=2, sequence_parallel=True))
    assert _layer(gpt) == _expected_dense_layer(model, tp=2)
    qkv = gpt.decoder.layers[0].self_attention.linear_qkv
    assert (
        repr(qkv)
        == "TELayerNormColumnParallelLinear(in_features=64, out_features=64, bias=False, TP=2)"
    )
    assert qkv.sequence_parallel and qkv.layer_norm_weight.sequence_parallel
    assert gpt.decoder.final_layernorm.weight.sequence_parallel is True


MOE = dict(
    num_experts=4,
    moe_ffn_hidden_size=32,
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
)


def test_moe_grouped_gemm_builds_te_grouped_mlp() -> None:
    model = _model(moe_grouped_gemm=True, **MOE)
    gpt = build(model, Layout())
    layer = _layer(gpt)
    assert type(gpt.decoder.layers[0].mlp.experts).__name__ == "TEGroupedMLP"
    assert layer["pre_mlp_layernorm.weight"] == (64,)  # MoE keeps a separate norm
    assert layer["mlp.router.weight"] == (4, 64)
    for i in range(4):
        assert layer[f"mlp.experts.linear_fc1.weight{i}"] == (64, 64)  # 2F x h
        assert layer[f"mlp.experts.linear_fc2.weight{i}"] == (64, 32)  # h x F
    assert "mlp.experts.linear_fc1.weight4" not in layer


def test_moe_sequential_builds_te_linears() -> None:
    gpt = build(_model(**MOE), Layout())
    layer = _layer(gpt)
    assert type(gpt.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    assert layer["mlp.experts.local_experts.3.linear_fc1.weight"] == (64, 64)
    assert layer["mlp.experts.local_experts.3.linear_fc2.weight"] == (64, 32)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "sequential"])
def test_ep2_tp2_sequence_parallel_builds(grouped: bool) -> None:
    model = _model(moe_grouped_gemm=grouped, **MOE)
    layout = Layout(tp=2, ep=2, sequence_parallel=True)
    gpt = build(model, layout, rank=2)  # expert rank 1 of 2
    layer = _layer(gpt)
    assert gpt.decoder.layers[0].mlp.local_expert_indices == [2, 3]
    # Expert tensor parallelism defaults to tp: F / etp per expert, E / ep experts per rank.
    fc1 = (
        "mlp.experts.linear_fc1.weight1"
        if grouped
        else "mlp.experts.local_experts.1.linear_fc1.weight"
    )
    fc2 = (
        "mlp.experts.linear_fc2.weight1"
        if grouped
        else "mlp.experts.local_experts.1.linear_fc2.weight"
    )
    assert (layer[fc1], layer[fc2]) == ((32, 64), (64, 16))
    assert len([n for n in layer if "experts" in n]) == 4
    assert layer["self_attention.linear_qkv.weight"] == (96, 64)


# --- Cross-check with megatron's own local-to-TE key map ----------------------------------------

CROSS = {
    **DENSE,
    "tp2-layernorm-sp": _model(),
    "moe-sequential": _model(**MOE),
}
CROSS_LAYOUT = {"tp2-layernorm-sp": Layout(tp=2, sequence_parallel=True)}


def _mapped_local_names(gpt: Any, keys_map: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """Rename local parameters as megatron's apply_prefix_mapping renames checkpoint keys."""
    mapped = {}
    for name, param in gpt.named_parameters():
        head, sep, rest = name.partition("decoder.layers.")
        if sep:
            index, _, inner = rest.partition(".")
            for old, new in keys_map.items():
                if inner.startswith(old):
                    inner = new + inner[len(old) :]
                    break
            name = f"{head}decoder.layers.{index}.{inner}"
        mapped[name] = tuple(param.shape)
    return mapped


@pytest.mark.parametrize("name", CROSS)
def test_te_names_are_local_names_through_megatrons_key_map(name: str) -> None:
    model, layout = CROSS[name], CROSS_LAYOUT.get(name, Layout())
    te_gpt, te_checkpoint = build_checkpoint(model, layout, "te")
    local_gpt, local_checkpoint = build_checkpoint(model, layout, "local")
    keys_map = dict(_local_spec(model).submodules.sharded_state_dict_keys_map)
    te_names = {n: tuple(p.shape) for n, p in te_gpt.named_parameters()}
    if model.num_experts:
        # megatron's local map also sends MoE layers' pre_mlp_layernorm to
        # mlp.linear_fc1.layer_norm_ (gpt_layer_specs.py ~417-420), but the TE spec keeps
        # pre_mlp_layernorm in MoE layers: the map is right for dense layers only, and megatron's
        # local and TE checkpoints of a MoE model disagree on exactly that key.
        moe_norm = "decoder.layers.pre_mlp_layernorm.weight"
        misnamed = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
        assert {k for k, _ in set(te_checkpoint) - set(local_checkpoint)} == {moe_norm}
        assert {k for k, _ in set(local_checkpoint) - set(te_checkpoint)} == {misnamed}
        keys_map = {"input_layernorm.": keys_map["input_layernorm."]}
    else:
        # megatron's own checkpoint keys agree too (TransformerLayer.sharded_state_dict applies
        # the map): same ShardedTensor keys, global and local shapes.
        assert te_checkpoint == local_checkpoint
    assert te_names == _mapped_local_names(local_gpt, keys_map)
    assert sum(p.numel() for p in te_gpt.parameters()) == sum(
        p.numel() for p in local_gpt.parameters()
    )


# --- Context parallelism, multi-latent attention, multi-token prediction -----------------------


def test_context_parallel_builds_te_attention_with_cp_group() -> None:
    # TEDotProductAttention passes cp_group / cp_global_ranks / a shared cp_stream to TE with
    # cp > 1 (extensions/transformer_engine.py ~1223-1245); the local DotProductAttention refuses.
    model = DENSE["rmsnorm-swiglu-gqa-nobias"]
    gpt = build(model, Layout(tp=2, cp=2, sequence_parallel=True), rank=1)
    attn = gpt.decoder.layers[0].self_attention.core_attention
    assert len(attn.cp_global_ranks) == 2 and attn.cp_comm_type == "p2p"
    assert type(attn.cp_stream).__name__ == "SimulatedStream"
    # Context parallelism changes no weight shape.
    assert _layer(gpt) == _expected_dense_layer(model, tp=2)


def _megatron_minor() -> str:
    from megatron.core import __version__

    return ".".join(__version__.split(".")[:2])


MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)


@pytest.mark.parametrize("qk_layernorm", [True, False], ids=["qk-layernorm", "no-qk-layernorm"])
def test_multi_latent_attention_builds(qk_layernorm: bool) -> None:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    model = _model(
        normalization="RMSNorm",
        swiglu=True,
        disable_bias_linear=True,
        multi_latent_attention=True,
        qk_layernorm=qk_layernorm,
        position_embedding_type="none",
    )
    layout = Layout(tp=2, sequence_parallel=True)
    gpt = build(model, layout, config_class=MLATransformerConfig, **MLA)
    n, h, t = 4, 64, 2
    # The q/kv down projections: megatron-core 0.13 builds them column-parallel (divided by tp);
    # 0.16 builds TELinear "duplicated" (whole on every tp rank; gpt_layer_specs.py uses
    # backend.linear() for them).
    down = type(gpt.decoder.layers[0].self_attention.linear_q_down_proj).__name__
    known = {"0.13": "TEColumnParallelLinear", "0.16": "TELinear"}
    assert down == known.get(_megatron_minor(), down)
    down_tp = t if down == "TEColumnParallelLinear" else 1
    expected = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_q_down_proj.weight": (MLA["q_lora_rank"] // down_tp, h),
        "self_attention.linear_kv_down_proj.weight": (
            (MLA["kv_lora_rank"] + MLA["qk_pos_emb_head_dim"]) // down_tp,
            h,
        ),
        "self_attention.linear_q_up_proj.weight": (
            n * (MLA["qk_head_dim"] + MLA["qk_pos_emb_head_dim"]) // t,
            MLA["q_lora_rank"],
        ),
        "self_attention.linear_kv_up_proj.weight": (
            n * (MLA["qk_head_dim"] + MLA["v_head_dim"]) // t,
            MLA["kv_lora_rank"],
        ),
        "self_attention.linear_proj.weight": (h, n * MLA["v_head_dim"] // t),
        "mlp.linear_fc1.layer_norm_weight": (h,),
        "mlp.linear_fc1.weight": (2 * model.ffn_size // t, h),
        "mlp.linear_fc2.weight": (h, model.ffn_size // t),
    }
    if (
        qk_layernorm
    ):  # the q/kv norms fuse into the up projections (TELayerNormColumnParallelLinear)
        expected["self_attention.linear_q_up_proj.layer_norm_weight"] = (MLA["q_lora_rank"],)
        expected["self_attention.linear_kv_up_proj.layer_norm_weight"] = (MLA["kv_lora_rank"],)
    assert _layer(gpt) == expected


def test_multi_token_prediction_builds_with_te_layers() -> None:
    model = DENSE["rmsnorm-swiglu-gqa-nobias"]
    gpt = build(model, Layout(), mtp_num_layers=1)
    mtp = {n: tuple(p.shape) for n, p in gpt.named_parameters() if n.startswith("mtp.")}
    h = model.hidden_size
    from tests.test_versions import MTP_INNER

    inner = {
        f"mtp.layers.0.{MTP_INNER}.{name}": shape
        for name, shape in _expected_dense_layer(model, tp=1).items()
    }
    assert mtp == {
        "mtp.layers.0.enorm.weight": (h,),
        "mtp.layers.0.hnorm.weight": (h,),
        "mtp.layers.0.eh_proj.weight": (h, 2 * h),
        "mtp.layers.0.final_layernorm.weight": (h,),
        **inner,
    }
