"""Model dimensions, parallel sizes and the pipeline schedule replayed from megatron-core."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from inspector.errors import ConfigError
from inspector.job.dims import (
    ARGUMENT_NAMES,
    ModelDims,
    _schedule_table,
    live_microbatches,
    microbatches_in_flight,
    num_microbatches,
)
from inspector.job.job import Job, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.job.versions import LATENT_MOE_SINCE, megatron_version
from tests.test_gdn import GDN_IN_GPT

# the gated delta net's fields (megatron-core 0.16+, tests/test_gdn.py)
GDN = dict(
    experimental_attention_variant="gated_delta_net", linear_attention_freq=(1, 0, 1, 0),
    linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, attention_output_gate=True,
)  # fmt: skip
# --moe-latent-size: megatron-core 0.16+ (0.13-0.15 refuse it by version)
LATENT = 16 if megatron_version() >= LATENT_MOE_SINCE else None
# A model that sets every field ModelDims reads to something other than ModelDims' default.
EVERYTHING = ModelConfig(
    num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
    swiglu=True, bf16=True, qk_layernorm=True, num_experts=4, moe_router_topk=3,
    moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=80, moe_layer_freq=(0, 1, 1, 1),
    multi_latent_attention=True, transformer_impl="transformer_engine", q_lora_rank=24,
    kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
    position_embedding_type="rope", mtp_num_layers=1, fp8_format="hybrid",
    moe_router_num_groups=2, moe_router_group_topk=2, moe_latent_size=LATENT, **GDN,
)  # fmt: skip
# What the job, not the architecture, gives ModelDims (the kernels: formulas/ops.py).
JOB_FIELDS = {"seq_length", "vocab_size", "activation_bytes", "attention_dropout", "hidden_dropout",
              "rotary", "flash_attention", "fused_kernels", "moe_sorts_chunks",
              "moe_row_padding", "bias_activation_fusion", "bias_dropout_fusion",
              "document_length", "layer_symbols", "mamba", "dsa_indexer_loss_coeff",
              "grad_accumulation_fusion", "deterministic", "te_attention", "mtp_symbols",
              "rope_fusion", "tp_comm_overlap"}  # fmt: skip
# DSA's indexer sizes: exclusive with GDN (EVERYTHING's variant), read from a DSA model's fields
DSA_DIMS = {"dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"}


def test_model_dims_come_from_the_transformer_config_fields() -> None:
    """Job.dims() maps no field by hand: each comes from ModelConfig.transformer_fields by name."""
    names = {ARGUMENT_NAMES.get(name, name) for name in EVERYTHING.transformer_fields()}
    unset = {"moe_latent_size"} if LATENT is None else set()  # a field 0.13-0.15 lack
    assert {f.name for f in dataclasses.fields(ModelDims)} - JOB_FIELDS - unset - DSA_DIMS <= names
    dsa = dataclasses.replace(EVERYTHING, experimental_attention_variant="dsa", linear_attention_freq=None,
                              dsa_indexer_n_heads=2, dsa_indexer_head_dim=8, dsa_indexer_topk=4)  # fmt: skip
    assert DSA_DIMS <= set(dsa.transformer_fields())
    gdn = GDN if GDN_IN_GPT else {}  # the job refuses GDN before megatron-core 0.16
    model = dataclasses.replace(EVERYTHING, **{**{k: ModelConfig.__dataclass_fields__[k].default
                                                  for k in GDN}, **gdn})  # fmt: skip
    job = Job(model, Layout(tp=2, dp=2, ep=2, etp=1, sequence_parallel=True), Training(hidden_dropout=0))
    # Megatron-LM's rules by hand: swiglu f = int(4 * 64 * 2 / 3 / 64) * 64 = 128; vocabulary
    # 1000 padded to a multiple of 128 x tp 2 = 1024; bf16 activations take 2 bytes.
    assert job.dims() == ModelDims(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1024,
        ffn_hidden_size=128, num_query_groups=4, kv_channels=16, swiglu=True, num_experts=4,
        moe_router_topk=3, moe_ffn_hidden_size=48, moe_shared_expert_intermediate_size=80,
        moe_layer_freq=(0, 1, 1, 1), activation_bytes=2, multi_latent_attention=True,
        q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
        mtp_num_layers=1, qk_layernorm=True, attention_dropout=True, hidden_dropout=False,
        rotary=True, flash_attention=False, fused_kernels=True, fp8="hybrid",
        moe_router_num_groups=2, moe_router_group_topk=2, te_attention=True, moe_latent_size=LATENT,
        **gdn,
    )  # fmt: skip


def test_model_dims_fill_megatron_lm_defaults() -> None:
    """Unset sizes take Megatron-LM's defaults: f = 4h, g = a, d = h / a, experts' f = f, fp32."""
    dims = Job(ModelConfig(num_experts=2, moe_router_topk=1)).dims()
    assert (dims.ffn, dims.query_groups, dims.head_dim, dims.expert_ffn) == (3072, 12, 64, 3072)
    assert (dims.activation_bytes, dims.mtp_num_layers, dims.vocab_size) == (4, 0, 50304)
    assert not dims.swiglu and not dims.multi_latent_attention


def test_defaults_follow_megatron_lm() -> None:
    dims = ModelDims(
        num_layers=2, hidden_size=768, num_attention_heads=12, seq_length=1024, vocab_size=50304
    )
    assert (dims.ffn, dims.query_groups, dims.head_dim, dims.expert_ffn) == (3072, 12, 64, 3072)
    assert dims.shared_expert_ffn == 0 and not dims.is_moe_layer(0)


def test_moe_layer_frequency() -> None:
    # --moe-layer-freq 2: layers 0, 2, 4 are MoE; a list gives one flag per layer.
    every_other = ModelDims(6, 64, 4, 16, 128, num_experts=4, moe_layer_freq=2)
    assert [every_other.is_moe_layer(i) for i in range(6)] == [True, False] * 3
    listed = ModelDims(3, 64, 4, 16, 128, num_experts=4, moe_layer_freq=(0, 1, 1))
    assert [listed.is_moe_layer(i) for i in range(3)] == [False, True, True]


@pytest.mark.parametrize(("layers", "experts", "freq"), [
    (4, 8, 1), (4, 8, 2), (1, 8, 3), (3, 8, (1, 1, 1)), (3, 8, (1, 0, 1)), (4, None, 1)])
def test_every_layer_moe_is_each_layer_asked(layers: int, experts: int | None, freq: Any) -> None:
    # the job's CUDA-graph check asks whether every layer is MoE once per job (a plan search
    # builds tens of thousands): the arithmetic answer is the per-layer loop's
    from inspector.job.model import ModelConfig

    model = ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, seq_length=16,
                        num_experts=experts, moe_layer_freq=freq)  # type: ignore[call-arg]  # fmt: skip
    assert model.every_layer_moe() == all(model.is_moe_layer(i) for i in range(layers))


def test_heads_not_divisible_by_groups() -> None:
    # GQA needs whole groups of query heads.
    with pytest.raises(ConfigError, match=r"12 % 5 = 2"):
        ModelDims(2, 768, 12, 1024, 50304, num_query_groups=5)


def test_moe_pattern_length() -> None:
    # A per-layer list must name every layer.
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        ModelDims(3, 64, 4, 16, 128, num_experts=4, moe_layer_freq=(1, 1))


def test_num_microbatches() -> None:
    assert num_microbatches(1536, 1, 16) == 96
    # 100 samples cannot be cut into steps of 3 x 2.
    with pytest.raises(ConfigError, match=r"100 % 6 = 4"):
        num_microbatches(100, 3, 2)


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 20])
def test_1f1b_in_flight_is_min_of_remaining_stages_and_microbatches(pp: int, m: int) -> None:
    for stage in range(pp):
        assert microbatches_in_flight(stage, pp, m) == min(pp - stage, m)


@pytest.mark.parametrize(
    ("pp", "v", "m", "group"),
    [(2, 2, 4, None), (4, 2, 8, None), (4, 3, 12, 4), (4, 2, 10, 5), (2, 4, 2, 2)],
)
def test_interleaved_in_flight_closed_form(pp: int, v: int, m: int, group: int | None) -> None:
    g = group or pp
    for stage in range(pp):
        expected = min(2 * (pp - stage - 1) + (v - 1) * g + 1, m * v)
        assert microbatches_in_flight(stage, pp, m, v, group) == expected


def test_interleaved_stage0_reaches_the_papers_factor() -> None:
    # Section 4.3: stage 0 holds L (1 + (p - 1) / (p v)) layers: p (v + 1) - 1 chunk passes.
    pp, v = 4, 3
    assert microbatches_in_flight(0, pp, 16, v) == pp * (v + 1) - 1


def test_schedule_table_matches_megatron_core() -> None:
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for m, v, g in [(5, 2, 3), (8, 2, 4), (12, 3, 4), (10, 4, 5)]:
        theirs = [chunk for _, chunk in schedules.get_schedule_table(m, v, g)]
        assert _schedule_table(m, v, g) == theirs


def _megatron_warmup(
    schedules: Any, monkeypatch: pytest.MonkeyPatch, pp: int, v: int | None, m: int, stage: int
) -> tuple[int, int]:
    """Return megatron-core's (warm-up, remaining) micro-batches for one pipeline rank.

    0.14+ take the pipeline group through `p2p_communicator`; 0.13 reads parallel_state
    (tests/test_versions.py records which).
    """
    if "p2p_communicator" in inspect.signature(schedules.get_pp_rank_microbatches).parameters:
        group = SimpleNamespace(size=lambda: pp, rank=lambda: stage)
        comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=v)
        result = schedules.get_pp_rank_microbatches(m, v or 1, pp, p2p_communicator=comm)
    else:
        ps = schedules.parallel_state
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: pp)
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: stage)
        monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: v)
        result = schedules.get_pp_rank_microbatches(m, v or 1, pp)
    return result[2], result[3]


def test_warmup_matches_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    for pp, v, m in [(4, None, 8), (4, None, 2), (4, 2, 8), (8, 3, 16)]:
        for stage in range(pp):
            warmup, remaining = _megatron_warmup(schedules, monkeypatch, pp, v, m, stage)
            points = live_microbatches(stage, pp, m, v or 1)
            # Memory peaks one forward after the warm-up, unless every forward is warm-up.
            assert max(map(sum, points)) == warmup + (1 if remaining else 0)


def test_interleaved_needs_whole_groups() -> None:
    # megatron-core: 6 micro-batches in groups of 4 leave 2, fewer than pp = 4.
    with pytest.raises(ConfigError, match=r"6 % 4 = 2"):
        live_microbatches(0, 4, 6, 2)


def test_interleaved_needs_at_least_pp_microbatches() -> None:
    # megatron-core: the group size (pp = 4) must not exceed the 3 micro-batches.
    with pytest.raises(ConfigError, match="--pp 4"):
        live_microbatches(0, 4, 3, 2)


def test_stage_out_of_range() -> None:
    # Stage 4 does not exist with four stages.
    with pytest.raises(ConfigError, match="--stage 4"):
        live_microbatches(4, 4, 8)
