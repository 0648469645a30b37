"""`plan`'s step time against Megatron-Bridge's published DGX-H100 FP8 rows, with each recipe's layout.

    .venv/bin/python bench/bridge_fp8.py [--markdown]

Megatron-Bridge's performance summary gives tokens/s/GPU for each recipe (bench/RESULTS.md, "FP8:
Megatron-Bridge's published 405B, Qwen3 and DeepSeek-V3 rows on DGX-H100", names the recipe files
and their settings). Each row is priced by `inspect-model plan` with the recipe's layout, precision,
dispatcher and recomputation pinned (`--top 1`); the published step is global batch x sequence /
GPUs / published tokens/s/GPU. Prints, per row, the priced step, tokens/s/GPU and the difference
(+: priced faster than published), then how many rows are within 15%. Nothing is tuned to them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

COMMON = (
    "--gpu h100 --bf16 --micro-batch-size 1 --use-distributed-optimizer --grad-reduce-in-bf16 "
    "--fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --top 1 --format json --no-cache"
)
# name, published tokens/s/GPU, global batch, sequence, GPUs, the recipe's own flags; the two
# Llama recipes overlap tensor-parallel communication with TE's userbuffers (Megatron-Bridge
# recipes/llama/h100/llama3.py: CommOverlapConfig(tp_comm_overlap=True, ...), which
# perf_recipes/llama/h100/llama3.py and llama31.py keep, each with its own userbuffers
# settings, which `plan` does not read: it prices TE's defaults), the Qwen3-235B recipe not
# (perf_recipes/qwen/h100/qwen3_moe.py: tp_comm_overlap=False)
ROWS = [
    ("Llama 3 70B", 1664, 256, 8192, 64,
     "--model llama3-70b --tp 4 --pp 8 --cp 1 --sequence-parallel "
     "--pipeline-model-parallel-layout Et*2|(t*2|)*34,t*3|(t*2|)*3,tL "
     "--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"),
    ("Llama 3.1 405B", 328, 1536, 8192, 1024,
     "--model llama3.1-405b --tp 8 --pp 8 --cp 2 --sequence-parallel "
     "--num-virtual-stages-per-pipeline-rank 8 --account-for-embedding-in-pipeline-split "
     "--account-for-loss-in-pipeline-split --overlap-grad-reduce --overlap-param-gather "
     "--recompute-granularity none --tp-comm-overlap"),
    ("Qwen3-30B-A3B (HybridEP)", 8960, 1024, 4096, 16,
     "--model qwen3-30b-a3b --tp 1 --pp 1 --cp 1 --ep 16 --expert-tensor-parallel-size 1 "
     "--moe-grouped-gemm --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
     "--overlap-grad-reduce --overlap-param-gather --recompute-granularity none"),
    ("Qwen3-235B-A22B", 1712, 8192, 4096, 256,
     "--model qwen3-235b-a22b --tp 2 --pp 8 --num-virtual-stages-per-pipeline-rank 4 --cp 1 "
     "--ep 32 --expert-tensor-parallel-size 1 --sequence-parallel "
     "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
     "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-grad-reduce "
     "--overlap-param-gather --recompute-granularity none --overlap-moe-expert-parallel-comm "
     "--delay-wgrad-compute --transformer-impl transformer_engine"),
    ("DeepSeek-V3 (DeepEP)", 1297, 8192, 4096, 1024,
     "--model deepseek-v3 --tp 2 --pp 8 --cp 1 --ep 64 --expert-tensor-parallel-size 1 "
     "--sequence-parallel --pipeline-model-parallel-layout Et|(tt|)*30mL --moe-grouped-gemm "
     "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep "
     "--recompute-granularity selective --recompute-modules mla_up_proj,mlp "
     "--overlap-moe-expert-parallel-comm --delay-wgrad-compute --transformer-impl transformer_engine "
     "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16 "
     "--exp-avg-sq-dtype bf16"),
]  # fmt: skip


def price(flags: str, gbs: int, seq: int, gpus: int) -> dict[str, float]:
    """Return the best plan's step seconds and peak GiB for one row (the CLI in this interpreter)."""
    argv = ["plan", *flags.split(), "--gpus", str(gpus), "--global-batch-size", str(gbs),
            "--seq-length", str(seq), *COMMON.split()]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "inspector", *argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"plan {' '.join(argv)}\n{done.stderr}")
    best = json.loads(done.stdout)["plans"][0]
    return {"step": best["step_seconds"], "peak": best["peak_bytes"] / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    markdown = parser.parse_args().markdown
    print("| row | published tokens/s/GPU (step s) | priced step s | tokens/s/GPU | vs published | peak GiB |"
          if markdown else "row, published tokens/s/GPU, published step s, priced step s, tokens/s/GPU, "
          "vs published, peak GiB")  # fmt: skip
    if markdown:
        print("|---|---|---|---|---|---|")
    within = 0
    for name, published, gbs, seq, gpus, flags in ROWS:
        got = price(flags, gbs, seq, gpus)
        step = gbs * seq / gpus / published
        tokens = gbs * seq / gpus / got["step"]
        error = tokens / published - 1
        within += abs(error) <= 0.15
        cells = [name, f"{published:,} ({step:.2f})", f"{got['step']:.2f}", f"{tokens:,.0f}",
                 f"{error:+.1%}", f"{got['peak']:.1f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |" if markdown else ", ".join(cells), flush=True)
    print(f"\n{within} of {len(ROWS)} rows within 15%")


if __name__ == "__main__":
    main()
