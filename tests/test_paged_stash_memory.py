"""megatron-core 0.18+'s MoE paged stash in `memory` (memory/engine/paged_stash.py): megatron's
profiling pass, its allocate_stash_buffers for the rank, its pages in the steady pass; the bad
inputs; the version facts the stand-ins rest on."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math

import pytest

from inspector.inputs.versions import megatron_core_version

HAS_STASH = importlib.util.find_spec("megatron.core.transformer.moe.paged_stash") is not None
needs_stash = pytest.mark.skipif(not HAS_STASH, reason="megatron-core 0.18 added the MoE paged stash")

# tests/test_fused_mlp.py's MXFP8 job (TE's CuTe DSL grouped MLP marks what the stash pages): a
# rank gets 4,096 tokens x top-8 = 32,768 rows a layer; the budget 1.5 x that (49,152 rows), so
# megatron's _fused_forward counts int(49,152 // 1.5) = 32,768 a layer
JOB = ("memory", "--model", "qwen3-30b-a3b", "--num-layers", "2", "--ep", "8", "--dp", "8",
       "--micro-batch-size", "1", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
       "--use-transformer-engine-op-fuser", "--moe-token-dispatcher-type", "flex",
       "--moe-flex-dispatcher-backend", "hybridep", "--moe-mlp-glu-interleave-size", "32",
       "--moe-expert-rank-capacity-factor", "1.5", "--no-cache")  # fmt: skip
ROWS, LAYERS, PAGE, F, H = 32_768, 2, 64, 768, 2048


def _pages(tokens: int, factor: float) -> int:
    """paged_stash.py allocate_stash_buffers / PagedStashBuffer: int(tokens x factor) in pages."""
    return math.ceil(int(tokens * factor) / PAGE)


@pytest.mark.slow
@needs_stash
def test_the_stash_buffers_are_megatrons_own(cli, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe import paged_stash

    made: list[tuple[int, int, int, str]] = []
    init = paged_stash.PagedStashBuffer.__init__

    def spied(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        made.append((self.num_cuda_pages, self.num_host_pages, self.hidden_size, str(self.dtype)))

    monkeypatch.setattr(paged_stash.PagedStashBuffer, "__init__", spied)
    done = cli(*JOB, "--moe-paged-stash", "--moe-paged-stash-buffer-size-factor-cpu", "1.0",
               "--format", "json")  # fmt: skip
    assert done.code == 0, done.err
    stage = json.loads(done.out)["stages"][0]
    persistent = stage["buffers"]["persistent"]
    stash = {where: size for where, size in persistent if where.startswith("paged stash")}
    # the rank's buffers: both layers' marked tensors wait for backward at pp 1 (the profiling
    # pass's most); SwiGLU's input bf16 [N, 2F], the probs fp32 [N], fc1's and fc2's column-wise
    # MXFP8 data with their scales (a 32nd of the rows, the same columns: one buffer)
    bf16, scales = _pages(LAYERS * ROWS, 1.1), _pages(LAYERS * (ROWS + ROWS // 32), 1.1)
    assert stash[f"paged stash: bfloat16 pages ({bf16} pages of 64 x {2 * F} bfloat16)"] == bf16 * PAGE * 2 * F * 2
    assert f"paged stash: float32 pages ({bf16} pages of 64 x 1 float32)" in stash
    assert stash[f"paged stash: uint8 pages ({scales} pages of 64 x {H} uint8)"] == scales * PAGE * H
    assert stash[f"paged stash: uint8 pages ({scales} pages of 64 x {F} uint8)"] == scales * PAGE * F
    # and megatron's own PagedStashBuffer made them (the last four: the rank's, after the traces')
    assert sorted(made[-4:]) == sorted([
        (bf16, _pages(LAYERS * ROWS, 1.0), 2 * F, "torch.bfloat16"),
        (bf16, _pages(LAYERS * ROWS, 1.0), 1, "torch.float32"),
        (scales, _pages(LAYERS * (ROWS + ROWS // 32), 1.0), F, "torch.uint8"),
        (scales, _pages(LAYERS * (ROWS + ROWS // 32), 1.0), H, "torch.uint8")])  # fmt: skip
    # the pinned host buffers (CPU factor 1.0) are host memory, beside offloading's
    host_rows = _pages(LAYERS * ROWS, 1.0) * PAGE, _pages(LAYERS * (ROWS + ROWS // 32), 1.0) * PAGE
    asked = host_rows[0] * (2 * F * 2 + 4) + host_rows[1] * (F + H)
    assert stage["host_offload"]["bytes"] == asked
    # the text names them under the table
    text = cli(*JOB, "--moe-paged-stash")
    assert f"Stage 0: the MoE paged stash's buffers 0.40 GiB (bfloat16 pages ({bf16} pages of 64 x 1536" in text.out


@pytest.mark.slow
@needs_stash
def test_the_steady_pass_keeps_the_stashed_layer_in_pages(cli) -> None:
    # without the stash both layers hold their marked tensors at the budget's 49,152 rows until
    # backward; with it the first layer's are in the pages (the last layer's backward comes
    # right after its forward, so megatron keeps its tensors): the activations drop
    plain = cli(*JOB, "--format", "json")
    stash = cli(*JOB, "--moe-paged-stash", "--format", "json")
    assert plain.code == 0 and stash.code == 0, stash.err
    before, after = (json.loads(done.out)["stages"][0]["activations"]["total"] for done in (plain, stash))
    budget = ROWS * 3 // 2  # fc1's and fc2's column-wise data and scales, SwiGLU's input, probs
    marked = budget * (H + 2 * F * 2 + 4 + F) + budget // 32 * (H + F)
    assert before - after >= marked * 0.99


def test_the_profiling_count_follows_megatrons_passes() -> None:
    # megatron's capture adds a layer's tokens in its forward and takes them off in its backward;
    # under the all-to-all overlap the older micro-batch's layer L-1-i gives its tokens back
    # before the newer one's layer i saves (TransformerLayerSchedulePlan.run: b_layer.mlp.backward,
    # then f_layer.mlp.forward), so 2 layers of 10 tokens peak at 20, not 30
    from inspector.memory.engine.paged_stash import most_counted
    from inspector.memory.engine.schedule import Pass

    kind = ("bfloat16", 1536, "avg")
    layers = [[{kind: 10}, {kind: 10}]]
    plain = [Pass(True, 0, 0, 0, 1), Pass(True, 0, 1, 0, 2), Pass(False, 0, 0, 0, 2), Pass(False, 0, 1, 0, 1)]
    assert most_counted(plain, layers) == {kind: 40}  # two micro-batches in flight
    paired = [Pass(True, 0, 0, 0, 1), Pass(True, 0, 1, 0, 2, (0, 0)), Pass(False, 0, 1, 0, 1)]
    assert most_counted(paired, layers) == {kind: 20}


def test_most_in_flight_counts_the_micro_batches_megatron_keeps() -> None:
    # offloading's host demand: stage 0 of pp 2 holds two micro-batches in flight, the last one
    from inspector.memory.engine.offload_steady import most_in_flight

    assert most_in_flight([[10, 3]], 0, 2, 4) == [20, 6]
    assert most_in_flight([[10, 3]], 1, 2, 4) == [10, 3]


@pytest.mark.parametrize(("extra", "message"), [
    # transformer_config.py __post_init__: the stash needs HybridEP's static budget
    (("--moe-paged-stash",), "Error: --moe-paged-stash needs --moe-expert-rank-capacity-factor"),
    # a page holds at least one token (PagedStashBuffer's ceil division)
    (("--moe-paged-stash-page-size", "0"), "Error: --moe-paged-stash-page-size must be at least 1, got 0"),
    # under 1 in all, balanced routing overflows the buffers: megatron's rerun is not simulated
    (("--moe-paged-stash-buffer-size-factor-cuda", "0.5", "--moe-paged-stash-buffer-size-factor-cpu",
      "0.25"), "Error: --moe-paged-stash-buffer-size-factor-cuda 0.5 with "
     "--moe-paged-stash-buffer-size-factor-cpu 0.25 is not modelled: the stash's buffers hold "
     "|0.5| + |0.25| = 0.75 times"),
    # one iteration is the profiling one alone: memory reports the steady state
    (("--train-iters", "1"), "Error: --train-iters 1 with --moe-paged-stash is not modelled"),
])  # fmt: skip
@needs_stash
def test_bad_stash_sizes_are_refused(cli, extra: tuple[str, ...], message: str) -> None:
    job = [a for a in JOB if a not in ("--moe-expert-rank-capacity-factor", "1.5")]
    if extra[0] != "--moe-paged-stash":
        job += ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.5"]
    done = cli(*job, *extra)
    assert done.code == 2 and done.out == ""
    assert done.err.splitlines()[-1].startswith(message), done.err


def test_before_0_18_the_stash_is_refused_by_version(cli) -> None:
    from inspector.inputs.unmodelled import refusal_message

    message = refusal_message("--moe-paged-stash", None)
    if HAS_STASH:
        assert message is None and refusal_message("--moe-paged-stash-page-size", "128") is None
    else:
        assert message == ("--moe-paged-stash is not modelled: megatron-core 0.13-0.17 have no MoE "
                           "paged stash (transformer/moe/paged_stash.py came in 0.18, where it is "
                           "modelled)")  # fmt: skip
    assert HAS_STASH == (megatron_core_version() >= (0, 18))


@needs_stash
def test_the_stand_ins_mirror_megatrons_stash() -> None:
    # the page kernels the stand-in replaces, by name, in the module that launches them
    from megatron.core.transformer.moe import paged_stash
    from megatron.core.transformer.transformer_config import TransformerConfig as Config

    from inspector.job.job import Training

    source = inspect.getsource(paged_stash.PagedTensor)
    assert "paged_stash_copy_kernel[grid](" in source and "paged_stash_pop_kernel[grid](" in source
    # the job's defaults are TransformerConfig's
    fields = Config.__dataclass_fields__
    training = Training()
    assert (fields["moe_paged_stash_page_size"].default, fields["moe_paged_stash_buffer_size_factor_cuda"].default,
            fields["moe_paged_stash_buffer_size_factor_cpu"].default) == (
        training.moe_paged_stash_page_size, training.moe_paged_stash_factor_cuda,
        training.moe_paged_stash_factor_cpu)  # fmt: skip
    # megatron's schedules reset the stash each iteration: the second call allocates the buffers
    reset = inspect.getsource(paged_stash.paged_stash_reset)
    assert "stash_manager.status = 'capture'" in reset and "allocate_stash_buffers(" in reset


@pytest.mark.slow
@needs_stash
def test_offloading_beside_the_stash_counts_one_iteration(cli) -> None:
    # the profiling pass runs with its own offload manager: the host memory offloading takes is
    # the steady pass's alone, the same with the stash as without (no host stash: CPU factor 0)
    offload = ("--fine-grained-activation-offloading", "--offload-modules", "core_attn", "--format", "json")
    plain, stash = cli(*JOB, *offload), cli(*JOB, *offload, "--moe-paged-stash")
    assert plain.code == 0 and stash.code == 0, stash.err
    host = [json.loads(done.out)["stages"][0]["host_offload"] for done in (plain, stash)]
    assert host[0] == host[1] and host[0]["bytes"] > 0


def _qwen_job(**flags):  # type: ignore[no-untyped-def]
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job

    args = dict(num_layers=4, pipeline_model_parallel_size=2, expert_model_parallel_size=8,
                data_parallel_size=8, micro_batch_size=1, bf16=True, fp8_format="e4m3",
                fp8_recipe="mxfp8", use_transformer_engine_op_fuser=True,
                moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                moe_mlp_glu_interleave_size=32, moe_expert_rank_capacity_factor=1.5, **flags)  # fmt: skip
    resolved = merge_sources(Sources(preset="qwen3-30b-a3b", flags=args), ("model", "layout", "training"))
    return make_job(resolved.args)


@pytest.mark.slow
@needs_stash
def test_a_stage_before_the_last_stashes_its_last_layer_too() -> None:
    # 1F1B on stage 0 of pp 2 runs another micro-batch's pass between a chunk's forward and its
    # backward, so megatron stashes the chunk's last layer as well (PipelinePostScheduleFunction:
    # the next schedule entry is not the layer's own backward); the last stage keeps it
    from inspector.memory.engine.run import run_memory

    budget = ROWS * 3 // 2
    marked = budget * (H + 2 * F * 2 + 4 + F) + budget // 32 * (H + F)
    first = [run_memory(_qwen_job(**f), 0).replay.traces[0].held for f in ({}, {"moe_paged_stash": True})]
    last = [run_memory(_qwen_job(**f), 1).replay.traces[0].held for f in ({}, {"moe_paged_stash": True})]
    assert first[0] - first[1] >= 2 * marked * 0.99  # both of its layers in pages
    assert marked * 0.99 <= last[0] - last[1] < 1.01 * marked  # one in pages, the last kept
