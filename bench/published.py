"""`plan`'s step time against published, measured step times (a calibration file's records).

    .venv/bin/python bench/published.py PATH/published-calibration.json [--markdown]

Each record (the format of shared/gpu/published-calibration.json: model, precision, GPU, tp, pp, vpp,
dp, cp, ep, etp, micro-batch, global batch, recomputation, split, distributed optimizer, flash
attention, measured step seconds) is priced with every published dimension fixed (what a record
leaves out, e.g. the micro-batch of Narayanan et al. 2021's 1T run, is searched) and memory left
unbounded (the run fitted). Prints one line per record, then the mean and largest absolute error
for dense and MoE records apart. Nothing here is tuned to these numbers: the time model reads
only the kernel table and its cited peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# record model key -> Megatron-LM argument (anything else already spelled as an argument passes)
MODEL_KEYS = {
    "layers": "num_layers", "hidden": "hidden_size", "ffn": "ffn_hidden_size",
    "heads": "num_attention_heads", "vocab": "vocab_size", "seq": "seq_length",
    "experts": "num_experts", "topk": "moe_router_topk", "moe_ffn": "moe_ffn_hidden_size",
}  # fmt: skip
SKIP = {"name", "arch", "kv_groups", "preset"}


def model_flags(record: dict[str, Any]) -> dict[str, Any]:
    """Return the Megatron-LM flags of a record's model and precision."""
    model = record["model"]
    flags: dict[str, Any] = {MODEL_KEYS.get(k, k): v for k, v in model.items() if k not in SKIP}
    if model.get("kv_groups") not in (None, model.get("heads")):
        flags.update(group_query_attention=True, num_query_groups=model["kv_groups"])
    arch = model.get("arch", "")
    if "RMSNorm" in arch:
        flags["normalization"] = "RMSNorm"
    if "SwiGLU" in arch:
        flags["swiglu"] = True
    if "RoPE" in arch or "rotary" in arch:
        flags["position_embedding_type"] = "rope"
    if "untied" in arch:
        flags["untie_embeddings_and_output_weights"] = True
    flags["max_position_embeddings"] = model["seq"] if "seq" in model else None
    flags[record["precision"] if record["precision"] in ("fp16", "bf16") else "bf16"] = True
    flags["global_batch_size"] = record["gbs"]
    if not record.get("flash_attention"):
        # the records without flash attention are Megatron-LM's 2021-2022 runs (Narayanan et al.
        # 2021, Korthikanti et al. 2022), older than Transformer Engine (first release v0.1.0,
        # 2022-09): megatron's own layers and FusedScaleMaskSoftmax, not TE's unfused attention
        flags["transformer_impl"] = "local"
    return flags


def fixed_dims(record: dict[str, Any]) -> dict[str, Any]:
    """Return the plan's fixed dimensions: the record's layout and training settings."""
    fixed: dict[str, Any] = {"tp": record["tp"], "pp": record["pp"], "cp": record.get("cp") or 1,
                             "distopt": bool(record["distopt"])}
    for key in ("ep", "etp", "vpp", "mbs"):
        if record.get(key) is not None:
            fixed[key] = record[key]
    recompute = record["recompute"] or {"granularity": "none"}
    fixed["recompute"] = recompute["granularity"]
    if recompute["granularity"] == "full":
        fixed["recompute_method"] = recompute.get("method", "uniform")
        fixed["recompute_num_layers"] = recompute.get("num_layers", 1)
    if record.get("split"):
        fixed["split"] = tuple(record["split"])
    return fixed


def price(record: dict[str, Any], efficiency: float | None = None) -> float:
    """Return the planner's step seconds for one record (the kernel tables, or `efficiency`)."""
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    preset = record["model"].get("preset")  # a preset of `inspect-model models`, if named
    flags = model_flags(record)
    if preset:
        flags = {k: v for k, v in flags.items() if k not in ("preset",)}
    args = merge_sources(Sources(preset=preset, flags=flags), ("model", "layout", "training")).args
    req = make_request(args, PlanFlags(record["gpus"], gpu=record["gpu"], efficiency=efficiency, top=1))
    req = replace(req, fixed=fixed_dims(record), memory=1 << 50,
                  flash_attention=bool(record.get("flash_attention")))
    plans = search(req).plans
    if not plans:
        raise SystemExit(f"{record['id']}: the planner found no plan")
    return plans[0].time.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="price every FLOP at this fraction of peak (the model before the kernel tables)")
    args = parser.parse_args()
    with open(args.path) as f:
        records = json.load(f)["records"]
    errors: dict[str, list[float]] = {"dense": [], "MoE": []}
    print("| record | GPU | measured s | estimated s | error |")
    print("|---|---|---|---|---|")
    for record in records:
        measured = record["measured"]["step_seconds"]
        estimated = price(record, args.efficiency)
        error = estimated / measured - 1
        kind = "MoE" if record["model"].get("experts") or record["model"].get("num_experts") else "dense"
        errors[kind].append(error)
        print(f"| {record['id']} | {record['gpu']} | {measured:.2f} | {estimated:.2f} "
              f"| {error * 100:+.1f}% |")
    for kind, values in errors.items():
        if values:
            mae = sum(abs(e) for e in values) / len(values)
            worst = max(values, key=abs)
            print(f"\n{kind}: {len(values)} records, mean absolute error {mae * 100:.1f}%, "
                  f"largest {worst * 100:+.1f}%")


if __name__ == "__main__":
    main()
