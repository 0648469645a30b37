"""LatentMoE (--moe-latent-size): megatron-core 0.16+ builds the routed experts on the latent width
between fc1_latent_proj (h -> latent) and fc2_latent_proj (latent -> h), moe_layer.py; router and
shared expert stay on h. `tree`, `params` and `memory` run megatron's own build; `plan` and
`workload` refuse it by name."""

from __future__ import annotations

import json
import math

import pytest

from inspector.job.versions import LATENT_MOE_SINCE, megatron_version

H, LATENT, EXPERTS, FFN, LAYERS = 256, 64, 8, 128, 2
ARGS = ("--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "1024",
        "--num-experts", str(EXPERTS), "--moe-router-topk", "2", "--ffn-hidden-size", "512",
        "--moe-ffn-hidden-size", str(FFN), "--moe-latent-size", str(LATENT))  # fmt: skip
BUILDS = megatron_version() >= LATENT_MOE_SINCE
needs_latent = pytest.mark.skipif(not BUILDS, reason="LatentMoE needs megatron-core 0.16")


def _mlp_counts(cli, *extra: str) -> dict[str, int]:
    result = cli("params", *ARGS, *extra, "--format", "json")
    assert result.code == 0, result.err
    counts: dict[str, int] = {}
    for row in json.loads(result.out)["parameters"]:
        if ".mlp." in row["name"]:
            part = row["name"].split(".mlp.")[1].split(".")[0]
            counts[part] = counts.get(part, 0) + math.prod(row["global_shape"])
    return counts


@needs_latent
def test_megatron_builds_the_experts_on_the_latent_width(cli):
    # by hand, per layer (biases on: Megatron-LM's default --add-bias-linear): the router e x h
    # plus e; each projection h x latent plus its bias (latent in, h out); each expert's fc1
    # latent -> ffn and fc2 ffn -> latent with their biases
    assert _mlp_counts(cli) == {
        "router": LAYERS * (EXPERTS * H + EXPERTS),
        "fc1_latent_proj": LAYERS * (H * LATENT + LATENT),
        "fc2_latent_proj": LAYERS * (LATENT * H + H),
        "experts": LAYERS * EXPERTS * (LATENT * FFN + FFN + FFN * LATENT + LATENT),
    }


@needs_latent
def test_memory_runs_megatron_s_latent_forward_and_backward(cli):
    args = (*ARGS, "--swiglu", "--disable-bias-linear", "--micro-batch-size", "1",
            "--global-batch-size", "8")  # fmt: skip
    latent = cli("memory", *args, "--format", "json")
    assert latent.code == 0, latent.err
    stages = json.loads(latent.out)["stages"]
    # the experts on the 64-wide latent instead of the 256-wide hidden size: 2 layers x 8 experts
    # x 3 x 128 x (256 - 64) fewer weights, 2 x 2 x 256 x 64 more for the projections
    assert stages[0]["parameters"] == 2_398_720 - 2 * 8 * 3 * 128 * (256 - 64) + 2 * 2 * 256 * 64
    # Megatron-LM's throughput formula (training.py core_v0.16.1): the routed experts' term on the
    # latent width plus 2 x latent for the projections; 7,650,410,496 without a latent size;
    # 6 FLOPs per multiply-add (forward and backward) x 1,024 tokens, top-2, SwiGLU's 3 GEMMs
    per_layer = 6 * 1024 * ((LATENT - H) * FFN * 2 * 3 + 2 * H * LATENT)
    assert json.loads(latent.out)["iteration_flops"] == 7_650_410_496 + LAYERS * per_layer


@needs_latent
def test_hybrid_flops_count_the_latent_experts_as_megatron_lm():
    from inspector.formulas.hybrid_flops import hybrid_layer_flops
    from inspector.job.job import Job
    from inspector.job.model_args import make_model_config

    args = {"num_layers": 2, "hidden_size": H, "num_attention_heads": 4, "num_experts": EXPERTS,
            "moe_router_topk": 2, "moe_ffn_hidden_size": FFN, "hybrid_override_pattern": "ME",
            "transformer_impl": "transformer_engine"}
    plain = make_model_config(args)
    latent = make_model_config({**args, "moe_latent_size": LATENT})
    flops = [hybrid_layer_flops(m, Job(model=m).dims(), "E", 1) for m in (plain, latent)]
    # `moe_layer_flops`, forward x 3: 4 x tokens x (latent instead of h) x ffn x top-k, plus
    # 4 x tokens x h x latent for the projections; 1,024 tokens (Megatron-LM's default length)
    tokens = Job(model=plain).dims().seq_length
    assert flops[1] - flops[0] == 3 * 4 * tokens * ((LATENT - H) * FFN * 2 + H * LATENT)


@pytest.mark.parametrize("command", ["plan", "workload"])
def test_plan_and_workload_refuse_it_by_name(cli, command, tmp_path):
    extra = ("--gpus", "8") if command == "plan" else ("--gpu", "h100", "-o", str(tmp_path / "w"))
    result = cli(command, *ARGS, "--micro-batch-size", "1", "--global-batch-size", "8", *extra)
    assert (result.code, result.out) == (2, "")
    if BUILDS:
        assert result.err == (
            f"Error: {command} does not price --moe-latent-size yet (its latent projections and "
            "the dispatcher's smaller volume); tree, params, diff and memory build and run it\n"
        )
    assert not (tmp_path / "w").exists()


def test_versions_without_it_refuse_it(cli):
    result = cli("tree", *ARGS)
    if BUILDS:
        assert result.code == 0, result.err
        return
    version = ".".join(map(str, megatron_version()))
    assert (result.code, result.err) == (2, (
        "Error: --moe-latent-size needs megatron-core 0.16 or newer (LatentMoE's projections, "
        f"moe_layer.py): {version} has no moe_latent_size\n"))  # fmt: skip
