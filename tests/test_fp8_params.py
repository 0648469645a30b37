"""fp8 parameters (--fp8-param-gather): what a rank holds, counted by hand from the sources.

Transformer Engine 2.11 under `quantized_model_init` (module/base.py `reset_parameters`
1210-1300) makes each GEMM weight a Float8Tensor (tensor/float8_tensor.py): uint8 data [N, K], a
uint8 transpose [K, N] (column-wise usage on Hopper) and an fp32 scale_inv [1]. megatron-core's
DDP (distributed_data_parallel.py 139-146) puts those in a uint8 param buffer and points the data
into it (`replace_raw_data`); the DistributedOptimizer keeps an fp32 main copy per element
(distrib_optimizer.py 364-395) and casts it back with TE's `cast_master_weights_to_fp8`
(tensor/utils.py 54-155). The counts below are written from those lines, not from the stand-in.
"""

from __future__ import annotations

import json

import pytest

from inspector.inputs.versions import megatron_core_version

SMALL = ("--num-layers 2 --hidden-size 256 --num-attention-heads 8 --seq-length 256 --vocab-size "
         "1000 --micro-batch-size 1 --bf16 --swiglu --normalization RMSNorm --disable-bias-linear "
         "--position-embedding-type rope --transformer-impl transformer_engine --fp8-format hybrid "
         "--use-distributed-optimizer --dp 2").split()  # fmt: skip
H, F = 256, 640  # hidden; SwiGLU ffn int(4 x 256 x 2/3 / 64) x 64
TE_WEIGHT_SHAPES = [(3 * H, H), (H, H), (2 * F, H), (H, F)] * 2  # qkv, proj, fc1, fc2; 2 layers
TE_WEIGHTS = [rows * cols for rows, cols in TE_WEIGHT_SHAPES]
SCALE = 512  # an fp32 [1] tensor, as the caching allocator rounds it


def _memory(cli, *flags):
    result = cli("memory", *SMALL, "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def _persistent(stage) -> int:
    return sum(b for _, b in stage["buffers"]["persistent"])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_parameters_hold_one_byte_weights_and_their_transposes(cli, recipe):
    """Weights: the 16-bit buffer (embedding, norms) at 2 bytes, the fp8 buffer at 1 byte, plus
    TE's transpose (1 byte) and scale_inv per fp8 weight. Without the flag each TE linear holds
    a bf16 weight and an fp8 workspace (data + transpose + scale_inv); with it the workspace is
    gone: the rank holds 2 bytes less per TE weight element."""
    plain = _memory(cli, "--fp8-recipe", recipe)
    fp8 = _memory(cli, "--fp8-recipe", recipe, "--fp8-param-gather")
    n = sum(TE_WEIGHTS)
    params = fp8["parameters"]  # every buffer is a multiple of 128 elements: no padding here
    assert fp8["weights"] == 2 * (params - n) + n + sum(w + SCALE for w in TE_WEIGHTS)
    assert plain["weights"] == 2 * params
    assert _persistent(plain) - _persistent(fp8) == sum(2 * w + SCALE for w in TE_WEIGHTS)
    # fp32 main grads and fp32 main params + Adam moments for every element, as without
    assert (fp8["gradients"], fp8["optimizer"]) == (plain["gradients"], plain["optimizer"])
    assert (plain["static"] - fp8["static"]) == 2 * n


def test_a_te_linear_built_under_quantized_model_init_holds_a_float8_tensor():
    import torch

    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from megatron.core.fp8_utils import is_float8tensor
    from transformer_engine.common import recipe

    with te_pytorch.fp8_model_init(recipe=recipe.Float8CurrentScaling()):
        linear = te_pytorch.Linear(128, 384, bias=True, params_dtype=torch.bfloat16, device="cuda")
    weight = linear.weight
    assert is_float8tensor(weight) and isinstance(weight, torch.nn.Parameter)
    assert weight.dtype == torch.bfloat16 and tuple(weight.shape) == (384, 128)  # nominal
    assert (weight._data.dtype, tuple(weight._data.shape)) == (torch.uint8, (384, 128))
    assert (weight._transpose.dtype, tuple(weight._transpose.shape)) == (torch.uint8, (128, 384))
    assert (weight._scale_inv.dtype, tuple(weight._scale_inv.shape)) == (torch.float32, (1,))
    assert not is_float8tensor(linear.bias) and weight.tensor_model_parallel is True
    # outside the context TE builds 16-bit weights again
    plain = te_pytorch.Linear(128, 384, bias=False, params_dtype=torch.bfloat16, device="cuda")
    assert not is_float8tensor(plain.weight)


def test_megatron_ddp_puts_fp8_parameters_in_a_uint8_buffer():
    """distributed_data_parallel.py 139-146: one buffer per (param dtype, grad dtype), uint8 for
    fp8 parameters; the TE weights' elements are exactly that buffer's."""
    import torch

    from inspector.job.job import make_job
    from inspector.world.build import View, build

    job = make_job(dict(
        num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1000,
        micro_batch_size=1, bf16=True, swiglu=True, normalization="RMSNorm",
        disable_bias_linear=True, position_embedding_type="rope",
        transformer_impl="transformer_engine", fp8_format="hybrid", fp8_recipe="tensorwise",
        fp8_param_gather=True, use_distributed_optimizer=True, data_parallel_size=2,
        pipeline_model_parallel_size=1, tensor_model_parallel_size=1,
    ))  # fmt: skip
    built = build(job, View((0,)), expert_ranks=(0,))
    buffers = {b.param_dtype: b for chunk in built.chunks for b in chunk.buffers()}
    assert set(buffers) == {torch.uint8, torch.bfloat16}
    assert buffers[torch.uint8].numel_unpadded == sum(TE_WEIGHTS)
    assert buffers[torch.uint8].kept == sum(w + SCALE for w in TE_WEIGHTS)
    assert buffers[torch.bfloat16].kept == 0
    assert buffers[torch.uint8].grad_dtype == torch.float32


def test_the_step_casts_each_main_shard_through_a_16_bit_copy():
    """cast_master_weights_to_fp8 (utils.py 118-127) casts each rank's fp32 main shard to the
    weight's bf16 dtype first, all kept until it returns, then writes the fp8 data in place."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_optimizer_step import _job, _step

    from inspector.memory.engine.allocator import rounded

    flags = dict(transformer_impl="transformer_engine", use_distributed_optimizer=True,
                 fp8_format="hybrid", fp8_recipe="tensorwise", swiglu=True)  # fmt: skip
    run, _ = _step(_job(**flags, fp8_param_gather=True), fused=True)
    copies = [e.bytes for e in run.events if e.where.endswith("main params to weights _to_copy")]
    assert copies and all(b > 0 for b in copies)
    plain, _ = _step(_job(**flags), fused=True)
    assert not [e for e in plain.events if e.where.endswith("_to_copy")]
    # rank 0's shard of the fp8 buffer, 2 bytes an element, each copy rounded to 512 bytes
    from inspector.world.build import View, build

    job = _job(**flags, fp8_param_gather=True)
    built = build(job, View((0,)), expert_ranks=(0,))
    import torch

    owned = sum(b.owned_numel[0] for c in built.chunks for b in c.buffers()
                if b.param_dtype == torch.uint8)  # fmt: skip
    assert 0 <= sum(copies) - 2 * owned < 512 * len(copies)
    assert sum(copies) == sum(rounded(b) for b in copies)


def test_block_scaled_weights_live_in_the_uint8_buffer_with_their_scales_and_transpose(cli):
    """--fp8-recipe blockwise: TE 2.11's Float8BlockwiseQTensor (float8_blockwise_tensor.py
    `make_empty` 227-290, `get_scale_shape` 125-184 with 128 x 128 weight blocks): row-wise
    uint8 [M, K] in megatron's uint8 param buffer (replace_raw_data 42-47), beside it fp32
    scales [ceil(M/128), round_up(ceil(K/128), 4)], the column-wise uint8 [K, M] and its scales
    [ceil(K/128), round_up(ceil(M/128), 4)], each rounded to 512 bytes."""
    def up(value: int, multiple: int) -> int:
        return -(-value // multiple) * multiple

    def kept(m: int, k: int) -> int:
        scales = [4 * -(-m // 128) * up(-(-k // 128), 4), 4 * -(-k // 128) * up(-(-m // 128), 4)]
        return sum(up(b, SCALE) for b in scales) + k * m

    plain = _memory(cli, "--fp8-recipe", "blockwise")
    block = _memory(cli, "--fp8-recipe", "blockwise", "--fp8-param-gather")
    params, n = block["parameters"], sum(TE_WEIGHTS)
    assert block["weights"] == 2 * (params - n) + n + sum(kept(m, k) for m, k in TE_WEIGHT_SHAPES)
    assert block["weights"] == 3_549_696  # by hand in bench/RESULTS.md (branch fp4pg)
    assert (block["gradients"], block["optimizer"]) == (plain["gradients"], plain["optimizer"])


# megatron-core 0.13-0.15's custom_fsdp keeps fp8 weights its own way: refused by version there
FSDP_NO_SHARD = ("--fp8-param-gather with --use-megatron-fsdp and --data-parallel-sharding-strategy "
                 "no_shard is not modelled" if megatron_core_version() >= (0, 16) else
                 "--fp8-param-gather with --use-megatron-fsdp is not modelled before megatron-core "
                 "0.16")  # fmt: skip


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8-param-gather", "--use-megatron-fsdp"], FSDP_NO_SHARD),
    ],
)  # fmt: skip
def test_fp8_parameters_not_modelled_are_refused_with_the_reason(cli, flags, message):
    result = cli("memory", *SMALL, *flags)
    assert result.code == 2 and result.err.startswith("Error: ") and message in result.err
    assert len(result.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "drop, message",
    [
        ("--use-distributed-optimizer",
         "--fp8-param-gather needs --use-distributed-optimizer (Megatron-LM's validate_args: "
         "'--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron "
         "fsdp, or inference mode')"),
        ("--fp8-format",
         "--fp8-param-gather needs --fp8-format (megatron-core's TransformerConfig: 'fp8_param "
         "must be used together with fp8 mode.')"),
    ],
)  # fmt: skip
def test_command_line_fp8_parameters_meet_megatron_lms_own_checks(cli, drop, message):
    flags = list(SMALL)
    at = flags.index(drop)
    del flags[at : at + (2 if drop == "--fp8-format" else 1)]
    result = cli("memory", *flags, "--fp8-param-gather")
    assert result.code == 2 and result.err == f"Error: {message}\n"


@pytest.mark.skipif(megatron_core_version() < (0, 18), reason="muon takes the distributed optimizer from 0.18")
def test_under_the_layer_wise_optimizer_s_legacy_deal_fp8_weights_keep_their_own_storage(cli):
    """Megatron-LM 0.18+ checks --fp8-param-gather against --use-distributed-optimizer, then turns
    `--optimizer muon --use-distributed-optimizer` into the layer-wise optimizer with it off
    (validate_args, "emerging optimizer check"): Megatron-Bridge's dist_muon. With
    --no-use-layer-wise-param-layout DDP makes no param buffer (param_and_grad_buffer.py
    allocates `param_data` only under the distributed optimizer), so each Float8Tensor keeps its
    uint8 data, its uint8 transpose and its fp32 scale_inv, each its own allocation. The grad
    buffer holds every element in fp32, unpadded. LayerWiseDistributedOptimizer wraps each base
    optimizer in Float16OptimizerWithFloat16Params, which takes a Float8Tensor as a 16-bit
    weight (TE's wrapper reports `torch.cuda.BFloat16Tensor`) and keeps the fp32 main copy of
    each weight its rank owns (`param.detach().clone().float()`, dequantized by TE): Muon's
    matrices 4 + 4 bytes an element (main copy, momentum), Adam's 4 + 8; every weight is owned
    by one data-parallel rank."""
    result = cli("memory", *SMALL, "--fp8-recipe", "tensorwise", "--fp8-param-gather", "--optimizer",
                 "muon", "--no-use-layer-wise-param-layout", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    stage = json.loads(result.out)["stages"][0]
    n = sum(TE_WEIGHTS)
    others = stage["parameters"] - n  # embedding 1024 x 256, five norms of 256
    assert others == 1024 * H + 5 * H
    assert stage["weights"] == 2 * others + sum(w + w + SCALE for w in TE_WEIGHTS)
    assert stage["gradients"] == 4 * stage["parameters"]
    assert sum(stage["optimizer_by_rank"].values()) == 8 * n + 12 * others
    spelled = [a for a in SMALL if a != "--use-distributed-optimizer"]
    refused = cli("memory", *spelled, "--fp8-param-gather", "--optimizer", "dist_muon")
    assert refused.code == 2 and "--fp8-param-gather needs --use-distributed-optimizer" in refused.err


@pytest.mark.skipif(megatron_core_version() < (0, 18), reason="muon takes the distributed optimizer from 0.18")
@pytest.mark.parametrize("extra, refused", [
    (["--dp", "2"], True),  # allgather_params flattens the MXFP8 weights: TE refuses the view
    (["--dp", "1"], False),  # one data-parallel rank: LayerWise deals and gathers nothing
    (["--dp", "2", "--overlap-grad-reduce", "--overlap-param-gather"], False),  # DDP's buckets
])  # fmt: skip
def test_mxfp8_weights_under_the_legacy_deal_need_the_overlapped_gather(cli, extra, refused):
    flags = SMALL[:-2]  # without its "--dp 2"
    result = cli("memory", *flags, *extra, "--fp8-recipe", "mxfp8", "--fp8-param-gather",
                 "--reuse-grad-buf-for-mxfp8-param-ag", "--optimizer", "muon",
                 "--no-use-layer-wise-param-layout")  # fmt: skip
    if refused:
        assert result.code == 2 and result.err.startswith(
            "Error: --fp8-param-gather with --fp8-recipe mxfp8 and --no-use-layer-wise-param-layout "
            "needs --overlap-param-gather"), result.err  # fmt: skip
    else:
        assert result.code == 0, result.err


def test_plan_keeps_the_distributed_optimizer_and_matches_memory(cli):
    """plan searches fp8 parameters with the distributed optimizer only (Megatron-LM gathers them
    through it), and its memory is what `memory` measures on the plan's flags."""
    import shlex

    model = ["--model", "llama3-8b", "--num-layers", "2", "--seq-length", "1024", "--bf16",
             "--global-batch-size", "8", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
             "--fp8-param-gather"]  # fmt: skip
    result = cli("plan", "--format", "json", "--gpus", "2", "--tp", "1", "--cp", "1", *model,
                 "--top", "3")  # fmt: skip
    assert result.code == 0, result.err
    plans = json.loads(result.out)["plans"]
    assert all("--use-distributed-optimizer" in p["flags"] for p in plans)
    flags = [word for flag in plans[0]["flags"] for word in shlex.split(flag)]
    memory = cli("memory", "--format", "json", *model, *flags, "--dp", str(plans[0]["layout"]["dp"]))
    assert memory.code == 0, memory.err
    built = json.loads(memory.out)["stages"]
    assert [s["total"] for s in plans[0]["stages"]] == [s["total"] for s in built]


def test_after_the_step_megatron_keeps_or_drops_the_transposes_as_its_version_does():
    """megatron-core 0.16 passes `manual_post_all_gather_processing=True` to TE's cast (its
    fp8_utils.py imports TE's post_all_gather_processing) and remakes each transpose after the
    all-gather, so they stay; 0.13 lets the cast drop them (`_reset_caches`), to be made again by
    the next forward. The static count keeps them: the forward's peak holds them either way."""
    import sys
    from pathlib import Path

    import megatron.core

    sys.path.insert(0, str(Path(__file__).parent))
    from test_optimizer_step import _job

    from inspector.memory.engine.optimizer import run_step
    from inspector.memory.engine.runtime import runtime_config
    from inspector.memory.engine.stage import _ddp as ddp_wrapped
    from inspector.world.stage import stage_world
    from inspector.world.te.float8_tensor import Float8Tensor

    job = _job(transformer_impl="transformer_engine", use_distributed_optimizer=True,
               fp8_format="hybrid", fp8_recipe="tensorwise", swiglu=True, fp8_param_gather=True)
    with stage_world(job.model, job.layout, 0, checkpoint=False, runtime=runtime_config(job)) as chunks:
        ddps = [ddp_wrapped(job, chunk.module, 0, i) for i, chunk in enumerate(chunks)]
        run_step(job, ddps, True)
        weights = [p for c in chunks for p in c.module.parameters() if isinstance(p, Float8Tensor)]
    from megatron.core import fp8_utils

    manual = hasattr(fp8_utils, "post_all_gather_processing")  # 0.16.1 has it, 0.13.1 not
    version = tuple(int(part) for part in megatron.core.__version__.split(".")[:2])
    assert manual == (version >= (0, 16)) or version not in ((0, 13), (0, 16))
    assert len(weights) == 8
    assert [w._transpose is not None for w in weights] == [manual] * 8, megatron.core.__version__


def test_workload_gathers_fp8_parameters_in_one_byte(cli, tmp_path):
    """The distributed optimizer all-gathers megatron's param buffers: the uint8 one moves one
    byte per Transformer Engine weight element, the 16-bit one two per other parameter."""
    gathered = []
    for flags in ([], ["--fp8-param-gather"]):
        out = tmp_path / str(len(flags))
        result = cli("workload", *SMALL, "--fp8-recipe", "tensorwise", "--gpu", "h100", "-o",
                     str(out), *flags)  # fmt: skip
        assert result.code == 0, result.err
        rows = [line.split("\t") for f in sorted(out.rglob("*.txt")) for line in f.read_text().splitlines()]
        gathered.append(sum(int(row[10]) for row in rows if row[0] == "grad_gather"))
    assert gathered[0] - gathered[1] == sum(TE_WEIGHTS)
