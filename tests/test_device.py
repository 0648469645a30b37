"""What a rank allocates by the GPU it runs on (job/device.py): the cuBLAS workspaces torch and
Transformer Engine keep, by compute capability and CUBLAS_WORKSPACE_CONFIG, and the low-precision
recipes Transformer Engine refuses on a GPU without them."""

from __future__ import annotations

import json

import pytest

from inspector.errors import ConfigError
from inspector.job.device import Device, te_cublas_workspace, torch_cublas_workspace
from inspector.job.hardware import GPUS
from tests.conftest import run_cli

MIB = 1 << 20
# a small Transformer Engine job: torch's two GEMM threads' workspaces and TE's one
MEMORY = ("memory", "--num-layers", "2", "--micro-batch-size", "1", "--bf16",
          "--transformer-impl", "transformer_engine", "--format", "json")  # fmt: skip


def test_compute_capability_of_each_gpu() -> None:
    # NVIDIA's CUDA GPU compute capability table (developer.nvidia.com/cuda-gpus)
    assert {name: gpu.compute_capability for name, gpu in GPUS.items()} == {
        "h100": (9, 0), "h200": (9, 0), "a100-80gb": (8, 0), "b200": (10, 0), "gb200": (10, 0),
        "b300": (10, 3), "gb300": (10, 3)}  # fmt: skip


@pytest.mark.parametrize(("gpu", "expected"), [
    # CublasHandlePool.cpp parseChosenWorkspaceSize: `use32mb = major == 9 || major == 10 ||
    # major == 12`, `4096 * 8 * 1024`, else `4096 * 1024 * 2 + 16 * 1024 * 8`
    ("h100", 4096 * 8 * 1024), ("h200", 32 * MIB), ("gb200", 32 * MIB), ("b200", 32 * MIB),
    ("b300", 32 * MIB), ("gb300", 32 * MIB), ("a100-80gb", 4096 * 1024 * 2 + 16 * 1024 * 8),
])  # fmt: skip
def test_torch_cublas_workspace_by_capability(gpu: str, expected: int) -> None:
    assert torch_cublas_workspace(Device(gpu)) == expected


@pytest.mark.parametrize(("gpu", "expected"), [
    # TE cpp_extensions/gemm.py get_cublas_workspace_size_bytes: major >= 9: 32 MiB + 1024,
    # else 4_194_304
    ("h100", 32 * MIB + 1024), ("gb200", 32 * MIB + 1024), ("gb300", 32 * MIB + 1024),
    ("a100-80gb", 4_194_304),
])  # fmt: skip
def test_te_cublas_workspace_by_capability(gpu: str, expected: int) -> None:
    assert te_cublas_workspace(Device(gpu)) == expected


def test_a_job_without_a_gpu_is_sized_as_on_h100() -> None:
    assert torch_cublas_workspace(Device()) == torch_cublas_workspace(Device("h100"))
    assert te_cublas_workspace(Device()) == te_cublas_workspace(Device("h100"))


@pytest.mark.parametrize(("config", "expected"), [
    (":4096:8", 4096 * 1024 * 8),  # Megatron-LM's functional tests' ENV_VARS
    (":4096:2:16:8", 4096 * 1024 * 2 + 16 * 1024 * 8),  # every SIZE:COUNT pair, summed
    (":16:8", 16 * 1024 * 8),
    ("4096", 4096 * 1024 * 2 + 16 * 1024 * 8),  # unparsable: torch warns and keeps the default
])  # fmt: skip
def test_cublas_workspace_config_overrides_the_default(config: str, expected: int) -> None:
    assert torch_cublas_workspace(Device("a100-80gb", config)) == expected


def test_unknown_gpu_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown --gpu 'v100'"):
        Device("v100")


def _workspaces(*flags: str) -> tuple[int, int]:
    result = run_cli(*MEMORY, *flags)
    assert result.code == 0, result.err
    stage = json.loads(result.out)["stages"][0]
    return stage["buffers"]["workspaces"], stage["buffers"]["total"]


def test_memory_differs_by_gpu_by_the_workspaces_alone() -> None:
    h100, h100_total = _workspaces("--gpu", "h100")
    a100, a100_total = _workspaces("--gpu", "a100-80gb")
    gb200, gb200_total = _workspaces("--gpu", "gb200")
    assert h100 == 2 * 32 * MIB + (32 * MIB + 1024)  # torch's two threads, TE's one
    assert a100 == 2 * (8 * MIB + 128 * 1024) + 4 * MIB
    assert h100_total - a100_total == h100 - a100 == 79_430_656
    assert (gb200, gb200_total) == (h100, h100_total)  # Blackwell's workspaces are Hopper's


def test_cublas_workspace_config_reaches_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert _workspaces("--gpu", "a100-80gb")[0] == 2 * 32 * MIB + 4 * MIB


@pytest.mark.parametrize(("flags", "gpu", "least"), [
    (("--fp8-format", "hybrid"), "a100-80gb", "8.9"),  # check_fp8_support
    (("--fp8-format", "e4m3", "--fp8-recipe", "blockwise"), "a100-80gb", "9.0"),
    (("--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"), "h100", "10.0"),  # check_mxfp8_support
])  # fmt: skip
def test_fp8_recipe_refused_on_a_gpu_without_it(flags: tuple[str, ...], gpu: str, least: str) -> None:
    result = run_cli(*MEMORY, *flags, "--gpu", gpu)
    assert result.code == 2 and result.out == ""
    recipe = flags[3] if len(flags) > 2 else "delayed"
    cc = ".".join(map(str, GPUS[gpu].compute_capability))
    assert result.err.startswith(
        f"Error: --fp8-format {flags[1]} --fp8-recipe {recipe} cannot run on --gpu {gpu} "
        f"(compute capability {cc}): Transformer Engine needs compute capability {least} or higher")


def test_nvfp4_refused_before_blackwell() -> None:
    from inspector.job.device import check_precision
    from inspector.job.model import ModelConfig

    model = ModelConfig(fp4_format="e2m1", transformer_impl="transformer_engine")
    with pytest.raises(ConfigError, match=r"--fp4-recipe nvfp4 cannot run on --gpu h100 .*10\.0"):
        check_precision(model, Device("h100"))
    check_precision(model, Device("gb200"))  # check_nvfp4_support: 10.0 and higher
    check_precision(model, Device())  # no GPU named: nothing refused


def test_mxfp8_runs_on_blackwell_and_without_a_named_gpu() -> None:
    from inspector.job.device import check_precision
    from inspector.job.model import ModelConfig

    model = ModelConfig(fp8_format="hybrid", fp8_recipe="mxfp8", transformer_impl="transformer_engine")
    for device in (Device("gb200"), Device("b300"), Device()):
        check_precision(model, device)


def test_plan_confirms_memory_with_the_gpu_s_workspaces() -> None:
    def totals(gpu: str) -> list[int]:
        result = run_cli("plan", "--num-layers", "2", "--gpus", "8", "--global-batch-size", "8",
                         "--bf16", "--tp", "1", "--pp", "1", "--top", "1", "--format", "json",
                         "--gpu", gpu)  # fmt: skip
        assert result.code == 0, result.err
        return [s["total"] for s in json.loads(result.out)["plans"][0]["stages"]]

    # the local spec: torch's two workspaces alone, 32 MiB on Hopper, 8 MiB + 128 KiB on A100
    assert totals("h100")[0] - totals("a100-80gb")[0] == 2 * (32 * MIB - (8 * MIB + 128 * 1024))


def test_plan_refuses_a_recipe_its_gpu_cannot_run() -> None:
    result = run_cli("plan", "--num-layers", "2", "--gpus", "8", "--global-batch-size", "8",
                     "--bf16", "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
                     "--fp8-recipe", "mxfp8")  # fmt: skip
    assert result.code == 2
    assert result.err.startswith("Error: --fp8-format hybrid --fp8-recipe mxfp8 cannot run on "
                                 "--gpu h100 (compute capability 9.0)")  # fmt: skip


def test_the_result_cache_keys_cublas_workspace_config(tmp_path, monkeypatch) -> None:
    # a cached `memory` answer is not given for another CUBLAS_WORKSPACE_CONFIG (cli/cache.py)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("INSPECT_MODEL_NO_CACHE", "0")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    default = _workspaces("--gpu", "a100-80gb")[0]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert _workspaces("--gpu", "a100-80gb")[0] == default + 2 * (32 * MIB - (8 * MIB + 128 * 1024))
    assert len(list((tmp_path / "inspect-model").glob("*.txt"))) == 2


# What the simulated world reads of its GPU (Device.world, world/te/cuda.py `on_gpu`).
# A small fp8 job, the sizes of tests/test_fp8_params.py: TE's four GEMM weights per layer
FP8 = ("memory", "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
       "--seq-length", "256", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
       "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
       "rope", "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid",
       "--use-distributed-optimizer", "--dp", "2", "--format", "json")  # fmt: skip
H, F = 256, 640  # hidden; SwiGLU ffn int(4 x 256 x 2/3 / 64) x 64
# qkv, proj, fc1, fc2 of 2 layers, [out, in]: each a multiple of the allocator's 512 bytes
TE_WEIGHTS = [rows * cols for rows, cols in [(3 * H, H), (H, H), (2 * F, H), (H, F)] * 2]


def _stage(*flags: str) -> dict:
    result = run_cli(*FP8, *flags)
    assert result.code == 0, result.err
    stage: dict = json.loads(result.out)["stages"][0]
    return stage


def _persistent(stage: dict) -> int:
    return sum(size for _, size in stage["buffers"]["persistent"])


def test_world_gpu_of_each_device() -> None:
    from inspector.job.device import WorldGpu

    assert Device().world == Device("h100").world == Device("h200").world == WorldGpu((9, 0), 132)
    assert Device("gb200").world == WorldGpu((10, 0), 152)
    assert Device("b200").world == WorldGpu((10, 0), 148)
    assert Device("gb300").world == WorldGpu((10, 3), 160)


def test_non_tn_fp8_gemms_by_capability() -> None:
    # TE utils.py is_non_tn_fp8_gemm_supported: (10, 0) <= cc < (12, 0) or cc >= (13, 0)
    from inspector.world.te.cuda import is_non_tn_fp8_gemm_supported, on_gpu

    assert not is_non_tn_fp8_gemm_supported()  # outside a job: an H100
    for capability, expected in (((8, 0), False), ((9, 0), False), ((10, 0), True),
                                 ((10, 3), True), ((12, 0), False), ((13, 0), True)):  # fmt: skip
        with on_gpu(capability, 132):
            assert is_non_tn_fp8_gemm_supported() is expected


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_blackwell_fp8_weight_workspaces_keep_no_transpose(recipe: str) -> None:
    """Each TE linear's cached fp8 weight workspace (module/base.py `get_weight_workspace`) is
    data [N, K] + transpose [K, N] + scale_inv on Hopper; on compute capability 10.x the
    quantizer makes no transpose (csrc/quantizer.cpp `with_transpose = columnwise_usage &&
    !nvte_is_non_tn_fp8_gemm_supported()`): one byte less per TE weight element, kept all step."""
    h100 = _stage("--fp8-recipe", recipe, "--gpu", "h100")
    gb200 = _stage("--fp8-recipe", recipe, "--gpu", "gb200")
    n = sum(TE_WEIGHTS)
    assert _persistent(h100) - _persistent(gb200) == n
    assert h100["static"] - gb200["static"] == n
    assert h100["total"] - gb200["total"] >= n  # the activations' transient transposes too
    assert (h100["weights"], h100["optimizer"]) == (gb200["weights"], gb200["optimizer"])
    assert _stage("--fp8-recipe", recipe, "--gpu", "b300")["static"] == gb200["static"]  # 10.3


def test_blackwell_fp8_parameters_keep_no_transpose() -> None:
    """--fp8-param-gather: a Float8Tensor weight keeps data, transpose and scale_inv on Hopper;
    on Blackwell no transpose (its quantizer makes none, `post_all_gather_processing` makes none:
    tensor/utils.py "if not is_non_tn_fp8_gemm_supported(): model_weight._create_transpose()")."""
    h100 = _stage("--fp8-param-gather", "--gpu", "h100")
    gb200 = _stage("--fp8-param-gather", "--gpu", "gb200")
    n = sum(TE_WEIGHTS)
    assert h100["weights"] - gb200["weights"] == n  # what TE keeps beside the uint8 buffer
    assert h100["static"] - gb200["static"] == n
    assert _persistent(h100) == _persistent(gb200)  # no workspaces either way


def test_mxfp8_is_the_same_on_blackwell() -> None:
    # MXFP8 keeps its own column-wise data on every GPU (mxfp8_tensor.py): gb200 is sized as a
    # job without --gpu (an H100's world, which refuses nothing)
    flags = ("--fp8-recipe", "mxfp8")
    gb200, unnamed = _stage(*flags, "--gpu", "gb200"), _stage(*flags)
    assert gb200.pop("fits") is True and unnamed.pop("fits") is None  # no --gpu: no memory size
    assert gb200 == unnamed


def test_mamba_kernels_split_by_the_gpu_s_sms() -> None:
    # ssd_chunk_state.py `_chunk_state_bwd_db`: per_program = min(ceil(b * chunks * heads / SMs),
    # heads / groups); splits = ceil(heads / groups / per_program). b 1, 3 chunks, 100 heads, 1 group
    from inspector.world.ssm.kernels import _splits
    from inspector.world.te.cuda import on_gpu

    with on_gpu((9, 0), 132):
        assert _splits(1, 3, 100, 1) == 34  # ceil(300 / 132) = 3 heads a program
    with on_gpu((10, 0), 152):
        assert _splits(1, 3, 100, 1) == 50  # ceil(300 / 152) = 2
    assert _splits(1, 3, 100, 1) == 34  # outside a job: an H100's 132


def test_the_planner_s_pieces_are_keyed_by_the_world_s_gpu() -> None:
    # plan composes a stage's state from small builds cached by piece_key (memory/compose/
    # pieces.py): an fp8 parameter keeps its transpose on Hopper only, so the key holds the GPU
    # the world reads (the same for H100 and H200)
    from dataclasses import replace

    from inspector.job.job import Job
    from inspector.job.layout import Layout
    from inspector.job.model import ModelConfig
    from inspector.memory.compose.pieces import piece_key

    job = Job(ModelConfig(num_layers=2), Layout())
    on = {gpu: piece_key(replace(job, device=Device(gpu))) for gpu in ("h100", "h200", "gb200")}
    assert on["h100"] == on["h200"] == piece_key(job) != on["gb200"]
