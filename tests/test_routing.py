"""Megatron-LM's routing flags that change what a GPU moves or computes (issue #29): node-limited
routing (`--moe-router-num-groups`, `--moe-router-group-topk`) and the router's padding for fp8
(`--moe-router-padding-for-fp8`, 0.16's `--moe-router-padding-for-quantization`)."""

from __future__ import annotations

import pytest

from inspector.inputs.presets import PRESETS

SMALL = "--hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 1000 --num-layers 2".split()
MOE = SMALL + "--num-experts 8 --moe-ffn-hidden-size 32 --disable-bias-linear".split()


# ---- node-limited routing: megatron-core's TransformerConfig checks, each as an Error: line ----


@pytest.mark.parametrize(("extra", "message"), [
    # TransformerConfig.__post_init__: "When using group limited routing, moe_router_num_groups
    # must be specified."
    ("--moe-router-group-topk 2", "--moe-router-group-topk 2 needs --moe-router-num-groups "
     "(megatron-core's TransformerConfig: 'When using group limited routing, "
     "moe_router_num_groups must be specified.')"),
    # assert num_moe_experts % moe_router_num_groups == 0
    ("--moe-router-num-groups 3 --moe-router-group-topk 2", "--num-experts 8 is not divisible by "
     "--moe-router-num-groups 3 (8 % 3 = 2; megatron-core's TransformerConfig asserts it)"),
    # assert moe_router_group_topk <= moe_router_num_groups
    ("--moe-router-num-groups 4 --moe-router-group-topk 5", "--moe-router-group-topk 5 is larger "
     "than --moe-router-num-groups 4 (megatron-core's TransformerConfig asserts "
     "moe_router_group_topk <= moe_router_num_groups)"),
    # ours: top-2 from 1 group of 8 / 8 = 1 expert would take a masked (-inf) expert
    ("--moe-router-num-groups 8 --moe-router-group-topk 1", "--moe-router-topk 2 is more than the "
     "experts of the --moe-router-group-topk 1 groups a token picks (1 x 8 / 8 = 1): megatron's "
     "group-limited top-k would pick experts outside them, which is not modelled"),
    ("--moe-router-num-groups 0 --moe-router-group-topk 1",
     "--moe-router-num-groups must be at least 1, got 0"),
])  # fmt: skip
def test_group_limited_routing_refusals(cli, extra: str, message: str) -> None:
    result = cli("params", *MOE, *extra.split())
    assert (result.code, result.err) == (2, f"Error: {message}\n")


def test_group_flags_need_experts(cli) -> None:
    # TransformerConfig would take num_moe_experts None % groups: a TypeError, not a job
    result = cli("params", *SMALL, "--moe-router-num-groups", "2", "--moe-router-group-topk", "1")
    assert (result.code, result.err) == (2, "Error: --moe-router-num-groups needs --num-experts\n")


def test_groups_without_a_group_topk_route_every_expert(cli) -> None:
    # moe_utils.py _compute_topk takes the group path only `if group_topk`: megatron accepts the
    # groups alone (no divisibility check either) and routes over every expert
    result = cli("params", *MOE, "--moe-router-num-groups", "3")
    assert result.code == 0, result.err


def test_deepseek_v3_preset_routes_within_4_of_8_groups() -> None:
    # HF deepseek-ai/DeepSeek-V3 config.json n_group 8, topk_group 4; Megatron-LM's
    # examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh --moe-router-group-topk 4
    # --moe-router-num-groups 8; Megatron-Bridge maps n_group/topk_group to them
    args = PRESETS["deepseek-v3"].args
    assert (args["moe_router_num_groups"], args["moe_router_group_topk"]) == (8, 4)
