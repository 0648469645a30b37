"""NVFP4 parameters (--fp4-format e2m1 --fp4-param-gather), counted by hand from the sources.

Transformer Engine 2.14 (the release the stand-in mirrors under megatron-core 0.17+) under
`quantized_model_init` makes each GEMM weight an NVFP4Tensor (tensor/nvfp4_tensor.py
`NVFP4Quantizer.make_empty` 292-372, `get_scale_shape` 223-257, `convert_shape_for_fp4` 286-290):
row-wise uint8 data [M, K / 2] with uint8 E4M3 scales [round_up(M, 128), round_up(K / 16, 4)] and
an fp32 amax [1]; column-wise uint8 data [K, M / 2] with scales [round_up(K, 128),
round_up(M / 16, 4)] and an fp32 amax [1]. megatron-core 0.18+'s DDP (param_and_grad_buffer.py
`_compute_nvfp4_packed_layout`) lays the NVFP4 weights' packed row-wise bytes into a uint8 param
buffer at half the elements (each start padded to 64, the end to lcm(dp, 128)) and points the
weights there (`modify_nvfp4_rowwise_storage`); the grad buffer keeps every element. Before 0.18
the flag is refused by name, with the version. The counts below are written from those lines.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from inspector.inputs.versions import FP4_PARAM_RELEASES, within
from inspector.job.versions import FP4_SINCE, megatron_version

sys.path.insert(0, str(Path(__file__).parent))
from test_nvfp4 import SMALL as NVFP4_SMALL  # noqa: E402
from test_nvfp4 import plan_and_memory  # noqa: E402

MODELLED = within(FP4_PARAM_RELEASES, megatron_version())
NEEDS_FP4_PARAMS = pytest.mark.skipif(not MODELLED, reason="megatron-core 0.18+ runs fp4 parameters")
# test_nvfp4.py's 4-layer model (h 256, SwiGLU, dp 2, distributed optimizer) in NVFP4
SMALL = [*NVFP4_SMALL, "--fp4-format", "e2m1"]
MODEL_ONLY = [a for i, a in enumerate(SMALL) if "--micro-batch-size" not in SMALL[i - 1 : i + 1]]
H, F = 256, 640  # hidden; SwiGLU ffn
LAYER_WEIGHTS = [(3 * H, H), (H, H), (2 * F, H), (H, F)]  # qkv, proj, fc1, fc2 (out, in)
BLOCK = 512  # the caching allocator's smallest block: each of TE's tensors is rounded to it


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _make_empty(rows: int, cols: int) -> list[tuple[str, tuple[int, ...]]]:
    """make_empty 318-358 for an [rows, cols] weight, both usages: (dtype, shape) per tensor."""
    return [("uint8", (rows, cols // 2)), ("uint8", (_up(rows, 128), _up(-(-cols // 16), 4))),
            ("float32", (1,)), ("uint8", (cols, rows // 2)),
            ("uint8", (_up(cols, 128), _up(-(-rows // 16), 4))), ("float32", (1,))]  # fmt: skip


def _bytes(entry: tuple[str, tuple[int, ...]]) -> int:
    dtype, shape = entry
    count = 1
    for n in shape:
        count *= n
    return count * (4 if dtype == "float32" else 1)


def _kept(rows: int, cols: int) -> int:
    """What stays the weight's own: all but the packed row-wise data, each tensor rounded."""
    return sum(_up(_bytes(t), BLOCK) for t in _make_empty(rows, cols)[1:])


def test_the_stand_in_follows_the_te_release_each_megatron_core_accepts():
    """0.16.1 pins transformer-engine <2.12 (its `dev` extra): 2.11; 0.17+ pin none and call
    TE 2.14's quantize_master_weights: 2.14; 0.18 and 0.19 the release their uv.lock installs
    (2.16.0, 2.17.1). The installed megatron-core's metadata agrees."""
    from packaging.requirements import Requirement

    from inspector.world import te

    assert te.release_for((0, 13)) == te.release_for((0, 16)) == "2.11.0"
    assert te.release_for((0, 17)) == "2.14.0"
    assert (te.release_for((0, 18)), te.release_for((0, 19))) == ("2.16.0", "2.17.1")  # uv.lock
    assert te.VERSION == te.release_for(megatron_version())
    pins = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    for pin in (p for p in pins if p.name == "transformer-engine"):
        assert pin.specifier.contains(te.VERSION, prereleases=True), (pin, te.VERSION)
    te.install()
    import transformer_engine.pytorch.tensor.utils as utils

    assert hasattr(utils, "quantize_master_weights") == (te.VERSION >= "2.14")


def test_an_nvfp4_weight_holds_what_make_empty_allocates():
    import torch

    from inspector.world import te

    te.install()
    import transformer_engine.pytorch as te_pytorch
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Tensor

    with te_pytorch.fp8_model_init(recipe=recipe.NVFP4BlockScaling()):
        linear = te_pytorch.Linear(160, 384, bias=False, params_dtype=torch.bfloat16, device="cuda")
    weight = linear.weight
    assert isinstance(weight, NVFP4Tensor) and weight.dtype == torch.bfloat16
    names = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise", "_columnwise_data",
             "_columnwise_scale_inv", "_amax_columnwise")  # fmt: skip
    held = [(str(getattr(weight, n).dtype).removeprefix("torch."), tuple(getattr(weight, n).shape))
            for n in names]  # fmt: skip
    assert held == _make_empty(384, 160)
    # megatron's buffer takes the packed row-wise bytes; TE keeps the rest beside the parameter
    assert weight.buffer_data() is weight._rowwise_data
    assert [tuple(t.shape) for t in weight.kept_tensors()] == [s for _, s in _make_empty(384, 160)[1:]]


@NEEDS_FP4_PARAMS
def test_nvfp4_weights_are_gathered_packed_and_the_optimizer_keeps_fp32_main_params(cli):
    """Weights: the bf16 buffer (embedding 1024 x 256, nine norms of 256) at 2 bytes, the uint8
    buffer of packed NVFP4 bytes (each weight M x K / 2, all multiples of 64 and 128 here) and
    what TE keeps of each weight. Gradients and optimizer state are as with bf16 parameters:
    the grad buffer and the fp32 main copies cover every element."""
    plain = _memory(cli)
    fp4 = _memory(cli, "--fp4-param-gather")
    weights = [w for _ in range(4) for w in LAYER_WEIGHTS]
    sixteen_bit = 1024 * H + 9 * H
    packed = sum(r * c // 2 for r, c in weights)
    assert packed == 1_507_328
    assert fp4["weights"] == 2 * sixteen_bit + packed + sum(_kept(r, c) for r, c in weights)
    assert fp4["weights"] == 3_936_768  # by hand in bench/RESULTS.md (branch fp4pg)
    assert plain["weights"] == 2 * fp4["parameters"]
    assert (fp4["gradients"], fp4["optimizer"]) == (plain["gradients"], plain["optimizer"])
    assert fp4["optimizer"] == 12 * fp4["parameters"] // 2  # fp32 main and two moments, dp 2


@NEEDS_FP4_PARAMS
def test_without_the_distributed_optimizer_each_nvfp4_weight_keeps_its_own_storage(cli):
    """Megatron-LM 0.18-0.19 validate_args checks --fp4-param-gather only against --fp4-format.
    Without the distributed optimizer megatron's DDP makes no param buffer
    (param_and_grad_buffer.py allocates `param_data` only under it): all six of make_empty's
    tensors stay the weight's own allocations, each rounded to 512 bytes. The grad buffer holds
    every element in fp32, unpadded; Float16OptimizerWithFloat16Params takes an NVFP4 weight as a
    16-bit one (TE's wrapper reports its nominal `torch.cuda.BFloat16Tensor`) and keeps its fp32
    main copy (`param.detach().clone().float()`, TE dequantizes) with Adam's two moments: 12
    bytes an element on every rank."""
    args = [a for a in SMALL if a != "--use-distributed-optimizer"]
    result = cli("memory", *args, "--fp4-param-gather", "--format", "json")
    assert result.code == 0, result.err
    fp4 = json.loads(result.out)["stages"][0]
    weights = [w for _ in range(4) for w in LAYER_WEIGHTS]
    sixteen_bit = 1024 * H + 9 * H
    own = sum(_up(_bytes(t), BLOCK) for r, c in weights for t in _make_empty(r, c))
    assert fp4["parameters"] == sixteen_bit + sum(r * c for r, c in weights) == 3_279_104
    assert fp4["weights"] == 2 * sixteen_bit + own == 3_936_768
    assert fp4["gradients"] == 4 * fp4["parameters"]
    assert fp4["optimizer"] == 12 * fp4["parameters"]


@NEEDS_FP4_PARAMS
def test_params_counts_each_nvfp4_weight_as_te_stores_it(cli):
    """The table's bytes: all six of TE's tensors, unrounded (records.ParamRecord.stored)."""
    result = cli("params", *MODEL_ONLY, "--fp4-param-gather", "--format", "table")
    assert result.code == 0, result.err
    rows = {line.split()[0]: line.split() for line in result.out.splitlines() if line.strip()}
    proj = rows["decoder.layers.0.self_attention.linear_proj.weight"]
    assert int(proj[-1].replace(",", "")) == sum(_bytes(t) for t in _make_empty(H, H)) == 73_736


@NEEDS_FP4_PARAMS
def test_the_workload_gathers_the_packed_bytes(cli, tmp_path):
    """The all-gather moves the param buffers: bf16 for the embedding and norms, and the packed
    bytes, half a byte an element, for the NVFP4 weights (2 bytes each before)."""
    plain = _gathered(cli, tmp_path / "plain")
    fp4 = _gathered(cli, tmp_path / "fp4", "--fp4-param-gather")
    elements = sum(r * c for r, c in LAYER_WEIGHTS) * 4
    assert fp4 == 2 * (1024 * H + 9 * H) + elements // 2 == 2_036_224
    assert plain - fp4 == 2 * elements - elements // 2


@pytest.mark.skipif(MODELLED or megatron_version() < FP4_SINCE, reason="refused before 0.18")
def test_before_megatron_core_0_18_it_is_refused_with_the_version(cli):
    result = cli("memory", *SMALL, "--fp4-param-gather")
    assert result.code == 2
    assert result.err.startswith("Error: --fp4-param-gather is not modelled: megatron-core "
                                 "0.13-0.16's DDP points each NVFP4 weight")  # fmt: skip
    assert "from 0.18 it is modelled" in result.err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fp4-param-gather", "--use-distributed-optimizer", "--use-torch-fsdp2"],
         "Error: --fp4-param-gather with --use-torch-fsdp2 is not modelled"),
    ],
)  # fmt: skip
@NEEDS_FP4_PARAMS
def test_what_is_not_modelled_with_it_is_refused(cli, flags, message):
    args = [a for a in SMALL if a != "--use-distributed-optimizer"]
    result = cli("memory", *args, *flags)
    assert result.code == 2 and result.err.startswith(message), result.err


def _memory(cli, *flags):
    result = cli("memory", *SMALL, "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def _gathered(cli, folder, *flags) -> int:
    """Return the dense parameter all-gather's bytes in the SimAI workload (`grad_gather`)."""
    result = cli("workload", *SMALL, "--global-batch-size", "2",
                 "--gpu-tflops", "1000", *flags, "-o", str(folder))  # fmt: skip
    assert result.code == 0, result.err
    for path in sorted(folder.iterdir()):
        for line in path.read_text().splitlines():
            if line.startswith("grad_gather"):
                return int(line.split()[-2])
    raise AssertionError("no grad_gather record")


@NEEDS_FP4_PARAMS
def test_plan_composes_the_packed_param_buffer_as_memory_measures_it(cli):
    """plan's composed buffers (memory/compose/ddp_buffers.py `place`, with its packed NVFP4
    cursor) against megatron's own DDP, bucketed (--overlap-grad-reduce) at dp 2."""
    plan, measured = plan_and_memory(cli, "--fp4-param-gather")
    assert "--use-distributed-optimizer" in plan["flags"]
    fields = ("weights", "gradients", "optimizer", "total")
    assert [[s[f] for f in fields] for s in plan["stages"]] == [[s[f] for f in fields] for s in measured]
