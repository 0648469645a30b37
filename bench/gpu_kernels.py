"""Kernel throughput on this machine's GPU at the shapes of a kernel table, in bf16 and fp8.

    python3 bench/gpu_kernels.py --like inspector/formulas/kernels-h200.json --out kernels-GPU.json

Re-measures every row of the table named by `--like` (the H200 table the step-time model reads,
shared/gpu/kernels-h200.json) on the GPU at hand, in the same row format, so that
inspector/formulas/kernels.py can read the new table as it reads the H200 one:
  - `gemm` (m, n, k) and `expert_gemm` (tokens x hidden times hidden x 2 expert_ffn): bf16
    `torch.matmul`, A [m, k] row-major times B [k, n]; FLOPs 2 m n k.
  - the same shapes in fp8 (`gemm_fp8`, `expert_gemm_fp8` rows), as Transformer Engine runs an fp8
    GEMM on Hopper: `torch._scaled_mm` (cuBLASLt) of two fp8 operands with one fp32 scale each
    (per-tensor scaling: TE's delayed and tensorwise/current recipes), bf16 output. Forward GEMMs
    are E4M3 x E4M3; data and weight gradients E5M2 (the gradient, Megatron-LM's
    `--fp8-format hybrid`) x E4M3. cuBLASLt wants fp8 operands "TN" (both K-major), which is the
    layout TE makes (it keeps transposed fp8 copies for the backward GEMMs), so B is K-major here.
  - `flash_attention`: causal `F.scaled_dot_product_attention` (torch's flash kernel), batch 1,
    head dim 128, the row's query heads and grouped-query ratio, forward and backward timed apart.
  - `memory_bound`: copy (`dst.copy_(src)`), add (`a + b`), rms_norm (`F.rms_norm` with a weight),
    swiglu (`F.silu(x[:, :h]) * x[:, h:]` on [tokens, 2 h]); bytes as the H200 table counts them
    (copy and rms_norm 2 tensors, add and swiglu 3).
Timing: CUDA events around each call, `--warmup` calls, then the median of `--iters`.
Inputs are random normal (scaled for fp8 so that nothing saturates).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any


def timed(fn: Any, warmup: int, iters: int) -> float:
    """Return fn's median seconds over `iters` calls after `warmup` calls (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def gemm_bf16(m: int, n: int, k: int, warmup: int, iters: int) -> float:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return timed(lambda: torch.matmul(a, b), warmup, iters)


def gemm_fp8(m: int, n: int, k: int, grad: bool, warmup: int, iters: int) -> float:
    import torch

    a_dtype = torch.float8_e5m2 if grad else torch.float8_e4m3fn
    a = (torch.randn(m, k, device="cuda") * 0.5).to(a_dtype)
    b = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn).t()  # K-major [k, n]
    one = torch.ones((), device="cuda", dtype=torch.float32)
    return timed(
        lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        warmup,
        iters,
    )


def attention(seq: int, heads: int, gqa: int, warmup: int, iters: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, heads, seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, heads // gqa, seq, 128, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)  # fmt: skip
    v = torch.randn_like(k, requires_grad=True)
    gqa_kw = {"enable_gqa": True} if gqa > 1 else {}

    def fwd() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa_kw)

    out = fwd()
    grad = torch.randn_like(out)
    forward = timed(fwd, warmup, iters)

    def bwd() -> None:
        torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return forward, timed(bwd, warmup, iters)


def memory_bound(op: str, tokens: int, hidden: int, warmup: int, iters: int) -> float:
    import torch
    import torch.nn.functional as F

    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    if op == "copy":
        return timed(lambda: x.copy_(y), warmup, iters)
    if op == "add":
        return timed(lambda: x + y, warmup, iters)
    if op == "rms_norm":
        w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        return timed(lambda: F.rms_norm(x, (hidden,), w), warmup, iters)
    if op == "swiglu":
        both = torch.randn(tokens, 2 * hidden, device="cuda", dtype=torch.bfloat16)
        return timed(lambda: F.silu(both[:, :hidden]) * both[:, hidden:], warmup, iters)
    raise SystemExit(f"unknown memory-bound op {op!r}")


MEMORY_TENSORS = {"copy": 2, "rms_norm": 2, "add": 3, "swiglu": 3}


def measure(row: dict[str, Any], warmup: int, iters: int) -> list[dict[str, Any]]:
    """Return the row re-measured here (and its fp8 twin for GEMMs)."""
    import torch

    kind = row["kind"]
    if kind == "device":
        props = torch.cuda.get_device_properties(0)
        return [{"kind": "device", "name": props.name, "torch": torch.__version__,
                 "cuda": torch.version.cuda, "sm": props.multi_processor_count}]  # fmt: skip
    if kind in ("gemm", "expert_gemm"):
        if kind == "gemm":
            m, n, k = row["m"], row["n"], row["k"]
            grad = row["orient"] != "fwd"
        else:
            m, n, k = row["tokens"], 2 * row["expert_ffn"], row["hidden"]
            grad = False
        flops = 2 * m * n * k
        out = []
        seconds = gemm_bf16(m, n, k, warmup, iters)
        out.append({**row, "seconds": seconds, "tflops": flops / seconds / 1e12})
        try:
            seconds = gemm_fp8(m, n, k, grad, warmup, iters)
            fp8 = {"seconds": seconds, "tflops": flops / seconds / 1e12}
        except Exception as exc:  # record why, keep going
            fp8 = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        a = "e5m2" if grad else "e4m3"
        out.append({**row, "kind": kind + "_fp8", "a": a, "b": "e4m3", "scaling": "tensor", **fp8})
        return out
    if kind == "flash_attention":
        seq, heads, gqa = row["seq"], row["heads_per_rank"], row["gqa"]
        fwd, bwd = attention(seq, heads, gqa, warmup, iters)
        flops = 2 * 2 * heads * seq * seq * 128 / 2
        return [{**row, "fwd_seconds": fwd, "bwd_seconds": bwd, "fwd_tflops": flops / fwd / 1e12,
                 "bwd_tflops": 2.5 * flops / bwd / 1e12}]  # fmt: skip
    if kind == "memory_bound":
        seconds = memory_bound(row["op"], row["tokens"], row["hidden"], warmup, iters)
        moved = MEMORY_TENSORS[row["op"]] * row["tokens"] * row["hidden"] * 2
        return [{**row, "seconds": seconds, "gbytes_per_s": moved / seconds / 1e9}]
    raise SystemExit(f"unknown row kind {kind!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True, help="the kernel table whose rows to re-measure")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    import torch

    rows = json.load(open(args.like))
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        out += measure(row, args.warmup, args.iters)
        torch.cuda.empty_cache()
        if i % 100 == 0:
            print(f"{i}/{len(rows)} {out[-1]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    print(f"wrote {len(out)} rows to {args.out}")


if __name__ == "__main__":
    main()
