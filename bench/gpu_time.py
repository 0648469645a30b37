"""Real megatron-core training iterations timed on one GPU, to check `inspect-model plan`'s step time.

Each job is a single-GPU run (tp = pp = cp = dp = 1) built as bench/gpu_step.py builds it (a one-rank
nccl world; GPTModel, vocabulary 50257 padded to 50304, LayerNorm, GeLU, biases, learned positions,
tied embeddings, bf16 parameters created on the GPU, Float16Module; megatron's
DistributedDataParallel with an fp32 gradient buffer; get_megatron_optimizer(adam, bf16), which
without Transformer Engine or apex is Float16OptimizerWithFloat16Params over torch's foreach AdamW,
gradient clipping 1.0). An iteration is Megatron-LM's train_step for m micro-batches of b sequences:
zero_grad_buffer, get_forward_backward_func()(forward_step_func, m micro-batches) (megatron's
forward_backward_no_pipelining: forward, Megatron-LM's pretrain_gpt loss_func (per-token loss summed
over the loss mask, divided by the tokens), loss scaling, backward, finalize_model_grads), then
optimizer.step(). Batches are random tokens made on the GPU before timing (no data loader).

Attention (`attn` in a job): `local` is megatron-core's DotProductAttention from
get_gpt_layer_local_spec (unfused: baddbmm Q K^T over the full s x s, torch softmax with the causal
mask, dropout, bmm with V); `sdpa` replaces only that module by torch's
F.scaled_dot_product_attention(is_causal=True, dropout) (a fused kernel that stores no s x s scores,
whichever torch picks), to see what flash attention changes; `te` is
get_gpt_layer_with_transformer_engine_spec when Transformer Engine is importable. On the CPU
(fp32, no dropout) SdpaAttention's output and gradients match DotProductAttention's to 1e-5.

Timing: `--warmup` iterations, then `--iters` iterations, each between torch.cuda.synchronize()
calls (time.perf_counter), with forward+backward and the optimizer step timed apart; the median is
reported. One JSON line per job (`RESULT {...}`), also written to `--out`.

    pip install --no-deps megatron_core-0.16.1-*.whl   # as for gpu_step.py (torch is there)
    python3 bench/gpu_time.py --out /tmp/t.json [--job h1024-l8-a16-s1024-b1-m4-local ...]

`--estimate [FILE]` (any machine, no GPU: this tree's inspector) prints, per job, the planner's
estimate (plan.search with every dimension fixed: --gpus 1, tp = pp = 1, the job's micro-batch,
global batch b x m, no recomputation, flash attention off for `local` and on otherwise, which
changes memory, not time; the bias-GeLU and bias-dropout-add fusions off, as the jobs' TransformerConfig
leaves them) and, with FILE (the JSON above), the measured time, Megatron-LM's FLOPs
over it (inspector.formulas.flops.iteration_flops) and the efficiency against the H100's 989 TFLOP/s, as a
markdown table.

Status: written in a session that had no GPU; not yet run on one (bench/RESULTS.md, "Real GPU
check: step time (H100)").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from functools import partial
from typing import Any

VOCAB = 50257
PADDED_VOCAB = 50304  # 50257 rounded up to a multiple of 128 (--make-vocab-size-divisible-by)
PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 (job/hardware.py GPUS["h100"])

DEFAULT_JOBS = [
    "h1024-l8-a16-s1024-b1-m4-local",
    "h1024-l8-a16-s1024-b4-m4-local",
    "h4096-l8-a32-s2048-b1-m4-local",
    "h4096-l8-a32-s2048-b2-m4-local",
    "h4096-l4-a32-s4096-b1-m4-local",
    "h1024-l8-a16-s1024-b4-m4-sdpa",
    "h4096-l8-a32-s2048-b2-m4-sdpa",
    "h4096-l4-a32-s4096-b1-m4-sdpa",
]
JOB = re.compile(r"h(\d+)-l(\d+)-a(\d+)-s(\d+)-b(\d+)-m(\d+)-(local|sdpa|te)(?:-e(\d+)k(\d+)f(\d+))?$")
MOE_JOBS = ["h2048-l4-a16-s4096-b1-m4-sdpa-e8k2f8192", "h2048-l4-a16-s4096-b2-m4-sdpa-e32k4f1024"]


def parse_job(name: str) -> dict[str, Any]:
    """Return a job's shape from its name, e.g. h4096-l8-a32-s2048-b1-m4-local; an MoE job ends in
    -e<experts>k<top-k>f<expert ffn>, e.g. h2048-l4-a16-s4096-b1-m4-sdpa-e8k2f8192."""
    match = JOB.match(name)
    if not match:
        raise SystemExit(
            f"bad job {name!r}: want h<hidden>-l<layers>-a<heads>-s<seq>-b<mbs>-m<micro-batches>-<local|sdpa|te>"
            "[-e<experts>k<topk>f<expert ffn>]"
        )
    h, layers, heads, seq, b, m = (int(x) for x in match.groups()[:6])
    experts, topk, ffn = (int(x) if x else 0 for x in match.groups()[7:])
    return dict(
        name=name, hidden=h, layers=layers, heads=heads, seq=seq, mbs=b, m=m, attn=match.group(7),
        experts=experts, topk=topk, expert_ffn=ffn,
    )


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--job", action="append", help="job name (repeatable); default: " + " ".join(DEFAULT_JOBS)
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", help="write the results (a JSON list) here")
    p.add_argument(
        "--estimate",
        nargs="?",
        const="",
        metavar="FILE",
        help="no GPU: price the jobs (of FILE, measured, or --job / the defaults) with this tree's planner",
    )
    p.add_argument(
        "--softmax-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TransformerConfig.attention_softmax_in_fp32 (megatron-core's default: on)",
    )
    return p.parse_args()


def sdpa_attention_class() -> type:
    """Return a DotProductAttention whose forward is torch's scaled_dot_product_attention."""
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            # [s, b, n, d] -> [b, n, s, d]; causal, the mask tensor is not needed
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            p = self.config.attention_dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale
            )
            s, b = query.size(0), query.size(1)
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SdpaAttention


def run_job(job: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Build one job, time its iterations and return the measurements."""
    import torch
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    seq, b, m = job["seq"], job["mbs"], job["m"]
    torch.cuda.reset_peak_memory_stats()
    # an MoE job: megatron's torch experts (SequentialMLP, no grouped GEMM without TE), the
    # all-to-all dispatcher at ep 1, aux-loss balancing; no linear biases (megatron-core 0.13 builds
    # no MoE with them)
    moe = dict(num_moe_experts=job["experts"], moe_router_topk=job["topk"],
               moe_ffn_hidden_size=job["expert_ffn"], moe_token_dispatcher_type="alltoall",
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
               ) if job.get("experts") else {}  # fmt: skip
    config = TransformerConfig(
        **moe,
        num_layers=job["layers"],
        hidden_size=job["hidden"],
        num_attention_heads=job["heads"],
        normalization="LayerNorm",
        add_bias_linear=not moe,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        attention_softmax_in_fp32=args.softmax_in_fp32,
        use_cpu_initialization=False,
        perform_initialization=True,
    )
    if job["attn"] == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=job.get("experts") or None, moe_grouped_gemm=False, normalization="LayerNorm"
        )
        if job["attn"] == "sdpa":
            spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=PADDED_VOCAB,
        max_sequence_length=seq,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    gpt.cuda(torch.cuda.current_device())
    params = sum(p.numel() for p in gpt.parameters())
    model = Float16Module(config, gpt)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config, ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-4,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    megatron_opts = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = megatron_opts[0].optimizer

    device = torch.device("cuda")
    batches = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (b, seq), device=device)
        labels = torch.randint(0, VOCAB, (b, seq), device=device)
        loss_mask = torch.ones((b, seq), dtype=torch.float, device=device)
        mask = torch.tril(torch.ones((1, seq, seq), device=device)).view(1, 1, seq, seq) < 0.5
        positions = torch.arange(seq, dtype=torch.long, device=device).unsqueeze(0).expand(b, seq)
        batches.append((tokens, labels, loss_mask, mask, positions))

    def loss_func(loss_mask, output):
        # Megatron-LM pretrain_gpt.loss_func: (sum of masked losses, tokens, reporting)
        losses = output.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask)
        num_tokens = mask.sum().clone().detach().to(torch.int)
        return (
            loss,
            num_tokens,
            {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
        )

    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, mask, positions = next(data_iterator)
        output = model(tokens, positions, mask, labels=labels)
        return output, partial(loss_func, loss_mask)

    forward_backward = get_forward_backward_func()

    def iteration() -> tuple[float, float, dict[str, Any]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=m,
            seq_length=seq,
            micro_batch_size=b,
            forward_only=False,
        )
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ok, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loss = sum(float(x["lm loss"][0]) for x in losses) / sum(
            float(x["lm loss"][1]) for x in losses
        )
        return (
            t1 - t0,
            t2 - t1,
            {"loss": round(loss, 4), "grad_norm": round(float(grad_norm), 4), "ok": bool(ok)},
        )

    for _ in range(args.warmup):
        first = iteration()
    fb, opt, totals = [], [], []
    for _ in range(args.iters):
        f, o, last = iteration()
        fb.append(f)
        opt.append(o)
        totals.append(f + o)
    out = {
        "job": job["name"],
        **{k: job[k] for k in ("hidden", "layers", "heads", "seq", "mbs", "m", "attn", "experts",
                               "topk", "expert_ffn")},  # fmt: skip
        "softmax_in_fp32": args.softmax_in_fp32,
        "parameters": params,
        "iteration_s": statistics.median(totals),
        "forward_backward_s": statistics.median(fb),
        "optimizer_s": statistics.median(opt),
        "iteration_min_s": min(totals),
        "iteration_max_s": max(totals),
        "iterations": args.iters,
        "warmup": args.warmup,
        "warmup_last": first[2],
        "last": last,
        "peak_memory_allocated": torch.cuda.max_memory_allocated(),
        "core_attention": type(gpt.decoder.layers[0].self_attention.core_attention).__name__,
        "inner_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
    }
    return out  # the model, optimizer and batches go with this frame


def measure(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    # megatron-core 0.16.1's router names te_general_gemm only when Transformer Engine imports
    # (shared/gpu's memprobe.py does the same)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    env = {
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }
    print("ENV " + json.dumps(env), flush=True)
    results = []
    for name in args.job or DEFAULT_JOBS:
        start = time.perf_counter()
        try:
            res = {**run_job(parse_job(name), args), **env}
        except Exception as exc:  # one failing job (e.g. out of memory) must not lose the others
            traceback.print_exc()
            res = {"job": name, "error": f"{type(exc).__name__}: {exc}"[:500], **env}
        gc.collect()  # free the job's model and optimizer before the next one
        torch.cuda.empty_cache()
        res["wall_s"] = round(time.perf_counter() - start, 1)
        results.append(res)
        print("RESULT " + json.dumps(res), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _flash_request_class() -> type:
    from inspector.plan.request import Request

    class FlashRequest(Request):
        """A request whose local-spec candidates run flash attention (the `sdpa` jobs)."""

        @property
        def flash(self) -> bool:
            return True

    return FlashRequest


def estimate(path: str | None, jobs: list[str]) -> None:
    """Print the planner's estimate of each job, beside its measurement in `path` if given."""
    from dataclasses import fields, replace

    from inspector.formulas.flops import iteration_flops
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.plan.request import PlanFlags, make_request
    from inspector.plan.search import search

    _FlashRequest = _flash_request_class()
    if path:
        with open(path) as f:
            results = [r for r in json.load(f) if "error" not in r]
    else:
        results = [{**parse_job(name), "job": name} for name in jobs]
    print(
        "| job | attention | measured s (fwd+bwd, optimizer) | estimated s (compute, optimizer) "
        "| measured / estimated | model TFLOP/s | efficiency (of 989) | efficiency, fwd+bwd only |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        flags = dict(
            num_layers=r["layers"],
            hidden_size=r["hidden"],
            num_attention_heads=r["heads"],
            seq_length=r["seq"],
            max_position_embeddings=r["seq"],
            vocab_size=VOCAB,
            bf16=True,
            global_batch_size=r["mbs"] * r["m"],
            micro_batch_size=r["mbs"],
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            recompute_granularity="none",
            transformer_impl="local",
            # the job's TransformerConfig leaves bias_activation_fusion and bias_dropout_fusion
            # at megatron-core's defaults (off), where Megatron-LM's flags default them on
            no_bias_gelu_fusion=True,
            no_bias_dropout_fusion=True,
        )
        if r.get("experts"):
            flags.update(num_experts=r["experts"], moe_router_topk=r["topk"],
                         moe_ffn_hidden_size=r["expert_ffn"], moe_token_dispatcher_type="alltoall",
                         disable_bias_linear=True)  # fmt: skip
        args = merge_sources(Sources(flags=flags, apex=False), ("model", "layout", "training")).args
        gpu = "h100" if "H100" in r.get("device", "") else "h200"  # the GPU that measured it
        req = make_request(args, PlanFlags(1, gpu=gpu, top=1))
        # memory unbounded: the GPU showed what fits
        req = replace(req, memory=1 << 40)
        if r["attn"] != "local":
            # flash attention as the job ran it: torch's SDPA swapped into the local spec, which
            # Megatron-LM itself runs unfused (Request.flash is False for the local spec)
            req = _FlashRequest(**{f.name: getattr(req, f.name) for f in fields(req)})
        plan = search(req).plans[0]
        shares = plan.time.shares()
        flops = iteration_flops(plan.job.dims(), r["mbs"] * r["m"])
        assert flops == plan.flops, (flops, plan.flops)
        shape = f"h{r['hidden']} L{r['layers']} s{r['seq']} b{r['mbs']} x {r['m']} micro-batches"
        if r.get("experts"):
            shape += f", {r['experts']} experts top-{r['topk']} ffn {r['expert_ffn']}"
        est = f"{plan.time.seconds:.4f} ({shares['compute']:.4f}, {shares['optimizer']:.4f})"
        if "iteration_s" not in r:
            print(f"| {shape} | {r['attn']} | not measured | {est} | | | | |")
            continue
        built = plan.stages[0].state.weights // 2  # bf16 weights: the same model as the GPU built?
        if built != r["parameters"]:
            print(
                f"<!-- {r['job']}: {r['parameters']:,} parameters on the GPU, {built:,} planned -->"
            )
        tflops = flops / r["iteration_s"] / 1e12
        fb_tflops = flops / r["forward_backward_s"] / 1e12
        print(
            f"| {shape} | {r['attn']} | {r['iteration_s']:.4f} ({r['forward_backward_s']:.4f}, "
            f"{r['optimizer_s']:.4f}) | {est} | {r['iteration_s'] / plan.time.seconds:.2f} "
            f"| {tflops:.0f} | {tflops / PEAK_TFLOPS:.3f} | {fb_tflops / PEAK_TFLOPS:.3f} |"
        )


def main() -> None:
    args = parse()
    if args.estimate is not None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        estimate(args.estimate or None, args.job or DEFAULT_JOBS)
    else:
        measure(args)


if __name__ == "__main__":
    main()
