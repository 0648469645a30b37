"""Gated delta net (GDN) layers: megatron-core's own GatedDeltaNet built and run on the stand-ins
for flash-linear-attention and causal-conv1d (inspector/world/ssm/fla_kernels.py).

What differs between megatron-core versions is recorded here (VERSION facts), not in comments.
"""

from __future__ import annotations

import importlib
import json
import math

import megatron.core
import pytest

from tests.composition import assert_composed_equals_whole
from tests.counting import parameter_count

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
# TransformerConfig.experimental_attention_variant / linear_* / attention_output_gate and
# ssm/gated_delta_net.py: GPTModel builds GDN layers from 0.16 (0.13-0.15 have none)
GDN_IN_GPT = VERSION >= (0, 16)
# the hybrid pattern's `G` (Symbols.GDN; MambaStack's, later HybridStack's, gdn_layer): 0.17 on
GDN_IN_HYBRID = VERSION >= (0, 17)
# GatedDeltaNet's causal convolution: causal-conv1d's causal_conv1d_fn on 0.16-0.17,
# flash-linear-attention's fla.modules.convolution.causal_conv1d from 0.18
FLA_CONVOLUTION = VERSION >= (0, 18)
# ssm/gated_delta_net.py became a package (ssm/gated_delta_net/gdn.py, common.py) in 0.19
GDN_PACKAGE = VERSION >= (0, 19)

SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128 --vocab-size "
         "1000 --normalization RMSNorm --swiglu --linear-num-key-heads 4 --linear-num-value-heads 8 "
         "--linear-key-head-dim 32 --linear-value-head-dim 32").split()  # fmt: skip
GPT = SMALL + "--experimental-attention-variant gated_delta_net --linear-attention-freq 4".split()
HYBRID = SMALL + "--hybrid-override-pattern G*G- --position-embedding-type none".split()
gpt_only = pytest.mark.skipif(not GDN_IN_GPT, reason="GDN needs megatron-core 0.16")
hybrid_only = pytest.mark.skipif(not GDN_IN_HYBRID, reason="G layers need megatron-core 0.17")


def _args(flags: list[str]) -> dict:
    """Return flags as the tests' parameter count reads them (underscored names)."""
    args: dict = {}
    for i, word in enumerate(flags):
        if word.startswith("--"):
            value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else True
            args[word[2:].replace("-", "_")] = int(value) if str(value).isdigit() else value
    return args


def test_versions_build_gdn_where_megatron_has_it():
    from inspector.world.setup import megatron
    from inspector.world.ssm import fla_kernels

    megatron()  # the stand-ins go in before megatron-core is imported
    from megatron.core.transformer import TransformerConfig

    fields = {f for f in TransformerConfig.__dataclass_fields__}
    assert ("experimental_attention_variant" in fields) == GDN_IN_GPT
    assert ("attention_output_gate" in fields) == GDN_IN_GPT
    if not GDN_IN_GPT:
        return
    gdn = importlib.import_module("megatron.core.ssm.gated_delta_net")
    assert gdn.HAVE_FLA and hasattr(gdn, "__path__") == GDN_PACKAGE
    assert gdn.chunk_gated_delta_rule is fla_kernels.chunk_gated_delta_rule
    assert gdn.l2norm is fla_kernels.l2norm
    if FLA_CONVOLUTION:
        assert gdn.causal_conv1d is fla_kernels.causal_conv1d
    else:
        assert gdn.causal_conv1d_fn is fla_kernels.causal_conv1d_fn
    where = ("megatron.core.models.hybrid.hybrid_layer_allocation" if VERSION >= (0, 18)
             else "megatron.core.ssm.mamba_hybrid_layer_allocation")  # fmt: skip
    assert hasattr(importlib.import_module(where).Symbols, "GDN") == GDN_IN_HYBRID


@pytest.mark.skipif(GDN_IN_GPT, reason="megatron-core 0.16+ builds GDN")
def test_gdn_is_refused_by_name_before_0_16(cli):
    result = cli("tree", *GPT)
    assert result.code == 2
    assert result.err == (
        f"Error: --experimental-attention-variant needs megatron-core 0.16 or newer: "
        f"{VERSION[0]}.{VERSION[1]} has no TransformerConfig.experimental_attention_variant (gated "
        "delta net, ssm/gated_delta_net.py, came in 0.16)\n"
    )


@pytest.mark.skipif(GDN_IN_HYBRID, reason="megatron-core 0.17+ builds G layers")
def test_g_layers_are_refused_by_name_before_0_17(cli):
    result = cli("tree", *HYBRID)
    assert (result.code, result.err) == (2, (
        "Error: --hybrid-override-pattern G*G-: G (gated delta net) layers need megatron-core "
        f"0.17 or newer (the installed megatron-core is {VERSION[0]}.{VERSION[1]})\n"))  # fmt: skip


@gpt_only
@pytest.mark.parametrize("freq, kinds", [("4", "GGGA"), ("[1,0,0,1]", "GAAG")])
def test_gpt_builds_gdn_where_the_linear_attention_pattern_says(cli, freq, kinds):
    flags = [*GPT[:-1], freq]
    result = cli("tree", *flags)
    assert result.code == 0, result.err
    mixers = [line.split("(")[1][:-1] for line in result.out.splitlines()
              if "Submodule: self_attention (" in line]  # fmt: skip
    assert "".join("G" if m == "GatedDeltaNet" else "A" for m in mixers) == kinds
    assert mixers.count("SelfAttention") == kinds.count("A")


@gpt_only
def test_gdn_parameters_are_megatrons_split_over_tp(cli):
    result = cli("params", *GPT, "--tp", "2", "--format", "json")
    assert result.code == 0, result.err
    rows = {r["name"]: r for r in json.loads(result.out)["parameters"]}
    # by hand: q, k 4 x 32 each, v and gate z 8 x 32 each, beta and alpha 8 each: 784 rows; the
    # convolution over q, k, v: 512 channels of width 4; split over 2 tensor-parallel ranks
    layer = "decoder.layers.0.self_attention."
    shapes = {name[len(layer):]: tuple(r["shape"]) for name, r in rows.items() if name.startswith(layer)}
    assert shapes == {"dt_bias": (4,), "A_log": (4,), "in_proj.layer_norm_weight": (256,),
                      "in_proj.weight": (392, 256), "conv1d.weight": (256, 1, 4),
                      "out_norm.weight": (32,), "out_proj.weight": (256, 128)}  # fmt: skip
    # Shampoo: one factor per dimension of the local shape, the convolution's three too
    assert rows[layer + "conv1d.weight"]["precs"] == [[256, 256], [1, 1], [4, 4]]
    assert all(rows[layer + name]["tensor_parallel"] for name in ("dt_bias", "A_log", "conv1d.weight"))
    whole = cli("params", *GPT, "--format", "json")
    total = sum(math.prod(r["global_shape"]) for r in json.loads(whole.out)["parameters"])
    assert total == parameter_count(_args(GPT))


@gpt_only
def test_the_preset_builds_the_counted_qwen3_next(cli):
    result = cli("params", "--model", "qwen3-next-80b-a3b", "--num-layers", "4", "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    from inspector.inputs.presets import PRESETS

    args = {**PRESETS["qwen3-next-80b-a3b"].args, "num_layers": 4}
    assert sum(math.prod(r["global_shape"]) for r in rows if not r["tied"]) == parameter_count(args)
    # the gated attention's QKV projection holds a gate per query channel: (16 x 2 + 2 x 2) x 256
    qkv = next(r for r in rows if r["name"] == "decoder.layers.3.self_attention.linear_qkv.weight")
    assert qkv["shape"] == [9216, 2048]


@hybrid_only
def test_hybrid_g_layers_build_and_count(cli):
    result = cli("params", *HYBRID, "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    assert sum(math.prod(r["global_shape"]) for r in rows) == parameter_count(_args(HYBRID))
    assert "decoder.layers.2.self_attention.conv1d.weight" in {r["name"] for r in rows}


def _gdn_job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1000,
        pipeline_model_parallel_size=2, tensor_model_parallel_size=2, data_parallel_size=2,
        micro_batch_size=2, global_batch_size=8, bf16=True, use_distributed_optimizer=True,
        transformer_impl="transformer_engine", swiglu=True, normalization="RMSNorm",
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip
    return make_job({**args, **flags})


@gpt_only
@pytest.mark.slow
def test_composed_gdn_stage_equals_every_layer_run():
    """A GDN layer is its own kind: one of each kind stands for the rest."""
    cache = assert_composed_equals_whole(_gdn_job())
    kinds = {kind for _, _, small, _ in cache for kind in small}
    assert kinds == {(False, True), (False, False)}  # (MoE, GDN): GDN and attention layers


@gpt_only
def test_memory_runs_gdn_and_counts_megatron_lm_flops(cli):
    result = cli("memory", *GPT, "--bf16", "--micro-batch-size", "1", "--format", "json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["stages"][0]["activations"]["source"] == "engine"
    # Megatron-LM training.py num_floating_point_operations (core_v0.16.1), by hand: 128 tokens,
    # h 256, 3 GDN layers (in proj 256 x 784, conv 4 x 512, rule 8 x 32^2 x 4, out proj 256 x
    # 256), one attention layer (QKV + out 256 x 32 x 24 + 8 x 32 x 256, core 8 x 32 x 128),
    # SwiGLU MLPs of 640 (3 GEMMs), logits over 1024 (1000 padded)
    gdn = 256 * 784 + 4 * 512 + 8 * 32**2 * 4 + 256 * 256
    attention = 256 * 32 * 24 + 8 * 32 * 256 + 8 * 32 * 128
    per_token = 3 * gdn + attention + 4 * 3 * 256 * 640 + 256 * 1024
    assert report["iteration_flops"] == 6 * 128 * per_token


def test_attention_output_gate_adds_its_projection_flops():
    # training.py: gate_projection_size = query_projection_size with --attention-output-gate
    from inspector.formulas.flops import layer_flops
    from inspector.job.dims import ModelDims

    dims = ModelDims(num_layers=1, hidden_size=256, num_attention_heads=8, seq_length=128,
                     vocab_size=1024)  # fmt: skip
    gated = ModelDims(**{**dims.__dict__, "attention_output_gate": True})
    assert layer_flops(gated, 0, 1).attention - layer_flops(dims, 0, 1).attention == 6 * 128 * 256 * 256


@gpt_only
def test_workload_writes_gdn_records(cli, tmp_path):
    result = cli("workload", *GPT, "--tp", "2", "--bf16", "--micro-batch-size", "1", "--stage",
                 "0", "--gpu", "h100")  # fmt: skip
    assert result.code == 0, result.err
    names = [line.split("\t")[0] for line in result.out.splitlines()[2:]]
    assert names.count("gdn_layer") == 3 and names.count("attention_layer") == 1
    gdn = next(line.split("\t") for line in result.out.splitlines() if line.startswith("gdn_layer"))
    # out_proj all-reduces the (s, b, h) output forward, in_proj the input gradient backward
    assert gdn[3:5] == ["ALLREDUCE", str(2 * 128 * 256)] and gdn[6:8] == ["ALLREDUCE", str(2 * 128 * 256)]


NO_SWIGLU = [flag for flag in GPT if flag != "--swiglu"]


@gpt_only
@pytest.mark.parametrize(
    ("flags", "error"),
    [
        # TransformerConfig asserts the heads divide over tensor-parallel ranks
        ([*GPT, "--tp", "8"], "--linear-num-key-heads 4 is not divisible by --tp 8 (4 % 8 = 4); "
         "megatron-core's TransformerConfig asserts it"),
        # the causal convolution runs SiLU only
        (NO_SWIGLU, "gated delta net layers need --swiglu"),
        # the experimental block spec is Transformer Engine's
        ([*GPT, "--transformer-impl", "local"], "--experimental-attention-variant gated_delta_net "
         "with --transformer-impl local"),
        # one 1/0 a layer
        ([*GPT[:-1], "[1,0]"], "--linear-attention-freq has 2 layers but --num-layers is 4"),
        # GDN has no context parallelism in megatron-core 0.16
        ([*GPT, "--cp", "2"], "--context-parallel-size 2 with gated delta net layers"),
        # the sizes mean nothing without GDN layers
        (SMALL, "--linear-key-head-dim has no effect without --experimental-attention-variant "
         "gated_delta_net or G layers"),
    ],
)  # fmt: skip
def test_bad_gdn_jobs_name_the_flag(cli, flags, error):
    result = cli("tree", *flags)
    assert result.code == 2 and result.err.startswith("Error: " + error), result.err


@gpt_only
def test_gdn_needs_its_layer_pattern(cli):
    no_freq = GPT[:-2]  # without --linear-attention-freq 4
    result = cli("tree", *no_freq)
    assert (result.code, result.err) == (2, (
        "Error: --experimental-attention-variant gated_delta_net needs --linear-attention-freq "
        "(megatron-core: 'linear_attention_freq must be set for linear gated_delta_net')\n"))  # fmt: skip


def test_hf_config_reads_the_layer_pattern(tmp_path):
    from inspector.inputs.hf import read_hf_config

    data = json.loads(_fixture("qwen3-next-80b-a3b.json").read_text())
    assert read_hf_config(str(_fixture("qwen3-next-80b-a3b.json"))).args["linear_attention_freq"] == 4
    # transformers 5.5+ writes layer_types instead (transformers_compat.full_attention_interval_from_hf)
    data.pop("full_attention_interval")
    data["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * 12
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert read_hf_config(str(path)).args["linear_attention_freq"] == "[" + ",".join("1110" * 12) + "]"


def _fixture(name: str):
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "fixtures" / "hf" / name


def _meta(*shape, dtype=None, grad=True):
    import torch

    return torch.empty(shape, dtype=dtype or torch.bfloat16, device="meta", requires_grad=grad)


def test_chunk_gated_delta_rule_saves_what_fla_saves():
    # fla chunk.py ChunkGatedDeltaRuleFunction.forward: save_for_backward(q, q_rstd, k, k_rstd, v,
    # g, beta, A, initial_state, cu_seqlens, chunk_indices): the None ones left out, g the fp32
    # chunk-local cumsum (B, T, H), A solve_tril's (B, T, H, 64) in k's dtype
    import torch

    from inspector.memory.engine.allocator import Tracker
    from inspector.world.ssm.fla_kernels import chunk_gated_delta_rule

    b, t, h, d = 1, 256, 4, 64
    q, k, v = (_meta(b, t, h, d) for _ in range(3))
    g, beta = _meta(b, t, h, dtype=torch.float32), _meta(b, t, h)
    tracker = Tracker()
    with tracker:
        o, final = chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    assert final is None and (o.shape, o.dtype) == ((b, t, h, d), torch.bfloat16)
    saved = [(tuple(s.shape), s.dtype) for s in o.grad_fn.saved_tensors]
    bf16, f32 = torch.bfloat16, torch.float32
    assert saved == [((b, t, h, d), bf16)] * 3 + [((b, t, h), f32), ((b, t, h), bf16),
                                                  ((b, t, h, 64), bf16)]  # fmt: skip
    # by hand, in fla's order: g cumsum 4 KiB, A fp32 256 KiB, A inverted (bf16) 128 KiB and the
    # fp32 one freed, w and u, h (4 chunks x 64 x 64 per head), v_new, o, 128 KiB each; then the
    # temporaries w, u, h, v_new freed (o and what is saved stay)
    kib = 1024
    assert [e.bytes // kib for e in tracker.events] == [4, 256, 128, -256, 128, 128, 128, 128, 128,
                                                        -128, -128, -128, -128]  # fmt: skip
    o.sum().backward()
    assert [(x.grad.shape, x.grad.dtype) for x in (q, k, v, g, beta)] == [
        (x.shape, x.dtype) for x in (q, k, v, g, beta)]  # fmt: skip


def test_l2norm_saves_its_output_and_fp32_rstd():
    # fla l2norm.py L2NormFunction: save_for_backward(y, rstd), rstd fp32 one per row
    import torch

    from inspector.world.ssm.fla_kernels import l2norm

    x = _meta(2, 128, 4, 32)
    y = l2norm(x)
    saved = [(tuple(s.shape), s.dtype) for s in y.grad_fn.saved_tensors]
    assert saved == [((2, 128, 4, 32), torch.bfloat16), ((2, 128, 4), torch.float32)]
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_convolutions_save_their_input_as_given():
    import torch

    from inspector.world.ssm.fla_kernels import causal_conv1d, causal_conv1d_fn

    # fla conv/triton/ops.py CausalConv1dFunction: x kept as given (no_guard_contiguous x: a view
    # of the in_proj output), save_for_backward(x, weight, bias, residual, initial_state)
    whole = _meta(2, 64, 700)
    x = whole[..., :512]  # megatron-core 0.18+: qkv split from the projection, (b, s, d)
    weight = _meta(512, 4)
    y, final = causal_conv1d(x=x, weight=weight, bias=None, activation="silu")
    assert final is None and y.shape == (2, 64, 512) and y.is_contiguous()
    saved = y.grad_fn.saved_tensors
    assert saved[0].stride() == x.stride() and saved[1].shape == (512, 4) and saved[2] is None
    y.sum().backward()
    assert whole.grad.shape == whole.shape and weight.grad.dtype == torch.bfloat16
    # causal-conv1d's CausalConv1dFn: (b, d, s), out empty_like(x); saves x, weight, bias
    x = _meta(2, 512, 64)
    out = causal_conv1d_fn(x=x, weight=weight, bias=None, activation="silu")
    assert out.shape == x.shape
    assert [None if s is None else tuple(s.shape) for s in out.grad_fn.saved_tensors] == [
        (2, 512, 64), (512, 4), None]  # fmt: skip
    out.sum().backward()
    assert weight.grad is not None


# the activations of 3 GDN layers over 3 attention layers' (the same model at
# --linear-attention-freq 1), by megatron-core version, where measured: from 0.18 fla's
# causal_conv1d saves its input as megatron gives it, a view of in_proj's output (b, s, 784),
# which stays alive, where 0.16's causal_conv1d_fn saved a contiguous (b, 512, s) copy: (784 -
# 512) x 128 tokens x 2 bytes more a layer. megatron-core 0.16.1 ssm/gated_delta_net.py 324
# (`qkv.transpose(1, 2).contiguous()`, then gate, beta, alpha made contiguous at 359-361: in_proj's
# output freed); 0.19.2 ssm/gated_delta_net/gdn.py 172 (the split) and 214-215 (`causal_conv1d(
# x=qkv`); fla conv/triton/ops.py `CausalConv1dFunction.forward` (input_guard no_guard_contiguous
# x, save_for_backward(x, ...)). The z, beta and alpha columns (v_dim + 2 x value heads) stay held:
# Qwen3-Next on 8 GPUs (36 GDN layers, 4,096 tokens, 4,096 + 64 columns) 36 x 4096 x 4160 x 2 =
# 1,226,833,920 bytes more on 0.19.2 (bench/RESULTS.md "trace42")
GDN_EXTRA_ACTIVATIONS = {(0, 16): 2_219_520, (0, 19): 2_219_520 + 3 * (784 - 512) * 128 * 2}


@pytest.mark.skipif(VERSION not in GDN_EXTRA_ACTIVATIONS, reason="not measured on this version")
def test_gdn_activations_follow_megatrons_forward_of_each_version(cli):
    totals = []
    for freq in ("4", "1"):
        result = cli("memory", *GPT[:-1], freq, "--bf16", "--micro-batch-size", "1", "--format",
                     "json")  # fmt: skip
        assert result.code == 0, result.err
        totals.append(json.loads(result.out)["stages"][0]["activations"]["total"])
    assert totals[0] - totals[1] == GDN_EXTRA_ACTIVATIONS[VERSION]


@gpt_only
def test_diff_shows_gdn_layers_split_over_tp(cli, tmp_path):
    one, two = tmp_path / "tp1.csv", tmp_path / "tp2.csv"
    assert cli("params", *GPT, "-o", str(one)).code == 0
    assert cli("params", *GPT, "--tp", "2", "-o", str(two)).code == 0
    result = cli("diff", str(one), str(two))
    assert result.code == 1  # the tables differ
    assert ("decoder.layers.*.self_attention.in_proj.weight (3 params, layers 0-2): (784, 256) -> "
            "(392, 256)") in result.out  # fmt: skip
    assert "conv1d.weight (3 params, layers 0-2): (512, 1, 4) -> (256, 1, 4)" in result.out


@hybrid_only
def test_hybrid_g_layers_run_and_count_megatron_lm_hybrid_flops(cli):
    result = cli("memory", *HYBRID, "--is-hybrid-model", "--bf16", "--micro-batch-size", "1",
                 "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["stages"][0]["activations"]["source"] == "engine"
    # Megatron-LM training.py hybrid_flops (core_v0.19.0), forward x 3, by hand: 128 tokens, h 256
    # `gdn_layer_flops` 2 T (in proj + conv + rule + out proj) for each G, `attn_layer_flops`
    # 4 T h (h + h g/a + s/2), `mlp_layer_flops` 4 (f/h) 1.5 T h^2 (SwiGLU), logits 2 T h v
    tokens, h = 128, 256
    gdn = 2 * tokens * (256 * 784 + 4 * 512 + 8 * 32**2 * 4 + 256 * 256)
    attention = 4 * tokens * h * (h + h + 128 / 2)
    mlp = 4 * (640 / h) * 1.5 * tokens * h**2
    logits = 2 * tokens * h * 1024
    assert report["iteration_flops"] == round(3 * (2 * gdn + attention + mlp + logits))
    workload = cli("workload", *HYBRID, "--tp", "2", "--bf16", "--micro-batch-size", "1",
                   "--stage", "0", "--gpu", "h100")  # fmt: skip
    assert workload.code == 0, workload.err
    names = [line.split("\t")[0] for line in workload.out.splitlines()[2:]]
    assert names.count("gdn_layer") == 2 and names.count("attention_layer") == 1
