"""--moe-expert-rank-capacity-factor: HybridEP's static budget of permuted tokens a rank,
computed by megatron-core 0.18+'s own `_HybridEPManager.setup_metadata` in `memory`, and its
refusals.

By hand from megatron-core 0.19.2 token_dispatcher.py 1090-1102: budget = int(tokens x topk x
factor) rounded up to `get_align_size_for_quantization` (256 with the op fuser, moe_utils.py
1407); HybridEP (DeepEP hybrid-ep deep_ep/hybrid_ep_buffer.py `dispatch_with_permute`) returns a
[budget, hidden] buffer with the real tokens per expert, and Transformer Engine 2.14's basic
GroupedLinear (ops/basic/grouped_linear.py `torch.split(x, split_sizes_int)`) needs them to fill it.
"""

from __future__ import annotations

import pytest

from inspector.inputs.versions import OP_FUSER_RELEASES, megatron_core_version, within

HAS_BUDGET = within(OP_FUSER_RELEASES, megatron_core_version())
needs_budget = pytest.mark.skipif(not HAS_BUDGET, reason="megatron-core 0.18 added the budget")
# qwen3-30b-a3b: sequence 4096, top-8; micro-batch 1, tp 1: 4096 tokens a rank
JOB = ("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16", "--ep", "8", "--dp", "8",
       "--micro-batch-size", "1", "--use-transformer-engine-op-fuser", "--moe-token-dispatcher-type",
       "flex", "--moe-flex-dispatcher-backend", "hybridep")  # fmt: skip


@needs_budget
def test_a_budget_of_what_balanced_routing_sends_runs_as_the_dynamic_buffers(cli):
    # factor 1: int(4096 x 8 x 1) = 32,768 rows, a multiple of 256: the fixed buffer holds what
    # balanced routing sends, so megatron allocates what the dynamic (CPU-synced) size gives
    plain, budget = cli(*JOB), cli(*JOB, "--moe-expert-rank-capacity-factor", "1.0")
    assert plain.code == budget.code == 0, budget.err
    assert budget.out == plain.out and "HybridEP" in plain.out


@needs_budget
def test_a_larger_budget_reaches_te_s_split_as_on_a_gpu(cli):
    # factor 1.5: int(4096 x 8 x 1.5) = 49,152 rows (a multiple of 256), 32,768 of them tokens:
    # TE 2.14's basic GroupedLinear splits the rows by the tokens per expert and torch refuses
    done = cli(*JOB, "--moe-expert-rank-capacity-factor", "1.5")
    assert done.code == 2 and done.out == ""
    error = done.err.splitlines()[-1]
    assert "split_sizes to sum exactly to 49152" in error, error
    assert "[2048, 2048" in error  # 4096 x 8 / 128 experts x 8 ranks a local expert


@pytest.mark.parametrize(
    "extra, start",
    [
        (("--moe-expert-rank-capacity-factor", "0.5"), "--moe-expert-rank-capacity-factor 0.5 below 1 is not modelled"),
        (("--moe-expert-rank-capacity-factor", "1.5", "--moe-flex-dispatcher-backend", "deepep"),
         "--moe-expert-rank-capacity-factor needs --moe-token-dispatcher-type flex with"),
    ],  # fmt: skip
    ids=["below-one", "deepep"],
)
@needs_budget
def test_budgets_megatron_or_this_tool_refuses_are_refused_by_name(cli, extra, start):
    done = cli(*JOB, *extra)
    assert done.code == 2 and done.out == ""
    assert done.err.splitlines()[-1].startswith("Error: " + start), done.err


@needs_budget
def test_the_budget_needs_the_op_fuser_as_megatron_says(cli):
    args = [a for a in JOB if a != "--use-transformer-engine-op-fuser"]
    done = cli(*args, "--moe-expert-rank-capacity-factor", "1.0")
    assert done.code == 2
    assert "requires use_transformer_engine_op_fuser to be enabled" in done.err.splitlines()[-1]
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(ValueError, match="requires use_transformer_engine_op_fuser"):
        TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                          moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                          moe_expert_rank_capacity_factor=1.0)  # fmt: skip


@pytest.mark.skipif(HAS_BUDGET, reason="megatron-core 0.18+ model the budget")
def test_memory_refuses_the_budget_before_megatron_core_0_18(cli):
    done = cli(*JOB[:12], "--moe-expert-rank-capacity-factor", "1.0")
    assert done.code == 2 and done.out == ""
    assert "--moe-expert-rank-capacity-factor is not modelled: megatron-core 0.13-0.17 have no " \
        "static per-rank budget" in done.err.splitlines()[-1], done.err


@needs_budget
def test_plan_keeps_the_budget_and_prints_its_flag(cli):
    args = [a for a in JOB[1:] if a not in ("--ep", "8", "--dp", "--micro-batch-size", "1")]
    done = cli("plan", *args, "--gpus", "8", "--global-batch-size", "64", "--gpu", "h100",
               "--moe-expert-rank-capacity-factor", "1.0")  # fmt: skip
    assert done.code == 0, done.err
    assert "--moe-expert-rank-capacity-factor 1 \\" in done.out
