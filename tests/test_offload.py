"""Fine-grained activation offloading: megatron's own offload manager run on meta tensors."""

from __future__ import annotations

import importlib.util

import pytest

from inspector.inputs.versions import megatron_core_version

MIB = 1 << 20
MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(MODULE) is None, reason="megatron-core before 0.16 has no such offloading"
)


def _start_chunk(off) -> None:
    """Start a micro-batch's chunk: megatron-core 0.16.1's call, or 0.19.2's (pp rank 0, all of it)."""
    if hasattr(off, "group_commit"):
        off.init_chunk_handler(None, None, 1024)
    else:
        off.init_chunk_handler(0, None, None, 1024, 0, 1.0)


def _commit(off, group, y):
    """End the group: `group_commit` (0.16.1), the group's `group_offload` (0.19.2)."""
    return off.group_commit(y, "mlp_norm") if hasattr(off, "group_commit") else group.group_offload(y)


def _run(offload: bool, layers: int = 3):
    """Run `layers` offloaded groups forward (h -> gelu(h @ w)) and backward, as a layer does."""
    import torch
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        PipelineOffloadManager,
    )

    from inspector.memory.engine.allocator import Tracker
    from inspector.memory.engine.offload import HostBytes, offloading_on_meta

    host, tracker = HostBytes(), Tracker()
    w = torch.empty(256, 256, device="meta", requires_grad=True)
    x0 = torch.empty(1024, 256, device="meta", requires_grad=True)  # 1 MiB in fp32
    with offloading_on_meta(host):
        off.reset_instance()
        getattr(off, "mark_not_offloadable", getattr(off, "mark_not_offload", None))(w)  # as GPTModel does
        with tracker:
            _start_chunk(off)
            x = x0
            for _ in range(layers):
                group = off(offload, x, "mlp_norm")
                with group as h:
                    y = torch.nn.functional.gelu(h @ w)
                x = _commit(off, group, y) if offload else y
            del h, y, group  # a layer's locals die with its forward
            held, tracker.forward_events = tracker.allocated, len(tracker.events)
            x.sum().backward()
        manager = PipelineOffloadManager.get_instance()
        offloaded = [g.total_offload_bytes for c in manager._cached_chunks_forward for g in c.offload_groups]
        pooled = host.live  # before the manager, and its pool, go
        off.reset_instance()
    return held, tracker, host, offloaded, pooled


def test_offloaded_activations_leave_the_gpu_and_the_host_holds_them():
    plain_held, plain, no_host, _, _ = _run(False)
    held, tracker, host, offloaded, pooled = _run(True)
    # without offloading each layer keeps its output and gelu's input: 2 MiB a layer
    assert plain_held == 6 * MIB and no_host.peak == 0
    # with it only the last output stays on the GPU: the rest went to pinned host buffers
    assert held == 1 * MIB
    # each group copies out its input and gelu's input (the weight is marked not offloadable)
    assert offloaded == [2 * MIB] * 3
    assert host.peak == sum(offloaded) and host.buffers == 6
    # megatron's pool keeps its pinned buffers after the reload, for the next iteration
    assert pooled == host.peak
    assert tracker.peak < plain.peak


def test_reloaded_activations_come_back_to_the_gpu_in_backward():
    def reloads(tracker):
        return sum(1 for e in tracker.events[tracker.forward_events :] if e.bytes == MIB)

    _, plain, _, _, _ = _run(False)
    _, tracker, host, offloaded, _ = _run(True)
    # each of the 6 offloaded 1 MiB tensors is copied back into a new GPU tensor in backward
    assert reloads(tracker) - reloads(plain) == host.buffers == 6
    assert tracker.allocated == 0  # and freed once its gradient is made


def test_pinned_host_buffers_round_up_to_a_power_of_two():
    from inspector.memory.engine.offload import pinned

    assert [pinned(n) for n in (0, 1, 512, 513, 3 * MIB)] == [0, 1, 512, 1024, 4 * MIB]


def test_the_stand_ins_are_put_back():
    import torch

    from inspector.memory.engine.offload import HostBytes, offloading_on_meta, supported

    before = (torch.cuda.Stream, torch.cuda.Event, torch.empty, dict(vars(torch.Tensor)))
    with offloading_on_meta(HostBytes()):
        assert torch.cuda.Stream is not before[0] and "record_stream" in vars(torch.Tensor)
    assert (torch.cuda.Stream, torch.cuda.Event, torch.empty, dict(vars(torch.Tensor))) == before
    assert supported()  # megatron-core 0.16.1 has pipeline_parallel/fine_grained_activation_offload.py


def _gpt_job(modules: tuple[str, ...], impl: str = "local", **more):
    """A 2-layer GPT job with megatron's offloading of `modules` (every saved tensor big enough:
    Megatron-LM's default is 1M elements)."""
    from inspector.job.job import make_job

    offloading = dict(fine_grained_activation_offloading=True, offload_modules=" ".join(modules),
                      min_offloaded_tensor_size=0) if modules else {}  # fmt: skip
    return make_job({**dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        pipeline_model_parallel_size=1, tensor_model_parallel_size=1, data_parallel_size=1,
        micro_batch_size=2, global_batch_size=8, bf16=True, transformer_impl=impl,
    ), **offloading, **more})  # fmt: skip


class _Host:
    """A trace's host buffers as the tests read them."""

    def __init__(self, trace):
        self.sizes = [size for _, size in trace.host]
        self.buffers = len(self.sizes)
        self.peak = sum(self.sizes)


def _gpt_trace(modules: tuple[str, ...], impl: str = "local"):
    """One micro-batch of a 2-layer GPT stage as the engine runs it, with megatron's offloading
    of `modules` switched on by the job's flags."""
    from inspector.memory.engine import stage

    (trace,) = stage.trace_stage(_gpt_job(modules, impl), 0)
    return trace, _Host(trace)


def test_a_gpt_layers_offloaded_norm_inputs_leave_the_gpu_block_for_block():
    from inspector.memory.engine.allocator import rounded

    plain, no_host = _gpt_trace(())
    trace, host = _gpt_trace(("attn_norm", "mlp_norm"))
    assert no_host.buffers == 0
    # each norm saves its input (s x b x h in bf16: 32 x 2 x 64 x 2 bytes) and its fp32 mean and
    # rstd per token: 3 tensors, 2 norms, 2 layers
    assert sorted(host.sizes) == [256] * 8 + [8192] * 4
    # and the GPU holds exactly those blocks less between forward and backward
    assert plain.held - trace.held == sum(rounded(size) for size in host.sizes)
    # they come back for the backward: its peak is lower by no more than what left
    assert max(e.allocated for e in trace.backward) <= max(e.allocated for e in plain.backward)


def test_under_transformer_engine_the_norms_are_fused_and_attention_is_offloaded():
    plain, _ = _gpt_trace((), "transformer_engine")
    normed, norm_host = _gpt_trace(("attn_norm", "mlp_norm"), "transformer_engine")
    # TE fuses each norm into the next linear (input_layernorm is an IdentityOp): nothing to offload
    assert norm_host.buffers == 0 and normed.held == plain.held
    trace, host = _gpt_trace(("qkv_linear", "core_attn", "attn_proj"), "transformer_engine")
    assert host.peak > 0 and trace.held < plain.held


def test_the_flags_reach_megatrons_transformer_config():
    from inspector.memory.engine.runtime import runtime_config

    job = _gpt_job(("core_attn", "attn_proj"))
    assert job.training.offloading is not None
    fields = runtime_config(job)
    assert fields["fine_grained_activation_offloading"] is True
    assert fields["offload_modules"] == ["core_attn", "attn_proj"]
    assert fields["min_offloaded_tensor_size"] == 0
    # Megatron-LM's default size: 1024 * 1024 elements (arguments.py)
    default = _gpt_job(()).training.offloading, runtime_config(_gpt_job(("attn_norm",), min_offloaded_tensor_size=None))
    assert default[0] is None and default[1]["min_offloaded_tensor_size"] == 1024 * 1024


MEMORY = ("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--micro-batch-size", "1", "--bf16", "--transformer-impl", "local")  # fmt: skip


@pytest.mark.parametrize("flags, error", [
    # TransformerConfig.__post_init__: assert self.offload_modules is not None and len(...) > 0
    ((), "Error: --fine-grained-activation-offloading needs --offload-modules (megatron-core's "
         "TransformerConfig asserts at least one module)"),
    # its allowed_modules
    (("--offload-modules", "mlp"), "Error: --offload-modules mlp is not one of: attn_norm, qkv_linear, "
                                   "core_attn, attn_proj, mlp_norm, expert_fc1, moe_act"
                                   + (", fused_group_mlp" if megatron_core_version() >= (0, 19) else "")),
    # megatron-core 0.19's module of the fused grouped MLP (Bridge's Nemotron 3 Ultra recipes):
    # its TransformerConfig needs the op fuser; not among 0.16's allowed_modules
    (("--offload-modules", "fused_group_mlp"), (
        "Error: --offload-modules fused_group_mlp needs --use-transformer-engine-op-fuser "
        "(megatron-core's TransformerConfig: 'fused_group_mlp requires "
        "use_transformer_engine_op_fuser.')")
     if megatron_core_version() >= (0, 19) else "Error: --offload-modules fused_group_mlp is not "
     "one of: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act"),
    # ValueError: attn_proj's input is core_attn's output, needed in core_attn.backward()
    (("--offload-modules", "attn_proj"), "Error: --offload-modules attn_proj needs core_attn too "
     "(megatron-core: the input of attn_proj is the output of core_attn, which is needed in "
     "core_attn.backward())"),
])  # fmt: skip
def test_offloading_flags_megatron_refuses_are_refused(cli, flags, error):
    result = cli(*MEMORY, "--fine-grained-activation-offloading", *flags)
    _refused(result, error)


def _refused(result, error: str) -> None:
    assert result.code == 2 and result.out == ""
    assert result.err.strip().splitlines()[-1] == error


@pytest.mark.parametrize("offload", [("--fine-grained-activation-offloading", "--offload-modules", "core_attn"),
                                     ("--cpu-offloading",)])  # fmt: skip
def test_plan_refuses_offloading_by_name(cli, offload):
    # plan's memory composition and step time know no copies to the host
    result = cli("plan", "--model", "llama3-8b", "--bf16", "--gpus", "8", "--global-batch-size", "64",
                 *offload)  # fmt: skip
    assert result.code == 2
    assert result.err.strip().splitlines()[-1] == (
        f"Error: plan does not price {offload[0]}: its memory and step time "
        "know no copies to the host; `memory` measures the offloading on a layout you choose")


def _synthetic(held: int = 4096):
    """A chunk's trace holding `held` bytes, whose two layers each offload groups a (1 KiB) and b
    (2 KiB), in that commit order."""
    from inspector.memory.engine.allocator import Event
    from inspector.memory.engine.microbatch import Trace

    host = tuple((f"layer {layer} self_attention: offload {name}", size)
                 for layer in (0, 1) for name, size in (("a", 1024), ("b", 2048)))  # fmt: skip
    return Trace((Event(held, held, "layer 0"),), (Event(-held, 0, "layer 0"),), (), host=host)


def test_the_groups_are_read_off_the_host_buffers_in_commit_order():
    from inspector.memory.engine.offload_steady import offload_groups

    groups = offload_groups(_synthetic())
    assert [(g.name, g.gpu, g.host) for g in groups] == [("a", 1024, 1024), ("b", 2048, 2048)] * 2
    # an MTP layer's groups count too (its transformer layer runs megatron's offload groups), and
    # Transformer Engine's layer offload has none (no state across micro-batches)
    mtp = _synthetic()
    mtp = type(mtp)(mtp.forward, mtp.backward, (), host=(
        ("mtp.layers.0.transformer_layer.self_attention: offload core_attn", 512),
        ("decoder: cpu offload", 4096)))  # fmt: skip
    assert [(g.name, g.gpu) for g in offload_groups(mtp)] == [("core_attn", 512)]


def test_the_first_backward_chunk_keeps_its_last_groups_and_the_next_reloads_early():
    from inspector.memory.engine.schedule import replay_passes

    trace = _synthetic()
    passes = list(replay_passes((trace,), 0, 2, 4))  # stage 0 of 2: F0 F1 B0 F2 B1 F3 B2 B3
    order = [("F" if p.forward else "B") + str(p.mb) for p in passes]
    assert order == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    held = {name: p.held for name, p in zip(order, passes)}
    # micro-batch 0 is the first backward chunk: its layer 1 groups a and b stay (3 KiB)
    assert held["F1"] == trace.held + 3072
    # micro-batch 1's forward finds micro-batch 0 ahead in the backward order: it offloads all
    assert held["B0"] == trace.held
    # micro-batch 0's backward began 2 groups ahead: at its end it reloads micro-batch 1's top two
    assert held["F2"] == trace.held + 3072
    assert held["B1"] == trace.held  # micro-batch 2 offloaded all; 1's early groups are its own
    assert held["F3"] == trace.held + 3072  # 2 reloaded early at the end of 1, as 1 was


def test_a_last_stage_keeps_the_last_groups_of_every_micro_batch():
    from inspector.memory.engine.offload_steady import backward_order, steady_offload

    trace = _synthetic()
    order = [(True, 0), (False, 0)] * 3  # 1F1B on the last stage: each is the next backward chunk
    steady = steady_offload((trace,), order)
    assert backward_order(order) == [(0, 0), (0, 1), (0, 2)]
    kept = []
    for mb in range(3):
        kept.append(steady.forward(0, mb))
        steady.backward(0, mb)
        assert steady.backward_done(0, mb) == 0  # the next has not run its forward
    assert kept == [3072] * 3


def test_host_demand_is_the_first_iterations_most_in_flight():
    from inspector.memory.engine.offload_steady import host_demand

    trace = _synthetic()
    # stage 0 of 2 holds at most 2 micro-batches in flight, each 6 KiB on the host
    assert host_demand((trace,), 0, 2, 4) == (2 * 6144, 2 * 6144)
    assert host_demand((trace,), 1, 2, 4) == (6144, 6144)
    plain = _synthetic()
    assert host_demand((type(plain)(plain.forward, plain.backward, ()),), 0, 2, 4) == (0, 0)


def test_memory_reports_the_host_bytes_and_a_lower_peak(cli):
    plain = cli(*MEMORY, "--format", "json")
    offloaded = cli(*MEMORY, "--format", "json", "--fine-grained-activation-offloading",
                    "--offload-modules", "attn_norm", "mlp_norm", "--min-offloaded-tensor-size", "0")  # fmt: skip
    assert plain.code == 0 and offloaded.code == 0, offloaded.err
    import json

    (before,), (after,) = json.loads(plain.out)["stages"], json.loads(offloaded.out)["stages"]
    assert "host_offload" not in before
    host = after["host_offload"]
    # one micro-batch in flight: 2 layers x 2 norms x (input 32 x 1 x 64 bf16, fp32 mean and rstd)
    assert host["bytes"] == 4 * (4096 + 2 * 128)
    assert host["pinned"] == 4 * (4096 + 2 * 128)  # each a power of two already
    # the one micro-batch is the first backward chunk: from the second iteration its last layer's
    # norms stay, and the peak (the logits) is above layer 0's few KiB anyway
    assert after["total"] <= before["total"]


def test_fp8_linears_keep_the_weight_object_under_the_offload_hooks(cli):
    # TE's linears (linear.py, layernorm_linear.py, grouped_linear.py) keep `ctx.weight_object`:
    # under saved-tensor hooks torch unpacks a Parameter as a plain tensor, without main_grad
    result = cli(*MEMORY[:-2], "--fp8-format", "hybrid", "--num-experts", "4", "--moe-grouped-gemm",
                 "--disable-bias-linear", "--fine-grained-activation-offloading", "--offload-modules",
                 "qkv_linear", "core_attn", "attn_proj", "expert_fc1", "--min-offloaded-tensor-size", "0")  # fmt: skip
    assert result.code == 0, result.err
    assert "offloaded activations take" in result.out


def test_te_layer_offload_schedule_is_te_2_11s_default():
    from inspector.world.te.cpu_offload import DefaultOffloadSynchronizer

    # TE 2.11 cpu_offload.py `_init_offload_synchronization_dicts`: layer i < N is offloaded, its
    # device memory released at the forward of layer L-N+i, its reload started at the backward of
    # layer L-1-N+i
    sync = DefaultOffloadSynchronizer(6, 3)
    assert sync.offloaded == {0: True, 1: True, 2: True, 3: False, 4: False, 5: False}
    assert sync.finish_offload == {3: [0], 4: [1], 5: [2]}
    assert sync.start_reload == {2: [0], 3: [1], 4: [2]}


TE_LAYERS = ("memory", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "256", "--micro-batch-size", "1", "--bf16",
             "--transformer-impl", "transformer_engine", "--format", "json")  # fmt: skip


def _te_layer_offload(cli, layers: int | None):
    import json

    flags = () if layers is None else ("--cpu-offloading", "--cpu-offloading-num-layers", str(layers))
    result = cli(*TE_LAYERS, *flags)
    assert result.code == 0, result.err
    (stage,) = json.loads(result.out)["stages"]
    return stage["total"], stage.get("host_offload", {}).get("bytes", 0)


def test_te_layer_offload_moves_the_first_layers_saved_tensors_to_the_host(cli):
    plain = _te_layer_offload(cli, None)
    assert _te_layer_offload(cli, 0) == plain  # nothing offloaded
    one, three = _te_layer_offload(cli, 1), _te_layer_offload(cli, 3)
    # every layer saves alike: three layers' host buffers are three times one layer's
    assert one[1] > 0 and three[1] == 3 * one[1]
    # the peak is the loss's, after the forward: the offloaded layers' device memory is released
    # by then (at the forward of layer L-N+i); TE deduplicates by tensor object, so the attention's
    # output, saved again as the projection's input under another view, is copied twice
    saved = [plain[0] - total for total, _ in (one, three)]
    assert 0 < saved[0] < one[1] and saved[0] < saved[1] < three[1]
    assert three[1] - saved[1] < 3 * (one[1] - saved[0])


@pytest.mark.parametrize("flags, error", [
    # TransformerConfig.__post_init__: "Currently there is no support for Pipeline parallelism
    # with CPU offloading"
    (("--pp", "2"), "Error: --cpu-offloading needs --pipeline-model-parallel-size 1, got 2 "
                    "(megatron-core: no support for pipeline parallelism with CPU offloading)"),
    # "CPU offloading does not work when activation recomputation is enabled"
    (("--recompute-granularity", "selective"), "Error: --cpu-offloading cannot go with "
     "--recompute-granularity (megatron-core's TransformerConfig refuses them together)"),
    # "CPU offloading can be done only for layers less than {num_layers}"
    (("--cpu-offloading-num-layers", "4"), "Error: --cpu-offloading-num-layers 4 must be below "
     "--num-layers 4 (megatron-core: CPU offloading can be done only for layers less than it)"),
])  # fmt: skip
def test_te_layer_offload_flags_megatron_refuses_are_refused(cli, flags, error):
    _refused(cli(*TE_LAYERS, "--cpu-offloading", *flags), error)


# the op fuser's grouped MLP (SwiGLU, no biases) on 4 layers of 8 experts, ep 2: N = s x topk =
# 2,048 rows a rank (balanced routing), hidden 256, expert ffn 256
FUSED_MOE = dict(num_experts=8, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                 use_transformer_engine_op_fuser=True, moe_grouped_gemm=True,
                 expert_model_parallel_size=2, data_parallel_size=2, hidden_size=256,
                 moe_ffn_hidden_size=256, seq_length=1024, max_position_embeddings=1024,
                 moe_router_force_load_balancing=True)  # fmt: skip


@pytest.mark.skipif(megatron_core_version() < (0, 19), reason="megatron-core 0.19's module")
def test_fused_group_mlp_offloads_what_the_fused_mlp_saves():
    from inspector.memory.engine.run import run_memory
    from tests.test_cuda_graphs import _job

    plain = run_memory(_job(**FUSED_MOE), 0)
    off = run_memory(_job(**FUSED_MOE, fine_grained_activation_offloading=True,
                          offload_modules=["fused_group_mlp"]), 0)  # fmt: skip
    # experts.py `_fused_forward` runs ops(...) inside the fused_group_mlp offload group: of what
    # TE's basic ops save, Megatron-LM's default 1M-element floor keeps ScaledSwiGLU's input
    # alone (fc1's output [N, 2F] = 2,048 x 512 bf16); fc1's input views and fc2's input
    # [2,048, 256] are below it, the weights are parameters: one micro-batch in flight, 4 layers
    assert off.host == (4 * 2048 * 512 * 2, 4 * 2048 * 512 * 2)
    assert plain.host == (0, 0) and off.peak.bytes < plain.peak.bytes


@pytest.mark.skipif(megatron_core_version() < (0, 19), reason="megatron-core 0.19's module")
def test_fused_group_mlp_with_the_partial_moe_modules_is_megatrons_refusal():
    from inspector.errors import ConfigError
    from tests.test_cuda_graphs import _job

    with pytest.raises(ConfigError, match="cannot be combined with expert_fc1 or moe_act"):
        _job(**FUSED_MOE, fine_grained_activation_offloading=True,
             offload_modules=["fused_group_mlp", "moe_act"])  # fmt: skip
