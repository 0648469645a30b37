"""MXFP8 parameters (--fp8-recipe mxfp8 --fp8-param-gather --reuse-grad-buf-for-mxfp8-param-ag),
counted by hand from the sources.

Transformer Engine 2.11 under `quantized_model_init` makes each GEMM weight an MXFP8Tensor
(tensor/mxfp8_tensor.py `MXFP8Quantizer.make_empty` 98-159): row-wise uint8 data [M, K] with
uint8 E8M0 scales [round_up(M, 128), round_up(K / 32, 4)], column-wise uint8 data [M, K] with
scales [round_up(M / 32, 4), round_up(K, 128)]. megatron-core 0.16.1's DDP
(param_and_grad_buffer.py 774-793) gives a buffer holding MXFP8 weights one `shared_buffer` in
the grad dtype, the param buffer a bf16 view of its first half, and (with the flag, 821-835)
never points the weights into it. The counts below are written from those lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8_params import FSDP_NO_SHARD, SMALL, TE_WEIGHT_SHAPES  # noqa: E402

MXFP8 = ["--fp8-recipe", "mxfp8", "--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag"]
BLOCK = 512  # the caching allocator's smallest block: each of TE's four tensors is rounded to it


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _mxfp8_bytes(rows: int, cols: int) -> int:
    """make_empty 119-147: two uint8 [rows, cols] data tensors and their E8M0 scales."""
    tensors = [rows * cols, _up(rows, 128) * _up(cols // 32, 4),
               rows * cols, _up(rows // 32, 4) * _up(cols, 128)]  # fmt: skip
    return sum(_up(t, BLOCK) for t in tensors)


def _memory(cli, *flags):
    result = cli("memory", *SMALL, "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def test_mxfp8_weights_live_outside_megatrons_buffers_and_the_grad_buffer_serves_the_gather(cli):
    """Weights: the 16-bit buffer (embedding, norms) at 2 bytes, no param buffer for the MXFP8
    weights (their gather reuses the grad buffer), and each weight's four TE tensors. Gradients
    and optimizer state are as without fp8 parameters: fp32 grads, fp32 main copy and moments."""
    plain = _memory(cli, "--fp8-recipe", "mxfp8")
    mx = _memory(cli, *MXFP8)
    n = sum(r * c for r, c in TE_WEIGHT_SHAPES)
    params = mx["parameters"]  # every buffer is a multiple of 128 elements: no padding here
    assert mx["weights"] == 2 * (params - n) + sum(_mxfp8_bytes(r, c) for r, c in TE_WEIGHT_SHAPES)
    assert plain["weights"] == 2 * params
    assert (mx["gradients"], mx["optimizer"]) == (plain["gradients"], plain["optimizer"])


def test_a_te_linear_built_under_quantized_model_init_holds_an_mxfp8_tensor():
    import torch

    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from megatron.core.fp8_utils import is_float8tensor, is_mxfp8tensor
    from transformer_engine.common import recipe

    with te_pytorch.fp8_model_init(recipe=recipe.MXFP8BlockScaling()):
        linear = te_pytorch.Linear(160, 384, bias=False, params_dtype=torch.bfloat16, device="cuda")
    weight = linear.weight
    assert is_mxfp8tensor(weight) and is_float8tensor(weight)
    assert isinstance(weight, torch.nn.Parameter) and weight.tensor_model_parallel is True
    assert weight.dtype == torch.bfloat16 and tuple(weight.shape) == (384, 160)  # nominal
    shapes = [(t.dtype, tuple(t.shape)) for t in (
        weight._rowwise_data, weight._rowwise_scale_inv,
        weight._columnwise_data, weight._columnwise_scale_inv)]  # fmt: skip
    u8 = torch.uint8
    # rows 384 (a multiple of 128), 160 / 32 = 5 scales a row padded to 8; 384 / 32 = 12 scale
    # rows, columns 160 padded to 256
    assert shapes == [(u8, (384, 160)), (u8, (384, 8)), (u8, (384, 160)), (u8, (12, 256))]


def test_megatron_ddp_shares_the_grad_buffer_with_the_mxfp8_gather():
    """param_and_grad_buffer.py 779-793: one fp32 buffer, the param buffer a bf16 view of its
    first half; the MXFP8 weights' `.data` is not pointed into it (821-835), `main_grad` is."""
    import torch

    from inspector.job.job import make_job
    from inspector.world.build import View, build

    job = make_job(dict(
        num_layers=2, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1000,
        micro_batch_size=1, bf16=True, swiglu=True, normalization="RMSNorm",
        disable_bias_linear=True, position_embedding_type="rope",
        transformer_impl="transformer_engine", fp8_format="hybrid", fp8_recipe="mxfp8",
        fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True,
        use_distributed_optimizer=True, data_parallel_size=2,
        pipeline_model_parallel_size=1, tensor_model_parallel_size=1,
    ))  # fmt: skip
    built = build(job, View((0,)), expert_ranks=(0,))
    buffers = {b.param_dtype: b for chunk in built.chunks for b in chunk.buffers()}
    assert set(buffers) == {torch.uint8, torch.bfloat16}
    mx, rest = buffers[torch.uint8], buffers[torch.bfloat16]
    assert mx.shared and not rest.shared and mx.grad_dtype == torch.float32
    assert mx.numel_unpadded == sum(r * c for r, c in TE_WEIGHT_SHAPES)
    assert mx.kept == sum(_mxfp8_bytes(r, c) for r, c in TE_WEIGHT_SHAPES)


def test_megatrons_own_buffer_is_one_allocation():
    """Read megatron's _ParamAndGradBuffer itself: `param_data` views `grad_data`'s storage."""
    import torch
    from test_optimizer_step import _job

    from inspector.memory.engine.optimizer import run_step
    from inspector.memory.engine.runtime import runtime_config
    from inspector.memory.engine.stage import _ddp as ddp_wrapped
    from inspector.world.stage import stage_world
    from inspector.world.te.mxfp8_tensor import MXFP8Tensor

    job = _job(transformer_impl="transformer_engine", use_distributed_optimizer=True,
               fp8_format="hybrid", fp8_recipe="mxfp8", swiglu=True, fp8_param_gather=True,
               reuse_grad_buf_for_mxfp8_param_ag=True)  # fmt: skip
    with stage_world(job.model, job.layout, 0, checkpoint=False, runtime=runtime_config(job)) as chunks:
        ddp = ddp_wrapped(job, chunks[0].module, 0, 0)
        shared = [b for b in ddp.buffers if hasattr(b, "shared_buffer")]
        assert len(shared) == 1
        buffer = shared[0]
        assert buffer.grad_data is buffer.shared_buffer and buffer.grad_dtype == torch.float32
        assert buffer.param_data.dtype == torch.bfloat16
        assert buffer.param_data.numel() == buffer.numel  # half of the fp32 buffer, as bf16
        assert all(isinstance(p, MXFP8Tensor) for p in buffer.params)
        # the step copies the fp32 main shards into the bf16 view in place
        # (distrib_optimizer.py 2481-2503 `_copy_main_params_to_param_buffer`), with no 16-bit
        # copies as the Float8Tensor cast makes (test_fp8_params), and the all-gather's
        # `param.data.copy_` quantizes in place (distributed_data_parallel.py 491-502)
        step = run_step(job, [ddp], True)
        assert not [e for e in step.events if "main params to weights" in e.where]
        assert step.state > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp8-recipe", "mxfp8", "--fp8-param-gather"],
         "Error: --fp8-param-gather with --fp8-recipe mxfp8 needs "
         "--reuse-grad-buf-for-mxfp8-param-ag: without it megatron's DDP points each MXFP8 "
         "weight into its param buffer, which Transformer Engine refuses"),
        (["--fp8-recipe", "mxfp8", "--reuse-grad-buf-for-mxfp8-param-ag"],
         "Error: --reuse-grad-buf-for-mxfp8-param-ag needs --fp8-param-gather"),
        # Megatron-FSDP keeps its own buffers (no replace_raw_data): megatron's DDP does not
        # stop it; its no_shard (the default strategy), which makes no weight buffer, is refused
        (["--fp8-recipe", "mxfp8", "--fp8-param-gather", "--use-megatron-fsdp",
          "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
         "Error: " + FSDP_NO_SHARD),
        (["--fp8-recipe", "tensorwise", "--fp8-param-gather",
          "--reuse-grad-buf-for-mxfp8-param-ag"],
         "Error: --reuse-grad-buf-for-mxfp8-param-ag needs --fp8-recipe mxfp8, not tensorwise"),
    ],
)  # fmt: skip
def test_mxfp8_parameters_megatron_refuses_are_refused_with_the_reason(cli, flags, message):
    result = cli("memory", *SMALL, *flags)
    assert result.code == 2 and result.err.startswith(message), result.err
    assert len(result.err.strip().splitlines()) == 1


def test_workload_gathers_mxfp8_parameters_in_bf16(cli, tmp_path):
    """The distributed optimizer all-gathers the grad buffer's bf16 view: two bytes an MXFP8
    weight element, as many as without fp8 parameters."""
    gathered = []
    for flags in (["--fp8-recipe", "mxfp8"], MXFP8):
        out = tmp_path / str(len(flags))
        result = cli("workload", *SMALL, "--gpu", "b200", "-o", str(out), *flags)
        assert result.code == 0, result.err
        rows = [line.split("\t") for f in sorted(out.rglob("*.txt")) for line in f.read_text().splitlines()]
        gathered.append(sum(int(row[10]) for row in rows if row[0] == "grad_gather"))
    assert gathered[0] == gathered[1] > 0


def test_plan_prices_mxfp8_parameters_as_memory_measures_them(cli):
    import shlex

    model = ["--model", "llama3-8b", "--num-layers", "2", "--seq-length", "1024", "--bf16",
             "--global-batch-size", "8", "--fp8-format", "hybrid", *MXFP8]  # fmt: skip
    result = cli("plan", "--format", "json", "--gpus", "2", "--tp", "1", "--cp", "1", *model,
                 "--top", "3", "--gpu", "b200")  # fmt: skip
    assert result.code == 0, result.err
    plans = json.loads(result.out)["plans"]
    assert all("--use-distributed-optimizer" in p["flags"] for p in plans)
    assert "--reuse-grad-buf-for-mxfp8-param-ag" in plans[0]["flags"]
    flags = [word for flag in plans[0]["flags"] for word in shlex.split(flag)]
    memory = cli("memory", "--format", "json", *model[:-1], *flags, "--dp", str(plans[0]["layout"]["dp"]))
    assert memory.code == 0, memory.err
    built = json.loads(memory.out)["stages"]
    assert [s["total"] for s in plans[0]["stages"]] == [s["total"] for s in built]


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_the_params_table_counts_what_each_quantized_weight_stores(cli, recipe):
    """The `# stage` line's bytes: 2 per 16-bit parameter; a Float8Tensor's data and transpose
    (1 byte each an element) and fp32 scale_inv; an MXFP8Tensor's four tensors (make_empty)."""
    flags = [f for f in SMALL if f not in ("--micro-batch-size", "1")]
    extra = MXFP8 if recipe == "mxfp8" else ["--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    result = cli("params", *flags, *extra)
    assert result.code == 0, result.err
    line = next(x for x in result.out.splitlines() if x.startswith("# stage 0"))
    params, size = (int(w) for w in line.replace(",", "").split()[-4::2])
    n = sum(r * c for r, c in TE_WEIGHT_SHAPES)
    stored = (sum(_mxfp8_bytes(r, c) for r, c in TE_WEIGHT_SHAPES) if recipe == "mxfp8"
              else 2 * n + 4 * len(TE_WEIGHT_SHAPES))  # fmt: skip
    assert size == 2 * (params - n) + stored
