"""--delay-wgrad-compute with --use-transformer-engine-op-fuser: TE 2.14's ops.GroupedLinear keeps
its weight-gradient GEMMs' operands (`wgrad_store`) from the experts' backward until megatron-core's
TEGroupedMLP.backward_dw runs them (world/te/ops.py, world/te/fused_mlp.py, memory/engine/
delayed_wgrad.py).

Expectations by hand from TE's `v2.14` tag: module/_common.py 198-270 (`WeightGradStore`),
ops/basic/grouped_linear.py 189-222 (`backward_dw`) and 912-989 (`fuser_backward`: the GEMM put
with [xs, dys, grad_weights], the input views not cleared, no weight gradient returned),
ops/fused/backward_grouped_mlp.py 127-160, 536-539 and 631-634 (the fused MXFP8 kernel's: the
column-wise input and the MXFP8 output gradient kept, the input not cleared); megatron-core
0.19.2's transformer/moe/experts.py `TEGroupedMLP.backward_dw` (fc2's, then fc1's).
"""

from __future__ import annotations

import inspect

import pytest

from tests.test_op_fuser import HAS_OP_FUSER, SPLITS, F, H, N, _as_param, _meta, _ops

needs_op_fuser = pytest.mark.skipif(not HAS_OP_FUSER, reason="megatron-core 0.18 added the op fuser")
BF16 = 2


def _delayed_mlp(ops, delay=True):
    fc1 = ops.GroupedLinear(len(SPLITS), H, 2 * F, bias=False, device="meta", delay_wgrad_compute=delay)
    fc2 = ops.GroupedLinear(len(SPLITS), F, H, bias=False, device="meta", delay_wgrad_compute=delay)
    for i in range(len(SPLITS)):
        fc1.register_parameter(f"weight{i}", _as_param(_meta(2 * F, H)))
        fc2.register_parameter(f"weight{i}", _as_param(_meta(H, F)))
    return fc1, fc2, ops.Sequential().append(fc1).append(ops.ScaledSwiGLU()).append(fc2)


def test_the_store_runs_and_empties_as_tes_weight_grad_store():
    # _common.py 240-263: put keeps (operands, GEMM); pop runs the oldest and returns both;
    # popping an empty queue raises; without delay there is no queue
    ops = _ops()
    store = ops.WeightGradStore(True)
    store.put([1, 2, 3], lambda a, b, c: a + b + c)
    store.put([4, 5, 6], lambda a, b, c: a * b * c)
    assert store.pop() == (6, [1, 2, 3]) and store.pop() == (120, [4, 5, 6])
    with pytest.raises(RuntimeError, match="Pop empty queue"):
        store.pop()
    assert ops.WeightGradStore(False).context is None and not ops.WeightGradStore(False).delay_wgrad_compute()


def test_basic_ops_keep_the_wgrad_operands_until_backward_dw():
    # against the same backward without the delay, the backward keeps fc2's input [N, F] (views
    # of the scaled SwiGLU output, not cleared), fc2's output gradient [N, H], fc1's [N, 2F]
    # (ScaledSwiGLU's input gradient) and the new weight-gradient buffers, and returns no weight
    # gradient. backward_dw (fc2's, then fc1's, as megatron calls them) frees the operands and
    # sets each weight's .grad
    import torch

    from inspector.memory.engine.allocator import Tracker

    ops = _ops()
    kept = {}
    for delay in (False, True):
        fc1, fc2, fused = _delayed_mlp(ops, delay)
        x, probs, splits = _meta(N, H), _meta(N), torch.tensor(SPLITS)
        tracker = Tracker()
        with tracker:
            out = fused(x, splits, probs, splits)
            before = tracker.allocated
            grads = torch.autograd.grad(out, (x, probs), torch.empty_like(out))
            del out
            kept[delay] = tracker.allocated - before
            if not delay:
                continue
            assert all(w.grad is None for w in fused.parameters())
            assert len(fc1.wgrad_store.context) == len(fc2.wgrad_store.context) == 1
            at = tracker.allocated
            fc2.backward_dw()
            assert at - tracker.allocated == (N * F + N * H) * BF16
            at = tracker.allocated
            fc1.backward_dw()
            assert at - tracker.allocated == N * 2 * F * BF16  # fc1's input (views of x) stays x's
    wgrads = 2 * (2 * F * H + H * F) * BF16  # made in the backward, written by backward_dw
    assert kept[True] - kept[False] == (N * F + N * H + N * 2 * F) * BF16 + wgrads
    assert not fc1.wgrad_store.context and not fc2.wgrad_store.context
    assert [tuple(p.grad.shape) for p in fused.parameters()] == [(2 * F, H)] * 2 + [(H, F)] * 2
    assert [tuple(g.shape) for g in grads] == [(N, H), (N,)]
    fc1.backward_dw()  # grouped_linear.py 193-194: nothing kept, nothing done


def test_the_fused_mxfp8_mlp_keeps_its_quantized_operands(monkeypatch):
    # backward_grouped_mlp.py 131-139: fc2 keeps its input's columns [N, F] and the quantized
    # output gradient (row- and column-wise [N, H]); fc1 its input's columns [N, H] and the
    # dSwiGLU kernel's gradient (row- and column-wise [N, 2F]); none cleared in the backward
    import torch

    from inspector.memory.engine.allocator import Tracker
    from tests.test_fused_mlp import SPLITS as SPLITS2
    from tests.test_fused_mlp import F as f
    from tests.test_fused_mlp import G, N, _mlp, _te
    from tests.test_fused_mlp import H as H2

    monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
    te_pytorch, recipe, ops = _te()

    def mx(rows, cols):  # one direction of an MXFP8 tensor with its E8M0 scales
        return rows * cols + rows * cols // 32

    runs = {}
    for delay in (False, True):
        mlp = _mlp(ops)
        fc1, _, fc2 = mlp.children()
        for op in (fc1, fc2):
            op.wgrad_store = ops.WeightGradStore(delay)
        x, probs = _meta(N, H2), torch.empty(N, device="meta", requires_grad=True)
        tracker = Tracker()
        with tracker, te_pytorch.fp8_autocast(enabled=True, fp8_recipe=recipe.MXFP8BlockScaling()):
            out = mlp(x, torch.tensor(SPLITS2), probs, torch.tensor(SPLITS2))
        before = tracker.allocated
        with tracker:
            torch.autograd.grad(out, (x, probs), torch.empty_like(out))
            del out
            runs[delay] = tracker.allocated - before
            if delay:
                at = tracker.allocated
                fc2.backward_dw()
                assert at - tracker.allocated == mx(N, f) + 2 * mx(N, H2)
                at = tracker.allocated
                fc1.backward_dw()
                assert at - tracker.allocated == mx(N, H2) + 2 * mx(N, 2 * f)
                assert all(p.grad is not None for p in mlp.parameters())
    kept = mx(N, f) + 2 * mx(N, H2) + mx(N, H2) + 2 * mx(N, 2 * f)
    wgrads = G * (2 * f * H2 + H2 * f) * BF16  # new buffers kept for backward_dw
    assert runs[True] - runs[False] == kept + wgrads


@needs_op_fuser
def test_megatron_calls_backward_dw_on_the_fused_ops():
    # experts.py TEGroupedMLP.backward_dw: with the fused impl and delayed wgrad, fc2's then fc1's
    # op backward_dw, then the wgrad hooks of its own linear_fc2 and linear_fc1
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    source = inspect.getsource(TEGroupedMLP.backward_dw)
    assert source.index("fused_children[2].backward_dw()") < source.index("fused_children[0].backward_dw()")
    assert "self.linear_fc2._trigger_wgrad_accumulation_and_reduce_hooks()" in source
    assert "delay_wgrad_compute=fc1_delay_wgrad_compute" in inspect.getsource(TEGroupedMLP._make_fused_ops)


@needs_op_fuser
def test_the_job_runs_and_megatron_empties_every_store():
    # one micro-batch through the stage: megatron's own TEGroupedMLP.backward_dw runs (engine/
    # delayed_wgrad.py) and leaves no operands kept; the same job refused on main
    from inspector.memory.engine.stage import trace_stage
    from tests.test_engine import _MOE_TP1
    from tests.test_te_engine import _job

    flags = dict(_MOE_TP1, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=2,
                 expert_model_parallel_size=2, global_batch_size=4, ffn_hidden_size=128,
                 moe_grouped_gemm=True, use_transformer_engine_op_fuser=True, bf16=True,
                 moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True)  # fmt: skip
    job, plain = _job(**flags, delay_wgrad_compute=True), _job(**flags)
    delayed, eager = trace_stage(job, 0)[0], trace_stage(plain, 0)[0]
    assert delayed.forward == eager.forward
    # n permuted rows a rank (32 tokens x 2 micro-batch x topk 2), h 64, f 128 (ffn 128), bf16:
    # kept past the experts' backward: fc1's input [n, h] (views kept), fc1's output gradient
    # [n, 2f], fc2's input [n, f] and output gradient [n, h]; megatron's backward_dw frees them
    # all before the dispatcher's all-to-all backward runs
    n, h, f = 32 * 2 * 2, 64, 128
    kept = (n * h + n * 2 * f + n * f + n * h) * BF16
    levels, before_alltoall = {}, {}
    for name, trace in (("delayed", delayed), ("eager", eager)):
        events = trace.backward
        last = max(i for i, e in enumerate(events) if e.where.endswith("experts: _OperationFuserFunctionBackward"))
        alltoall = next(i for i in range(last, len(events)) if "_AllToAllBackward" in events[i].where)
        levels[name], before_alltoall[name] = events[last].allocated, events[alltoall - 1].allocated
    assert levels["delayed"] - levels["eager"] == kept
    assert before_alltoall["delayed"] == before_alltoall["eager"]
    assert delayed.backward[-1].allocated == eager.backward[-1].allocated
    assert delayed.persistent == eager.persistent  # nothing left kept past the micro-batch


@needs_op_fuser
def test_memory_runs_the_op_fuser_with_delayed_weight_gradients(cli):
    # refused before (TE's wgrad store was not simulated); the same job without the delay peaks
    # no higher: the kept operands only add to the backward
    flags = ("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16", "--ep", "4",
             "--dp", "4", "--micro-batch-size", "1", "--use-transformer-engine-op-fuser",
             "--moe-token-dispatcher-type", "alltoall", "--overlap-moe-expert-parallel-comm")  # fmt: skip
    eager, delayed = cli(*flags), cli(*flags, "--delay-wgrad-compute")
    assert eager.code == 0 and delayed.code == 0, delayed.err
    peak = lambda out: float(out.split(", peak ")[1].split(" GiB")[0])  # noqa: E731
    assert peak(delayed.out) >= peak(eager.out)
