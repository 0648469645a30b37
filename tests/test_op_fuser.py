"""--use-transformer-engine-op-fuser: Transformer Engine 2.14's fused operations (world/te/ops.py)
under megatron-core 0.18+'s TEGroupedMLP._fused_forward, and its refusals.

The expectations are written by hand from TE's source at the `v2.14` tag (ops/basic/
grouped_linear.py, ops/basic/swiglu.py, ops/fuser.py) and megatron-core 0.19.2's
transformer/moe/experts.py, each with the lines it mirrors.
"""

from __future__ import annotations

import inspect

import pytest

from inspector.inputs.versions import OP_FUSER_RELEASES, megatron_core_version, within

HAS_OP_FUSER = within(OP_FUSER_RELEASES, megatron_core_version())
needs_op_fuser = pytest.mark.skipif(not HAS_OP_FUSER, reason="megatron-core 0.18 added the op fuser")
# megatron-core 0.19 locks TE 2.17 (the stand-in declares it): ScaledSReLU, its fused grouped MLP
HAS_TE_217 = megatron_core_version()[:2] >= (0, 19)
needs_te_217 = pytest.mark.skipif(not HAS_TE_217, reason="megatron-core 0.19 locks TE 2.17")
N, H, F = 24, 64, 96  # rows (tokens x topk), hidden, expert ffn
SPLITS = [10, 14]  # tokens per local expert


def _ops():
    from inspector.world import te

    te.install()
    from inspector.world.te import ops

    return ops


def _meta(*shape, grad=True):
    import torch

    return torch.empty(shape, device="meta", dtype=torch.bfloat16, requires_grad=grad)


def test_grouped_linear_registers_a_weight_per_group_holding_no_memory():
    # grouped_linear.py 88-173: weight{i} (out, in) per group in `dtype`, then bias{i} (out) or
    # None; megatron makes the shells with device="meta" and re-registers its own parameters
    import torch

    ops = _ops()
    op = ops.GroupedLinear(3, H, 2 * F, bias=False, device="meta", dtype=torch.bfloat16)
    params = dict(op.named_parameters())
    assert list(params) == ["weight0", "weight1", "weight2"]
    assert all(p.shape == (2 * F, H) and p.dtype == torch.bfloat16 for p in params.values())
    assert all(p.untyped_storage().nbytes() == 0 for p in params.values())
    assert op.bias0 is None and op.num_extra_inputs == 1
    with_bias = ops.GroupedLinear(2, H, F, bias=True, device="meta", dtype=torch.bfloat16)
    assert [n for n, _ in with_bias.named_parameters()] == ["weight0", "weight1", "bias0", "bias1"]
    assert ops.ScaledSwiGLU().num_extra_inputs == 1 and not list(ops.ScaledSwiGLU().parameters())
    with pytest.raises(ValueError, match="Supported dtypes"):  # grouped_linear.py 126-127
        ops.GroupedLinear(2, H, F, dtype=torch.float64)


def _fused_mlp():
    """megatron's _make_fused_ops (experts.py 436-566): fc1, ScaledSwiGLU, fc2, params attached."""
    ops = _ops()
    fc1 = ops.GroupedLinear(len(SPLITS), H, 2 * F, bias=False, device="meta")
    fc2 = ops.GroupedLinear(len(SPLITS), F, H, bias=False, device="meta")
    weights = [_meta(2 * F, H) for _ in SPLITS] + [_meta(H, F) for _ in SPLITS]
    for i in range(len(SPLITS)):
        fc1.register_parameter(f"weight{i}", _as_param(weights[i]))
        fc2.register_parameter(f"weight{i}", _as_param(weights[len(SPLITS) + i]))
    return ops.Sequential().append(fc1).append(ops.ScaledSwiGLU()).append(fc2)


def _as_param(tensor):
    import torch

    return torch.nn.Parameter(tensor.detach())


def test_the_fuser_saves_what_tes_basic_ops_save():
    # fuser.py 160-172: one save_for_backward of every op's to_save, in op order:
    # fc1 (grouped_linear.py 779): split_sizes, the input's views per group, the weights;
    # ScaledSwiGLU (swiglu.py 438-441): its input (fc1's [N, 2F] output) and the scales;
    # fc2: split_sizes, views of the scaled SwiGLU output [N, F], the weights
    import torch

    fused = _fused_mlp()
    x, probs = _meta(N, H), _meta(N)
    splits = torch.tensor(SPLITS)
    out = fused(x, splits, probs, splits)
    bf16, i64 = torch.bfloat16, torch.int64
    saved = [(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]
    assert saved == (
        [((2,), i64), ((10, H), bf16), ((14, H), bf16), ((2 * F, H), bf16), ((2 * F, H), bf16)]
        + [((N, 2 * F), bf16), ((N,), bf16)]
        + [((2,), i64), ((10, F), bf16), ((14, F), bf16), ((H, F), bf16), ((H, F), bf16)]
    )
    views = out.grad_fn.saved_tensors[1:3]
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)
    assert out.shape == (N, H) and x._do_not_clear and out._do_not_clear  # fuser.py 100, 191


def test_the_fuser_allocates_and_frees_as_te_does():
    # forward: fc1's output (grouped_linear.py 746), tex.swiglu's [N, F] then its product with the
    # scales (swiglu.py 427-428; the first freed on return), fc2's output; backward frees
    # ScaledSwiGLU's saved input (swiglu.py 500) and the GroupedLinears' saved views (943)
    import torch

    from inspector.memory.engine.allocator import Tracker

    fused = _fused_mlp()
    x, probs, splits = _meta(N, H), _meta(N), torch.tensor(SPLITS)
    tracker = Tracker()
    with tracker:
        out = fused(x, splits, probs, splits)
    assert [e.bytes for e in tracker.events] == [N * 2 * F * 2, N * F * 2, N * F * 2, -N * F * 2, N * H * 2]
    grads = torch.autograd.grad(out, (x, probs, *fused.parameters()), torch.empty_like(out))
    assert [tuple(g.shape) for g in grads[:2]] == [(N, H), (N,)]
    assert [tuple(g.shape) for g in grads[2:]] == [(2 * F, H)] * 2 + [(H, F)] * 2


@needs_op_fuser
def test_megatron_builds_the_fused_mlp_from_these_ops():
    # experts.py: the op fuser's parameters are the experts' own, the shells made on meta, and
    # _is_fused_impl_supported asks TE 2.14 for exactly these ops
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    source = inspect.getsource(TEGroupedMLP._make_fused_ops)
    for call in ("te.pytorch.ops.Sequential()", "te.pytorch.ops.GroupedLinear(",
                 "te.pytorch.ops.ScaledSwiGLU(", 'device="meta"'):  # fmt: skip
        assert call in source
    # the experts' own weights put on the op (version fact: 0.18 by setattr, which registers a
    # Parameter as register_parameter does; 0.19 by register_parameter)
    attach = ('setattr(op, f"weight{idx}", getattr(self.linear_fc1, f"weight{idx}"))'
              if megatron_core_version()[:2] == (0, 18) else
              'op.register_parameter(f"weight{idx}", linear.get_parameter(f"weight{idx}"))')  # fmt: skip
    assert attach in source
    supported = inspect.getsource(TEGroupedMLP._is_fused_impl_supported)
    assert "import GroupedLinear, ScaledSwiGLU" in supported
    # version fact: megatron-core 0.19 refuses the op fuser's SwiGLU without
    # NVTE_CUTEDSL_FUSED_GROUPED_MLP (the tool builds with it set); 0.18 does not ask
    asks = megatron_core_version()[:2] >= (0, 19)
    assert ("NVTE_CUTEDSL_FUSED_GROUPED_MLP" in supported) == asks


@needs_op_fuser
def test_the_experts_hold_what_the_fused_ops_save():
    # one MoE layer (test_te_engine's small job): fc1's [n, 2f] output kept by ScaledSwiGLU, the
    # scaled [n, f] kept by fc2 (as views), fc2's [n, h] output until the combine; the unfused
    # TEGroupedMLP holds the same three (test_te_engine.py)
    from inspector.memory.engine.stage import trace_stage
    from tests.test_engine import _MOE_TP1
    from tests.test_te_engine import _job

    job = _job(**_MOE_TP1, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=1,
               global_batch_size=2, ffn_hidden_size=128, moe_grouped_gemm=True,
               use_transformer_engine_op_fuser=True)  # fmt: skip
    trace = trace_stage(job, 0)[0]
    forward = [(e.where, e.bytes) for e in trace.forward if e.where.startswith("decoder.layers.0.mlp.experts")]
    n, h, f, bf16 = 32 * 2 * 2, 64, 128, 2
    assert sum(b for _, b in forward) == n * (2 * f + f + h) * bf16, forward
    backward = [e.where for e in trace.backward if "mlp.experts" in e.where]
    assert backward and all(where.endswith("_OperationFuserFunctionBackward") for where in backward)


@needs_op_fuser
def test_gpt_oss_experts_hold_what_the_fused_ops_save():
    # the same small job with gpt-oss's clamped quick-GEGLU and biases: ScaledClampedQGeGLU keeps
    # fc1's [n, 2f] output, fc2 the scaled [n, f] (views), fc2's [n, h] output is held; each
    # expert's bias x probs ([32, h] bf16 here, the probs being bf16) is made and freed
    # (TE v2.17.1 grouped_linear.py 1168-1173). main refused the job
    from inspector.memory.engine.stage import trace_stage
    from tests.test_engine import _MOE_TP1
    from tests.test_te_engine import _job

    moe = {k: v for k, v in _MOE_TP1.items() if k not in ("swiglu", "disable_bias_linear")}
    job = _job(**moe, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=1,
               global_batch_size=2, ffn_hidden_size=128, moe_grouped_gemm=True, quick_geglu=True,
               activation_func_clamp_value=7.0, no_bias_dropout_fusion=True,
               use_transformer_engine_op_fuser=True)  # fmt: skip
    trace = trace_stage(job, 0)[0]
    forward = [e.bytes for e in trace.forward if e.where.startswith("decoder.layers.0.mlp.experts")]
    n, h, f, bf16 = 32 * 2 * 2, 64, 128, 2
    bias_x_probs = n // 4 * h * bf16  # 4 experts, balanced
    assert forward == [n * 2 * f * bf16, n * f * bf16, n * f * bf16, -n * f * bf16, n * h * bf16,
                       *[bias_x_probs, -bias_x_probs] * 4]  # fmt: skip


@needs_op_fuser
def test_memory_runs_the_op_fuser_and_params_do_not_change(cli, tmp_path):
    # the fused ops are kept in a tuple, not registered: the same parameters, the same DDP buffers
    config = tmp_path / "fuser.yaml"
    config.write_text("use_transformer_engine_op_fuser: true\n")
    flags = ("--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16", "--ep", "8", "--dp", "8")
    done = cli("memory", *flags, "--micro-batch-size", "1", "--use-transformer-engine-op-fuser")
    assert done.code == 0, done.err
    assert "run on meta tensors" in done.out
    plain, fused = cli("params", *flags), cli("params", *flags, "--config", str(config))
    assert fused.code == 0 and fused.out == plain.out and len(plain.out) > 1000


@pytest.mark.skipif(HAS_OP_FUSER, reason="megatron-core 0.18+ model the op fuser")
def test_memory_refuses_the_op_fuser_before_megatron_core_0_18(cli):
    done = cli("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16", "--ep", "8",
               "--dp", "8", "--micro-batch-size", "1", "--use-transformer-engine-op-fuser")  # fmt: skip
    assert done.code == 2 and done.out == ""
    assert done.err.splitlines()[-1] == (
        "Error: --use-transformer-engine-op-fuser is not modelled: megatron-core 0.13-0.17 have no "
        "Transformer Engine op fuser for the MoE experts (TransformerConfig.use_transformer_engine_"
        "op_fuser came in 0.18, where it is modelled)")  # fmt: skip


@pytest.mark.parametrize(
    "extra, start",
    [
        # TE's quantized fused operations (and its MXFP8 CuTe DSL kernel) are not simulated
        (("--fp8-format", "e4m3"), "--use-transformer-engine-op-fuser with --fp8-format e4m3 is not modelled"),
        # megatron's _is_fused_impl_supported refuses tensor-parallel experts
        (("--tp", "2", "--sequence-parallel"), "--use-transformer-engine-op-fuser with an expert tensor-parallel size of 2"),
        # megatron asks TE's fused activation to recompute itself (experts.py _make_fused_ops)
        # (0.19: TE 2.17's basic operations refuse it; only MXFP8's fused grouped MLP reads it)
        (("--recompute-granularity", "selective", "--recompute-modules", "moe_act"),
         "--use-transformer-engine-op-fuser with --recompute-modules moe_act "),
    ],  # fmt: skip
    ids=["fp8", "expert-tp", "moe-act-recompute"],
)
@needs_op_fuser
def test_op_fuser_combinations_not_modelled_are_refused_by_name(cli, extra, start):
    done = cli("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--bf16", "--ep", "4",
               "--dp", "4", "--micro-batch-size", "1", "--use-transformer-engine-op-fuser", *extra)  # fmt: skip
    assert done.code == 2 and done.out == ""
    assert done.err.splitlines()[-1].startswith("Error: " + start), done.err


@needs_op_fuser
def test_a_dense_model_runs_the_same_job_with_the_op_fuser(cli):
    # megatron-core 0.18-0.19 read use_transformer_engine_op_fuser in TEGroupedMLP (and the MoE
    # padding) only; Megatron-LM's gpt_builders builds the dense TE spec without use_te_op_fuser
    flags = ("memory", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "512", "--micro-batch-size", "1", "--bf16", "--transformer-impl",
             "transformer_engine")  # fmt: skip
    plain, fused = cli(*flags), cli(*flags, "--use-transformer-engine-op-fuser")
    assert plain.code == fused.code == 0, fused.err
    assert fused.out == plain.out and "run on meta tensors" in plain.out


SMALL_MOE = ("--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "512", "--num-experts", "4", "--moe-grouped-gemm", "--bf16",
             "--transformer-impl", "transformer_engine", "--micro-batch-size", "1")  # fmt: skip


@pytest.mark.parametrize(
    "flags, what",
    [
        # a plain MLP (the tool reads --squared-relu as numerics only): ScaledSReLU
        (SMALL_MOE + ("--disable-bias-linear",),
         "experts other than SwiGLU or --quick-geglu (squared ReLU)"),
        # gpt-oss in MXFP8: TE 2.15+'s fused grouped MLP with GeGLU and biases
        (("--model", "gpt-oss-20b", "--num-layers", "2", "--bf16", "--micro-batch-size", "1",
          "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"), "--fp8-format and --quick-geglu"),
        (SMALL_MOE + ("--swiglu", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"),
         "--fp8-format and biased experts (no --disable-bias-linear)"),
    ],  # fmt: skip
    ids=["mlp", "gpt-oss-mxfp8", "biased-swiglu-mxfp8"],
)
@pytest.mark.skipif(not HAS_OP_FUSER or HAS_TE_217, reason="megatron-core 0.18 (TE 2.16)")
def test_op_fuser_experts_the_stand_in_lacks_are_refused_by_name(cli, flags, what):
    # on a GPU megatron-core 0.18 fuses these through TE 2.16 ops the stand-in does not have
    # (TE 2.15+'s quantized fused grouped MLP), so they are refused by name, as not modelled
    done = cli("memory", *flags, "--use-transformer-engine-op-fuser")
    assert done.code == 2 and done.out == ""
    assert done.err.splitlines()[-1].startswith(
        f"Error: --use-transformer-engine-op-fuser with {what} is not modelled"), done.err


def _biased_mlp(activation):
    """_make_fused_ops for gpt-oss (experts.py 0.19.2 436-566): fc1 with biases, the scaled
    activation, fc2 with biases scaled by the probs (`scale_bias=True`), params attached."""
    ops = _ops()
    fc1 = ops.GroupedLinear(len(SPLITS), H, 2 * F, bias=True, device="meta")
    fc2 = ops.GroupedLinear(len(SPLITS), F, H, bias=True, device="meta", scale_bias=True)
    for op, out, inp in ((fc1, 2 * F, H), (fc2, H, F)):
        for i in range(len(SPLITS)):
            op.register_parameter(f"weight{i}", _as_param(_meta(out, inp)))
            op.register_parameter(f"bias{i}", _as_param(_meta(out)))
    return ops.Sequential().append(fc1).append(activation).append(fc2)


def test_scaled_bias_takes_the_probs_and_saves_them():
    # TE v2.17.1 grouped_linear.py 132-134: scale_bias makes the probs a second extra input;
    # 1196-1201 saves them after the split sizes (the raw fp32 probs, no copy); 1168-1173 adds
    # bias x prob a group, each product [rows, H] in fp32 (bf16 bias x fp32 probs) and freed;
    # the backward (1398-1411, triton/grouped_dbias_dscales.py) gives fp32 prob gradients
    import torch

    from inspector.memory.engine.allocator import Tracker, rounded

    ops = _ops()
    assert "scale_bias" in inspect.signature(ops.GroupedLinear.__init__).parameters
    fused = _biased_mlp(ops.ScaledClampedQGeGLU(limit=7.0))
    assert [op.num_extra_inputs for op in fused.children()] == [1, 1, 2]
    x, splits = _meta(N, H), torch.tensor(SPLITS)
    probs = torch.empty(N, device="meta", dtype=torch.float32, requires_grad=True)
    tracker = Tracker()
    with tracker:
        out = fused(x, splits, probs, splits, probs)
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
    saved = [(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]
    assert saved[5:7] == [((N, 2 * F), bf16), ((N,), bf16)]  # the GeGLU's input, probs in bf16
    assert saved[7:] == ([((2,), i64), ((N,), f32), ((10, F), bf16), ((14, F), bf16)]
                         + [((H, F), bf16)] * 2)  # fmt: skip
    assert out.grad_fn.saved_tensors[8] is probs or out.grad_fn.saved_tensors[8]._cdata == probs._cdata
    # fc1's [N, 2F]; the probs in bf16 [N]; the GeGLU's [N, F], its scaled copy, the first freed;
    # fc2's [N, H]; then bias x probs [10, H] and [14, H] in fp32, each freed (in 512-byte blocks)
    assert [e.bytes for e in tracker.events] == [
        N * 2 * F * 2, rounded(N * 2), N * F * 2, N * F * 2, -N * F * 2, N * H * 2,
        10 * H * 4, -10 * H * 4, 14 * H * 4, -14 * H * 4]  # fmt: skip
    grads = torch.autograd.grad(out, (x, probs, *fused.parameters()), torch.empty_like(out))
    assert (tuple(grads[1].shape), grads[1].dtype) == ((N,), f32)
    shapes = [tuple(g.shape) for g in grads[2:]]
    assert shapes == [(2 * F, H)] * 2 + [(2 * F,)] * 2 + [(H, F)] * 2 + [(H,)] * 2


@needs_op_fuser
def test_megatron_builds_gpt_oss_fused_experts_from_these_ops():
    # experts.py 0.19.2 498-525, 545-566: quick_gelu with a clamp builds ScaledClampedQGeGLU with
    # the clamp as `limit`; biased fc2 gets scale_bias=True and the probs as its second input
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    source = inspect.getsource(TEGroupedMLP._make_fused_ops)
    assert "te.pytorch.ops.ScaledClampedQGeGLU(" in source and "limit=clamp" in source
    assert '{"scale_bias": True} if self.linear_fc2.use_bias' in source
    forward = inspect.getsource(TEGroupedMLP._fused_forward)
    assert "(tokens_per_expert, permuted_probs)" in forward


GPT_OSS = ("--model", "gpt-oss-20b", "--num-layers", "2", "--bf16", "--micro-batch-size", "1",
           "--no-bias-dropout-fusion")  # fmt: skip


@pytest.mark.parametrize("flags", [GPT_OSS, SMALL_MOE + ("--swiglu", "--no-bias-dropout-fusion")],
                         ids=["gpt-oss", "biased-swiglu"])  # fmt: skip
@needs_op_fuser
def test_memory_runs_the_op_fuser_with_geglu_and_biases(cli, flags):
    # main refused both ("experts other than SwiGLU", "biased experts"); in 16 bits megatron's
    # _fused_forward now runs on ScaledClampedQGeGLU and GroupedLinear's scale_bias
    done = cli("memory", *flags, "--use-transformer-engine-op-fuser")
    assert done.code == 0, done.err
    assert "run on meta tensors" in done.out


def _srelu_mlp(recompute=False):
    """megatron-core 0.19.2 experts.py `_make_fused_ops` 524-536 for Nemotron 3: fc1 of F
    columns (no gate), ScaledSReLU, fc2, the parameters attached."""
    ops = _ops()
    fc1 = ops.GroupedLinear(len(SPLITS), H, F, bias=False, device="meta")
    fc2 = ops.GroupedLinear(len(SPLITS), F, H, bias=False, device="meta")
    for i in range(len(SPLITS)):
        fc1.register_parameter(f"weight{i}", _as_param(_meta(F, H)))
        fc2.register_parameter(f"weight{i}", _as_param(_meta(H, F)))
    act = ops.ScaledSReLU(activation_recompute_in_mlp=recompute)
    return ops.Sequential().append(fc1).append(act).append(fc2)


def test_scaled_srelu_saves_allocates_and_frees_as_te_2_17_does():
    # TE v2.17.1 ops/basic/activation.py 386-424: `tex.srelu(x)` [N, F] times the scales (the
    # first freed on return), x and the scales saved (422); 426-463: the scaled gradient and
    # tex.dsrelu's [N, F], a recomputed srelu for the scales' gradient, x cleared (461)
    import torch

    from inspector.memory.engine.allocator import Tracker

    fused, x, probs, splits = _srelu_mlp(), _meta(N, H), _meta(N), torch.tensor(SPLITS)
    with Tracker() as tracker:
        out = fused(x, splits, probs, splits)
    bf16, i64 = torch.bfloat16, torch.int64
    saved = [(tuple(t.shape), t.dtype) for t in out.grad_fn.saved_tensors]
    assert saved[5:7] == [((N, F), bf16), ((N,), bf16)]  # the squared ReLU's input, the scales
    assert saved[7:10] == [((2,), i64), ((10, F), bf16), ((14, F), bf16)]  # fc2's input views
    assert [e.bytes for e in tracker.events] == [N * F * 2, N * F * 2, N * F * 2, -N * F * 2, N * H * 2]
    kept = out.grad_fn.saved_tensors[5]
    with Tracker() as tracker:
        grads = torch.autograd.grad(out, (x, probs, *fused.parameters()), torch.empty_like(out))
    assert [tuple(g.shape) for g in grads] == [(N, H), (N,)] + [(F, H)] * 2 + [(H, F)] * 2
    assert not kept.untyped_storage().nbytes()  # cleared (461)
    made = [e.bytes for e in tracker.events if e.bytes > 0]
    assert made.count(N * F * 2) >= 3  # the scaled gradient, tex.dsrelu's, the recomputed srelu


def test_the_basic_activations_refuse_te_s_recompute_as_te_2_17_does():
    # v2.17.1 activation.py 396-400, swiglu.py 426-430: activation_recompute_in_mlp=True
    # "requires the fused grouped MLP path." (megatron-core 0.19 passes it for moe_act)
    import torch

    with pytest.raises(RuntimeError, match=r"ScaledSReLU\(activation_recompute_in_mlp=True\) "
                                           "requires the fused grouped MLP path."):  # fmt: skip
        _srelu_mlp(recompute=True)(_meta(N, H), torch.tensor(SPLITS), _meta(N), torch.tensor(SPLITS))
    assert "activation_recompute_in_mlp" in inspect.signature(_ops().ScaledSwiGLU).parameters


@needs_te_217
def test_megatron_builds_squared_relu_experts_on_scaled_srelu():
    # experts.py 0.19.2 `_is_fused_impl_supported` 369-390, `_make_fused_ops` 523-536: the op
    # fuser's experts without a gated unit are squared ReLU fused through ScaledSReLU
    # (memory/engine/runtime.py sets --squared-relu --use-fused-weighted-squared-relu): fc1's
    # [n, f] output, the srelu [n, f] made and freed, the scaled [n, f], fc2's [n, h]
    from inspector.memory.engine.stage import trace_stage
    from tests.test_engine import _MOE_TP1
    from tests.test_te_engine import _job

    moe = {k: v for k, v in _MOE_TP1.items() if k != "swiglu"}
    job = _job(**moe, num_layers=1, pipeline_model_parallel_size=1, data_parallel_size=1,
               global_batch_size=2, ffn_hidden_size=128, moe_grouped_gemm=True,
               use_transformer_engine_op_fuser=True)  # fmt: skip
    trace = trace_stage(job, 0)[0]
    forward = [e.bytes for e in trace.forward if e.where.startswith("decoder.layers.0.mlp.experts")]
    n, h, f, bf16 = 32 * 2 * 2, 64, 128, 2
    assert forward == [n * f * bf16, n * f * bf16, n * f * bf16, -n * f * bf16, n * h * bf16]


@needs_te_217
@pytest.mark.parametrize(
    "flags, outcome",
    [
        (SMALL_MOE + ("--disable-bias-linear",), None),  # squared ReLU in 16 bits
        (SMALL_MOE + ("--swiglu", "--no-bias-dropout-fusion", "--fp8-format", "e4m3",
                      "--fp8-recipe", "mxfp8", "--moe-mlp-glu-interleave-size", "32"), None),
        # not interleaved by 32: TE runs its quantized basic operations (gm 673-677)
        (SMALL_MOE + ("--swiglu", "--no-bias-dropout-fusion", "--fp8-format", "e4m3",
                      "--fp8-recipe", "mxfp8"), "basic operations in mxfp8 (split_quantize)"),
    ],  # fmt: skip
    ids=["squared-relu", "biased-swiglu-mxfp8", "not-interleaved-mxfp8"],
)
def test_memory_runs_what_te_2_17_fuses(cli, flags, outcome):
    done = cli("memory", *flags, "--use-transformer-engine-op-fuser")
    if outcome is None:
        assert done.code == 0, done.err
    else:
        assert done.code == 2 and outcome in done.err, done.err
