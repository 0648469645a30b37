"""--recompute-modules and --moe-layer-recompute: read and checked as megatron-core 0.16 does."""

from __future__ import annotations

from typing import Any

import pytest

from inspector.errors import ConfigError
from inspector.inputs.versions import megatron_core_version
from inspector.job.job import make_job
from tests.composition import assert_composed_equals_whole
from tests.test_versions import GROUPED_MLP

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
            micro_batch_size=1, bf16=True, transformer_impl="local")  # fmt: skip


def test_default_modules_are_core_attn_as_in_transformer_config():
    job = make_job({**BASE, "recompute_granularity": "selective"})
    assert job.training.recompute_modules == ("core_attn",)


def test_modules_read_space_or_comma_separated():
    job = make_job({**BASE, "recompute_granularity": "selective", "recompute_modules": "core_attn, mlp",
                    "disable_bias_linear": True})  # fmt: skip
    assert job.training.recompute_modules == ("core_attn", "mlp")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (dict(recompute_granularity="selective", recompute_modules="attn"), "--recompute-modules attn"),
        (dict(recompute_modules="core_attn"), "needs --recompute-granularity selective"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              moe_layer_recompute=True), "--moe-layer-recompute"),
        (dict(recompute_granularity="selective", recompute_modules="moe_act"), "--moe-grouped-gemm"),
        (dict(recompute_granularity="selective", recompute_modules="mla_up_proj"),
         "--multi-latent-attention"),
        (dict(recompute_granularity="selective", recompute_modules="mlp"), "--disable-bias-linear"),
    ],  # fmt: skip
)
def test_invalid_combinations_name_the_flag(flags, words):
    with pytest.raises(ConfigError, match=words):
        make_job({**BASE, **flags})


def test_moe_layer_recompute_turns_selective_and_adds_moe():
    from inspector.job.recompute_modules import parse_modules

    assert parse_modules({"moe_layer_recompute": True}, "none") == ("selective", ("core_attn", "moe"))


def test_a_script_passes_every_word_after_the_flag(tmp_path):
    from inspector.inputs.sources import read_launch_script

    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun pretrain_gpt.py --num-layers 2 --recompute-granularity selective "
        "--recompute-modules core_attn mlp --bf16\n"
    )
    args = read_launch_script(str(script)).args
    assert args["recompute_modules"] == "core_attn mlp" and args["bf16"] is True


# The engine's runs: s 32, b 2, h 64, tp 2, bf16; every count below is one layer's, times 2 layers.
ENGINE = dict(BASE, micro_batch_size=2, global_batch_size=8, tensor_model_parallel_size=2,
              data_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0, ffn_hidden_size=128,
              disable_bias_linear=True)  # fmt: skip
S, B, H, TP, LAYERS = 32, 2, 64, 2, 2
BLOCK = 512  # the caching allocator's smallest block: a [s*b] fp32 statistic takes one
MOE = dict(num_experts=4, moe_router_topk=2, swiglu=True, sequence_parallel=True,
           moe_grouped_gemm=True)  # fmt: skip
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16, normalization="RMSNorm",
           position_embedding_type="rope", transformer_impl="transformer_engine")  # fmt: skip


def _held(args: dict, **flags) -> int:
    """Return what one micro-batch holds between its forward and backward on stage 0."""
    from inspector.memory.engine.run import chunk_shapes
    from inspector.memory.engine.stage import trace_chunks
    from inspector.world.build import View, build

    job = make_job({**args, **flags})
    if job not in _HELD:  # a job several tests ask about (the baselines, mlp's) runs once
        shapes = chunk_shapes(build(job, View((0,)), expert_ranks=(0,)).stages[0])
        _HELD[job] = trace_chunks(job, 0, shapes, whole=True)[0].held
    return _HELD[job]


_HELD: dict[Any, int] = {}


def _drop(args: dict, modules: str) -> int:
    return _held(args) - _held(args, recompute_granularity="selective", recompute_modules=modules)


def test_engine_stops_saving_the_mlp_inner_tensors_under_mlp():
    """transformer_layer.py _forward_mlp: tensor_parallel.checkpoint keeps the MLP's input only, so
    each layer stops holding fc1's output (saved by the gelu, [s, b, ffn/tp] bf16) and the gelu's
    output (saved by fc2, the same shape): 2 x 32 x 2 x 128 x 2 bytes per layer (ffn 4h = 256, tp 2)."""
    args = {**ENGINE, "ffn_hidden_size": 256}
    assert _drop(args, "mlp") == LAYERS * 2 * S * B * 256 // TP * 2


@pytest.mark.parametrize(("normalization", "stats"), [("LayerNorm", 2), ("RMSNorm", 1)])
def test_engine_stops_saving_the_norms_outputs_under_layernorm(normalization, stats):
    """transformer_layer.py: CheckpointWithoutOutput around input_layernorm and pre_mlp_layernorm
    frees each norm's output ([s, b, h] bf16, saved by the next linear) after its use and rebuilds
    it in backward; run under no_grad, the norm no longer saves its fp32 statistics per row
    (LayerNorm: mean and rstd, RMSNorm: rstd)."""
    args = {**ENGINE, "normalization": normalization}
    per_norm = S * B * H * 2 + stats * BLOCK
    assert _drop(args, "layernorm") == LAYERS * 2 * per_norm


def test_layernorm_recomputes_nothing_where_transformer_engine_fuses_the_norms():
    """Under Transformer Engine's spec both norms sit inside the next linear (LayerNormLinear):
    megatron's layer holds IdentityOp norms and checkpoints none of them."""
    args = {**ENGINE, "transformer_impl": "transformer_engine", "normalization": "RMSNorm"}
    assert _drop(args, "layernorm") == 0


def test_engine_stops_saving_the_expert_activation_under_moe_act():
    """experts.py GroupedMLP: CheckpointWithoutOutput around `activation_func_with_probs` (swiglu,
    times the routing probabilities): the layer stops holding silu's output (saved by the glu's
    product), the glu's output (saved by the product with the fp32 probabilities) and the result
    cast back to bf16 (saved by fc2): 3 x [tokens x topk, moe_ffn / etp] bf16. The all-gather
    dispatcher gives each rank all s x b tokens of its tp group."""
    rows, width = S * B * 2, 128 // TP
    if GROUPED_MLP:
        assert _drop({**ENGINE, **MOE}, "moe_act") == LAYERS * 3 * rows * width * 2
    else:  # 0.17+: the local spec's SequentialMLP, whose experts megatron never checkpoints
        assert _drop({**ENGINE, **MOE}, "moe_act") == 0


def test_moe_recomputes_the_whole_layer():
    """moe_layer.py: tensor_parallel.checkpoint around the MoE layer keeps its input only: it stops
    holding at least moe_act's tensors and fc1's output ([tokens x topk, 2 moe_ffn / etp] bf16);
    --moe-layer-recompute is megatron's old name for adding it to core_attn."""
    args = {**ENGINE, **MOE}
    rows, width = S * B * 2, 128 // TP
    moe = _drop(args, "moe")
    # GroupedMLP's moe_act tensors and fc1's output; 0.17+'s SequentialMLP: at least fc1's outputs
    assert moe > LAYERS * (3 * rows * width * 2 * GROUPED_MLP + rows * 2 * width * 2)
    both = _held(args, recompute_granularity="selective", recompute_modules="core_attn moe")
    assert _held(args, moe_layer_recompute=True) == both


@pytest.mark.skipif(megatron_core_version() < (0, 14), reason="megatron-core lists shared_experts from 0.14")
def test_engine_stops_saving_the_shared_expert_inner_tensors_under_shared_experts():
    """moe_layer.py shared_experts_compute: tensor_parallel.checkpoint around the shared expert MLP:
    the layer stops holding fc1's output ([s x b, 2 x 64 / tp] bf16, saved by the swiglu) and the
    swiglu's ([s x b, 64 / tp], saved by fc2); sequence parallelism gathers all s x b tokens."""
    args = {**ENGINE, **MOE, "moe_shared_expert_intermediate_size": 64}
    assert _drop(args, "shared_experts") == LAYERS * 3 * S * B * (64 // TP) * 2


# megatron-core before 0.16 marks its fused MLA RoPE `experimental_fn` (it needs --enable-experimental)
MLA_ROPE_EXPERIMENTAL = megatron_core_version() < (0, 16)


def _formula_drop(args: dict, modules: str) -> float:
    """Return the closed forms' saving (memory/closed/activations.py) over the job's stage-0 layers."""
    from inspector.memory.closed.activations import layer_activations

    job = make_job({**args, "recompute_granularity": "selective", "recompute_modules": modules})
    dims, b = job.dims(), job.schedule().micro_batch_size

    def held(*asked: str) -> float:
        return sum(layer_activations(dims, job.layout, i, b, "selective", False, asked).total
                   for i in range(LAYERS))  # fmt: skip

    return held() - held(*job.training.recompute_modules)


@pytest.mark.parametrize(
    ("args", "module"),
    [({**ENGINE, "ffn_hidden_size": 256}, "mlp"), ({**ENGINE, "swiglu": True}, "mlp"),
     pytest.param({**ENGINE, **MOE, "moe_shared_expert_intermediate_size": 64}, "shared_experts",
                  marks=pytest.mark.skipif(megatron_core_version() < (0, 14), reason="0.14+"))],
)  # fmt: skip
def test_closed_forms_count_the_saving_the_engine_measures(args, module):
    """The closed forms drop a dense MLP's inner terms under mlp and the shared expert's under
    shared_experts: exactly what the engine stops holding."""
    assert _formula_drop(args, module) == _drop(args, module) > 0


def test_fused_mla_rope_is_experimental_before_megatron_core_0_16():
    from megatron.core.fusions import fused_mla_yarn_rope_apply as rope

    wrapped = [hasattr(f, "__wrapped__") for f in (rope.fused_apply_mla_rope_for_q, rope.fused_apply_mla_rope_for_kv)]
    assert wrapped == [MLA_ROPE_EXPERIMENTAL] * 2


@pytest.mark.skipif(MLA_ROPE_EXPERIMENTAL, reason="the fused MLA RoPE is experimental here")
def test_engine_stops_saving_the_mla_up_projections_under_mla_up_proj():
    """multi_latent_attention.py: CheckpointWithoutOutput around the up projections and RoPE frees
    query and key ([s, b, heads / tp, 16 + 8] bf16 each) and value ([s, b, heads / tp, 16]) after
    core attention, and linear_kv_up_proj no longer saves its input (TE's Linear copies the
    non-contiguous kv_compressed, [s x b, kv_lora 16] bf16); the checkpoint keeps its own inputs,
    among them k_pos_emb, a view of linear_kv_down_proj's output ([s, b, 16 + 8] bf16), which
    without it is freed after the forward."""
    heads = 4 // TP
    freed = 2 * S * B * heads * 24 * 2 + S * B * heads * 16 * 2 + S * B * 16 * 2
    kept = S * B * 24 * 2
    assert _drop({**ENGINE, **MLA}, "mla_up_proj") == LAYERS * (freed - kept)


def test_mlp_with_biases_is_refused_because_megatron_recurses_on_any_device():
    """The refusal's reason, shown on host tensors: the MLP returns fc2's bias Parameter itself, so
    megatron's CheckpointFunction makes that Parameter one of its outputs (it is no longer a leaf);
    the recomputation in backward returns the same Parameter, whose gradient goes back into the
    same CheckpointFunction: torch's custom-Function rule, not the meta device."""
    import torch
    from megatron.core.tensor_parallel.random import checkpoint

    from inspector.memory.engine.cuda import cuda_on_meta

    weight, bias = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    with cuda_on_meta():
        out, returned = checkpoint(lambda x: (x @ weight, bias), False, torch.ones(2, 4, requires_grad=True))
    assert returned is bias and not bias.is_leaf
    assert bias.grad_fn is out.grad_fn and type(out.grad_fn).__name__ == "CheckpointFunctionBackward"
    with pytest.raises(ConfigError, match="recomputes itself without end"):
        make_job({**ENGINE, "disable_bias_linear": False, "recompute_granularity": "selective",
                  "recompute_modules": "mlp"})  # fmt: skip


def test_shared_experts_needs_the_megatron_core_that_lists_it():
    """core_v0.14.0 added shared_experts to TransformerConfig's allowed modules (megatron itself
    is checked in tests/test_versions.py); before it the tool refuses the name, as megatron does."""
    flags = {**BASE, "recompute_granularity": "selective", "recompute_modules": "shared_experts"}
    if megatron_core_version() >= (0, 14):
        assert make_job(flags).training.recompute_modules == ("shared_experts",)
    else:
        with pytest.raises(ConfigError, match="shared_experts needs megatron-core 0.14 or later"):
            make_job(flags)


def test_the_formula_fallback_refuses_modules_it_does_not_count(cli, monkeypatch):
    from inspector.memory.engine import run as engine

    # a job the engine cannot run (none the command line admits today: made up here)
    monkeypatch.setattr(engine, "engine_gap", lambda job: "Some layer is not run")
    result = cli("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
                 "--disable-bias-linear", "--transformer-impl", "transformer_engine",
                 "--cp", "2", "--use-flash-attn",
                 "--recompute-granularity", "selective", "--recompute-modules", "core_attn mlp")  # fmt: skip
    assert result.code == 2 and result.err.startswith("Error: --recompute-modules mlp is measured by the engine only")


PLAN = ("plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--vocab-size", "1000", "--bf16", "--disable-bias-linear",
        "--gpus", "4", "--global-batch-size", "8", "--recompute-granularity", "selective")  # fmt: skip


@pytest.mark.parametrize("flags", [["--recompute-modules", "core_attn layernorm"], ["--moe-layer-recompute"]])
def test_plan_refuses_modules_it_would_drop(cli, flags):
    """plan's closed forms count the saving of core_attn, mla_up_proj, mlp and shared_experts only: a plan
    without the asked modules would be a different job, so it says so instead of planning one."""
    result = cli(*PLAN, *flags)
    assert result.code == 2
    assert result.err.startswith("Error: --recompute-modules ")
    assert "plan prices selective recomputation of core_attn, mla_up_proj, mlp, shared_experts only" in result.err


def test_plan_with_mlp_recomputation_is_confirmed_by_memory(cli):
    """A plan recomputing the MLP prints the flag, holds less than core_attn alone, and `memory`
    with its pasted flags (the engine's run) reports the peak the plan printed."""
    import json

    def best(modules: str) -> dict:
        found = cli(*PLAN, "--recompute-modules", modules, "--top", "1", "--format", "json",
                    "--no-cache", "--tp", "2", "--pp", "1")  # fmt: skip
        assert found.code == 0, found.err
        return json.loads(found.out)["plans"][0]

    mlp, core = best("core_attn mlp"), best("core_attn")
    assert "--recompute-modules core_attn mlp" in mlp["flags"]
    assert not any(f.startswith("--recompute-modules") for f in core["flags"])
    assert mlp["peak_bytes"] < core["peak_bytes"]
    assert mlp["time_shares"]["compute"] > core["time_shares"]["compute"]
    assert mlp["time_shares"]["tensor"] > core["time_shares"]["tensor"]  # fc2's all-reduce again
    flags = [word for flag in mlp["flags"] for word in flag.split(" ", 1)]
    flags = [f for f in flags if f != "--overlap-param-gather"]
    memory = cli("memory", *PLAN[1:13], *flags, "--dp", str(mlp["layout"]["dp"]), "--format", "json")
    assert memory.code == 0, memory.err
    stages = json.loads(memory.out)["stages"]
    assert [s.get("total_bytes", s.get("total")) for s in stages] == [s["total"] for s in mlp["stages"]]


WORKLOAD = ("workload", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--bf16", "--disable-bias-linear",
            "--recompute-granularity", "selective", "--stage", "0")  # fmt: skip


def test_workload_times_the_mlp_it_recomputes(cli):
    """workload adds each module's recomputed GEMMs (tests/test_workload.py): the MLP records'
    backward grows, the attention records' does not (core_attn not asked)."""
    from inspector.report.simai import parse_workload

    runs = {m: cli(*WORKLOAD, "--recompute-modules", m, "--gpu", "h100") for m in ("core_attn", "mlp")}
    assert all(r.code == 0 for r in runs.values())
    core, mlp = (parse_workload(r.out)[1] for r in runs.values())
    grew = {a.name for a, b in zip(core, mlp, strict=True) if b.ig_compute > a.ig_compute}
    assert grew == {"mlp_layer"}


def test_workload_refuses_modules_it_cannot_time(cli, tmp_path):
    """A measured profile holds the norms inside attention's time: layernorm's recomputation
    cannot be told apart, so workload says so instead of leaving it out."""
    from tests.test_workload import PROFILE

    profile = tmp_path / "profile.txt"
    profile.write_text(PROFILE)
    result = cli(*WORKLOAD, "--recompute-modules", "layernorm", "--compute-profile", str(profile))
    assert result.code == 2
    assert result.err.startswith("Error: --recompute-modules layernorm: workload cannot time")


def test_memory_names_the_modules_beyond_megatrons_default(cli):
    args = ["memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
            "--disable-bias-linear", "--recompute-granularity", "selective"]  # fmt: skip
    named = cli(*args, "--recompute-modules", "layernorm mlp")
    assert named.code == 0 and "recompute selective (layernorm, mlp), flash" in named.out
    default = cli(*args)
    assert default.code == 0 and "recompute selective, flash" in default.out


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        dict(recompute_modules="layernorm mlp"),
        pytest.param(dict(recompute_modules="moe_act shared_experts layernorm", **MOE,
                          moe_shared_expert_intermediate_size=64, moe_layer_freq=2),
                     marks=pytest.mark.skipif(megatron_core_version() < (0, 14), reason="0.14+")),
    ],  # fmt: skip
    ids=["dense", "moe-mixed"],
)
def test_one_layer_of_each_kind_stands_for_the_rest_under_module_recomputation(flags):
    """`memory` composes a stage from one layer of each kind (memory/engine/stage.py): the checkpoints'
    frees and restores (storage resizes included) must compose event for event."""
    job = make_job({**ENGINE, "num_layers": 6, "pipeline_model_parallel_size": 2,
                    "recompute_granularity": "selective", **flags})  # fmt: skip
    assert_composed_equals_whole(job)


_MLA_CASES = {"latents": {}, "sequence-parallel": {"sequence_parallel": True},
              "qk-layernorm": {"qk_layernorm": True}, "no-q-latent": {"q_lora_rank": None},
              "tp1": {"tensor_model_parallel_size": 1, "data_parallel_size": 4}}  # fmt: skip


@pytest.mark.skipif(MLA_ROPE_EXPERIMENTAL, reason="the fused MLA RoPE is experimental here")
@pytest.mark.parametrize("flags", _MLA_CASES.values(), ids=_MLA_CASES.keys())
def test_closed_forms_count_the_mla_up_proj_saving_the_engine_measures(flags):
    """activations.py `_mla_attention(up_proj=True)`: Q, K, V go, the checkpoint's inputs stay
    (the RoPE key keeps kv_down's whole output; gathered under sequence parallelism; with
    --qk-layernorm the latent norms' outputs go too): exactly the engine's drop."""
    args = {**ENGINE, **MLA, **flags}
    assert _formula_drop(args, "mla_up_proj") == _drop(args, "mla_up_proj") > 0


@pytest.mark.skipif(MLA_ROPE_EXPERIMENTAL, reason="the fused MLA RoPE is experimental here")
def test_mla_up_proj_with_sequence_parallel_qk_layernorm_is_within_a_block_per_layer():
    """Sequence parallelism with --qk-layernorm: the closed form (norm outputs on the rank's
    rows gone, the gathered RoPE key kept) is one 512-byte allocator block per layer short of the
    engine's drop (a per-row statistic the closed forms do not count)."""
    args = {**ENGINE, **MLA, "sequence_parallel": True, "qk_layernorm": True}
    assert _drop(args, "mla_up_proj") - _formula_drop(args, "mla_up_proj") == LAYERS * BLOCK


MLA_FLAGS = ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
             "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
             "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--transformer-impl", "transformer_engine")  # fmt: skip


@pytest.mark.skipif(MLA_ROPE_EXPERIMENTAL, reason="the fused MLA RoPE is experimental here")
def test_plan_with_mla_up_proj_recomputation_is_confirmed_by_memory(cli):
    """plan accepts mla_up_proj: its plan holds less and computes more than core_attn alone, and
    `memory` with the printed flags (the engine's run) reports the peak the plan printed."""
    import json

    def best(modules: str) -> dict:
        found = cli(*PLAN, *MLA_FLAGS, "--recompute-modules", modules, "--top", "1", "--format",
                    "json", "--no-cache", "--tp", "2", "--pp", "1")  # fmt: skip
        assert found.code == 0, found.err
        return json.loads(found.out)["plans"][0]

    up, core = best("core_attn mla_up_proj"), best("core_attn")
    assert "--recompute-modules core_attn mla_up_proj" in up["flags"]
    assert up["peak_bytes"] < core["peak_bytes"]
    assert up["time_shares"]["compute"] > core["time_shares"]["compute"]
    flags = [word for flag in up["flags"] for word in flag.split(" ", 1)]
    flags = [f for f in flags if f != "--overlap-param-gather"]
    memory = cli("memory", *PLAN[1:13], *MLA_FLAGS, *flags, "--dp", str(up["layout"]["dp"]),
                 "--format", "json")  # fmt: skip
    assert memory.code == 0, memory.err
    stages = json.loads(memory.out)["stages"]
    assert [s.get("total_bytes", s.get("total")) for s in stages] == [s["total"] for s in up["stages"]]


def test_workload_times_the_mla_up_projections_it_recomputes(cli):
    """workload adds the up projections' forward to attention's input-gradient phase."""
    from inspector.report.simai import parse_workload

    runs = {m: cli(*WORKLOAD, *MLA_FLAGS, "--recompute-modules", m, "--gpu", "h100",
                   "--seq-length", "4096")  # the up projections' nanoseconds above rounding
            for m in ("core_attn", "core_attn mla_up_proj")}  # fmt: skip
    assert all(r.code == 0 for r in runs.values()), [r.err for r in runs.values()]
    core, up = (parse_workload(r.out)[1] for r in runs.values())
    grew = {a.name for a, b in zip(core, up, strict=True) if b.ig_compute > a.ig_compute}
    assert grew == {"attention_layer"}
