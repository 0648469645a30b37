"""One real megatron-core training step on one GPU, to check `inspect-model memory` against.

Builds the job that `inspect-model memory --num-layers 8 --hidden-size 1024 --num-attention-heads 16
--seq-length 1024 --bf16 --micro-batch-size B --no-apex` describes, as Megatron-LM's pretrain_gpt
builds it, but with nothing outside megatron-core and torch (no apex, no Transformer Engine):
  - a one-rank world (torch.distributed nccl, rank 0 of 1; parallel_state.initialize_model_parallel(1, 1));
  - GPTModel with get_gpt_layer_local_spec() (torch LayerNorm through WrappedTorchNorm), vocabulary
    50257 padded to 50304, learned positions, biases, GeLU, tied embeddings, parameters created in
    bf16 on the GPU (Megatron-LM's --bf16 and default GPU initialisation), cast whole by Float16Module;
  - megatron's DistributedDataParallel (grad_reduce_in_fp32, no distributed optimizer) and
    get_megatron_optimizer(adam, bf16): Float16OptimizerWithFloat16Params over torch.optim.AdamW
    when neither TE nor apex FusedAdam is importable;
  - iterations as Megatron-LM's train_step runs them for one micro-batch: zero_grad_buffer, forward
    with labels (per-token loss), masked mean, loss scaling, backward, finalize_model_grads,
    optimizer.step().

It prints one JSON line: parameter count, memory_allocated after each set-up step and iteration,
max_memory_allocated per phase (forward, backward, optimizer step) of the first and second iteration,
and, from a third forward under torch.autograd.graph.saved_tensors_hooks, the bytes of every
distinct storage autograd saved for backward (the activations, measured), grouped by dtype and shape.

    python3 bench/gpu_step.py --micro-batch-size 1 [--no-softmax-in-fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

SEQ = 1024
VOCAB = 50257
# 50257 rounded up to a multiple of 128 (Megatron-LM's --make-vocab-size-divisible-by)
PADDED_VOCAB = 50304


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-attention-heads", type=int, default=16)
    p.add_argument(
        "--softmax-in-fp32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TransformerConfig.attention_softmax_in_fp32 (megatron-core's default: on)",
    )
    return p.parse_args()


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def main() -> None:
    args = parse()
    warnings.simplefilter("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)

    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    torch.cuda.synchronize()
    mem: dict[str, int] = {"start": torch.cuda.memory_allocated()}

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        normalization="LayerNorm",
        add_bias_linear=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        attention_softmax_in_fp32=args.softmax_in_fp32,
        use_cpu_initialization=False,
        perform_initialization=True,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=PADDED_VOCAB,
        max_sequence_length=SEQ,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    # Megatron-LM's get_model moves every chunk to the GPU: torch norms and position embeddings
    # are created on the CPU, megatron's own linears and word embedding on the GPU.
    on_cpu = sum(p.numel() for p in gpt.parameters() if not p.is_cuda)
    gpt.cuda(torch.cuda.current_device())
    params = sum(p.numel() for p in gpt.parameters())
    # dtypes as GPTModel built them, before Float16Module casts all to bf16 (torch norms and
    # position embeddings come out fp32)
    dtypes = sorted({str(p.dtype) for p in gpt.parameters()})
    mem["model"] = torch.cuda.memory_allocated()
    model = Float16Module(config, gpt)
    mem["float16_module"] = torch.cuda.memory_allocated()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config, ddp_config, module=model)
    grad_buffer = sum(b.grad_data.numel() * b.grad_data.element_size() for b in model.buffers)
    mem["ddp"] = torch.cuda.memory_allocated()
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
    torch.cuda.synchronize()
    mem["optimizer"] = torch.cuda.memory_allocated()
    # get_megatron_optimizer returns a ChainedOptimizer (here of one Float16OptimizerWithFloat16Params).
    megatron_opts = getattr(optimizer, "chained_optimizers", [optimizer])
    inner = megatron_opts[0].optimizer  # the torch/apex/TE optimizer megatron wraps

    b = args.micro_batch_size
    device = torch.device("cuda")

    def batch():
        # Megatron-LM's get_ltor_masks_and_position_ids: one [1, 1, s, s] mask, True = masked.
        tokens = torch.randint(0, VOCAB, (b, SEQ), device=device)
        labels = torch.randint(0, VOCAB, (b, SEQ), device=device)
        loss_mask = torch.ones((b, SEQ), dtype=torch.float, device=device)
        mask = torch.tril(torch.ones((1, SEQ, SEQ), device=device)).view(1, 1, SEQ, SEQ) < 0.5
        positions = torch.arange(SEQ, dtype=torch.long, device=device).unsqueeze(0).expand(b, SEQ)
        return tokens, labels, loss_mask, mask, positions

    def forward():
        tokens, labels, loss_mask, mask, positions = batch()
        losses = model(tokens, positions, mask, labels=labels)
        return (losses.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()

    def iteration() -> dict[str, int]:
        peaks = {}
        model.zero_grad_buffer()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = forward()
        torch.cuda.synchronize()
        peaks["after_forward"] = torch.cuda.memory_allocated()
        peaks["live_after_forward"] = peaks["after_forward"] - before
        peaks["peak_forward"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        config.grad_scale_func(loss).backward()
        finalize_model_grads([model])
        torch.cuda.synchronize()
        peaks["peak_backward"] = torch.cuda.max_memory_allocated()
        peaks["after_backward"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ok, grad_norm, _ = optimizer.step()
        torch.cuda.synchronize()
        peaks["peak_step"] = torch.cuda.max_memory_allocated()
        peaks["after_step"] = torch.cuda.memory_allocated()
        peaks["peak"] = max(peaks["peak_forward"], peaks["peak_backward"], peaks["peak_step"])
        peaks["loss"] = round(loss.item(), 4)
        peaks["grad_norm"] = round(float(grad_norm), 4)
        peaks["update_ok"] = bool(ok)
        return peaks

    it1 = iteration()
    it2 = iteration()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    torch.cuda.synchronize()
    mem["steady"] = torch.cuda.memory_allocated()

    # Activations, measured: every distinct storage autograd keeps for backward (parameters excluded).
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, tuple[int, str, tuple[int, ...]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if t.device.type == "cuda" and st.data_ptr() not in param_ptrs:
            saved.setdefault(
                st.data_ptr(), (st.nbytes(), str(t.dtype).removeprefix("torch."), tuple(t.shape))
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for nbytes, dtype, shape in saved.values():
        key = f"{dtype} {'x'.join(map(str, shape))}"
        groups[key][0] += 1
        groups[key][1] += nbytes
    loss.backward()
    del loss
    model.zero_grad_buffer()

    state_bytes: dict[str, int] = defaultdict(int)
    for st in inner.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_cuda:
                state_bytes[k] += v.numel() * v.element_size()
    master = sum(
        p.numel() * p.element_size()
        for o in megatron_opts
        for g in getattr(o, "fp32_from_float16_groups", [])
        for p in g
    )

    free, total = torch.cuda.mem_get_info()
    out = {
        "micro_batch_size": b,
        "softmax_in_fp32": args.softmax_in_fp32,
        "parameters": params,
        "param_dtypes": dtypes,
        "params_built_on_cpu": on_cpu,
        "grad_buffer_bytes": grad_buffer,
        "master_bytes": master,
        "adam_state_bytes": dict(state_bytes),
        "memory_allocated": mem,
        "iteration_1": it1,
        "iteration_2": it2,
        "saved_activation_bytes": sum(v[0] for v in saved.values()),
        "saved_storages": len(saved),
        "saved_by_dtype_shape": sorted(
            ([k, n, by] for k, (n, by) in groups.items()), key=lambda r: -r[2]
        ),
        "memory_reserved": torch.cuda.memory_reserved(),
        "device_used_total": total - free,
        "device_total": total,
        "megatron_optimizer": f"{type(optimizer).__name__} of {[type(o).__name__ for o in megatron_opts]}",
        "inner_optimizer": f"{type(inner).__module__}.{type(inner).__name__}",
        "inner_optimizer_defaults": {
            k: v for k, v in inner.defaults.items() if k in ("foreach", "fused", "weight_decay")
        },
        "megatron_core": megatron.core.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }
    print("RESULT " + json.dumps(out), flush=True)
    print(
        f"b={b} fp32softmax={args.softmax_in_fp32}: params {params:,}; set-up {mib(mem['optimizer'])} MiB; "
        f"steady {mib(mem['steady'])} MiB; peak it1 {mib(it1['peak'])} it2 {mib(it2['peak'])} MiB; "
        f"saved activations {mib(out['saved_activation_bytes'])} MiB",
        flush=True,
    )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
