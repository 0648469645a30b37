"""`plan` for DeepSeek sparse attention (DSA) models (megatron-core 0.18+): each DSA layer's
closed-form bytes against the engine's, its kernels priced, the plans `memory` measures."""

from __future__ import annotations

import pytest

from inspector.job.dsa import DSA_BUILT_SINCE
from inspector.job.versions import megatron_version
from tests.test_plan_hybrid import MODEL, SMALL, assert_memory_measures_the_plans

VERSION = megatron_version()
builds = pytest.mark.skipif(VERSION < DSA_BUILT_SINCE, reason="megatron-core 0.18+ builds DSA")
# a small DSA layer: MLA (latents 192 and 64, heads of 16 + 8) and an indexer of 8 heads of 32
SIZES = dict(multi_latent_attention=True, q_lora_rank=192, kv_lora_rank=64, qk_head_dim=16,
             qk_pos_emb_head_dim=8, v_head_dim=16, dsa_indexer_n_heads=8, dsa_indexer_head_dim=32,
             dsa_indexer_topk=64, transformer_impl="transformer_engine", no_rope_fusion=True,
             dsa_indexer_loss_coeff=0.01)  # fmt: skip
FLAGS = ("--q-lora-rank", "192", "--kv-lora-rank", "64", "--qk-head-dim", "16",
         "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--dsa-indexer-n-heads", "8",
         "--dsa-indexer-head-dim", "32", "--dsa-indexer-topk", "64", "--dsa-indexer-loss-coeff",
         "0.01", "--transformer-impl", "transformer_engine")  # fmt: skip


def _job(pattern: str, **flags):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    args = {**SMALL, **SIZES, "num_layers": len(pattern), "hybrid_override_pattern": pattern, **flags}
    return make_job(merge_sources(Sources(flags=args), ("model", "layout", "training")).args)


@pytest.mark.slow
@builds
@pytest.mark.parametrize("flags", [{}, {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                                   {"seq_length": 2048, "max_position_embeddings": 2048},
                                   {"dsa_indexer_loss_coeff": None}],
                         ids=["tp1", "tp2 sp", "s2048", "no indexer loss"])  # fmt: skip
def test_a_dsa_layer_keeps_about_what_the_engine_measures(flags) -> None:
    # a D layer's bytes kept for backward: the net of its segment of megatron's forward on fake
    # tensors, against the planner's closed form (memory/closed/dsa.py). The s^2 terms are
    # counted exactly; small per-token temporaries of the indexer and absorbed MLA are left
    # out: under 1% at s = 1024 (the s^2 terms grow past them with the sequence)
    from inspector.memory.closed.activations import layer_activations
    from inspector.memory.engine.compose import cut
    from inspector.memory.engine.stage import trace_stage
    from inspector.plan.price import job_dims

    if VERSION < (0, 19) and flags.get("dsa_indexer_loss_coeff", 1) is None:
        pytest.skip("megatron-core 0.18 fails without the loss coefficient (kl_div * None)")
    job = _job("D-D-D-", **flags)
    segments = cut(trace_stage(job, 0)[0].forward, 6).layers
    measured = sum(step[0] for step in segments[2])
    formed = layer_activations(job_dims(job), job.layout, 2, 1, "none", True).total
    assert abs(measured - formed) < 0.01 * measured, (measured, formed)


@builds
def test_a_dsa_layer_is_priced_by_its_indexer_and_masked_attention() -> None:
    from inspector.formulas.kernels import Gemm
    from inspector.formulas.ops import Shard
    from inspector.plan.hybrid import hybrid_kernels
    from inspector.plan.price import job_dims

    dims = job_dims(_job("D-"))
    ops = hybrid_kernels(dims, Shard(tp=1, micro_batch=1), "D")
    names = [op.name for op in ops.forward]
    assert names.index("indexer scores (fp32)") < names.index("DSA Q K^T (fp32)") < names.index(
        "attention output")  # fmt: skip
    scores = next(op for op in ops.forward if op.name == "DSA Q K^T (fp32)")
    # every score of the sequence, in fp32, for each of the 8 heads (megatron's PyTorch path)
    assert isinstance(scores, Gemm) and scores.fp32 and (scores.m, scores.n, scores.batch) == (1024, 1024, 8)


@pytest.mark.slow
@builds
@pytest.mark.parametrize("extra", [("--hybrid-override-pattern", "D-D-D-D-", "--num-layers", "8"),
                                   ("--multi-latent-attention", "--experimental-attention-variant",
                                    "dsa", "--num-layers", "4")],
                         ids=["hybrid D", "GPT dsa"])  # fmt: skip
def test_memory_measures_the_plans_plan_prints(extra) -> None:
    found = assert_memory_measures_the_plans((*MODEL, *FLAGS, "--no-rope-fusion", *extra))
    assert all(p["layout"]["cp"] == 1 for p in found["plans"])  # megatron refuses DSA with p2p CP


@pytest.mark.skipif(VERSION >= DSA_BUILT_SINCE, reason="megatron-core 0.18+ builds DSA")
def test_plan_names_the_version_without_dsa(cli) -> None:
    result = cli("plan", *MODEL, *FLAGS, "--multi-latent-attention", "--experimental-attention-variant",
                 "dsa", "--num-layers", "4", "--gpus", "8", "--global-batch-size", "16")  # fmt: skip
    assert result.code == 2 and "--experimental-attention-variant dsa: megatron-core 0." in result.err


@builds
def test_efficiency_is_refused_for_dsa_by_name(cli) -> None:
    # --efficiency prices Megatron-LM's FLOPs, which count no indexer (and no hybrid D layer):
    # a D layer would take no time at all
    result = cli("plan", *MODEL, *FLAGS, "--no-rope-fusion", "--hybrid-override-pattern", "D-D-",
                 "--num-layers", "4", "--gpus", "8", "--global-batch-size", "16", "--efficiency",
                 "0.5")  # fmt: skip
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("Error: --efficiency 0.5 prices Megatron-LM's FLOPs"), result.err
