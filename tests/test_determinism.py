"""What --deterministic-mode, --no-gradient-accumulation-fusion and Transformer Engine's unfused
attention add to a layer's step time (formulas/determinism.py, te_unfused.py, ops.py), checked
against hand counts."""

from __future__ import annotations

from inspector.formulas.kernels import Memory
from inspector.formulas.ops import Shard, layer_ops, output_ops
from tests.test_engine import _job

# bf16 with --attention-backend auto: Transformer Engine's fused (cuDNN) attention; Megatron-LM refuses
# --use-flash-attn with --deterministic-mode (tests/test_arguments.py)
TE = dict(transformer_impl="transformer_engine", bf16=True, seq_length=64)


def _backward(job, *, tp: int = 2, mbs: int = 2) -> dict[str, Memory]:
    ops = layer_ops(job.dims(), Shard(tp=tp, micro_batch=mbs), False)
    return {op.name: op for op in ops.backward if isinstance(op, Memory)}


def test_deterministic_attention_backward_writes_and_reads_the_causal_half_of_dp():
    # cuDNN's deterministic backward on Hopper: a [b, h, s, s] 16-bit dP workspace, written and
    # read once (NVIDIA/cudnn-frontend#398); causal: half the tiles. 4 heads / tp 2 x mbs 2.
    plain = _backward(_job(**TE))
    deterministic = _backward(_job(**TE, deterministic_mode=True))
    added = set(deterministic) - set(plain)
    assert added == {"deterministic attention dP workspace"}
    workspace = deterministic["deterministic attention dP workspace"]
    assert workspace.elements == (4 // 2 * 2) * 64 * 64 // 2
    assert workspace.bytes == workspace.elements * (2 + 2)
    # megatron's unfused DotProductAttention is deterministic as it is: nothing added
    unfused = dict(transformer_impl="transformer_engine", seq_length=64, attention_backend="unfused")
    plain = _backward(_job(**unfused))
    assert "scale-mask-softmax backward" in plain
    assert set(_backward(_job(**unfused, deterministic_mode=True))) == set(plain)


def test_no_gradient_accumulation_fusion_adds_ddps_main_grad_add_under_transformer_engine():
    # TE's linears get fuse_wgrad_accumulation=config.gradient_accumulation_fusion; without it
    # the wgrad is a 16-bit tensor DDP's hook adds into main_grad: read 4 + 2, write 4 per weight
    fused = _backward(_job(**TE))
    unfused = _backward(_job(**TE, no_gradient_accumulation_fusion=True))
    added = {name: op for name, op in unfused.items() if name not in fused}
    h, ffn, tp = 64, 4 * 64, 2
    assert {name: op.bytes for name, op in added.items()} == {
        "QKV main_grad.add_": 3 * h * h // tp * 10,
        "attention output main_grad.add_": h * h // tp * 10,
        "MLP fc1 main_grad.add_": h * ffn // tp * 10,
        "MLP fc2 main_grad.add_": ffn * h // tp * 10,
    }


def test_no_gradient_accumulation_fusion_adds_the_output_layers_main_grad_add():
    # the output layer is megatron's ColumnParallelLinear: the same DDP hook adds its gradient
    job = _job(**TE, no_gradient_accumulation_fusion=True)
    dims = job.dims()
    names = {op.name: op for op in output_ops(dims, Shard(tp=2, micro_batch=2)).backward}
    assert names["output layer main_grad.add_"].bytes == 64 * dims.vocab_size // 2 * 10
    fused = output_ops(_job(**TE).dims(), Shard(tp=2, micro_batch=2)).backward
    assert not any(op.name.endswith("main_grad.add_") for op in fused)


def test_plan_keeps_deterministic_mode_and_prices_it():
    # the plan re-makes each candidate's training from what it keeps of the user's flags
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    args = dict(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=2048,
                vocab_size=1000, micro_batch_size=1, global_batch_size=8, bf16=True,
                transformer_impl="transformer_engine", tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, context_parallel_size=1,
                expert_model_parallel_size=1)  # fmt: skip

    def step(**flags: object) -> float:
        plans = search(make_request({**args, **flags}, PlanFlags(8, "h100", top=1))).plans
        return plans[0].time.seconds

    assert step(deterministic_mode=True) > step()


def test_transformer_engines_unfused_attention_rebuilds_the_causal_mask_each_call():
    # TE's UnfusedDotProductAttention calls get_full_mask every forward: int32 differences,
    # comparisons, two int64 torch.where, their difference, logical_not: 81 bytes a position,
    # once per call ([s, s], not per head); megatron's own DotProductAttention does not
    unfused = dict(seq_length=64, attention_backend="unfused")
    te = layer_ops(_job(transformer_impl="transformer_engine", **unfused).dims(), Shard(tp=2), False)
    masks = [op for op in te.forward if op.name == "causal mask (Transformer Engine)"]
    assert [(op.elements, op.bytes) for op in masks] == [(64 * 64, 64 * 64 * 81)]
    assert masks[0] in te.core  # inside core attention: recomputed with it
    local = layer_ops(_job(transformer_impl="local", **unfused).dims(), Shard(tp=2), False)
    assert not any(op.name == "causal mask (Transformer Engine)" for op in local.forward)
