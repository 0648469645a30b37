"""Hybrid (Mamba) models: megatron-core's MambaModel built from Megatron-LM's hybrid flags."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest

from inspector.inputs.versions import megatron_core_version
from inspector.job.versions import hybrid_gdn_layers, hybrid_moe_layers
from tests.counting import parameter_count

SMALL = ("--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--vocab-size", "1000")  # fmt: skip


def _params(cli, *args: str) -> list[dict]:
    result = cli("params", "--format", "json", *args)
    assert result.code == 0, result.err
    return json.loads(result.out)["parameters"]


def test_attention_and_mlp_pattern_builds_gpt_parameters(cli):
    # `*-` twice: megatron's MambaStack builds attention-only and MLP-only layers; GPTModel (the
    # same Transformer Engine modules) holds each pair in one layer. Same tensors, same shapes.
    hybrid = _params(cli, *SMALL, "--hybrid-override-pattern", "*-*-")
    gpt = _params(cli, *SMALL, "--num-layers", "2", "--transformer-impl", "transformer_engine")

    def gpt_name(name: str) -> str:
        match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if match:
            return f"decoder.layers.{int(match.group(1)) // 2}.{match.group(2)}"
        return name.replace("decoder.final_norm.", "decoder.final_layernorm.")

    mapped = sorted((gpt_name(r["name"]), tuple(r["shape"])) for r in hybrid)
    assert mapped == sorted((r["name"], tuple(r["shape"])) for r in gpt)


def test_gpt_job_stays_gpt(cli):
    result = cli("tree", *SMALL)
    assert result.code == 0 and result.out.startswith("Module: GPTModel\n")


def test_mamba_layers_hand_count_with_tp_and_stages(cli):
    # hidden 256: d_inner 512, 8 heads of 64, 8 groups of state 128; tp 2 halves heads and groups
    rows = _params(cli, *SMALL, "--hybrid-override-pattern", "M*M-", "--tp", "2", "--pp", "2")
    shapes = {r["name"]: (r["stage"], tuple(r["shape"])) for r in rows}
    conv = 512 // 2 + 2 * (8 // 2) * 128  # x, B, C of this rank: 1280 channels
    assert shapes["decoder.layers.0.mixer.in_proj.weight"] == (0, (conv + 256 + 4, 256))
    # megatron-core 0.19 keeps the convolution's weight as the mixer's own `conv1d_weight`
    conv1d = shapes.get("decoder.layers.0.mixer.conv1d.weight") or shapes.get(
        "decoder.layers.0.mixer.conv1d_weight"
    )
    assert conv1d == (0, (conv, 1, 4))
    assert shapes["decoder.layers.2.mixer.A_log"] == (1, (4,))
    assert shapes["decoder.layers.2.mixer.norm.weight"] == (1, (256,))
    assert shapes["decoder.layers.3.mlp.linear_fc2.weight"][0] == 1
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in shapes
    args = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "vocab_size": 1000,
            "normalization": "RMSNorm", "disable_bias_linear": True,
            "hybrid_override_pattern": "M*M-", "seq_length": 1024}  # fmt: skip
    total = sum(math.prod(r["global_shape"]) for r in rows if not r["tied"])
    assert total == parameter_count(args, tp=2)


def test_triton_stand_in_leaves_with_the_import(cli):
    _params(cli, *SMALL, "--hybrid-override-pattern", "M*M-")
    # megatron's other `import triton` still find none (or the real one, where it is installed)
    triton = sys.modules.get("triton")
    assert triton is None or getattr(triton, "__file__", None) is not None


def test_gated_norm_registers_like_mamba_ssm():
    import torch

    from inspector.world.setup import megatron

    megatron()
    from mamba_ssm.ops.triton.layernorm_gated import RMSNorm

    norm = RMSNorm(12, group_size=4, norm_before_gate=False, device="meta")
    assert [name for name, _ in norm.named_parameters()] == ["weight"]
    assert norm.weight.shape == (12,) and norm.bias is None and norm.group_size == 4
    assert RMSNorm(3).weight.eq(torch.ones(3)).all()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        # a symbol no megatron-core's allocate_layers knows
        (("--hybrid-override-pattern", "M*x-"), "--hybrid-override-pattern M*x-: x is not a layer "
         "symbol of this megatron-core (M Mamba, * attention, - MLP"
         + (", E MoE" if hybrid_moe_layers() else "")
         + (", G gated delta net" if hybrid_gdn_layers() else "")
         + (", D DeepSeek sparse attention" if megatron_core_version() >= (0, 18) else "") + ")"),
        # one symbol per layer
        (("--hybrid-override-pattern", "M*"), "--hybrid-override-pattern has 2 layers but "
         "--num-layers is 4; megatron-core needs one symbol per layer"),
        # MoE layers need experts
        (("--hybrid-override-pattern", "M*ME"), "--hybrid-override-pattern has MoE layers (E): "
         "they need --num-experts" if hybrid_moe_layers() else "--hybrid-override-pattern M*ME: "
         "E is not a layer symbol of this megatron-core"),
        # MambaMixer asserts heads divide by tp: 8 heads on 16 ranks
        (("--hybrid-override-pattern", "M*M-", "--tp", "16", "--num-attention-heads", "16"),
         "Mamba heads 8 is not divisible by --tp 16 (8 % 16 = 8)"),
        # megatron's mamba_stack_spec is Transformer Engine's
        (("--hybrid-override-pattern", "M*M-", "--transformer-impl", "local"),
         "--transformer-impl local cannot build a hybrid model"),
        # megatron refuses virtual stages without the pattern's '|' segments
        (("--hybrid-override-pattern", "M*M-", "--pp", "2",
          "--num-layers-per-virtual-pipeline-stage", "1"),
         "a hybrid model without '|' in its --hybrid-layer-pattern cannot be interleaved"),
    ],
)
def test_bad_hybrid_arguments(cli, args, error):
    result = cli("params", *SMALL, *args)
    assert result.code == 2 and result.err.startswith(f"Error: {error}"), result.err


def test_plan_searches_a_hybrid_model_and_names_its_estimate(cli):
    # tests/test_plan_hybrid.py checks what it prices; here: the table and the scan's note
    result = cli("plan", *SMALL, "--hybrid-override-pattern", "M*M-", "--micro-batch-size", "1",
                 "--gpus", "8", "--global-batch-size", "8", "--top", "1")  # fmt: skip
    assert result.code == 0, result.err
    assert "\n1    tp" in result.out
    assert "Note: Mamba layers: the chunked scan of Mamba-2 has no measured kernel here" in result.out


def test_memory_runs_mamba_layers_and_counts_megatron_lm_hybrid_flops(cli):
    result = cli("memory", *SMALL, "--hybrid-override-pattern", "M*M-", "--is-hybrid-model",
                 "--bf16", "--seq-length", "512", "--micro-batch-size", "1", "--format", "json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    mamba, attention, mlp, logits = small_hybrid_flops()
    assert report["iteration_flops"] == round(3 * (2 * mamba + attention + mlp + logits))
    activations = report["stages"][0]["activations"]
    assert activations["source"] == "engine", activations  # megatron's own forward and backward
    assert "MambaSplitConv1dScanCombinedFn" in activations["moment"]


def small_hybrid_flops() -> tuple[float, float, float, float]:
    """Return Megatron-LM's forward FLOPs (training.py hybrid_flops) of SMALL's Mamba, attention
    and MLP layers and of its logits, by hand: B 1, s 512, h 256, 8 heads, vocab 1024 (1000
    padded to 128), ffn 1024, Mamba d_in 512, 8 groups of state 128, 8 heads."""
    tokens, h = 512, 256
    mamba = (2 * tokens * h * (2 * 512 + 2 * 8 * 128 + 8) + 7 * tokens * 512 * 128
             + 2 * tokens * 512 * h)  # fmt: skip
    return mamba, 4 * tokens * h * 1 * (h + h + 512 / 2), 4 * 4 * tokens * h**2, 2 * tokens * h * 1024


def test_split_scan_saves_what_the_kernel_saves():
    # ssd_combined.py MambaSplitConv1dScanCombinedFn.forward: save_for_backward(zxbcdt,
    # conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, ...) with out_x the ungated (b, s, h, p)
    import torch

    from inspector.world.ssm.kernels import LayerNormFn, mamba_split_conv1d_scan_combined

    b, s, h, p, g, n = 2, 256, 8, 64, 2, 16
    meta = {"device": "meta"}
    zxbcdt = torch.empty(b, s, 2 * h * p + 2 * g * n + h, dtype=torch.bfloat16, requires_grad=True,
                         **meta)  # fmt: skip
    weight = torch.empty(h * p + 2 * g * n, 4, dtype=torch.bfloat16, requires_grad=True, **meta)
    bias = torch.empty(h * p + 2 * g * n, dtype=torch.bfloat16, requires_grad=True, **meta)
    heads = [torch.empty(h, requires_grad=True, **meta) for _ in range(3)]  # dt_bias, A, D
    out = mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, *heads, chunk_size=128,
                                           headdim=p, ngroups=g)  # fmt: skip
    assert out.shape == (b, s, h * p) and out.dtype == torch.bfloat16
    saved = [tuple(t.shape) for t in out.grad_fn.saved_tensors]
    assert saved == [(b, s, 2 * h * p + 2 * g * n + h), (h * p + 2 * g * n, 4), (h * p + 2 * g * n,),
                     (b, s, h, p), (h,), (h,), (h,)]  # fmt: skip
    # layernorm_gated.py LayerNormFn: saves x (rows, d), weight, and an fp32 rstd per row and group
    weight_norm = torch.empty(h * p, dtype=torch.bfloat16, requires_grad=True, **meta)
    y = LayerNormFn.apply(out, weight_norm, h * p // g)
    saved = [(tuple(t.shape), t.dtype) for t in y.grad_fn.saved_tensors]
    assert saved == [((b * s, h * p), torch.bfloat16), ((h * p,), torch.bfloat16),
                     ((g * b * s,), torch.float32)]  # fmt: skip
    y.sum().backward()
    assert zxbcdt.grad.shape == zxbcdt.shape and weight.grad.dtype == torch.bfloat16


# Megatron-LM's examples/mamba/train.sh (core_v0.16.1), its model arguments as written: ratios,
# no pattern, the layer spec pretrain_mamba.py needs
MAMBA_EXAMPLE = (
    "torchrun --nproc_per_node 8 ../../pretrain_mamba.py --tensor-model-parallel-size 1 "
    "--sequence-parallel --pipeline-model-parallel-size 1 --use-distributed-optimizer "
    "--untie-embeddings-and-output-weights --position-embedding-type none --num-layers 48 "
    "--hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 8 "
    "--hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 4 --global-batch-size 32 "
    "--disable-bias-linear --normalization RMSNorm --bf16 --use-mcore-models {spec} "
    "--vocab-size 32000\n"
)
SPEC = "--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec"


def test_pretrain_mamba_example_is_read_as_written(cli, tmp_path):
    path = tmp_path / "train.sh"
    path.write_text(MAMBA_EXAMPLE.format(spec=SPEC))
    result = cli("tree", "--from-script", str(path))
    assert result.code == 0, result.err
    assert result.out.startswith(("Module: MambaModel\n", "Module: HybridModel\n"))  # 0.18+
    # megatron's allocate_layers: 48 layers, round(0.08 x 48) = 4 attention, 24 MLP, 20 Mamba
    kinds = re.findall(r"Submodule: \d+ \((\w+)\)", result.out)
    assert (kinds.count("TransformerLayer"), kinds.count("MLPLayer"), kinds.count("MambaLayer")) == (
        4, 24, 20)  # fmt: skip


def test_pretrain_mamba_needs_its_spec(cli, tmp_path):
    # mamba_builders.py: "You must provide a valid Mamba layer spec via --spec"
    path = tmp_path / "train.sh"
    path.write_text(MAMBA_EXAMPLE.format(spec=""))
    result = cli("tree", "--from-script", str(path))
    assert result.code == 2 and "pretrain_mamba.py needs --spec" in result.err, result.err


# Nemotron-H 8B's Hugging Face config.json as its keys are spelled (NemotronHForCausalLM)
NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "attention_bias": False,
    "attention_head_dim": 128, "chunk_size": 128, "conv_kernel": 4, "expand": 2,
    "hidden_act": "relu2", "hidden_size": 4096,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "intermediate_size": 21504, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_num_heads": 128, "mamba_proj_bias": False, "max_position_embeddings": 8192,
    "mlp_bias": False, "n_groups": 8, "num_attention_heads": 32, "num_hidden_layers": 52,
    "num_key_value_heads": 8, "residual_in_fp32": False, "ssm_state_size": 128,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_bias": False,
    "use_conv_bias": True, "vocab_size": 131072,
}  # fmt: skip


def test_nemotron_h_hf_config_builds_its_pattern(cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NEMOTRON_H_8B))
    rows = _params(cli, "--hf-config", str(path))
    assert sum(1 for r in rows if r["name"].endswith("mixer.A_log")) == 24  # 24 M in the pattern
    args = {"num_layers": 52, "hidden_size": 4096, "num_attention_heads": 32,
            "group_query_attention": True, "num_query_groups": 8, "kv_channels": 128,
            "ffn_hidden_size": 21504, "vocab_size": 131072, "normalization": "RMSNorm",
            "disable_bias_linear": True, "position_embedding_type": "none",
            "untie_embeddings_and_output_weights": True, "mamba_num_heads": 128,
            "hybrid_override_pattern": NEMOTRON_H_8B["hybrid_override_pattern"]}  # fmt: skip
    assert sum(math.prod(r["global_shape"]) for r in rows) == parameter_count(args)


def test_nemotron_h_hf_config_other_convolution_is_refused(cli, tmp_path):
    # megatron-core's MambaMixer convolves over 4 positions whatever the config says
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**NEMOTRON_H_8B, "conv_kernel": 3}))
    result = cli("params", "--hf-config", str(path))
    assert result.code == 2
    assert "\"conv_kernel\": 3 is not modelled: megatron-core's MambaMixer builds conv_kernel 4" in (
        result.err)  # fmt: skip


def test_job_line_says_the_stack(cli):
    result = cli("params", *SMALL, "--hybrid-override-pattern", "M*M-", "--format", "table")
    assert result.code == 0, result.err
    assert result.out.startswith(
        "Job: gpt2-small (4 layers, hidden 256, hybrid: 2 Mamba, 1 attention, 1 MLP), fp32,"
    ), result.out.splitlines()[0]


def test_pretrain_gpt_with_a_hybrid_pattern_is_refused(cli, tmp_path):
    # gpt_builders.py builds GPTModel whatever the hybrid arguments say: never a hybrid table
    path = tmp_path / "train.sh"
    path.write_text(MAMBA_EXAMPLE.format(spec="").replace("pretrain_mamba.py", "pretrain_gpt.py"))
    result = cli("params", "--from-script", str(path))
    assert result.code == 2
    assert "pretrain_gpt.py builds GPTModel whatever --hybrid-attention-ratio, " in result.err


def test_train_rl_builds_hybrid_with_is_hybrid_model(cli, tmp_path):
    # train_rl.py `_model_builder`: mamba_builder when --is-hybrid-model, else gpt_builder
    script = MAMBA_EXAMPLE.format(spec=SPEC).replace("../../pretrain_mamba.py", "train_rl.py")
    path = tmp_path / "train.sh"
    path.write_text(script)
    assert "train_rl.py builds GPTModel whatever" in cli("tree", "--from-script", str(path)).err
    path.write_text(script.replace("--bf16", "--bf16 --is-hybrid-model"))
    result = cli("tree", "--from-script", str(path))
    assert result.code == 0 and "(MambaLayer)" in result.out, result.err


def test_hybrid_stack_spec_is_the_mamba_spec_from_0_18(cli, tmp_path):
    # pretrain_hybrid.py's functional tests name megatron-core 0.18+'s home of the spec
    # (models/hybrid/hybrid_layer_specs.py `mamba_stack_spec = hybrid_stack_spec`)
    path = tmp_path / "train.sh"
    spec = "--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec"
    path.write_text(MAMBA_EXAMPLE.format(spec=spec))
    result = cli("params", "--from-script", str(path))
    if megatron_core_version() >= (0, 18):
        assert result.code == 0, result.err
        import megatron.core.models.hybrid.hybrid_layer_specs as specs

        assert specs.hybrid_stack_spec is specs.mamba_stack_spec
    else:  # no models/hybrid to import it from
        assert result.code == 2
        assert "hybrid_stack_spec is not modelled" in result.err
