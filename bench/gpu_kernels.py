"""Kernel throughput on this machine's GPU at the shapes of a kernel table, in bf16 and fp8.

    python3 bench/gpu_kernels.py --like inspector/formulas/kernels-h200.json --out kernels-GPU.json

The command that measured formulas/kernels-h100.json (bench/RESULTS.md), now a front for
`inspect-model calibrate --like FILE -o OUT`: inspector/measure/kernels.py says what each row
times and how.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True, help="the kernel table whose rows to re-measure")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's inspector
    from inspector.cli import main as cli

    return cli(["calibrate", "--like", args.like, "-o", args.out, "--warmup", str(args.warmup),
                "--iters", str(args.iters)])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
