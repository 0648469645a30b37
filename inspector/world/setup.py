"""The simulated world's set-up: megatron imported once, apex, grouped-GEMM and MLA RoPE stand-ins, ranks."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import cache
from types import SimpleNamespace
from typing import Any

from inspector.job.layout import Layout


@cache
def megatron() -> SimpleNamespace:
    """Import the megatron-core pieces this tool uses, once, with import-time warnings silenced.

    fastimport prepares the process first (torch.compile passing through, DTensor deferred, no
    dynamo import on meta kernels), installs the Transformer Engine stand-in (inspector.world.te) before
    megatron-core is imported, and keeps it so for as long as megatron is in use.
    """

    def names() -> SimpleNamespace:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.fusions import fused_layer_norm
        from megatron.core.models import backends
        from megatron.core.models.gpt import GPTModel, gpt_layer_specs
        from megatron.core.transformer import transformer_block
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_config import TransformerConfig
        from torch.testing._internal.distributed.fake_pg import FakeStore

        return SimpleNamespace(
            torch=torch,
            dist=dist,
            parallel_state=parallel_state,
            fused_layer_norm=fused_layer_norm,
            backends=backends,
            gpt_layer_specs=gpt_layer_specs,
            transformer_block=transformer_block,
            GPTModel=GPTModel,
            TransformerConfig=TransformerConfig,
            WrappedTorchNorm=WrappedTorchNorm,
            FakeStore=FakeStore,
        )

    from inspector.world.fastimport import import_megatron

    result: SimpleNamespace = import_megatron(names)
    return result


def simulate_apex(enabled: bool) -> None:
    """Make megatron pick apex's FusedLayerNorm (as on a cluster with apex), or torch norms.

    megatron-core chooses the norm class at import time in three places: the local layer spec
    (`gpt_layer_specs.LNImpl`, and `backends.LNImpl`, which RMSNorm specs rebind globally), and the
    block's `final_layernorm` (`transformer_block.LayerNormImpl`). FusedLayerNorm itself refuses to
    construct unless `HAVE_FUSED_LAYER_NORM` is set. All four are set here, on every build, so one
    build's choice never leaks into the next.
    """
    m = megatron()
    norm = m.fused_layer_norm.FusedLayerNorm if enabled else m.WrappedTorchNorm
    m.fused_layer_norm.HAVE_FUSED_LAYER_NORM = enabled
    m.gpt_layer_specs.LNImpl = norm
    m.backends.LNImpl = norm
    m.transformer_block.LayerNormImpl = norm


def simulate_grouped_gemm(enabled: bool) -> None:
    """Let megatron's GroupedMLP construct as on a cluster with the grouped_gemm package.

    GroupedMLP asserts `grouped_gemm_util.grouped_gemm` is importable when it is built; only its
    forward pass calls into it, and nothing here runs forward. A stand-in module object satisfies
    the check; without grouped GEMM it is reset to what the import found. megatron-core 0.17
    removed GroupedMLP with its check (the local spec then builds SequentialMLP,
    `LocalSpecProvider.grouped_mlp_modules` in models/backends.py): nothing to simulate there.
    """
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:  # megatron-core 0.17+
        return

    if enabled:
        grouped_gemm_util.grouped_gemm = grouped_gemm_util.grouped_gemm or _GROUPED_GEMM_STANDIN
    elif grouped_gemm_util.grouped_gemm is _GROUPED_GEMM_STANDIN:
        grouped_gemm_util.grouped_gemm = None


_GROUPED_GEMM_STANDIN = SimpleNamespace(ops=None, __name__="grouped_gemm (simulated)")


def simulate_grad_accum_fusion(enabled: bool) -> None:
    """Let megatron's own linears fuse weight-gradient accumulation, as with apex's extension.

    Megatron-LM's default `gradient_accumulation_fusion` needs apex's `fused_weight_gradient_mlp_
    cuda` for megatron's ColumnParallelLinear (the output layer of a TE model): the check is
    `layers._grad_accum_fusion_available` (tensor_parallel/layers.py), and the backward calls
    `wgrad_gemm_accum_fp32/fp16(input, grad_output, weight.main_grad)`, which accumulates into
    the grad buffer in place: nothing to allocate, so the stand-in's kernels do nothing.
    """
    from megatron.core.tensor_parallel import layers

    if not hasattr(layers, "_grad_accum_fusion_found"):
        layers._grad_accum_fusion_found = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = enabled or layers._grad_accum_fusion_found
    if enabled and not hasattr(layers, "fused_weight_gradient_mlp_cuda"):
        layers.fused_weight_gradient_mlp_cuda = _WGRAD_ACCUM_STANDIN


def _accumulate_in_place(total_input: Any, grad_output: Any, main_grad: Any) -> None:
    """apex's wgrad_gemm_accum: main_grad += grad_output^T @ total_input, in place."""


_WGRAD_ACCUM_STANDIN = SimpleNamespace(
    wgrad_gemm_accum_fp32=_accumulate_in_place,
    wgrad_gemm_accum_fp16=_accumulate_in_place,
    __name__="fused_weight_gradient_mlp_cuda (simulated)",
)


def simulate_fused_mla_rope() -> None:
    """Let megatron's fused MLA RoPE run on meta tensors: its Triton kernels launch and write nothing.

    With `apply_rope_fusion` (on for TE jobs) multi_latent_attention.py calls
    `fused_apply_mla_rope_for_q` / `_for_kv` (fusions/fused_mla_yarn_rope_apply.py), whose autograd
    Functions `ApplyMLARotaryEmbQ` and `ApplyMLARotaryEmbKV` run here as written: they check the
    shapes, allocate their outputs (`new_empty`), save `(cos, sin)` and launch a Triton kernel per
    pass as `kernel[grid](...)`. Only the launches are simulated: without triton the module keeps the
    kernels as plain functions, which cannot be indexed, and a meta tensor holds no values to
    rotate. tests/test_te_engine.py checks the launches and the saved tensors against the source.
    """
    try:
        from megatron.core.fusions import fused_mla_yarn_rope_apply as fused
    except ImportError:  # no fused MLA RoPE in this megatron-core: nothing to simulate
        return
    for name in MLA_ROPE_KERNELS:
        if not isinstance(getattr(fused, name), KernelLaunchingNothing):
            setattr(fused, name, KernelLaunchingNothing(name))


# the Triton kernels ApplyMLARotaryEmbQ / ApplyMLARotaryEmbKV launch, forward and backward
MLA_ROPE_KERNELS = ("rotary_fwd_q_kernel", "rotary_bwd_q_kernel", "rotary_fwd_kv_kernel",
                    "rotary_bwd_kv_kernel")  # fmt: skip


class KernelLaunchingNothing:
    """A Triton kernel on meta tensors: `kernel[grid](*args)` returns, having written nothing."""

    def __init__(self, name: str) -> None:
        self.__name__ = f"{name} (simulated)"

    def __getitem__(self, grid: Any) -> Any:
        return self._launch

    @staticmethod
    def _launch(*args: Any, **kwargs: Any) -> None:
        """Write nothing: the kernel's outputs were allocated by its caller, on meta."""


def simulated_dp(layout: Layout) -> int:
    """Return the smallest data-parallel size that still lets megatron carve out the expert groups."""
    expert = layout.ep * layout.expert_tp
    dense = layout.tp * layout.cp
    return expert // math.gcd(expert, dense)


def parallel_sizes(layout: Layout, vpp: int | None) -> dict[str, int | None]:
    """Return the parallel sizes as megatron names them (initialize_model_parallel, TransformerConfig)."""
    return dict(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )


@contextlib.contextmanager
def simulated_rank(layout: Layout, rank: int, vpp: int | None) -> Iterator[Any]:
    """Run megatron's parallel_state set-up for one rank of a fake world; tear it down after.

    Only the process groups this rank is a member of are made (inspector.world.groups); inside the
    block torch.cat of meta tensors skips torch's Python meta kernel (inspector.world.fastimport).
    """
    from inspector.world.fastimport import meta_cat
    from inspector.world.groups import scoped_groups

    m = megatron()
    # N distributed-optimizer instances: N times the data-parallel ranks, so that megatron can
    # make its partial data-parallel groups (expert ones too) of the smallest size
    instances = layout.num_distributed_optimizer_instances
    world = layout.tp * layout.cp * simulated_dp(layout) * instances * layout.pp
    partial = {"num_distributed_optimizer_instances": instances} if instances > 1 else {}
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=rank, world_size=world)
    try:
        with scoped_groups(m.dist, m.parallel_state):
            m.parallel_state.initialize_model_parallel(
                **parallel_sizes(layout, vpp), create_gloo_process_groups=False, **partial
            )
        disable_embedding_group()
        with meta_cat():
            yield m.parallel_state
    finally:
        m.parallel_state.destroy_model_parallel()
        m.dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """Provide a one-rank fake world where none is set up (megatron's DDP logging asserts one)."""
    m = megatron()
    if m.dist.is_initialized():
        yield
        return
    m.dist.init_process_group("fake", store=m.FakeStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        m.dist.destroy_process_group()


def disable_embedding_group() -> None:
    """Forget megatron's embedding group so tied-embedding set-up skips its .cuda() all-reduce.

    With pp > 1 and tied embeddings, LanguageModule.setup_embeddings_and_output_layer copies the
    word embedding to the last stage with `weight.data.cuda()` and an all-reduce over this group.
    Without the group it only marks the last stage's copy `shared_embedding=True`, as on a cluster.
    """
    ps = megatron().parallel_state
    ps._EMBEDDING_GROUP = None
    ps._EMBEDDING_GLOBAL_RANKS = None


def fresh_te_process() -> None:
    """Forget what the Transformer Engine stand-in and megatron keep per process (TE's
    placeholder weight gradients; megatron's MTP loss-logging tracker, whose per-layer values
    `MTPLossLoggingHelper.save_loss_to_tracker` allocates once, multi_token_prediction.py), as
    a new process starts without them: each engine run makes its own, whatever ran before it
    in this process (a plan confirming several plans)."""
    from megatron.core.transformer import multi_token_prediction

    from inspector.world.te.state import reset_dummy_wgrads

    reset_dummy_wgrads()
    multi_token_prediction.MTPLossLoggingHelper.tracker.clear()


def on_job_gpu(device: Any) -> Any:
    """Return a context running the block on the job's GPU (job/device.py `Device.world`) as the
    TE stand-in and the Mamba kernels ask torch.cuda for it (te/cuda.py `on_gpu`)."""
    from inspector.world.te.cuda import on_gpu

    world = device.world
    return on_gpu(world.capability, world.sms)
