"""Render the GPU types (job/hardware.py) as the Markdown table docs/hardware.md shows."""

from __future__ import annotations

from tabulate import tabulate

from inspector.job.hardware import DEFAULT_GPU, GPUS

HEADERS = ["`--gpu`", "dense 16-bit TFLOP/s", "dense FP8", "dense FP4", "FP32", "memory", "HBM",
           "NVLink, each way", "InfiniBand per GPU", "GPUs per node", "SMs",
           "compute capability"]


def render_gpus() -> str:
    """Return one Markdown row per GPU type, the figures every command reads."""
    rows = [
        [
            f"`{gpu.name}`" + (" (plan default)" if gpu.name == DEFAULT_GPU else ""),
            f"{gpu.tflops_16bit:g}",
            "-" if gpu.tflops_fp8 is None else f"{gpu.tflops_fp8:g}",
            "-" if gpu.tflops_fp4 is None else f"{gpu.tflops_fp4:g}",
            f"{gpu.tflops_fp32:g}",
            f"{gpu.memory_gib:g} GiB",
            f"{gpu.hbm / 1e12:g} TB/s",
            f"{gpu.intra / 1e9:g} GB/s",
            f"{gpu.inter / 1e9:g} GB/s",
            str(gpu.gpus_per_node),
            "-" if gpu.sms is None else str(gpu.sms),
            ".".join(map(str, gpu.compute_capability)),
        ]
        for gpu in GPUS.values()
    ]
    return tabulate(rows, headers=HEADERS, tablefmt="github", disable_numparse=True) + "\n"
