"""The GPU a job runs on, as far as what it allocates and what it can run depend on it.

What a rank allocates besides megatron's own tensors depends on the GPU's compute capability
(job/hardware.py `Gpu.compute_capability`, one home): the cuBLAS workspaces torch and Transformer
Engine make; and Transformer Engine refuses the low-precision recipes a GPU lacks. A job carries
its `Device` (`Job.device`); `memory`, `check` and bench/ci_goldens.py set it from `--gpu` and
the job's environment (`with_device`). A job whose GPU is not named (`gpu=None`) is sized as on
the default GPU (H100) and nothing is refused for want of a GPU. What the simulated world reads
of the GPU (`Device.world`: compute capability, SM count) is entered around every build and
engine run (world/setup.py `on_job_gpu`) and keys their caches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inspector.errors import ConfigError
from inspector.job.hardware import DEFAULT_GPU, get_gpu

KIB = 1024
MIB = 1024 * KIB
# torch's cuBLAS workspace per (handle, stream), PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp
# `parseChosenWorkspaceSize`, as the versions that know Blackwell read: "/* :4096:2:16:8 default,
# 32MiB for Hopper and Blackwell */ ... use32mb = properties->major == 9 || major == 10 || major
# == 12; default_size = use32mb ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8" (a later
# version adds major 11; versions before Blackwell took 32 MiB for sm90 alone).
# cuBLASLt's workspace is that same one (`unified_cublas_and_lt_workspaces`, on unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE=0: `getCUDABlasLtWorkspace` takes the cuBLAS map's entry).
TORCH_WORKSPACE_32MB_MAJORS = (9, 10, 12)
TORCH_WORKSPACE_LARGE = 4096 * 8 * KIB  # 32 MiB
TORCH_WORKSPACE_SMALL = 4096 * KIB * 2 + 16 * KIB * 8  # :4096:2:16:8, 8 MiB + 128 KiB
# `CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[:SIZE:COUNT...]` replaces the default: the regex
# ":([0-9]+):([0-9]+)" over the value, total += SIZE * 1024 * COUNT; a value it does not match
# keeps the default ("Could not parse CUBLAS_WORKSPACE_CONFIG, using default workspace size").
_CONFIG = re.compile(r":([0-9]+):([0-9]+)")
# Transformer Engine's own cuBLAS workspace (pytorch/cpp_extensions/gemm.py, TE 2.11 to 2.18,
# `get_cublas_workspace_size_bytes`): "if ...get_device_properties(...).major >= 9: # 32 MiB for
# NVFP4 GEMM, plus additional 1024 B for alignment and misc scales; return 32 * 1024 * 1024 +
# 1024; return 4_194_304".
TE_WORKSPACE_HOPPER = 32 * MIB + 1024
TE_WORKSPACE_OLDER = 4_194_304


@dataclass(frozen=True)
class Device:
    """The GPU type a job runs on (`--gpu`; None: not named) and the cuBLAS workspace its
    environment asks torch for (`CUBLAS_WORKSPACE_CONFIG`; None: unset)."""

    gpu: str | None = None
    cublas_workspace_config: str | None = None

    def __post_init__(self) -> None:
        """Reject an unknown GPU type, naming the choices."""
        if self.gpu is not None:
            get_gpu(self.gpu)

    @property
    def capability(self) -> tuple[int, int]:
        """Return the compute capability (major, minor) the job's allocations follow."""
        return get_gpu(self.gpu or DEFAULT_GPU).compute_capability

    @property
    def world(self) -> WorldGpu:
        """Return what the simulated world asks torch.cuda of this GPU (world/te/cuda.py `on_gpu`):
        part of every cache key of a build or an engine run (world/build.py, compose/pieces.py)."""
        gpu = get_gpu(self.gpu or DEFAULT_GPU)
        sms = gpu.sms if gpu.sms is not None else get_gpu(DEFAULT_GPU).sms
        return WorldGpu(gpu.compute_capability, int(sms or 0))


@dataclass(frozen=True)
class WorldGpu:
    """What the traced world reads of its GPU: `torch.cuda.get_device_capability()` (Transformer
    Engine's `is_non_tn_fp8_gemm_supported`: which fp8 copies it keeps) and
    `get_device_properties().multi_processor_count` (the Mamba kernels' split sums)."""

    capability: tuple[int, int]
    sms: int


def torch_cublas_workspace(device: Device) -> int:
    """Return the bytes of one torch cuBLAS workspace (per handle and stream) on `device`."""
    major = device.capability[0]
    default = TORCH_WORKSPACE_LARGE if major in TORCH_WORKSPACE_32MB_MAJORS else TORCH_WORKSPACE_SMALL
    matches = _CONFIG.findall(device.cublas_workspace_config or "")
    if device.cublas_workspace_config is None or not matches:
        return default
    return sum(int(size) * KIB * int(count) for size, count in matches)


def te_cublas_workspace(device: Device) -> int:
    """Return the bytes of one Transformer Engine cuBLAS workspace on `device`."""
    return TE_WORKSPACE_HOPPER if device.capability[0] >= 9 else TE_WORKSPACE_OLDER


# Transformer Engine's checks of a recipe against the GPU (pytorch/quantization.py, TE 2.11):
# `check_fp8_support` "Device compute capability 8.9 or higher required for FP8 execution."
# (delayed and tensorwise); `check_fp8_block_scaling_support` "compute capability 9.0 or higher"
# (blockwise); `check_mxfp8_support` "Device compute capability 10.0 or higher required for
# MXFP8 execution." (and none on 12.0+, a capability no --gpu has); `check_nvfp4_support`
# "Device compute capability 10.0 or higher required for NVFP4 execution."
_FP8_LEAST = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}
_NVFP4_LEAST = (10, 0)


def check_precision(model: Any, device: Device) -> None:
    """Raise ConfigError, naming --gpu, for an fp8 or fp4 recipe TE refuses on the named GPU."""
    if device.gpu is None:
        return
    cc = device.capability
    named = f"--gpu {device.gpu} (compute capability {cc[0]}.{cc[1]})"
    if model.fp8_format is not None:
        least = _FP8_LEAST.get(model.fp8_recipe, (8, 9))
        if cc < least:
            raise ConfigError(
                f"--fp8-format {model.fp8_format} --fp8-recipe {model.fp8_recipe} cannot run on "
                f"{named}: Transformer Engine needs compute capability {least[0]}.{least[1]} or "
                "higher for it "
                "(transformer_engine/pytorch/quantization.py `check_recipe_support`)")  # fmt: skip
    if model.fp4_format is not None and cc < _NVFP4_LEAST:
        raise ConfigError(
            f"--fp4-recipe {model.fp4_recipe} cannot run on {named}: Transformer Engine needs "
            "compute capability 10.0 or higher for NVFP4 (transformer_engine/pytorch/"
            "quantization.py `check_nvfp4_support`)")  # fmt: skip


def with_device(job: Any, gpu: str | None, cublas_workspace_config: str | None = None) -> Any:
    """Return `job` on the named GPU with the job's CUBLAS_WORKSPACE_CONFIG (checked again)."""
    from dataclasses import replace

    device = Device(gpu, cublas_workspace_config)
    return job if device == job.device else replace(job, device=device)
