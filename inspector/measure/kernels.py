"""Kernel throughput on this machine, at the shapes of a kernel table (`inspect-model calibrate`).

Re-measures every row of a kernel table (by default the H200 table the step-time model reads,
formulas/kernels-h200.json) in the same row format, so that formulas/kernels.py reads the new
table as it reads the built-in ones (`--kernels FILE`):
  - `gemm` (m, n, k) and `expert_gemm` (tokens x hidden times hidden x 2 expert_ffn): bf16
    `torch.matmul`, A [m, k] row-major times B [k, n]; FLOPs 2 m n k.
  - the same shapes in fp8 (`gemm_fp8`, `expert_gemm_fp8` rows), as Transformer Engine runs an fp8
    GEMM on Hopper: `torch._scaled_mm` (cuBLASLt) of two fp8 operands with one fp32 scale each
    (per-tensor scaling: TE's delayed and tensorwise/current recipes), bf16 output. Forward GEMMs
    are E4M3 x E4M3; data and weight gradients E5M2 (the gradient, Megatron-LM's
    `--fp8-format hybrid`) x E4M3. cuBLASLt wants fp8 operands "TN" (both K-major), which is the
    layout TE makes, so B is K-major here. A GPU without fp8 GEMMs records the row's error.
  - `flash_attention`: causal `F.scaled_dot_product_attention`, batch 1, head dim 128, the row's
    query heads and grouped-query ratio, forward and backward timed apart.
  - `memory_bound`: copy (`dst.copy_(src)`), add (`a + b`), rms_norm (`F.rms_norm` with a weight),
    swiglu (`F.silu(x[:, :h]) * x[:, h:]` on [tokens, 2 h]); bytes as the tables count them
    (copy and rms_norm 2 tensors, add and swiglu 3).
Timing: CUDA events around each call, `warmup` calls, then the median of `iters`. On the CPU
(`device="cpu"`, for tests: the same code) a wall clock replaces the events. `shrink` divides
every row's sizes (tokens, widths, sequence) by a factor, for a quick run; the rows then record
the sizes measured. Inputs are random normal (scaled for fp8 so that nothing saturates).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from inspector.formulas.kernels import ATTENTION_BACKWARD, ELEMENT
from inspector.job.kernel_table import HEAD_DIM, MEASURED_BY, MEMORY_TENSORS

Row = dict[str, Any]
Progress = Callable[[int, int], None]


def timed(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    """Return fn's median seconds over `iters` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def gemm_bf16(m: int, n: int, k: int, device: str, warmup: int, iters: int) -> float:
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    return timed(lambda: torch.matmul(a, b), device, warmup, iters)


def gemm_fp8(m: int, n: int, k: int, grad: bool, device: str, warmup: int, iters: int) -> float:
    a_dtype = torch.float8_e5m2 if grad else torch.float8_e4m3fn
    a = (torch.randn(m, k, device=device) * 0.5).to(a_dtype)
    b = (torch.randn(n, k, device=device) * 0.5).to(torch.float8_e4m3fn).t()  # K-major [k, n]
    one = torch.ones((), device=device, dtype=torch.float32)
    return timed(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        device, warmup, iters,
    )  # fmt: skip


def attention(seq: int, heads: int, gqa: int, device: str, warmup: int, iters: int,
              ) -> tuple[float, float]:  # fmt: skip
    shape = (1, heads, seq, HEAD_DIM)
    q = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, heads // gqa, seq, HEAD_DIM, device=device, dtype=torch.bfloat16,
                    requires_grad=True)  # fmt: skip
    v = torch.randn_like(k, requires_grad=True)
    def forward() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa > 1)

    out = forward()
    grad = torch.randn_like(out)

    def backward() -> None:
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return timed(forward, device, warmup, iters), timed(backward, device, warmup, iters)


def memory_bound(op: str, tokens: int, hidden: int, device: str, warmup: int, iters: int) -> float:
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    y = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    ops: dict[str, Callable[[], Any]] = {"copy": lambda: x.copy_(y), "add": lambda: x + y}
    if op == "rms_norm":
        w = torch.ones(hidden, device=device, dtype=torch.bfloat16)
        ops[op] = lambda: F.rms_norm(x, (hidden,), w)
    elif op == "swiglu":
        both = torch.randn(tokens, 2 * hidden, device=device, dtype=torch.bfloat16)
        ops[op] = lambda: F.silu(both[:, :hidden]) * both[:, hidden:]
    return timed(ops[op], device, warmup, iters)


def shrunk(row: Row, shrink: int) -> Row:
    """Return the row with its sizes divided by `shrink` (at least 1 each; heads kept)."""
    sizes = ("m", "n", "k", "tokens", "hidden", "expert_ffn", "seq")
    return {**row, **{key: max(1, row[key] // shrink) for key in sizes if key in row}}


def device_row(device: str, gpu: str, shrink: int) -> Row:
    """Return the table's first row: what measured it, and the --gpu type it is relative to."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms = props.name, props.multi_processor_count
    else:
        name, sms = "cpu", None
    return {"kind": "device", "name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "sm": sms, "gpu": gpu, "device": device, "shrink": shrink,
            "measured_by": MEASURED_BY}  # fmt: skip


def measure(row: Row, device: str, warmup: int, iters: int) -> list[Row]:
    """Return one table row re-measured here (and its fp8 twin for a GEMM)."""
    kind = row["kind"]
    if kind in ("gemm", "expert_gemm"):
        if kind == "gemm":
            m, n, k, grad = row["m"], row["n"], row["k"], row["orient"] != "fwd"
        else:
            m, n, k, grad = row["tokens"], 2 * row["expert_ffn"], row["hidden"], False
        flops = 2 * m * n * k
        seconds = gemm_bf16(m, n, k, device, warmup, iters)
        bf16 = {**row, "seconds": seconds, "tflops": flops / seconds / 1e12}
        try:
            seconds = gemm_fp8(m, n, k, grad, device, warmup, iters)
            fp8: Row = {"seconds": seconds, "tflops": flops / seconds / 1e12}
        except (RuntimeError, NotImplementedError) as exc:  # no fp8 GEMM here: say why, go on
            fp8 = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}
        bare = {key: value for key, value in row.items() if key not in ("seconds", "tflops")}
        a = "e5m2" if grad else "e4m3"
        twin = {**bare, "kind": kind + "_fp8", "a": a, "b": "e4m3", "scaling": "tensor", **fp8}
        return [bf16, twin]
    if kind == "flash_attention":
        seq, heads = row["seq"], row["heads_per_rank"]
        forward, backward = attention(seq, heads, row["gqa"], device, warmup, iters)
        flops = 2 * 2 * heads * seq * seq * HEAD_DIM / 2
        rates = {"fwd_tflops": flops / forward / 1e12,
                 "bwd_tflops": ATTENTION_BACKWARD * flops / backward / 1e12}  # fmt: skip
        return [{**row, "fwd_seconds": forward, "bwd_seconds": backward, **rates}]
    seconds = memory_bound(row["op"], row["tokens"], row["hidden"], device, warmup, iters)
    moved = MEMORY_TENSORS[row["op"]] * row["tokens"] * row["hidden"] * ELEMENT
    return [{**row, "seconds": seconds, "gbytes_per_s": moved / seconds / 1e9}]


def calibrate(template: Sequence[Row], device: str, gpu: str, *, shrink: int = 1, warmup: int = 3,
              iters: int = 10, progress: Progress | None = None) -> list[Row]:  # fmt: skip
    """Return a kernel table measured here at the shapes of `template`'s rows (the device row
    first); `progress(done, total)` is called after each row."""
    shapes = [r for r in template if r["kind"] in ("gemm", "expert_gemm", "flash_attention",
                                                   "memory_bound")]  # fmt: skip
    table = [device_row(device, gpu, shrink)]
    for done, row in enumerate(shapes, 1):
        table += measure(shrunk(row, shrink), device, warmup, iters)
        if device == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(done, len(shapes))
    return table


def cuda_available() -> bool:
    """Return whether torch sees a CUDA GPU here."""
    return bool(torch.cuda.is_available())


def cuda_name() -> str:
    """Return the name of CUDA device 0 (call only when `cuda_available`)."""
    return str(torch.cuda.get_device_properties(0).name)
