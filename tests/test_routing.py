"""Megatron-LM's routing flags that change what a GPU moves or computes (issue #29): node-limited
routing (`--moe-router-num-groups`, `--moe-router-group-topk`) and the router's padding for fp8
(`--moe-router-padding-for-fp8`, 0.16's `--moe-router-padding-for-quantization`)."""

from __future__ import annotations

import json
from fractions import Fraction
from itertools import combinations
from math import comb

import megatron.core
import pytest

from inspector.inputs.presets import PRESETS
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS
from inspector.plan.flex import block_hit, expected_remote_nodes, sender_copies, token_copies
from tests.conftest import run_cli
from tests.test_versions import EXPERTS_PAD_AFTER_ROUTER_PADS

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])

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


# ---- node-limited routing in the flex dispatcher's price (plan/flex.py) ----


def _routes(experts: int, topk: int, groups: int, group_topk: int):
    """Every (top-k, weight) a balanced group-limited router gives: a uniform M-subset of the
    groups of E/G consecutive experts (moe_utils.py group_limited_topk's view(num_groups, -1)),
    then a uniform k-subset of their experts."""
    size = experts // groups
    for chosen in combinations(range(groups), group_topk):
        pool = [g * size + i for g in chosen for i in range(size)]
        picks = list(combinations(pool, topk))
        for pick in picks:
            yield pick, Fraction(1, comb(groups, group_topk) * len(picks))


def _brute_senders(experts, topk, ep, etp, on_node, groups, group_topk):
    """Each sender (node s, local index i) of the expert-tp x ep group, over every route: rank r
    holds ep index r // etp's experts; an InfiniBand copy per other node hit, an NVLink copy per
    hit rank that is not at local index i (the sender itself, or a node's RDMA receiver)."""
    ranks, per_ep = ep * etp, experts // ep
    routes = list(_routes(experts, topk, groups, group_topk))
    found = set()
    for sender in range(ranks):
        s, i = divmod(sender, on_node)
        inter = intra = Fraction(0)
        for pick, weight in routes:
            hit_ep = {e // per_ep for e in pick}
            hit = [r for r in range(ranks) if r // etp in hit_ep]
            inter += weight * len({r // on_node for r in hit} - {s})
            intra += weight * sum(1 for r in hit if r % on_node != i)
        found.add((round(float(inter), 12), round(float(intra), 12)))
    return tuple(sorted(found))


@pytest.mark.parametrize(("experts", "topk", "ep", "etp", "on_node", "groups", "group_topk"), [
    (8, 2, 4, 1, 2, 2, 1),  # a group a node: the token stays on one node
    (16, 3, 8, 1, 2, 4, 2),  # a group a node, 2 of 4 nodes
    (12, 2, 6, 1, 2, 2, 1),  # 3 nodes, 2 groups: the middle node holds half of each group
    (12, 3, 6, 1, 2, 4, 2),  # 4 groups of 3 over 3 nodes of 4: groups straddle nodes
    (8, 2, 4, 2, 4, 4, 2),  # expert tp 2: both ranks of an expert get the token
    (8, 2, 8, 1, 4, 8, 2),  # device-limited: a group a rank
])  # fmt: skip
def test_sender_copies_match_enumeration(experts, topk, ep, etp, on_node, groups, group_topk):
    want = _brute_senders(experts, topk, ep, etp, on_node, groups, group_topk)
    got = sender_copies(experts, topk, ep, etp, on_node, groups, group_topk)
    assert len(got) == len(want)
    for (gi, ga), (wi, wa) in zip(got, want, strict=True):
        assert (gi, ga) == (pytest.approx(wi, abs=1e-12), pytest.approx(wa, abs=1e-12))


def test_straddled_groups_make_senders_differ():
    # 2 groups of 6 over 3 nodes of 4 experts: a token of group 0 reaches node 0 and maybe
    # node 1; node 1 is hit by either group. A sender on node 1 sends fewer InfiniBand copies.
    got = sender_copies(12, 2, 6, 1, 2, 2, 1)
    assert len(got) == 2 and got[0][0] < got[1][0]
    # node 0: hit iff group 0 (1/2) and not both picks in experts 4-5: 1/2 x (1 - 1/15)
    node0 = Fraction(1, 2) * (1 - Fraction(1, 15))
    node1 = Fraction(1, 2) * (1 - Fraction(comb(4, 2), comb(6, 2))) * 2
    assert block_hit(12, 2, 2, 1, 0, 4) == pytest.approx(float(node0), rel=1e-12)
    assert block_hit(12, 2, 2, 1, 4, 8) == pytest.approx(float(node1), rel=1e-12)
    # a sender on node 0 (or 2): nodes 1 and 2, node 2 holding what node 0 does, mirrored
    assert got[1][0] == pytest.approx(float(node0 + node1), rel=1e-12)


def test_whole_groups_agree_with_expected_remote_nodes():
    # DeepSeek-V3 at ep 64 over 8 nodes: 8 groups of 32 experts, one a node; top-8 of 4 groups
    ((inter, _),) = sender_copies(256, 8, 64, 1, 8, 8, 4)
    assert inter == pytest.approx(expected_remote_nodes(256, 8, 8, 8, 4), rel=1e-12)
    # a token reaches at most its 4 groups' nodes (the sender's own among them half the time:
    # C(7, 3) / C(8, 4)); unlimited, 7 x (1 - C(224, 8) / C(256, 8)) = 4.63 of the 7 others
    assert inter < 4 < token_copies(256, 8, 64, 1, 8)[0]
    # every group open (M = G) is the unlimited price
    assert sender_copies(256, 8, 64, 1, 8, 8, 8)[0] == pytest.approx(token_copies(256, 8, 64, 1, 8))


def test_all_to_all_dispatcher_moves_the_same_bytes_under_node_limits():
    # the all-to-all sends each of a token's k copies to its expert's rank: what each rank (and
    # so each node) receives is k x P(expert picked); under group-limited balanced routing every
    # expert is still picked with chance k / E (enumerated), so network.py's price is unchanged
    experts, topk, groups, group_topk = 12, 3, 4, 2
    marginal = [Fraction(0)] * experts
    for pick, weight in _routes(experts, topk, groups, group_topk):
        for e in pick:
            marginal[e] += weight
    assert marginal == [Fraction(topk, experts)] * experts
    from inspector.job.layout import Layout
    from inspector.plan.flex import moe_exchange
    from inspector.plan.network import Network

    free = ModelDims(2, 256, 8, 512, 1024, num_experts=12, moe_router_topk=3)
    limited = ModelDims(2, 256, 8, 512, 1024, num_experts=12, moe_router_topk=3,
                        moe_router_num_groups=4, moe_router_group_topk=2)  # fmt: skip
    net, lay = Network(GPUS["h100"], 2), Layout(dp=6, ep=6)
    assert moe_exchange(limited, lay, net, 512, False) == moe_exchange(free, lay, net, 512, False) > 0
    assert moe_exchange(limited, lay, net, 512, True) < moe_exchange(free, lay, net, 512, True)


# ---- the router's padding for fp8 in `memory`: megatron's own padding on the routing's values ----

SMALL_MIXTRAL = ("--model", "mixtral-8x7b", "--num-layers", "2", "--hidden-size", "256",
                 "--ffn-hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "8",
                 "--seq-length", "120", "--max-position-embeddings", "128", "--bf16")  # fmt: skip
TINY = ("memory", "--no-cache", *SMALL_MIXTRAL, "--micro-batch-size", "1", "--ep", "2", "--dp", "2", "--global-batch-size", "2",
        "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--moe-grouped-gemm")  # fmt: skip
OLD_DEEPEP = () if VERSION >= (0, 16) else ("--moe-enable-deepep",)


def _expert_rows(monkeypatch, *flags: str, spied: type | None = None) -> list[list[int]]:
    """Run `memory` and return the rows per local expert that TE's Fp8Padding (experts.py
    TEGroupedMLP, fp8), or `spied` (a module taking `m_splits`), is handed, one list per call."""
    from inspector.world.te.kernels import fp8_functions

    seen: list[list[int]] = []
    spied = spied or fp8_functions.Fp8Padding
    forward = spied.forward

    def spy(self, inp, m_splits, *args, **kwargs):
        seen.append(list(m_splits))
        return forward(self, inp, m_splits, *args, **kwargs)

    monkeypatch.setattr(spied, "forward", spy)
    result = run_cli(*TINY, *flags)
    assert result.code == 0, result.err
    return seen


@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_router_padding_hands_the_experts_aligned_rows(monkeypatch, dispatcher: str) -> None:
    # 120 tokens a rank, top-2 of 8 experts: 30 a rank for each expert, 60 for each of a rank's 4
    # experts from the 2 ranks; TE pads them to 64 itself (a copy) ...
    chosen = ("--moe-token-dispatcher-type", dispatcher, *(OLD_DEEPEP if dispatcher == "flex" else ()))
    plain = _expert_rows(monkeypatch, *chosen)
    assert plain and {tuple(rows) for rows in plain} == {(60, 60, 60, 60)}
    # ... unless the dispatcher pads the routing map: the all-to-all's sender pads each
    # expert's 30 to 32 (token_dispatcher.py MoEAlltoAllTokenDispatcher.dispatch_preprocess,
    # moe_utils.py pad_routing_map), DeepEP's receiver its 60 to 64 (_DeepepManager
    # ._pad_routing_map): 64 rows either way, already aligned, so Fp8Padding copies nothing
    padded = _expert_rows(monkeypatch, *chosen, "--moe-router-padding-for-fp8")
    if EXPERTS_PAD_AFTER_ROUTER_PADS:
        assert padded and {tuple(rows) for rows in padded} == {(64, 64, 64, 64)}
    else:  # 0.18 on: the experts skip Fp8Padding when the router pads (skip_routed_expert_padding)
        from inspector.world.te.grouped_linear import GroupedLinear

        assert padded == []
        grouped = _expert_rows(monkeypatch, *chosen, "--moe-router-padding-for-fp8", spied=GroupedLinear)
        assert grouped and {tuple(rows) for rows in grouped} == {(64, 64, 64, 64)}


# megatron-core's TransformerConfig names the field it has: 0.16 turns the fp8 flag into
# moe_router_padding_for_quantization before checking; 0.13-0.15 know moe_router_padding_for_fp8
PAD_FIELD = "moe_router_padding_for_quantization" if VERSION >= (0, 16) else "moe_router_padding_for_fp8"
PAD_FP8 = ("fp8/fp4 must be specified when moe_router_padding_for_quantization is True."
           if VERSION >= (0, 16) else "fp8 must be specified when moe_router_padding_for_fp8 is True.")  # fmt: skip


# 0.16's quantization padding takes fp4 too (moe_utils.py get_align_size_for_quantization)
PAD_FORMATS = "--fp8-format or --fp4-format" if VERSION >= (0, 16) else "--fp8-format"


@pytest.mark.parametrize(("extra", "message"), [
    ("--moe-token-dispatcher-type alltoall", f"--moe-router-padding-for-fp8 needs {PAD_FORMATS} "
     f"(megatron-core's TransformerConfig: '{PAD_FP8}')"),
    ("--fp8-format hybrid --transformer-impl transformer_engine", "--moe-router-padding-for-fp8 "
     "needs --moe-token-dispatcher-type alltoall or flex, not allgather (megatron-core's "
     f"TransformerConfig: 'allgather and alltoall_seq dispatcher does not support {PAD_FIELD}.')"),
])  # fmt: skip
def test_router_padding_refusals(cli, extra: str, message: str) -> None:
    result = cli("memory", *MOE, "--bf16", "--moe-router-padding-for-fp8", *extra.split())
    assert (result.code, result.err) == (2, f"Error: {message}\n")


@pytest.mark.skipif(VERSION < (0, 16), reason="0.13-0.15 pad for fp8 only")
def test_router_padding_for_quantization_takes_fp4(cli) -> None:
    # megatron-core 0.16.1 TransformerConfig: 'fp8/fp4 must be specified ...'; this tool asked
    # for --fp8-format alone (gpt-oss 20B's NVFP4 recipes in Megatron-Bridge were refused)
    flags = ("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4", "--transformer-impl",
             "transformer_engine", "--moe-token-dispatcher-type", "alltoall",
             "--moe-router-padding-for-quantization", "--micro-batch-size", "1")  # fmt: skip
    result = cli("memory", *MOE, *flags)
    assert result.code == 0, result.err


def test_router_padding_needs_experts(cli) -> None:
    result = cli("memory", *SMALL, "--moe-router-padding-for-fp8")
    assert (result.code, result.err) == (
        2, "Error: --moe-router-padding-for-fp8 needs --num-experts (it pads the experts' token counts)\n")


def test_router_padding_for_quantization_is_0_16s_name(cli) -> None:
    flags = ("--bf16", "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine",
             "--moe-token-dispatcher-type", "alltoall", "--moe-router-padding-for-quantization")  # fmt: skip
    result = cli("memory", *MOE, *flags, "--micro-batch-size", "1")
    assert result.code == 0, result.err  # this tool takes either name on every version
    # before 0.16 Megatron-LM has no such argument: a launch script using it gets the note every
    # argument a version lacks gets (inputs/versions.py), and megatron runs moe_router_padding_for_fp8
    from inspector.inputs.versions import argument_unknown_note

    note = argument_unknown_note("--moe-router-padding-for-quantization")
    assert (note is not None and "added in 0.16" in note) is (VERSION < (0, 16))
    assert argument_unknown_note("--moe-router-padding-for-fp8") is None


# ---- the router's padding for fp8 in `plan`'s step time (formulas/ops.py, fp8_ops.py) ----

SEQ, HIDDEN = 512, 256


def _moe_dims(**extra: object) -> ModelDims:
    return ModelDims(2, HIDDEN, 8, SEQ, 1024, num_query_groups=2, swiglu=True, flash_attention=True,
                     num_experts=8, moe_router_topk=2, fp8="hybrid", **extra)  # type: ignore[arg-type]  # fmt: skip


def _ops(dims: ModelDims):
    from inspector.formulas.ops import Shard, layer_ops

    return layer_ops(dims, Shard(ep=2, micro_batch=1), True).forward


def _gemm_rows(ops, name: str) -> int:
    from inspector.formulas.kernels import Gemm

    rows = {op.m for op in ops if isinstance(op, Gemm) and op.name == name}  # one GEMM an expert
    assert len(rows) == 1
    return rows.pop()


def _copy_elements(ops, name: str) -> int:
    from inspector.formulas.kernels import Memory

    (copy,) = [op for op in ops if isinstance(op, Memory) and op.name == name]
    return copy.elements


def test_router_padding_replaces_te_copies_with_its_own_padded_rows():
    # 512 tokens a rank, top-2 of 8 experts, ep 2: a rank sends 512 x 2 / 8 = 128 rows to each
    # expert; an expert receives 2 x 128 = 256 (4 local experts)
    # Transformer Engine's Fp8Padding pads the 256 an expert received (263.5 -> 264) and its
    # grouped GEMM runs the padded rows
    te = _ops(_moe_dims())
    assert _gemm_rows(te, "expert fc1") == _gemm_rows(te, "expert fc2") == 264
    assert _copy_elements(te, "expert fp8 padding") == 4 * 256 * HIDDEN
    assert _copy_elements(te, "permute") == 512 * 2 * HIDDEN
    # the all-to-all's sender pads each of its 8 counts: 128 + 15 / 2 = 135.5 rows expected (a
    # remainder uniform in 0..15 under uneven routing), so an expert gets 2 x 135.5 = 271 rows
    # and the rank permutes and sends 8 x 135.5 = 1,084; Transformer Engine copies nothing
    source = _ops(_moe_dims(moe_row_padding="source"))
    assert _gemm_rows(source, "expert fc1") == 271
    assert _copy_elements(source, "permute") == _copy_elements(source, "unpermute") == 1084 * HIDDEN
    assert not [op for op in source if "fp8 padding" in op.name or "fp8 unpadding" in op.name]
    # DeepEP's receiver (or HybridEP's kernel) pads the 256 an expert received: 263.5 -> 264
    destination = _ops(_moe_dims(moe_row_padding="destination"))
    assert _gemm_rows(destination, "expert fc1") == 264
    assert _copy_elements(destination, "permute") == 512 * 2 * HIDDEN
    assert not [op for op in destination if "fp8 padding" in op.name]
    # mxfp8 aligns to 32: 128 + 31 / 2 = 143.5 a sender
    assert _gemm_rows(_ops(_moe_dims(moe_row_padding="source", fp8_recipe="mxfp8")), "expert fc1") == 287


def test_padded_rows_never_fall_below_the_next_multiple():
    from inspector.formulas.fp8_ops import padded_rows

    assert padded_rows(128, 16) == 135.5  # the remainder's mean
    assert padded_rows(2, 16) == 16  # a small count still fills a whole 16
    assert padded_rows(0.5, 32) == 32


@pytest.mark.parametrize(("flags", "padding"), [
    ({"moe_token_dispatcher_type": "alltoall"}, ""),
    ({"moe_token_dispatcher_type": "alltoall", "moe_router_padding_for_fp8": True}, "source"),
    ({"moe_token_dispatcher_type": "flex", "moe_router_padding_for_fp8": True}, "destination"),
    ({"moe_token_dispatcher_type": "flex"}, ""),  # DeepEP without the flag: TE pads
])  # fmt: skip
def test_who_pads_follows_the_dispatcher(flags: dict, padding: str):
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    base = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=128,
                max_position_embeddings=128, vocab_size=1000, num_experts=8, moe_router_topk=2,
                bf16=True, micro_batch_size=1, expert_model_parallel_size=2, data_parallel_size=2,
                fp8_format="hybrid", transformer_impl="transformer_engine", moe_grouped_gemm=True,
                disable_bias_linear=True, **flags)  # fmt: skip
    if flags["moe_token_dispatcher_type"] == "flex" and VERSION < (0, 16):
        base["moe_enable_deepep"] = True
    args = merge_sources(Sources(flags=base), ("model", "layout", "training")).args
    assert make_job(args).dims().moe_row_padding == padding


@pytest.mark.skipif(VERSION < (0, 16), reason="HybridEP is megatron-core 0.16's")
def test_hybridep_pads_in_its_dispatch_under_fp8():
    # token_dispatcher.py _HybridEPManager.dispatch: `if self.config.fp8 or self.config.fp4:
    # self.pad_multiple = get_align_size_for_quantization(self.config)`, passed to
    # hybrid_ep_dispatch (fused_a2a.py: "Alignment multiple required for FP8 GEMM"), flag or not
    from inspector.job.flex import row_padding
    from inspector.job.job import Training

    hybrid = Training(moe_token_dispatcher_type="flex", moe_flex_backend="hybridep")
    assert row_padding(hybrid) == "destination"


def test_sender_padding_rows_travel_in_the_all_to_all():
    from inspector.job.layout import Layout
    from inspector.plan.flex import moe_exchange
    from inspector.plan.network import Network, expert_alltoall

    net, lay = Network(GPUS["h100"], 1), Layout(dp=2, ep=2)  # one GPU a node: all InfiniBand
    plain, padded = _moe_dims(), _moe_dims(moe_row_padding="source")
    assert moe_exchange(plain, lay, net, SEQ, False) == expert_alltoall(4, SEQ * 2 * HIDDEN, 2, lay, net)
    # 8 experts x 135.5 padded rows instead of 512 x 2
    assert moe_exchange(padded, lay, net, SEQ, False) == expert_alltoall(4, 1084 * HIDDEN, 2, lay, net)


def test_workload_flex_bytes_count_the_ranks_a_limited_token_reaches():
    # report/workload_layers.py writes a flex exchange as the bytes it moves: each token once per rank
    # holding one of its experts (the sender's own share counted). 12 experts, top-3, 4 groups
    # of 3, top-2 groups, ep 6 (2 experts a rank, so groups straddle ranks): enumerated
    from types import SimpleNamespace

    from inspector.job.layout import Layout
    from inspector.report.workload_layers import flex_token_bytes

    experts, topk, ep = 12, 3, 6
    reached = sum((w * len({e // 2 for e in pick}) for pick, w in _routes(experts, topk, 4, 2)),
                  Fraction(0))  # fmt: skip
    dims = ModelDims(2, 256, 8, 512, 1024, num_experts=12, moe_router_topk=3,
                     moe_router_num_groups=4, moe_router_group_topk=2)  # fmt: skip
    job = SimpleNamespace(dims=dims, par=Layout(dp=ep, ep=ep))
    assert flex_token_bytes(job, 100) == round(100 * 256 * 2 * float(reached))  # bf16
    free = SimpleNamespace(dims=ModelDims(2, 256, 8, 512, 1024, num_experts=12, moe_router_topk=3),
                           par=Layout(dp=ep, ep=ep))  # fmt: skip
    assert flex_token_bytes(job, 100) < flex_token_bytes(free, 100)


def test_plan_keeps_the_router_padding_and_prints_it():
    import json

    result = run_cli("plan", *SMALL_MIXTRAL, "--gpus", "4", "--global-batch-size", "8",
                     "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine",
                     "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall", "--ep", "2",
                     "--moe-router-padding-for-fp8", "--top", "1", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    flags = json.loads(result.out)["plans"][0]["flags"]
    # 0.16 warns that --moe-router-padding-for-fp8 is going away: the plan writes the new name
    name = "--moe-router-padding-for-quantization" if VERSION >= (0, 16) else "--moe-router-padding-for-fp8"
    assert name in flags


def test_workload_all_to_all_carries_the_senders_padding_rows():
    # report/workload_layers.py's ALLTOALL_EP size: a rank's 512 x 2 copies of h at 2 bytes, or with the
    # router padding the 8 x 135.5 -> 1,084 rows each sender's padded counts hold (as plan's)
    from inspector.job.layout import Layout
    from inspector.report.workload_inputs import Context, Settings
    from inspector.report.workload_layers import _moe_mlp

    def a2a(dims: ModelDims) -> int:
        context = Context(dims, Layout(dp=2, ep=2), Settings(1, 1, 2))
        record = _moe_mlp(context, 0)[1]  # the dispatch (AICB's order)
        assert record.fwd_comm == "ALLTOALL_EP"
        return record.fwd_bytes

    assert a2a(_moe_dims()) == 512 * 2 * HIDDEN * 2
    assert a2a(_moe_dims(moe_row_padding="source")) == 1084 * HIDDEN * 2
    assert a2a(_moe_dims(moe_row_padding="destination")) == 512 * 2 * HIDDEN * 2


def test_memory_runs_megatrons_group_limited_top_k(monkeypatch):
    # the router runs moe_utils.py group_limited_topk on meta tensors (its temporaries counted)
    from inspector.world.setup import megatron

    megatron()
    from megatron.core.transformer.moe import moe_utils

    calls: list[tuple[int, int]] = []
    limited = moe_utils.group_limited_topk

    def spy(*args, **kwargs):
        calls.append((kwargs["num_groups"], kwargs["group_topk"]))
        return limited(*args, **kwargs)

    monkeypatch.setattr(moe_utils, "group_limited_topk", spy)
    result = run_cli("memory", "--no-cache", *MOE, "--bf16", "--micro-batch-size", "1", "--ep", "2",
                     "--dp", "2", "--moe-token-dispatcher-type", "alltoall",
                     "--moe-router-num-groups", "4", "--moe-router-group-topk", "2")  # fmt: skip
    assert result.code == 0, result.err
    assert calls and set(calls) == {(4, 2)}


def test_deterministic_mode_runs_megatrons_index_add_which_keeps_its_source():
    # Megatron-LM's validate_args turns on torch.use_deterministic_algorithms for
    # --deterministic-mode, and moe_utils.py branches on it: `unpermute` adds the experts' output
    # back with `index_add_` (autograd's IndexAddBackward0 saves the source, the rows of this
    # rank's experts) where it would `scatter_add_` (which saves the index only), and
    # `topk_routing_with_score_function` builds its maps by `index_put_` with the token rows
    # (`arange(num_tokens).unsqueeze(1)`, int64, saved as an index) where it would `scatter`
    def total(*extra: str) -> int:
        result = run_cli("memory", "--no-cache", *MOE, "--bf16", "--micro-batch-size", "1",
                         "--ep", "2", "--dp", "2", "--format", "json", *extra)  # fmt: skip
        assert result.code == 0, result.err
        return json.loads(result.out)["stages"][0]["total"]

    import inspect

    from inspector.world.setup import megatron

    megatron()
    from megatron.core.transformer.moe import moe_utils

    def branches(name: str) -> bool:  # megatron-core 0.13 has neither branch
        function = getattr(moe_utils, name, None)
        return function is not None and "are_deterministic_algorithms_enabled" in inspect.getsource(function)

    tokens, hidden, topk, experts, ep, layers = 64, 64, 2, 8, 2, 2  # MOE, Megatron-LM's top-2
    gathered = tokens * ep  # the allgather dispatcher gathers every EP rank's tokens
    rows = gathered * topk // experts * (experts // ep)  # balanced routing, this rank's experts
    source = rows * hidden * 2 if branches("unpermute") else 0  # bf16 expert output
    token_rows = tokens * 8 if branches("topk_routing_with_score_function") else 0  # int64
    assert total("--deterministic-mode") - total() == layers * (source + token_rows)
