"""The flex token dispatcher (DeepEP) in `memory`: megatron's MoEFlexTokenDispatcher runs on the
DeepEP stand-in (inspector/world/deep_ep.py), and DeepEP's buffers outside PyTorch's allocator are
counted from the sizes megatron asks for."""

from __future__ import annotations

import dataclasses
import json

import megatron.core
import pytest

from tests.conftest import run_cli
from tests.test_engine import _MOE_TP1
from tests.test_engine import _job as _engine_job
from tests.test_versions import DEEPEP_KEEPS_DISPATCHED

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
MIB = 1 << 20
# megatron-core before 0.16 runs the flex dispatcher with DeepEP only, and only with
# --moe-enable-deepep (MoEFlexTokenDispatcher asserts it; job/flex.py): the flag is added there
OLD_DEEPEP = () if VERSION >= (0, 16) else ("--moe-enable-deepep",)
FLEX = ("--moe-token-dispatcher-type", "flex", *OLD_DEEPEP)
# TransformerConfig's refusal of padding to capacity: 0.16 names the deepep backend
PAD_QUOTE = ("Flex token dispatcher with deepep backend does not support "
             "moe_pad_expert_input_to_capacity" if VERSION >= (0, 16) else
             "Flex token dispatcher does not support moe_pad_expert_input_to_capacity")  # fmt: skip


def _job(**flags):
    """tests/test_engine.py's job, with --moe-enable-deepep under flex where megatron-core needs it."""
    if flags.get("moe_token_dispatcher_type") == "flex" and OLD_DEEPEP:
        flags["moe_enable_deepep"] = True
    return _engine_job(**flags)

# a small Mixtral: 8 experts, top-2, hidden 256
TINY = ("--model", "mixtral-8x7b", "--num-layers", "2", "--hidden-size", "256",
        "--ffn-hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--bf16",
        "--micro-batch-size", "1")  # fmt: skip


def _nvl_hint(hidden_bytes: int, ranks: int, recv: int, sms: int = 20) -> int:
    """DeepEP csrc/config.hpp get_nvl_buffer_size_hint, written out for one NVLink domain or more."""
    channels, nvl, rdma = sms // 2, min(ranks, 8), max(ranks // 8, 1)
    queue = channels * nvl * recv
    # counters; tokens; SourceMeta (8 B); 128 int64 top-k indices; 128 fp32 weights; 128 fp32 scales
    raw = channels * nvl * (2 * rdma + 3) * 4 + queue * (hidden_bytes + 8 + 1024 + 512 + 512)
    return -(-raw // 128) * 128


def test_deepep_buffer_hints_match_hand_arithmetic():
    from inspector.world.deep_ep import Buffer

    Buffer.set_num_sms(20)
    # ep 2, hidden 64 in bf16 (128 bytes a token): 10 channels x 2 ranks x 256 tokens queued,
    # 2,184 bytes each, + 400 bytes of counters = 11,182,480, rounded up to 128: 11,182,592
    for config in (Buffer.get_dispatch_config(2), Buffer.get_combine_config(2)):
        assert config.get_nvl_buffer_size_hint(128, 2) == 11_182_592 == _nvl_hint(128, 2, 256)
        assert config.get_rdma_buffer_size_hint(128, 2) == 0  # one NVLink domain: no RDMA
    # ep 16 (two NVLink domains), DeepSeek-V3's hidden 7168 in bf16 (14,336 bytes)
    dispatch, combine = Buffer.get_dispatch_config(16), Buffer.get_combine_config(16)
    assert dispatch.get_nvl_buffer_size_hint(14336, 16) == 377_673_984 == _nvl_hint(14336, 16, 288)
    # RDMA: the receive queue 128 rounded up to the send chunk (dispatch 20, combine 28): 140;
    # 10 channels x 2 RDMA ranks x 140 tokens x 2 (send and receive) x (14,336 + 8 + 1,024 + 512
    # + 512 + 16) bytes + 2,880 bytes of counters + 1 MiB "to be safe" = 92,936,256 -> 92,936,320
    assert dispatch.num_max_rdma_chunked_recv_tokens == combine.num_max_rdma_chunked_recv_tokens == 140
    assert dispatch.get_rdma_buffer_size_hint(14336, 16) == 92_936_320
    assert combine.get_rdma_buffer_size_hint(14336, 16) == 92_936_320


class _Table:
    """A host-value table as the engine keeps one (memory/engine/moe.py `_HostValues.get` / `set`)."""

    def __init__(self) -> None:
        self.values: dict[int, object] = {}

    def get(self, tensor):
        return self.values.get(id(tensor))

    def set(self, tensor, values):
        self.values[id(tensor)] = values


def test_the_deepep_stand_in_returns_deepep_s_shapes_and_dtypes(monkeypatch):
    """deep_ep/buffer.py's docstrings and csrc/deep_ep.cpp's intranode allocations: 6 tokens,
    top-2 of 8 experts over 4 ranks (2 experts each), hidden 16 in bf16, rank 1."""
    import torch

    from inspector.world import deep_ep

    table = _Table()
    monkeypatch.setattr(deep_ep, "host_values", table)
    group = type("G", (), {"rank": lambda self: 1, "size": lambda self: 4})()
    buffer = deep_ep.Buffer(group, 1024, 0)
    idx = torch.empty(6, 2, dtype=torch.int64, device="meta")
    table.set(idx, torch.tensor([[0, 2], [2, 3], [4, 5], [6, 7], [1, 3], [0, 1]]))
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 8)
    assert (per_rank.dtype, per_rank.shape, per_expert.dtype, per_expert.shape) == (
        torch.int32, (4,), torch.int32, (8,))
    assert per_rdma is None and (in_rank.dtype, in_rank.shape) == (torch.bool, (6, 4))
    assert table.get(per_rank).tolist() == [3, 3, 1, 1]  # rank 1 (experts 2, 3): tokens 0, 1, 4
    weights = torch.empty(6, 2, dtype=torch.float32, device="meta")
    table.set(weights, torch.full((6, 2), 0.5))
    x = torch.empty(6, 16, dtype=torch.bfloat16, device="meta")
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=weights)  # fmt: skip
    # every rank sends rank 1 its tokens 0, 1, 4: 12 rows; local experts 0 (global 2), 1 (3)
    assert (recv_x.shape, recv_x.dtype) == ((12, 16), torch.bfloat16)
    assert (recv_idx.dtype, recv_w.dtype, recv_idx.shape) == (torch.int64, torch.float32, (12, 2))
    assert table.get(recv_idx)[:3].tolist() == [[-1, 0], [0, 1], [-1, 1]]
    assert table.get(recv_w)[:3].tolist() == [[0.0, 0.5], [0.5, 0.5], [0.0, 0.5]]
    assert counts == [8, 8]  # experts 2 and 3: two of the three tokens each, from 4 ranks
    assert [tuple(t.shape) for t in handle] == [(4, 4), (4, 10), (4, 10), (12,), (6, 4), (6, 4)]
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert (combined.shape, combined_w.shape, combined_w.dtype) == ((6, 16), (6, 2), torch.float32)
    again = buffer.dispatch(combined, handle=handle)[0]  # the combine's backward
    assert again.shape == (12, 16)


def test_fp32_hidden_states_double_deepep_s_token_bytes():
    """fused_a2a.py get_hidden_bytes: hidden x max(element size, 2)."""
    from inspector.memory.engine.run import outside_allocator
    from inspector.memory.engine.stage import ChunkShape

    shape = ChunkShape((0,), True, True, 0)
    sizes = {}
    for dtype in ("bf16", "fp32"):
        flags = {"bf16": dtype == "bf16"}
        job = _job(**{**_MOE_TP1, **flags}, num_layers=1, pipeline_model_parallel_size=1,
                   data_parallel_size=2, expert_model_parallel_size=2,
                   moe_token_dispatcher_type="flex")  # fmt: skip
        sizes[dtype] = dict(outside_allocator(job, [shape]))["DeepEP NVLink buffer"] - 160
    assert sizes == {"bf16": _nvl_hint(128, 2, 256), "fp32": _nvl_hint(256, 2, 256)}


def test_the_run_asks_deepep_for_the_buffer_memory_counts():
    """megatron's get_buffer, called in the forward, sizes the Buffer `outside_allocator` reports."""
    from megatron.core.transformer.moe import fused_a2a

    from inspector.memory.engine.run import run_memory

    fused_a2a._buffer = None
    job = _job(**_MOE_TP1, num_layers=2, pipeline_model_parallel_size=1, data_parallel_size=4,
               expert_model_parallel_size=4, moe_token_dispatcher_type="flex")  # fmt: skip
    run = run_memory(job, 0)
    made = fused_a2a._buffer  # the one megatron made while the MoE layers ran
    assert made is not None and made.group_size == 4
    assert (made.num_nvl_bytes, made.num_rdma_bytes) == (_nvl_hint(128, 4, 256), 0)
    nvl = made.num_nvl_bytes + 8 * 4 + 2 * 8 * 8  # + barrier signals and two pointer arrays
    assert run.outside == (("DeepEP NVLink buffer", nvl), ("DeepEP workspace", 32 * MIB))
    assert run.static == sum(s for _, s in run.persistent) + run.workspaces + nvl + 32 * MIB


@pytest.mark.slow
def test_composed_flex_stages_equal_every_layer_run():
    """One layer of each kind stands for the rest under flex too (pp 2, MoE every other layer):
    the dispatcher's per-layer kept metadata included."""
    from tests.composition import assert_composed_equals_whole

    job = _job(**_MOE_TP1, num_layers=6, moe_layer_freq=2, data_parallel_size=2,
               expert_model_parallel_size=2, moe_token_dispatcher_type="flex")  # fmt: skip
    cache = assert_composed_equals_whole(job)
    assert {moe for _, _, small, _ in cache for moe, _ in small} == {True, False}  # (MoE, GDN)


def test_a_stage_without_moe_layers_holds_no_deepep_buffer():
    from inspector.memory.engine.run import outside_allocator
    from inspector.memory.engine.stage import ChunkShape

    job = _job(**_MOE_TP1, num_layers=2, data_parallel_size=2, expert_model_parallel_size=2,
               moe_token_dispatcher_type="flex", moe_layer_freq=[0, 1])  # fmt: skip
    dense, moe = ChunkShape((0,), True, False, 0), ChunkShape((1,), False, True, 0)
    assert outside_allocator(job, [dense]) == ()
    assert [what for what, _ in outside_allocator(job, [moe])] == [
        "DeepEP NVLink buffer", "DeepEP workspace"]


def _events(disp: str):
    from inspector.memory.engine.stage import trace_stage

    job = _job(**_MOE_TP1, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=2,
               expert_model_parallel_size=2, moe_token_dispatcher_type=disp)  # fmt: skip
    trace = trace_stage(job, 0)[0]
    return [(e.bytes, e.where) for e in trace.forward + trace.backward]


def test_activations_differ_from_alltoall_only_in_the_dispatcher():
    """Attention, norms, loss and the experts' GEMMs allocate alike. Where megatron's code differs,
    the trace differs: the token exchange (DeepEP's layout, received tokens and handle, the
    multihot map megatron's _DeepepManager builds, what the manager keeps between micro-batches:
    its indices, probs and map, per layer), and the experts' weighted activation, whose probs
    are fp32 under DeepEP (token_dispatcher.py `_DeepepManager.dispatch`: "DeepEP only supports
    float32 probs", `.float()`) and in the router's 16-bit dtype under alltoall."""
    alltoall, flex = _events("alltoall"), _events("flex")

    def outside_dispatcher(events):
        return [e for e in events if not e[1].startswith("decoder.layers.0.mlp")]

    def gemms(events):
        return [e for e in events if ".mlp.experts." in e[1] and ".linear_fc" in e[1]]

    def activation(events):
        return [e for e in events if "WeightedSwiGLU" in e[1]]

    if DEEPEP_KEEPS_DISPATCHED:
        assert outside_dispatcher(flex) == outside_dispatcher(alltoall)
    else:  # 0.18 on: the manager lets go of its dispatched indices and probs
        # after combine; autograd frees them in backward, outside any layer
        def late(events):
            return [e for e in outside_dispatcher(events) if e[1] == "backward" and e[0] < 0]

        def kept(events):
            return [e for e in outside_dispatcher(events) if e not in late(events)]

        assert kept(flex) == kept(alltoall)
        extra = len(late(flex)) - len(late(alltoall))
        assert extra > 0
    assert gemms(flex) == gemms(alltoall) and gemms(flex)
    # fp32 probs: the activation's products with them are fp32, twice the bf16 ones
    assert max(b for b, _ in activation(flex)) == 2 * max(b for b, _ in activation(alltoall))
    dispatcher = [w for _, w in flex if w.startswith("decoder.layers.0.mlp")]
    assert any("FusedDispatchBackward" in w for w in dispatcher)
    assert any("FusedCombineBackward" in w for w in dispatcher)
    assert flex != alltoall


def test_deepep_receives_what_a_balanced_router_sends(monkeypatch):
    """ep 4, 8 experts, top-2 over 64 tokens: token t picks experts 2t and 2t + 1 (mod 8), and rank
    r holds experts 2r and 2r + 1, so 16 of each rank's 64 tokens go to rank r, once each though
    both their experts are there (DeepEP sends a token to a rank once): 4 x 16 = 64 rows
    received, and each local expert gets all 64 of them."""
    from inspector.world import deep_ep

    received = []
    real = deep_ep.Buffer.dispatch

    def recorded(self, x, *args, **kwargs):
        out = real(self, x, *args, **kwargs)
        if kwargs.get("handle") is None:
            received.append((x.shape[0], out[0].shape[0], out[3]))
        return out

    monkeypatch.setattr(deep_ep.Buffer, "dispatch", recorded)
    from inspector.memory.engine.run import run_memory

    job = _job(**{**_MOE_TP1, "num_experts": 8}, num_layers=1, pipeline_model_parallel_size=1,
               data_parallel_size=4, expert_model_parallel_size=4,
               moe_token_dispatcher_type="flex")  # fmt: skip
    run_memory(job, 0)
    assert received and all(r == (64, 64, [64, 64]) for r in received)


def test_over_two_nvlink_domains_deepep_returns_its_internode_handle(monkeypatch):
    """ep 16 (two nodes of 8), 16 experts, top-2, 64 tokens: token t picks experts 2t and 2t + 1
    (mod 16). Rank 0 holds expert 0: 8 tokens of each rank's 64, 128 received. Node 0 holds
    experts 0-7: 32 tokens of each rank go there, received over RDMA from the same GPU of each of
    the 2 nodes: the NVLink send head has 64 rows (csrc/deep_ep.cpp `internode_dispatch`)."""
    import torch

    from inspector.memory.engine.run import run_memory
    from inspector.world import deep_ep

    handles = []
    real = deep_ep.Buffer.dispatch

    def recorded(self, x, *args, **kwargs):
        out = real(self, x, *args, **kwargs)
        if kwargs.get("handle") is None:
            handles.append((out[0].shape[0], [tuple(t.shape) for t in out[4]], out[4][7].dtype))
        return out

    monkeypatch.setattr(deep_ep.Buffer, "dispatch", recorded)
    job = _job(**{**_MOE_TP1, "num_experts": 16}, num_layers=1, pipeline_model_parallel_size=1,
               data_parallel_size=16, global_batch_size=32, expert_model_parallel_size=16,
               moe_token_dispatcher_type="flex")  # fmt: skip
    run = run_memory(job, 0)
    shapes = [(64, 16), (2, 10), (16, 10), (2, 10), (2,), (16, 10), (16,), (128, 8), (64, 2), (64, 8)]
    assert handles and all(h == (128, shapes, torch.uint8) for h in handles)
    assert [what for what, _ in run.outside] == [
        "DeepEP NVLink buffer", "DeepEP RDMA buffer", "DeepEP workspace"]


@pytest.mark.slow
def test_memory_of_a_small_mixtral_with_flex_runs_and_reports_deepep_outside_torch():
    for ep in ("2", "4"):
        result = run_cli("memory", *TINY, "--ep", ep, "--dp", ep, "--global-batch-size", ep,
                         *FLEX, "--format", "json")  # fmt: skip
        assert result.code == 0, result.err
        stage = json.loads(result.out)["stages"][0]
        outside = dict(stage["buffers"]["outside_allocator"])
        nvl = _nvl_hint(512, int(ep), 256) + 160  # hidden 256 in bf16: 512 bytes a token
        assert outside == {"DeepEP NVLink buffer": nvl, "DeepEP workspace": 32 * MIB}
        buffers = stage["buffers"]
        assert buffers["total"] == (sum(s for _, s in buffers["persistent"])
                                    + buffers["workspaces"] + nvl + 32 * MIB)  # fmt: skip
    text = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2",
                   *FLEX)  # fmt: skip
    assert "flex dispatcher" in text.out
    assert "Stage 0: outside PyTorch's allocator 0.04 GiB (DeepEP NVLink buffer 0.01 GiB, " \
        "DeepEP workspace 0.03 GiB): in buffers and the total, not in what " \
        "torch.cuda.max_memory_allocated reports" in text.out  # fmt: skip


def test_no_deepep_buffer_without_the_flex_dispatcher():
    result = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2",
                     "--moe-token-dispatcher-type", "alltoall", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    assert "outside_allocator" not in json.loads(result.out)["stages"][0]["buffers"]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--ep", "1", "--dp", "2"),
         "Error: --moe-token-dispatcher-type flex needs expert parallelism: --expert-tensor-parallel-size 1 x --ep 1 = 1 "
         "(megatron-core's MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP > 1')\n"),
        (("--num-experts", "12", "--ep", "6", "--dp", "6"),
         "Error: --moe-token-dispatcher-type flex: DeepEP has no configuration for --expert-tensor-parallel-size 1 x --ep "
         "6 = 6 ranks (deep_ep Buffer.get_dispatch_config knows 2, 4, 8, 16, 24, 32, 64, 128, "
         "144, 160)\n"),
        (("--ep", "2", "--dp", "2", "--moe-expert-capacity-factor", "1",
          "--moe-pad-expert-input-to-capacity"),
         "Error: --moe-pad-expert-input-to-capacity does not run with the flex dispatcher's "
         f"DeepEP backend (megatron-core's TransformerConfig: '{PAD_QUOTE}')\n"),
        (("--ep", "2", "--dp", "2", "--moe-deepep-num-sms", "21"),
         "Error: --moe-deepep-num-sms 21 must be even (DeepEP's Buffer.set_num_sms: 'The SM "
         "count must be even')\n"),
    ],
    ids=["no-ep", "ep6", "pad", "odd-sms"],
)
def test_megatron_and_deepep_rules_are_errors(flags, error):
    result = run_cli("memory", *TINY, "--global-batch-size", "12",
                     *FLEX, *flags)  # fmt: skip
    assert (result.code, result.err) == (2, error)


def test_which_megatron_core_knows_the_flex_backend_flag():
    """0.13-0.15 have DeepEP alone, switched on by moe_enable_deepep (their flex dispatcher asserts
    it); 0.16+ names the backend, deepep or hybridep. The engine gives each what it takes."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from inspector.job.job import Training
    from inspector.memory.engine.runtime import _flex_fields

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    fields = _flex_fields(Training(micro_batch_size=1, global_batch_size=1,
                                   moe_token_dispatcher_type="flex"))  # fmt: skip
    if VERSION >= (0, 16):
        assert "moe_flex_dispatcher_backend" in names
        assert fields == {"moe_deepep_num_sms": 20, "moe_flex_dispatcher_backend": "deepep"}
    else:
        assert VERSION == (0, 13) and "moe_flex_dispatcher_backend" not in names
        assert fields == {"moe_deepep_num_sms": 20, "moe_enable_deepep": True}


def test_the_flex_group_is_expert_tensor_times_expert_parallel():
    """tp 2, etp 2, ep 2: the dispatcher's group has 4 ranks (token_dispatcher.py `tp_ep_group`),
    each token sent to both expert-tensor-parallel ranks of its experts; DeepEP's buffer is sized
    for 4 ranks."""
    from inspector.memory.engine.run import run_memory
    from tests.test_engine import _MOE

    job = _job(**_MOE, num_layers=2, pipeline_model_parallel_size=1, tensor_model_parallel_size=2,
               expert_tensor_parallel_size=2, data_parallel_size=2, expert_model_parallel_size=2,
               moe_token_dispatcher_type="flex")  # fmt: skip
    run = run_memory(job, 0)
    assert run.outside == (("DeepEP NVLink buffer", _nvl_hint(128, 4, 256) + 160),
                           ("DeepEP workspace", 32 * MIB))  # fmt: skip
