"""HybridEP (`--moe-flex-dispatcher-backend hybridep`) in `memory` and `plan`: its buffers outside
PyTorch's allocator (inspector/job/hybrid_ep.py), sized by hand here from DeepEP's hybrid-ep source
at eb9cee7 (the commit Megatron-LM core_v0.16.1 installs), and HybridEP's refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from inspector.job.flex import BACKEND_SINCE, megatron_version
from tests.conftest import run_cli

INSTALLED_NEW = megatron_version() >= BACKEND_SINCE
needs_016 = pytest.mark.skipif(not INSTALLED_NEW, reason="HybridEP is megatron-core 0.16's")

# a small Mixtral: 8 experts, top-2, hidden 256, 128 tokens a rank
TINY = ("--model", "mixtral-8x7b", "--num-layers", "2", "--hidden-size", "256",
        "--ffn-hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--bf16",
        "--micro-batch-size", "1")  # fmt: skip
HYBRIDEP = ("--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep")

# one node: hidden 256, 128 tokens -> T = 512 (HybridEP's floor), 8 experts over ep 2 -> L = 4, R = 2
SMALL = {
    # M = T x 2 ranks = 1,024 tokens: tokens 1,024 x 256 x 2 B + probs 1,024 x (4 x 2) x 4 B
    # + scaling factors 1,024 x (256 / 128) x 4 B
    "HybridEP NVLink buffers": 524_288 + 32_768 + 8_192,
    "HybridEP routing map": (4 * 2) * 512 * 2,  # experts x T x ranks, one byte each
    # preprocessing 108 x 2 x 8 B, 4 flags of 4 B, the 512 B test buffer, the all-gather's
    # 3 flags of 8 B and 2 peer pointers
    "HybridEP flags": 1_728 + 16 + 512 + 24 + 16,
}


def test_one_node_sizes_by_hand() -> None:
    from inspector.job.hybrid_ep import HybridEPShape, hybridep_buffers

    assert dict(hybridep_buffers(HybridEPShape(256, 512, 4, 2, 1))) == SMALL


def test_two_nodes_sizes_by_hand() -> None:
    """Qwen3-30B-A3B's recipe: hidden 2048, 4,096 tokens a rank, 128 experts over ep 16 (L = 8),
    two nodes of 8 (R = 8, N = 2), 16 SMs."""
    from inspector.job.hybrid_ep import HybridEPShape, hybridep_buffers

    t = 4096
    # M = 4,096 x 16 = 65,536 tokens x (2,048 x 2 + 64 x 4 + 16 x 4 bytes)
    nvlink = 65_536 * (4_096 + 256 + 64)
    routing = 128 * t * 16
    # dispatch: attention input (tokens 2 B, probs over all 128 experts 4 B, 16 scales 4 B),
    # one remote node's tokens, probs over its 64 experts, scales; 2 x 32 chunk flags of 8 B; 8 B
    dispatch = t * (4_096 + 512 + 64) + t * (4_096 + 256 + 64) + 2 * 32 * 8 + 8
    combine = 2 * t * (4_096 + 256) + 2 * 32 * 8 + 8  # reduced and received: tokens, probs
    metadata = 16 * (8 + 8 + 96 + 72)  # 16 queue pairs each way: device pointers, memory regions
    # a queue pair: 3 x 4,096 + 1 (dispatch) or 2 x 4,096 + 1 (combine) entries -> 16,384 x 64 B =
    # 1 MiB rings (completion and send), each + a page; two doorbell pages (+ a page each); the
    # device QP (280 B + a page)
    pair = 2 * (1_048_576 + 4_096) + 2 * 8_192 + 280 + 4_096
    assert dict(hybridep_buffers(HybridEPShape(2048, t, 8, 8, 2))) == {
        "HybridEP NVLink buffers": nvlink,
        "HybridEP routing map": routing,
        "HybridEP RDMA buffers": dispatch + combine + metadata,
        "HybridEP queue pairs": 32 * pair,
        "HybridEP flags": 108 * 8 * 8 + 16 + 512,
    }
    assert nvlink + routing + dispatch + combine + metadata + 32 * pair + 7_440 == 438_718_368  # 0.41 GiB


def test_the_shape_is_what_megatron_passes() -> None:
    # fused_a2a.py init_hybrid_ep_buffer: seq_len = the dispatcher input's tokens, s b / (cp t)
    from inspector.job.hybrid_ep import HybridEPShape, hybridep_shape
    from tests.test_engine import _MOE_TP1, _job

    job = _job(**{**_MOE_TP1, "num_experts": 32}, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=16,
               expert_model_parallel_size=16, seq_length=2048,
               max_position_embeddings=2048, micro_batch_size=2, global_batch_size=32)  # fmt: skip
    shape = hybridep_shape(job.model, job.layout, 2)
    assert shape == HybridEPShape(job.model.hidden_size, 4096, 2, 8, 2, 16)


@needs_016
def test_memory_prints_hybrideps_buffers() -> None:
    result = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2",
                     *HYBRIDEP, "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    stage = json.loads(result.out)["stages"][0]
    assert dict(stage["buffers"]["outside_allocator"]) == SMALL
    text = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2", *HYBRIDEP)
    assert text.code == 0, text.err
    assert ("Stage 0: outside PyTorch's allocator 0.00 GiB (HybridEP NVLink buffers 0.00 GiB, "
            "HybridEP routing map 0.00 GiB, HybridEP flags 0.00 GiB)") in text.out  # fmt: skip
    assert "flex dispatcher (HybridEP), dropless." in text.out


def test_the_stand_in_dispatches_what_hybridep_returns(monkeypatch) -> None:
    """world/hybrid_ep.py: shapes from the routing map's values, as HybridEP's kernels give them."""
    import torch

    from inspector.world import deep_ep, hybrid_ep

    table: dict[int, torch.Tensor] = {}
    values = SimpleNamespace(get=lambda t: table.get(id(t)),
                             set=lambda t, v: table.__setitem__(id(t), v))  # fmt: skip
    monkeypatch.setattr(deep_ep, "host_values", values)
    group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    buffer = hybrid_ep.HybridEPBuffer(group, 64, 100, 2)  # 4 experts over 2 ranks, 2 each
    routing = torch.empty(10, 4, dtype=torch.bool, device="meta")
    host = torch.zeros(10, 4, dtype=torch.bool)
    host[:, 0], host[:5, 1], host[:, 3] = True, True, True
    table[id(routing)] = host
    hidden = torch.empty(10, 64, dtype=torch.bfloat16, device="meta")
    probs = torch.empty(10, 4, device="meta")
    out, out_probs, scales, per_expert, handle = buffer.dispatch_with_permute(
        hidden=hidden, routing_map=routing, probs=probs, num_of_experts_per_rank=2)
    # rank 0 holds experts 0 and 1: 10 and 5 tokens from each of the 2 ranks (all route alike)
    assert per_expert.tolist() == [20, 10] and not per_expert.is_meta
    assert (out.shape, out.dtype, out_probs.shape, scales) == ((30, 64), torch.bfloat16, (30,), None)
    # permute.cu: row_id_map over the buffer's worst case, max(100, 512) tokens x 2 ranks
    assert handle[5].shape == (1024, 2) and handle[4].shape == (20, 2)  # local map [10 x 2, 2]
    combined, combined_probs = buffer.combine_with_unpermute(hidden=out, probs=out_probs, handle=handle)
    assert combined.shape == (10, 64) and combined_probs.shape == (10, 4)
    again = buffer.dispatch_with_permute(hidden=combined, handle=handle, num_permuted_tokens=30)
    assert again[0].shape == (30, 64)  # the combine's backward: the same tokens, by the handle


@pytest.mark.slow
@needs_016
def test_composed_hybridep_stages_equal_every_layer_run() -> None:
    """One layer of each kind stands for the rest under HybridEP too (its handle per layer)."""
    from tests.composition import assert_composed_equals_whole
    from tests.test_engine import _MOE_TP1, _job

    job = _job(**{**_MOE_TP1, "num_experts": 8}, num_layers=4, moe_layer_freq=2,
               data_parallel_size=2, expert_model_parallel_size=2,
               moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")  # fmt: skip
    cache = assert_composed_equals_whole(job)
    assert {moe for _, _, small, _ in cache for moe, _ in small} == {True, False}  # (MoE, GDN)


@needs_016
@pytest.mark.parametrize("flags, message", [
    # HybridEP sends 2-byte words; its combine asserts a 2-byte element
    (("--fp32",), "--moe-flex-dispatcher-backend hybridep needs 16-bit activations (--bf16 or "
                  "--fp16)"),
    # 12 ranks over 8-GPU nodes: HybridEP asserts group % ranks-per-node == 0
    (("--ep", "12", "--num-experts", "24", "--dp", "12"),
     "--moe-flex-dispatcher-backend hybridep: --expert-tensor-parallel-size 1 x --ep 12 = 12 "
     "ranks, 8 a node of 8 GPUs: HybridEP needs the group to fill whole nodes or lie within one"),
    # BufferConfig::is_valid: experts per rank x ranks per node a multiple of 4
    (("--ep", "2", "--num-experts", "2", "--moe-router-topk", "1", "--dp", "2"),
     "HybridEP refuses 1 local experts x 2 ranks a node = 2, not a multiple of 4"),
])
def test_hybrideps_refusals(flags, message) -> None:
    args = [a for a in TINY if a != "--bf16"] if "--fp32" in flags else list(TINY)
    flags = tuple(f for f in flags if f != "--fp32")
    if "--ep" not in flags:
        flags += ("--ep", "2", "--dp", "2")
    result = run_cli("memory", *args, *flags, *HYBRIDEP)
    assert result.code == 2
    assert result.err.startswith("Error: ") and message in result.err, result.err


@pytest.mark.skipif(INSTALLED_NEW, reason="megatron-core before 0.16 has no HybridEP")
def test_before_016_the_backend_flag_is_refused() -> None:
    # Megatron-LM 0.13-0.15 has no --moe-flex-dispatcher-backend: every command stops on it
    for command in ("memory", "plan"):
        result = run_cli(command, *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2", *HYBRIDEP,
                         *(("--gpus", "4", "--gpu", "h100") if command == "plan" else ()))  # fmt: skip
        assert result.code == 2
        assert "--moe-flex-dispatcher-backend is not an argument of Megatron-LM" in result.err


@needs_016
def test_plan_refuses_what_hybridep_refuses_before_searching() -> None:
    # the same words as memory's: a fixed group HybridEP cannot lay over 8-GPU nodes, 32-bit
    plan = ("plan", *TINY, "--gpus", "12", "--global-batch-size", "12", "--tp", "1", "--pp", "1",
            "--gpu", "h100", *HYBRIDEP)  # fmt: skip
    group = run_cli(*plan, "--ep", "12", "--num-experts", "24")
    assert group.code == 2 and "HybridEP needs the group to fill whole nodes" in group.err, group.err
    fp32 = run_cli(*[a for a in plan if a != "--bf16"], "--ep", "4")
    assert fp32.code == 2 and "hybridep needs 16-bit activations" in fp32.err, fp32.err
