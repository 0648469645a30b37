"""The GPU types the tool knows: one record per `--gpu` choice, each figure with its source.

`memory` (which stages fit, the time per iteration, and by the compute capability the cuBLAS
workspaces and the recipes refused: job/device.py), `workload` (compute times) and `plan` (the
step-time model) all read a GPU from `GPUS`; `--gpu-memory`, `--gpu-tflops`,
`--intra-node-bandwidth` and `--inter-node-bandwidth` override one figure (`with_overrides`).
To add a GPU type: a row in `GPUS` with its datasheet in the comment, and a test in
tests/test_hardware.py; `--gpu`'s choices and docs/hardware.md's table follow from the row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Any

from inspector.errors import ConfigError


@dataclass(frozen=True)
class KernelTable:
    """A kernel table the user measured on their GPU (`--kernels FILE`, written by `inspect-model
    calibrate`; job/kernel_table.py reads and checks it): equal to another when its text is."""

    source: str  # `--kernels FILE`, as errors and notes name it
    digest: str  # sha256 of the file's text
    rows: tuple[dict[str, Any], ...] = dataclasses.field(compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class Gpu:
    """A GPU and its links: dense peaks per precision, HBM, per-GPU network bandwidth (bytes/s)."""

    name: str
    tflops_16bit: float  # dense BF16 / FP16 tensor-core peak (no sparsity), TFLOP/s
    tflops_fp32: float  # FP32 without tensor cores (PyTorch's default: no TF32 for matmuls)
    tflops_fp8: float | None  # dense FP8 tensor-core peak; None: no FP8 tensor cores
    memory_gib: float  # the datasheet's capacity label read as GiB (docs/hardware.md)
    hbm: float  # HBM bandwidth, bytes/s
    intra: float  # NVLink, one direction
    inter: float  # InfiniBand, one direction, per GPU
    gpus_per_node: int = 8  # the NVLink domain of the vendor's reference node (BOARD_GPUS)
    # a collective's latency: round figures, not measured nor fitted; NCCL's own cost model
    # (src/graph/tuning.cc ncclTopoTuneModel) gives a ring 6.6 us + 0.6 us a step over NVLink
    # (LL), 7.2-15 us on 2-8 GPUs (docs/how-time-is-computed.md, "a collective's latency")
    alpha_intra: float = 5e-6
    alpha_inter: float = 10e-6
    tflops_fp4: float | None = None  # dense FP4 tensor-core peak, for the record: nothing prices it
    sms: int | None = None  # streaming multiprocessors; None: no cited count (plan/flex.py)
    kernels: KernelTable | None = None  # --kernels FILE; None: the built-in tables
    # which end of a published kernel range prices a GPU without a measured table
    # (formulas/published_kernels.py): "slow" ranks the plans, "fast" is shown beside them
    published_end: str = "slow"
    # the bus bandwidth NCCL reaches over NVLink (one direction; nccl-tests' busBw): for ring
    # all-reduce and every other collective, point-to-point and all-to-all; None: the line rate
    nccl_intra: float | None = None
    # NVLink SHARP's (NCCL_ALGO NVLS, NCCL's default) all-reduce bus bandwidth by group size:
    # ((ranks, bytes/s), ...); a size not listed gets nccl_intra
    nvls_intra: tuple[tuple[int, float], ...] = ()
    # CUDA compute capability (major, minor): what torch and Transformer Engine size their cuBLAS
    # workspaces by and check low-precision recipes against (job/device.py). NVIDIA, "CUDA GPU
    # Compute Capability" (developer.nvidia.com/cuda-gpus): A100 8.0; H100, H200 9.0; B200,
    # GB200 10.0; B300, GB300 10.3 (CUDA 12.9 release notes: sm_103, Blackwell Ultra).
    compute_capability: tuple[int, int] = (9, 0)

    def peak_tflops(self, dtype_name: str) -> float:
        """Return the dense peak TFLOP/s for a model of this dtype (bfloat16, float16, float32)."""
        return self.tflops_fp32 if dtype_name == "float32" else self.tflops_16bit


NCCL_NVLINK4 = 370e9  # H100/H200 NVLink: NCCL's Ring and point-to-point busBw (GPUS, h100)
NVLS_NVLINK4 = ((5, 420e9), (6, 440e9), (7, 460e9), (8, 480e9))  # NVLS all-reduce busBw by ranks

GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16 and FP16 (1,979 with
    # sparsity), 1,979 dense FP8 (3,958 with sparsity), 67 FP32; 80 GB HBM3 at 3.35 TB/s,
    # NVLink 900 GB/s (450 each way); DGX H100: 8 GPUs, 8 x 400 Gb/s ConnectX-7 InfiniBand, one
    # per GPU (50 GB/s).
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper: the SXM5 H100 has 132 SMs (as the
    # measured H100 of formulas/kernels-h100.json reported).
    # What NCCL reaches over that NVLink, measured on 8 H100 SXM (NVIDIA/nccl#1455, all_reduce_perf
    # at 2-4 GB): NCCL_ALGO=Ring busBw 365-370 GB/s for 2 to 8 GPUs, "about 80% of 450GBps"; NVLS
    # the same for 2-4 GPUs, then 420, 440, 460 and 480 GB/s for 5, 6, 7 and 8. NCCL's maintainer
    # (NVIDIA/nccl-tests#212): "450GB/s is the line rate. With the protocol overhead (~20%) NCCL
    # can get an effective NVLink bandwidth of 370GB/s, which you can observe as "BusBw" when
    # running non-allreduce operations, or when running with NCCL_ALGO=RING", and NVLink SHARP
    # all-reduce "on 8 GPUs ... a peak busBw of ~480GB/s".
    "h100": Gpu("h100", 989.0, 67.0, 1979.0, 80, 3.35e12, 450e9, 50e9, sms=132,
                nccl_intra=NCCL_NVLINK4, nvls_intra=NVLS_NVLINK4, compute_capability=(9, 0)),
    # NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16 and FP16, 1,979 dense FP8, 67 FP32;
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8 GPUs, 400 Gb/s InfiniBand per GPU.
    # 132 SMs: the measured H200 of formulas/kernels-h200.json (shared/gpu/) reported them.
    # The same NVLink 4 and NVSwitch as H100, so H100's NCCL figures (8 H200: all_reduce_perf peak
    # busBw 475 GB/s under NCCL's default algorithm, NVIDIA/nccl-tests#272).
    "h200": Gpu("h200", 989.0, 67.0, 1979.0, 141, 4.8e12, 450e9, 50e9, sms=132,
                nccl_intra=NCCL_NVLINK4, nvls_intra=NVLS_NVLINK4, compute_capability=(9, 0)),
    # NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s dense BF16 and FP16 (624 with sparsity), no
    # FP8, 19.5 FP32; HBM2e at 2,039 GB/s, NVLink 600 GB/s (300 each way); DGX A100 / Selene
    # (Narayanan et al. 2021): 8 GPUs, 8 x 200 Gb/s HDR InfiniBand per node, one per GPU (25 GB/s).
    # NVIDIA A100 Tensor Core GPU Architecture whitepaper: the A100 has 108 SMs.
    "a100-80gb": Gpu("a100-80gb", 312.0, 19.5, None, 80, 2.039e12, 300e9, 25e9, sms=108,
                     compute_capability=(8, 0)),
    # NVIDIA HGX B200 (1,000 W) specifications, per 8 GPUs: 36 PFLOP/s FP16/BF16 and 72 FP8 with
    # sparsity (2,250 and 4,500 dense per GPU), 600 TFLOP/s FP32 (75 per GPU), NVLink 5 at
    # 1.8 TB/s per GPU (900 GB/s each way); DGX B200 datasheet: 1,440 GB HBM3e (180 per GPU) at
    # 64 TB/s (8 TB/s per GPU), 8 x 400 Gb/s ConnectX-7 InfiniBand, one per GPU (50 GB/s).
    # FP4: 144 PFLOP/s with sparsity per 8 GPUs (9,000 dense per GPU).
    # Chips and Cheese, "Nvidia's B200: Keeping the CUDA Juggernaut Rolling": 148 SMs enabled.
    "b200": Gpu("b200", 2250.0, 75.0, 4500.0, 180, 8e12, 900e9, 50e9, tflops_fp4=9000.0, sms=148,
                compute_capability=(10, 0)),
    # NVIDIA GB200 NVL72 specifications (https://www.nvidia.com/en-us/data-center/gb200-nvl72/),
    # rack of 72 GPUs and, in the second column, one GB200 superchip of 2 GPUs. NVFP4 "1,440 |
    # 720 PFLOPS" (footnote: sparse | dense), so 10,000 dense per GPU; FP8/FP6 720 PFLOPS and
    # FP16/BF16 360 PFLOPS (footnote: "sparse. Dense is one-half sparse spec shown"), so 5,000 and
    # 2,500 dense per GPU; FP32 5,760 TFLOPS (80 per GPU); "13.4 TB HBM3E | 576 TB/s", superchip
    # "372 GB HBM3E | 16 TB/s" (186 GB and 8 TB/s per GPU); NVLink 130 TB/s, superchip 3.6 TB/s
    # (1.8 TB/s per GPU, 900 GB/s each way), all 72 GPUs in one NVLink domain (gpus_per_node 72).
    # InfiniBand: one 400 Gb/s ConnectX-7 per GPU (50 GB/s), as in DGX GB200 (4 per compute tray
    # of 4 GPUs), the same figure as b200.
    # SMs: NVIDIA's GB200 pages give none; 152 is what a GB200 GPU reports
    # (`multi_processor_count`), as public kernel sources and traces taken on GB200 note ("GB200
    # has 152" SMs, e.g. FlashInfer-based MXFP8 kernels' per-CTA stats, vLLM GB200 decode traces),
    # four more than B200's 148.
    "gb200": Gpu(
        "gb200", 2500.0, 80.0, 5000.0, 186, 8e12, 900e9, 50e9, gpus_per_node=72, tflops_fp4=10000.0,
        sms=152, compute_capability=(10, 0),
    ),
    # NVIDIA HGX B300 specifications, per 8 GPUs: FP16/BF16 36 PFLOP/s and FP8 72 with sparsity
    # (2,250 and 4,500 dense per GPU), FP4 144 | 108 PFLOP/s sparse | dense (13,500 dense per
    # GPU), FP32 600 TFLOP/s (75 per GPU), NVLink 5 at 1.8 TB/s per GPU (900 GB/s each way),
    # networking 1.6 TB/s: one 800 Gb/s ConnectX-8 per GPU (100 GB/s each way). Per GPU (Verda,
    # "NVIDIA GB300 NVL72: GPU Architecture & Performance", NVIDIA's per-GPU figures): 270 GB
    # HBM3e at 7.7 TB/s. NVIDIA, "Inside NVIDIA Blackwell Ultra" (technical blog): 160 SMs.
    "b300": Gpu("b300", 2250.0, 75.0, 4500.0, 270, 7.7e12, 900e9, 100e9, tflops_fp4=13500.0,
                sms=160, compute_capability=(10, 3)),
    # NVIDIA GB300 NVL72 specifications, rack of 72 GPUs: FP4 1,440 | 1,080 PFLOP/s sparse | dense
    # (15,000 dense per GPU), FP8/FP6 720 and FP16/BF16 360 PFLOP/s sparse (5,000 and 2,500 dense
    # per GPU), FP32 6 PFLOP/s (Verda's per-GPU table: 80 TFLOP/s), 20 TB HBM3e at 576 TB/s (279
    # GB and 8 TB/s per GPU), NVLink 130 TB/s (1.8 TB/s per GPU, 900 GB/s each way) in one domain
    # of 72 GPUs, 72 ConnectX-8 SuperNICs at 800 Gb/s (100 GB/s each way per GPU); 160 SMs
    # (Blackwell Ultra, as b300).
    "gb300": Gpu("gb300", 2500.0, 80.0, 5000.0, 279, 8e12, 900e9, 100e9, gpus_per_node=72,
                 tflops_fp4=15000.0, sms=160, compute_capability=(10, 3)),
}
DEFAULT_GPU = "h100"
GIB = 1 << 30  # --gpu-memory is in GiB, as nvidia-smi and torch count
BOARD_GPUS = 8  # the HGX / DGX boards' NVLink domain: a plan's job line names any other placement
# plan: None prices each kernel from the measured tables (formulas/kernels.py, scaled to the
# record's 16-bit peak and HBM); --efficiency F prices every FLOP at F x the 16-bit peak instead
DEFAULT_EFFICIENCY: float | None = None


def get_gpu(name: str) -> Gpu:
    """Return a named GPU or raise ConfigError naming the choices."""
    if name not in GPUS:
        raise ConfigError(f"unknown --gpu {name!r}; choose one of: {', '.join(GPUS)}")
    return GPUS[name]


def check_positive(flag: str, value: float, unit: str) -> None:
    """Raise ConfigError naming `flag` unless `value` is a finite number above 0."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a finite number of {unit} greater than 0, got {value}")


def with_overrides(
    gpu: Gpu,
    gpu_tflops: float | None = None,
    gpu_memory: float | None = None,
    intra_node_bandwidth: float | None = None,
    inter_node_bandwidth: float | None = None,
) -> Gpu:
    """Return `gpu` with the figures the user gave: --gpu-tflops (the 16-bit peak),
    --gpu-memory (GiB), --intra-node-bandwidth / --inter-node-bandwidth (GB/s, one direction)."""
    given = (
        ("--gpu-tflops", gpu_tflops, "TFLOP/s", "tflops_16bit", 1.0),
        ("--gpu-memory", gpu_memory, "GiB", "memory_gib", 1.0),
        ("--intra-node-bandwidth", intra_node_bandwidth, "GB/s", "intra", 1e9),
        ("--inter-node-bandwidth", inter_node_bandwidth, "GB/s", "inter", 1e9),
    )
    for flag, value, unit, field, scale in given:
        if value is not None:
            check_positive(flag, value, unit)
            gpu = replace(gpu, **{field: value * scale})  # type: ignore[arg-type]
    if intra_node_bandwidth is not None:  # the user's figure prices every NVLink collective
        gpu = replace(gpu, nccl_intra=None, nvls_intra=())
    return gpu
