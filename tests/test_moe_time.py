"""What an MoE recipe's step runs that the time model once left out (bench/RESULTS.md, "What the
MoE step leaves unpriced"): Qwen3's per-head Q and K norms, Transformer Engine's amax pass under
current scaling, and the streaming multiprocessors a fused dispatch kernel takes from the
compute it overlaps. Each term is computed here by hand from its source's arithmetic.
"""

from __future__ import annotations

import pytest

from inspector.formulas.kernels import Memory, op_seconds
from inspector.formulas.ops import Shard, layer_ops
from inspector.job.dims import ModelDims
from inspector.job.hardware import GPUS

SEQ, HIDDEN, HEADS, GROUPS, HEAD = 512, 256, 8, 2, 32


def _dims(**extra: object) -> ModelDims:
    return ModelDims(2, HIDDEN, HEADS, SEQ, 1024, num_query_groups=GROUPS, swiglu=True,
                     flash_attention=True, **extra)  # type: ignore[arg-type]  # fmt: skip


def _named(ops, name: str) -> list[Memory]:
    return [op for op in ops if isinstance(op, Memory) and op.name == name]


def test_qk_layernorm_normalises_each_query_and_key_head():
    # megatron-core attention.py: query = q_layernorm(query), key = k_layernorm(key), on the
    # rank's heads (a / t query heads, g / t key heads) of head size d, for every token
    z = Shard(tp=2, micro_batch=2)
    tokens = SEQ * 2
    ops = layer_ops(_dims(qk_layernorm=True), z, False)
    (forward,) = _named(ops.forward, "QK norm")
    (backward,) = _named(ops.backward, "QK norm backward")
    assert forward.elements == tokens * (HEADS // 2 + GROUPS // 2) * HEAD == 163_840
    assert (forward.cls, forward.bytes_per_element, backward.bytes_per_element) == ("rms_norm", 4, 6)
    assert not _named(layer_ops(_dims(), z, False).forward, "QK norm")


def test_current_scaling_reads_each_fp8_input_once_more_for_its_amax():
    z = Shard(micro_batch=1)
    delayed = layer_ops(_dims(fp8="hybrid", fp8_recipe="delayed"), z, False)
    current = layer_ops(_dims(fp8="hybrid", fp8_recipe="tensorwise"), z, False)
    assert not [op for op in delayed.forward + delayed.backward if op.name.endswith("amax")]
    forward = {op.name: op for op in current.forward if op.name.endswith("fp8 amax")}
    backward = {op.name: op for op in current.backward if op.name.endswith("fp8 amax")}
    # TE's LayerNormLinear (QKV, a dense fc1) gets the amax from its norm kernel: no pass
    assert sorted(forward) == ["MLP fc2 fp8 amax", "attention output fp8 amax"]
    assert sorted(backward) == ["MLP fc1 fp8 amax", "MLP fc2 fp8 amax", "QKV fp8 amax",
                                "attention output fp8 amax"]  # fmt: skip
    ffn = 4 * HIDDEN  # ModelDims' default f = 4h
    assert forward["MLP fc2 fp8 amax"].elements == SEQ * ffn  # fc2 reads the f-wide activation
    assert backward["QKV fp8 amax"].elements == SEQ * (HEADS + 2 * GROUPS) * HEAD
    assert {op.bytes_per_element for op in (*forward.values(), *backward.values())} == {2}
    # each pass costs its 2 bytes an element at the copy rate: the layers differ by exactly those
    h100 = GPUS["h100"]
    extra = sum(op_seconds(op, h100) for op in (*forward.values(), *backward.values()))
    gap = sum(op_seconds(op, h100) for op in current.forward + current.backward) - sum(
        op_seconds(op, h100) for op in delayed.forward + delayed.backward)
    assert gap == pytest.approx(extra)
    assert extra > 0


def test_an_exchange_kernel_slows_the_compute_beside_it_by_its_share_of_the_sms():
    from inspector.plan.overlap import Nodes, pair_seconds

    # compute-bound pair (tests/test_moe_overlap.py: 6 s of compute, exchanges of 0.01 s): each
    # of the four exchanges runs beside one compute node, which does 0.01 (1 - f) s of work in
    # those 0.01 s instead of 0.01: the pair grows by 4 x 0.01 x f
    kw = dict(attn_f=1, mlp_f=1, combine_f=0, attn_b=2, attn_dw=0, mlp_b=2, mlp_dw=0, combine_b=0)
    assert pair_seconds(Nodes(**kw, alltoall=0.01, taken=0.5)) == pytest.approx(6.02)
    assert pair_seconds(Nodes(**kw, alltoall=0.01, taken=0.0)) == pytest.approx(6.0)
    # exchange-bound pair: the slowed compute still hides behind the four 1 s exchanges
    small = dict(attn_f=0.1, mlp_f=0.1, combine_f=0, attn_b=0.2, attn_dw=0, mlp_b=0.2, mlp_dw=0,
                 combine_b=0)  # fmt: skip
    assert pair_seconds(Nodes(**small, alltoall=1.0, taken=0.5)) == pytest.approx(4.0)


def test_the_exchange_holds_the_dispatchers_sms_of_the_gpus():
    from dataclasses import replace

    from inspector.job.flex import BACKEND_SINCE, megatron_version
    from inspector.job.job import Training
    from inspector.plan.flex import exchange_sm_share

    h100 = GPUS["h100"]
    flex = Training(moe_token_dispatcher_type="flex")
    # megatron-core's defaults: DeepEP 20 SMs (--moe-deepep-num-sms), HybridEP 16; H100: 132
    assert exchange_sm_share(flex, h100) == pytest.approx(20 / 132)
    assert exchange_sm_share(replace(flex, moe_deepep_num_sms=24), h100) == pytest.approx(24 / 132)
    hybridep = 16 if megatron_version() >= BACKEND_SINCE else 20  # before 0.16: DeepEP only
    assert exchange_sm_share(replace(flex, moe_flex_backend="hybridep"), h100) == pytest.approx(hybridep / 132)
    # the all-to-all dispatcher: NCCL's send/receive kernel, a thread block per p2p channel (32
    # on NVSwitch nodes, NCCL's init log); the allgather dispatcher never runs beside compute
    assert exchange_sm_share(replace(flex, moe_token_dispatcher_type="alltoall"), h100) == pytest.approx(32 / 132)
    assert exchange_sm_share(replace(flex, moe_token_dispatcher_type="allgather"), h100) == 0.0
    assert exchange_sm_share(flex, GPUS["gb200"]) == pytest.approx(20 / 152)  # GB200's 152 SMs
    assert exchange_sm_share(flex, replace(h100, sms=None)) == 0.0  # no cited SM count


def test_the_all_to_all_dispatcher_sorts_received_tokens_by_local_expert_and_back():
    # token_dispatcher.py MoEAlltoAllTokenDispatcher: with 2+ local experts, sort_chunks_by_idxs
    # after the exchange and before the combine, each a copy (read 2, write 2 bytes) of the
    # tokens the rank's experts receive: T k e / E for each of E / e experts, T k = 1,024 rows of h
    moe = dict(num_experts=8, moe_router_topk=2)
    z = Shard(ep=2, micro_batch=1)
    ops = layer_ops(_dims(**moe, moe_sorts_chunks=True), z, True)
    for name in ("sort chunks", "unsort chunks"):
        (forward,) = _named(ops.forward, name)
        (backward,) = _named(ops.backward, name + " backward")
        assert forward.elements == backward.elements == SEQ * 2 * HIDDEN
        assert forward.bytes_per_element == backward.bytes_per_element == 4
    assert not _named(layer_ops(_dims(**moe), z, True).forward, "sort chunks")  # flex
    one = Shard(ep=8, micro_batch=1)  # one local expert: nothing to sort
    assert not _named(layer_ops(_dims(**moe, moe_sorts_chunks=True), one, True).forward, "sort chunks")


def test_job_dims_sort_only_under_the_all_to_all_dispatcher():
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    flags = dict(num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=512,
                 max_position_embeddings=512, vocab_size=1000, num_experts=8, moe_router_topk=2,
                 bf16=True, micro_batch_size=1, expert_model_parallel_size=2, data_parallel_size=2)  # fmt: skip
    for dispatcher, sorts in (("alltoall", True), ("allgather", False)):
        args = merge_sources(Sources(flags={**flags, "moe_token_dispatcher_type": dispatcher}),
                             ("model", "layout", "training")).args  # fmt: skip
        assert make_job(args).dims().moe_sorts_chunks is sorts


def test_fp8_experts_pad_their_input_and_unpad_their_output():
    # experts.py TEGroupedMLP under fp8: Fp8Padding (TE fused_multi_row_padding) of the T k rows
    # of h its experts receive, Fp8Unpadding of their output; backward the opposite copies
    z = Shard(ep=2, micro_batch=1)
    moe = dict(num_experts=8, moe_router_topk=2)
    ops = layer_ops(_dims(**moe, fp8="hybrid"), z, True)
    for name in ("expert fp8 padding", "expert fp8 unpadding"):
        (forward,) = _named(ops.forward, name)
        (backward,) = _named(ops.backward, name + " backward")
        assert forward.elements == backward.elements == SEQ * 2 * HIDDEN
        assert forward.bytes_per_element == backward.bytes_per_element == 4
    assert not _named(layer_ops(_dims(**moe), z, True).forward, "expert fp8 padding")
