"""The flex dispatcher (DeepEP, HybridEP) in `plan`: megatron's rules, and its exchange priced by
the bytes each link class carries (plan/flex.py)."""

from __future__ import annotations

import importlib.metadata
import json
from fractions import Fraction
from itertools import combinations
from math import comb
from pathlib import Path

import pytest

from inspector.job.flex import BACKEND_SINCE, flex_backend, megatron_version
from inspector.job.hardware import GPUS
from inspector.job.layout import Layout
from inspector.plan.flex import expected_remote_nodes, token_copies, token_record_bytes
from tests.conftest import run_cli

# ---- what a token costs on each link class: against enumeration of every top-k ----


def _brute_remote(experts: int, topk: int, nodes: int, groups: int = 0, group_topk: int = 0) -> Fraction:
    per_node = experts // nodes
    if groups:
        size = experts // groups
        subsets = []
        for chosen in combinations(range(groups), group_topk):
            pool = [g * size + i for g in chosen for i in range(size)]
            picks = list(combinations(pool, topk))
            subsets += [(pick, Fraction(1, len(picks))) for pick in picks]
        weight = Fraction(1, comb(groups, group_topk))
    else:
        subsets = [(p, Fraction(1)) for p in combinations(range(experts), topk)]
        weight = Fraction(1, len(subsets))
    total = Fraction(0)
    for pick, w in subsets:
        remote = {e // per_node for e in pick} - {0}  # the sender sits on node 0
        total += weight * w * len(remote)
    return total


@pytest.mark.parametrize(("experts", "topk", "nodes"), [(8, 2, 4), (8, 3, 2), (12, 4, 3), (6, 1, 3)])
def test_remote_nodes_match_enumeration(experts: int, topk: int, nodes: int) -> None:
    want = float(_brute_remote(experts, topk, nodes))
    assert expected_remote_nodes(experts, topk, nodes) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(("experts", "topk", "nodes", "groups", "group_topk"),
                         [(8, 2, 4, 4, 2), (8, 3, 2, 4, 2), (12, 3, 2, 6, 3), (16, 4, 4, 8, 3)])
def test_node_limited_remote_nodes_match_enumeration(
        experts: int, topk: int, nodes: int, groups: int, group_topk: int) -> None:
    want = float(_brute_remote(experts, topk, nodes, groups, group_topk))
    got = expected_remote_nodes(experts, topk, nodes, groups, group_topk)
    assert got == pytest.approx(want, rel=1e-12)


def test_node_limited_routing_reaches_fewer_nodes() -> None:
    # DeepSeek-V3 at ep 64 over 8 nodes: 256 experts, top-8 of the top-4 of 8 groups (one a node)
    # reach at most 4 nodes; unlimited, 7 x (1 - C(224, 8) / C(256, 8)) of the 7 others
    limited, free = expected_remote_nodes(256, 8, 8, 8, 4), expected_remote_nodes(256, 8, 8)
    assert 0 < limited < 4 and limited < free
    assert free == pytest.approx(7 * (1 - comb(224, 8) / comb(256, 8)), rel=1e-12)


def _brute_copies(experts: int, topk: int, ep: int, etp: int, on_node: int) -> tuple[Fraction, Fraction]:
    """Send one token from rank 0 for every top-k: rank r (expert tp innermost, megatron's
    expert rank order) holds ep index r // etp's experts; each node the token reaches gets one
    InfiniBand copy (not the sender's), and every hit rank of a node but the one it enters by
    (local index 0: the sender, or the RDMA receiver of the same local index) an NVLink copy."""
    per_rank = experts // ep
    picks = list(combinations(range(experts), topk))
    inter = intra = Fraction(0)
    for pick in picks:
        hit_ep = {e // per_rank for e in pick}
        hit = [r for r in range(ep * etp) if r // etp in hit_ep]
        nodes = {r // on_node for r in hit}
        inter += len(nodes - {0})
        intra += sum(1 for r in hit if r % on_node != 0)
    return inter / len(picks), intra / len(picks)


@pytest.mark.parametrize(("experts", "topk", "ep", "etp", "on_node"), [
    (8, 2, 4, 1, 2),  # two nodes of two ranks
    (8, 3, 8, 1, 4),
    (12, 2, 6, 1, 2),  # three nodes
    (8, 2, 4, 2, 4),  # expert tp 2: a token reaches both ranks of each expert it picks
    (6, 2, 3, 1, 3),  # one node: no InfiniBand copy
])
def test_token_copies_match_enumeration(experts: int, topk: int, ep: int, etp: int, on_node: int) -> None:
    inter, intra = _brute_copies(experts, topk, ep, etp, on_node)
    got = token_copies(experts, topk, ep, etp, on_node)
    assert got == pytest.approx((float(inter), float(intra)), rel=1e-12)
    assert got[0] == pytest.approx(expected_remote_nodes(experts, topk, ep * etp // on_node), rel=1e-12)


def test_deepep_token_record_is_hidden_meta_and_topk_aligned() -> None:
    # internode.cu get_num_bytes_per_rdma_token: 7168 bf16 + 8 (SourceMeta) + 8 x (4 + 4) =
    # 14,408, aligned up to 16: 14,416; fp32 hidden states are 4 bytes, fp8 would be sent as 2
    assert token_record_bytes(7168, 2, 8) == 14416
    assert token_record_bytes(2048, 2, 8) == 4176
    assert token_record_bytes(2048, 4, 8) == 8272
    assert token_record_bytes(2048, 1, 8) == 4176  # fused_a2a.py get_hidden_bytes: max(size, 2)


# Qwen3-30B-A3B on 2 nodes of 8 H100s, ep 16: a rank's 4,096 tokens
QWEN_INTER = 1 - comb(64, 8) / comb(128, 8)  # the other node is hit
QWEN_INTRA = 14 * (1 - comb(120, 8) / comb(128, 8))  # 16 ranks less 2 entry ranks, each hit
QWEN_EXCHANGE = max(10e-6 + 4096 * 4176 * QWEN_INTER / 50e9, 5e-6 + 4096 * 4176 * QWEN_INTRA / 450e9)


def test_qwen3_30b_exchange_by_hand() -> None:
    from inspector.plan.flex import flex_exchange
    from inspector.plan.network import Network

    assert QWEN_INTER == pytest.approx(0.99690, abs=1e-5) and QWEN_INTRA == pytest.approx(5.772, abs=1e-3)
    # the all-to-all's InfiniBand share was 8 top-k copies x 8/16 = 4 token copies: 4.0 / 0.9967
    assert 8 * 8 / 16 / QWEN_INTER == pytest.approx(4.012, abs=1e-3)
    dims = _qwen_dims()
    net, lay = Network(GPUS["h100"], 8), Layout(dp=16, ep=16, etp=1)
    assert flex_exchange(1, dims, 4096, lay, net) == pytest.approx(QWEN_EXCHANGE, rel=1e-12)
    assert flex_exchange(4, dims, 4096, Layout(dp=1, ep=1, etp=1), net) == 0.0


def _qwen_dims():
    from inspector.inputs.presets import get_preset
    from inspector.job.job import Job
    from inspector.job.model_args import make_model_config

    args = dict(get_preset("qwen3-30b-a3b").args)
    args.update(bf16=True, disable_bias_linear=True)
    return Job(make_model_config(args), Layout(dp=16, ep=16, etp=1)).dims()


QWEN = ("plan --model qwen3-30b-a3b --num-layers 2 --gpus 16 --global-batch-size 16 --seq-length 4096 "
        "--micro-batch-size 1 --tp 1 --pp 1 --cp 1 --ep 16 --expert-tensor-parallel-size 1 --bf16 "
        "--moe-grouped-gemm --recompute-granularity none --gpu h100 --format json").split()  # fmt: skip


@pytest.mark.slow
def test_plan_prices_the_hybridep_exchange_at_the_hand_price() -> None:
    # one micro-batch per rank, 2 MoE layers x 4 exchanges; the flags reproduce the dispatcher.
    # megatron-core 0.13-0.15 run DeepEP only, behind --moe-enable-deepep (priced the same)
    new = megatron_version() >= BACKEND_SINCE
    backend = ["--moe-flex-dispatcher-backend", "hybridep"] if new else ["--moe-enable-deepep"]
    flex = run_cli(*QWEN, "--moe-token-dispatcher-type", "flex", *backend)
    alltoall = run_cli(*QWEN, "--moe-token-dispatcher-type", "alltoall")
    assert flex.code == 0 and alltoall.code == 0, flex.err + alltoall.err
    plan, before = json.loads(flex.out)["plans"][0], json.loads(alltoall.out)["plans"][0]
    assert plan["time_shares"]["expert"] == pytest.approx(2 * 4 * QWEN_EXCHANGE, rel=1e-9)
    assert before["time_shares"]["expert"] == pytest.approx(2 * 4 * (10e-6 + 4096 * 8 * 2048 * 2 / 2 / 50e9), rel=1e-9)
    # the all-to-all dispatcher alone sorts the received T k rows by local expert and back
    # (token_dispatcher.py sort_chunks_by_idxs): 2 layers x 4 copies of 4096 x 8 x 2048 elements
    from inspector.formulas.kernels import Memory, op_seconds
    from inspector.job.hardware import GPUS

    sort = op_seconds(Memory("sort", "copy", 4096 * 8 * 2048, 4), GPUS["h100"])
    gap = before["time_shares"]["compute"] - plan["time_shares"]["compute"]
    assert gap == pytest.approx(2 * 4 * sort, rel=1e-6)
    if new:  # HybridEP's job is confirmed as built, its buffers counted: the two-node sizes
        # tests/test_hybrid_ep.py writes out by hand (hidden 2048, 4,096 tokens a rank, 8 local
        # experts, two nodes of 8 ranks)
        outside = dict(plan["stages"][0]["outside_allocator"])
        assert list(outside) == ["HybridEP NVLink buffers", "HybridEP routing map",
                                 "HybridEP RDMA buffers", "HybridEP queue pairs", "HybridEP flags"]
        assert sum(outside.values()) == 438_718_368
    else:  # DeepEP (0.13-0.15's one backend) is confirmed as built, its buffers counted
        names = [what for what, _ in plan["stages"][0]["outside_allocator"]]
        assert names == ["DeepEP NVLink buffer", "DeepEP RDMA buffer", "DeepEP workspace"]
    flags = " ".join(plan["flags"])
    assert "--moe-token-dispatcher-type flex" in flags
    if new:
        assert "--moe-flex-dispatcher-backend hybridep" in flags
    else:
        assert "--moe-enable-deepep" in flags


# ---- megatron's rules, as Error lines ----

NEW, OLD = (0, 16), (0, 13)


@pytest.mark.parametrize(("args", "version", "backend"), [
    ({"moe_token_dispatcher_type": "flex"}, NEW, "deepep"),  # 0.16's default backend
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep"}, NEW, "hybridep"),
    ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}, NEW, "deepep"),
    ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}, OLD, "deepep"),
    ({"moe_token_dispatcher_type": "alltoall"}, NEW, None),
    ({}, OLD, None),
    # HybridEP pads to capacity (it computes the capacity in setup_metadata); DeepEP does not
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep",
      "moe_pad_expert_input_to_capacity": True}, NEW, "hybridep"),
])
def test_backend_as_megatron_chooses_it(args, version, backend) -> None:
    assert flex_backend(args, version) == backend


@pytest.mark.parametrize(("args", "version", "message"), [
    # TransformerConfig.__post_init__ (0.13-0.16): DeepEP needs the flex dispatcher
    ({"moe_token_dispatcher_type": "alltoall", "moe_enable_deepep": True}, NEW,
     "--moe-enable-deepep needs --moe-token-dispatcher-type flex, not alltoall (megatron-core's "
     "TransformerConfig: 'DeepEP backend is only supported with flex token dispatcher.')"),
    # 0.16: the deprecated switch and the other backend together
    ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True,
      "moe_flex_dispatcher_backend": "hybridep"}, NEW,
     "--moe-enable-deepep with --moe-flex-dispatcher-backend hybridep: megatron-core's "
     "TransformerConfig allows one ('Only one backend is supported for flex token dispatcher.')"),
    # 0.13-0.15 know no backend flag: Megatron-LM's argparse stops on it
    ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"}, OLD,
     "--moe-flex-dispatcher-backend is not an argument of Megatron-LM 0.13 (the installed "
     "megatron-core; added in 0.16): its flex dispatcher runs DeepEP, with --moe-enable-deepep"),
    # 0.13-0.15 MoEFlexTokenDispatcher (built for an MoE model) asserts moe_enable_deepep
    ({"moe_token_dispatcher_type": "flex", "num_experts": 8}, OLD,
     "--moe-token-dispatcher-type flex needs --moe-enable-deepep in megatron-core 0.13 "
     "(MoEFlexTokenDispatcher: 'DeepEP is not enabled. Please set --moe-enable-deepep to use "
     "DeepEP backend.')"),
    # DeepEP does not pad to capacity (0.16: the deepep backend; 0.13: any flex, in other words)
    ({"moe_token_dispatcher_type": "flex", "moe_pad_expert_input_to_capacity": True}, NEW,
     "--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's DeepEP backend "
     "(megatron-core's TransformerConfig: 'Flex token dispatcher with deepep backend does not "
     "support moe_pad_expert_input_to_capacity')"),
    ({"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True,
      "moe_pad_expert_input_to_capacity": True}, OLD,
     "--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's DeepEP backend "
     "(megatron-core's TransformerConfig: 'Flex token dispatcher does not support "
     "moe_pad_expert_input_to_capacity')"),
])
def test_megatrons_refusals(args, version, message) -> None:
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        flex_backend(args, version)
    assert str(caught.value) == message


def test_flex_with_one_expert_rank_is_refused() -> None:
    # MoEFlexTokenDispatcher.__init__ asserts TPxEP > 1 over the expert tp x ep group
    result = run_cli(*QWEN[:QWEN.index("--ep")], "--ep", "1", "--expert-tensor-parallel-size", "1",
                     "--bf16", "--moe-grouped-gemm", "--gpu", "h100", "--moe-token-dispatcher-type",
                     "flex", "--gpus-per-node", "8",
                     *([] if megatron_version() >= BACKEND_SINCE else ["--moe-enable-deepep"]))  # fmt: skip
    assert result.code == 2
    assert result.err == (  # the words `memory` prints (tests/test_flex_memory.py): job/flex.py
        "Error: --moe-token-dispatcher-type flex needs expert parallelism: --expert-tensor-parallel-size 1 x --ep 1 = 1 "
        "(megatron-core's MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP > 1')\n")


def test_deepep_without_flex_is_refused_on_the_command_line() -> None:
    result = run_cli(*QWEN, "--moe-token-dispatcher-type", "alltoall", "--moe-enable-deepep")
    assert result.code == 2
    assert result.err.startswith("Error: --moe-enable-deepep needs --moe-token-dispatcher-type flex")


def test_installed_megatron_knows_the_backend_flag_from_0_16() -> None:
    # 0.13.1 (and 0.14, 0.15): only moe_enable_deepep; 0.16.1: moe_flex_dispatcher_backend too
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    text = importlib.metadata.version("megatron-core")
    installed = tuple(int(p) for p in text.split(".")[:2])
    assert megatron_version() == installed
    assert ("moe_flex_dispatcher_backend" in fields) == (installed >= BACKEND_SINCE)
    assert "moe_enable_deepep" in fields
    if installed >= BACKEND_SINCE:
        assert fields["moe_flex_dispatcher_backend"].default == "deepep"
    if BACKEND_SINCE <= installed < (0, 19):
        assert fields["moe_deepep_num_sms"].default == 20  # flex.py's docstring cites both
    if BACKEND_SINCE <= installed < (0, 17):
        assert fields["moe_hybridep_num_sms"].default == 16
    elif (0, 17) <= installed < (0, 19):  # None: HybridEPBuffer's own count (docs/limits.md)
        assert fields["moe_hybridep_num_sms"].default is None
    elif installed >= (0, 19):  # both deprecated, routed into one count, None: each backend's own
        assert fields["moe_deepep_num_sms"].default is None
        assert fields["moe_flex_dispatcher_num_sms"].default is None


def test_a_refused_value_given_as_a_flag_stops_other_commands_but_not_plan(monkeypatch) -> None:
    # a value unmodelled.REFUSED_VALUES refuses stops a command reading its group when given on
    # the command line, as in a launch script; plan accepts the flex dispatcher, which it prices
    from inspector.errors import ConfigError
    from inspector.inputs import refusals, resolve
    from inspector.inputs.unmodelled import Refusal

    refused = {"--moe-token-dispatcher-type": {"flex": Refusal("training", "why")}}
    monkeypatch.setattr(refusals, "REFUSED_VALUES", refused)
    flags = {"moe_token_dispatcher_type": "flex"}
    with pytest.raises(ConfigError, match=r"^--moe-token-dispatcher-type flex is not modelled: why$"):
        resolve.merge_sources(resolve.Sources(flags=flags), ("model", "training"))
    resolve.merge_sources(resolve.Sources(flags=flags), ("model", "layout"))  # not its group
    accepted = ("--moe-token-dispatcher-type flex",)
    args = resolve.merge_sources(resolve.Sources(flags=flags), ("model", "training"), accepted).args
    assert args["moe_token_dispatcher_type"] == "flex"


# ---- workload: SimAI's records of the flex dispatcher ----


def test_workload_writes_the_flex_exchange_as_the_bytes_it_moves() -> None:
    from inspector.job.dims import ModelDims
    from inspector.report.simai import parse_workload
    from inspector.report.workload import render_stage
    from inspector.report.workload_inputs import (
        BufferInput,
        ComputeRate,
        Context,
        Settings,
        StageInput,
    )

    # 4 experts top-2 over ep 2 (2 a rank): an ep rank is missed with C(2, 2) / C(4, 2) = 1/6;
    # expert tp is tp (2), so a token reaches 2 x 2 x 5/6 of the 4 flex ranks: this rank's 128/2
    # sequence-parallel tokens x 64 channels x 2 bytes x 10/3 = 27,307 bytes per exchange, where
    # the all-to-all dispatcher sends 2 top-k copies (16,384) and gathers them over expert tp
    dims = ModelDims(2, 64, 4, 128, 256, num_experts=4, moe_router_topk=2)
    par = Layout(tp=2, pp=1, ep=2, dp=4, sequence_parallel=True)
    stage = StageInput(0, ((0, 1),), True, True,
                       buffers=(BufferInput(13312, 2, 4), BufferInput(33024, 2, 4, expert=True)))
    flex = Context(dims, par, Settings(1, 2, 8, flex=True), ComputeRate(100.0, 0.5))
    alltoall = Context(dims, par, Settings(1, 2, 8), ComputeRate(100.0, 0.5))
    moe = [r for r in parse_workload(render_stage(flex, stage))[1] if r.name == "mlp_moelayer"]
    old = [r for r in parse_workload(render_stage(alltoall, stage))[1] if r.name == "mlp_moelayer"]
    assert len(moe) == 2 * 2 * 3 and len(old) == 2 * 2 * 5  # dispatch, experts, combine
    assert (moe[0].fwd_comm, moe[0].fwd_bytes) == ("ALLTOALL_EP", round(64 * 64 * 2 * 10 / 3))
    assert (moe[0].ig_comm, moe[0].ig_bytes) == ("ALLTOALL_EP", 27307)
    assert moe[2] == moe[0] and old[1].fwd_bytes == 64 * 2 * 64 * 2
    assert moe[1].fwd_compute == old[3].fwd_compute  # the experts' GEMMs are the same


def test_a_script_on_older_megatron_is_told_the_backend_flag_is_unknown() -> None:
    from inspector.inputs import versions

    note = versions.argument_unknown_note("--moe-flex-dispatcher-backend")
    assert (note is None) == (versions.megatron_core_version() >= BACKEND_SINCE)
    if note is not None:
        assert "added in 0.16" in note


@pytest.mark.slow
def test_the_search_skips_layouts_with_one_expert_rank() -> None:
    # tp 1 pinned: ep 1 leaves the flex dispatcher one rank (megatron asserts TPxEP > 1)
    base = ("plan --model qwen3-30b-a3b --num-layers 2 --gpus 4 --global-batch-size 8 --seq-length 1024 "
            "--micro-batch-size 1 --tp 1 --pp 1 --cp 1 --bf16 --moe-grouped-gemm --gpu h100 "
            "--gpu-memory 200 --top 50 --format json").split()  # fmt: skip
    old = [] if megatron_version() >= BACKEND_SINCE else ["--moe-enable-deepep"]
    seen = {}
    for dispatcher in ("alltoall", "flex"):
        extra = old if dispatcher == "flex" else []
        result = run_cli(*base, "--moe-token-dispatcher-type", dispatcher, *extra)
        assert result.code == 0, result.err
        seen[dispatcher] = {p["layout"]["ep"] for p in json.loads(result.out)["plans"]}
    assert seen["alltoall"] == {1, 2, 4} and seen["flex"] == {2, 4}


def test_plan_reads_the_flex_dispatcher_from_a_launch_script(tmp_path) -> None:
    # the script's value is refused where a command does not model it (unmodelled.REFUSED_VALUES,
    # as `memory`); plan models it, so the job it plans is the script's own
    new = megatron_version() >= BACKEND_SINCE
    backend = "--moe-flex-dispatcher-backend hybridep" if new else "--moe-enable-deepep"
    script = tmp_path / "train.sh"
    script.write_text(
        "python pretrain_gpt.py --num-layers 2 --hidden-size 2048 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 4 --kv-channels 128 --ffn-hidden-size 6144 "
        "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-grouped-gemm "
        "--seq-length 1024 --max-position-embeddings 4096 --vocab-size 151936 --normalization "
        "RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope --bf16 "
        "--micro-batch-size 1 --global-batch-size 16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        f"--context-parallel-size 1 --expert-model-parallel-size 16 --moe-token-dispatcher-type flex {backend}\n")
    result = run_cli("plan", "--from-script", str(script), "--gpus", "16", "--gpu", "h100", "--format", "json")
    assert result.code == 0, result.err
    flags = " ".join(json.loads(result.out)["plans"][0]["flags"])
    assert "--moe-token-dispatcher-type flex" in flags
    assert ("--moe-flex-dispatcher-backend hybridep" if new else "--moe-enable-deepep") in flags


@pytest.mark.slow
def test_the_all_to_all_overlap_replays_the_flex_exchange(monkeypatch) -> None:
    # under --overlap-moe-expert-parallel-comm each merged pair's four exchanges are the flex
    # dispatcher's own (one exchange: QWEN_EXCHANGE), not the all-to-all's
    import inspector.caches as caches
    from inspector.plan import cost

    seen: list[float] = []
    real = cost.merged_times

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[5])  # the `alltoall` argument: one exchange's seconds
        return real(*args, **kwargs)

    caches.clear()
    monkeypatch.setattr(cost, "merged_times", spy)
    new = megatron_version() >= BACKEND_SINCE
    backend = ["--moe-flex-dispatcher-backend", "deepep"] if new else ["--moe-enable-deepep"]
    args = [a if a != "16" or QWEN[i - 1] != "--global-batch-size" else "64" for i, a in enumerate(QWEN)]
    result = run_cli(*args, "--moe-token-dispatcher-type", "flex", *backend,  # 4 micro-batches
                     "--overlap-moe-expert-parallel-comm", "--transformer-impl", "transformer_engine")  # fmt: skip
    caches.clear()
    assert result.code == 0, result.err
    assert seen and all(s == pytest.approx(QWEN_EXCHANGE, rel=1e-12) for s in seen)


def test_one_rank_is_refused_where_megatron_core_asserts_it() -> None:
    # MoEFlexTokenDispatcher: 0.13-0.16 assert TPxEP > 1 for every backend; 0.17+ in the DeepEP
    # branch only (HybridEP is built over one rank)
    import megatron.core

    from inspector.job.flex import one_rank_refused

    source = (Path(megatron.core.__file__).parent / "transformer/moe/token_dispatcher.py").read_text()
    assert one_rank_refused("deepep")
    assert one_rank_refused("hybridep") == ("Flex token dispatcher requires TPxEP > 1" in source)
