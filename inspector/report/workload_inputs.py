"""What a SimAI workload is made from: each stage's contents, the job's settings, compute times.

`stage_inputs` reads them off a BuiltJob (megatron's placed layers and its DDP buffers);
workload.py turns them into records. Plain frozen records, so the records can be tested on
hand-made stages too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inspector.errors import ConfigError, InputError
from inspector.job.dims import ModelDims
from inspector.job.dsa import refuse_dsa
from inspector.job.hardware import Gpu
from inspector.job.hybrid_model import MambaShape, mamba_shape
from inspector.job.layout import Layout
from inspector.job.model_args import refuse_latent_moe

if TYPE_CHECKING:
    from inspector.world.build import BuiltJob
    from inspector.world.shards import BufferLayout

RECOMPUTE_MODES = ("none", "selective", "full")
LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")  # a chunk's I-th TransformerLayer


@dataclass(frozen=True)
class BufferInput:
    """One DDP grad buffer of a stage (megatron's _ParamAndGradBuffer, via shards.BufferLayout).

    `numel` includes megatron's padding: it is what every rank reduces and gathers.
    """

    numel: int
    param_bytes: int  # element size of the parameters (2 for bf16)
    grad_bytes: int  # element size of the gradients (4 with fp32 grad accumulation)
    expert: bool = False
    param_numel: int | None = None  # NVFP4's packed param buffer (BufferLayout.param_numel)

    @property
    def gathered_bytes(self) -> int:
        """Return the bytes of the parameter all-gather: the whole param buffer."""
        return (self.numel if self.param_numel is None else self.param_numel) * self.param_bytes

    @classmethod
    def from_layout(cls, layout: BufferLayout) -> BufferInput:
        """Return the input for one of megatron's grad buffers (numel with padding, dtypes)."""
        return cls(
            numel=layout.numel,
            # MXFP8 weights are gathered as bf16 through the grad buffer (BufferLayout.shared)
            param_bytes=2 if layout.shared else layout.param_dtype.itemsize,
            grad_bytes=layout.grad_dtype.itemsize,
            expert=layout.expert,
            param_numel=layout.param_numel,
        )


@dataclass(frozen=True)
class FsdpBucketInput:
    """One Megatron-FSDP bucket of a stage (world/fsdp.py FsdpBucket), as its collectives move it.

    `numel` is megatron's padded bucket (`build_data_parallel_buffer_index`): the whole buffer of
    its all-gather (parameters) and reduce-scatter or all-reduce (gradients). `unit` numbers the
    stage's FSDP units (TransformerLayers under optim_grads_params), None outside them; `layer` is
    the unit's global 0-based transformer layer (None for an MTP layer's unit).
    """

    numel: int
    param_bytes: int
    grad_bytes: int
    expert: bool = False
    unit: int | None = None
    layer: int | None = None


@dataclass(frozen=True)
class StageInput:
    """What megatron placed on one pipeline stage, as the lead's builder reads it off the model.

    `chunks`: per virtual chunk, the 0-based global numbers of its transformer layers (one chunk
    without interleaving). `parameters`: local parameters on one rank (for the index only).
    """

    stage: int
    chunks: tuple[tuple[int, ...], ...]
    has_embedding: bool
    has_output: bool
    mtp_layers: int = 0  # the MTP depths run (--mtp-use-repeated-layer: one layer, run at each)
    buffers: tuple[BufferInput, ...] = ()
    parameters: int = 0
    fsdp: tuple[FsdpBucketInput, ...] = ()  # Megatron-FSDP's buckets, in megatron's order
    symbols: tuple[str, ...] = ()  # a hybrid stack's layer kinds as its pattern writes them
    mtp_symbols: tuple[str, ...] = ()  # a hybrid MTP depth's layer kinds (the pattern after `/`)

    @property
    def layers(self) -> tuple[int, ...]:
        """Return the stage's layers, chunk after chunk."""
        return tuple(layer for chunk in self.chunks for layer in chunk)


# --recompute-modules that re-run no GEMM: the FLOPs-priced records add nothing for them
NOT_GEMMS: tuple[str, ...] = ("layernorm", "moe_act")


@dataclass(frozen=True)
class Settings:
    """Megatron-LM training flags that change what travels or how long compute takes."""

    micro_batch_size: int
    num_microbatches: int
    world_size: int
    distributed_optimizer: bool = True
    recompute: str = "none"  # --recompute-granularity: none, selective, full
    recompute_modules: tuple[str, ...] = ("core_attn",)  # --recompute-modules under selective
    learned_positions: bool = True  # --position-embedding-type learned_absolute
    flex: bool = False  # --moe-token-dispatcher-type flex (DeepEP's or HybridEP's kernels)
    sharding: str | None = None  # a Megatron-FSDP --data-parallel-sharding-strategy, or fsdp2

    def __post_init__(self) -> None:
        """Reject values no workload can use."""
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute-granularity must be one of {RECOMPUTE_MODES}")
        for name in ("micro_batch_size", "num_microbatches", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ComputeRate:
    """Compute times from FLOPs: --gpu-tflops x --mfu (labelled estimates in the index)."""

    gpu_tflops: float
    mfu: float
    fp8_tflops: float | None = None  # the --gpu's fp8 peak for an fp8 job's TE GEMMs

    def ns(self, flops: float, fp8: bool = False) -> int:
        """Return the nanoseconds `flops` take at this rate (fp8 GEMMs at the fp8 peak)."""
        peak = self.fp8_tflops if fp8 and self.fp8_tflops else self.gpu_tflops
        return round(flops / (peak * self.mfu * 1e3))


@dataclass(frozen=True)
class ComputeProfile:
    """Measured per-micro-batch times of one rank, in ns, from AICB/AIOB's profile file.

    Built by inspector.report.simai.parse_compute_profile, grouped as AICB's `extract_averages`
    (utils/utils.py 373-447) groups them: attention (atten*, layernorm), mlp (mlp*,
    layernorm2), embedding (Emb), logits (logit_time), optimizer (param_time min + avg).
    """

    attention: int
    mlp: int
    embedding: int = 0
    logits: int = 0
    optimizer: int = 0
    flash: int = 0  # the core-attention part of `attention`, recomputed under selective

    @classmethod
    def from_sections(cls, sections: dict[str, tuple[float, float]]) -> ComputeProfile:
        """Group parse_compute_profile's µs sections into ns the way AICB's extract_averages does."""

        def ns(names: list[str]) -> int:
            return round(sum(sections[n][0] for n in names) * 1000)

        attention = [n for n in sections if "atten" in n or n == "layernorm"]
        mlp = [n for n in sections if "mlp" in n or n == "layernorm2"]
        if not attention or not mlp:
            raise InputError(
                "the compute profile needs attention (atten*) and MLP (mlp*) sections, "
                f"found {', '.join(sections)}"
            )
        avg, low = sections.get("param_time", (0.0, 0.0))
        return cls(
            attention=ns(attention),
            mlp=ns(mlp),
            embedding=ns([n for n in ("Emb",) if n in sections]),
            logits=ns([n for n in ("logit_time",) if n in sections]),
            optimizer=round(low * 1000) + round(avg * 1000),  # AICB: min + avg (utils.py 395-399)
            flash=ns([n for n in attention if "flash" in n or "core" in n]),
        )


@dataclass(frozen=True)
class Context:
    """Everything one stage's records depend on besides the stage itself."""

    dims: ModelDims
    par: Layout
    training: Settings
    compute: ComputeRate | ComputeProfile = field(default_factory=lambda: ComputeRate(1.0, 1.0))
    mamba: MambaShape | None = None  # a hybrid model's Mamba mixer sizes

    @property
    def tokens(self) -> int:
        """Return the tokens of one micro-batch on one context-parallel rank: b s / c."""
        if self.dims.seq_length % self.par.cp:
            raise ConfigError(
                f"--seq-length {self.dims.seq_length} is not divisible by --cp {self.par.cp}"
            )
        return self.training.micro_batch_size * self.dims.seq_length // self.par.cp

    @property
    def activation(self) -> int:
        """Return the bytes of the (s/c, b, h) activation: 2 b s h at 16 bits, c = 1."""
        return self.dims.activation_bytes * self.tokens * self.dims.hidden_size


def stage_inputs(built: BuiltJob) -> list[StageInput]:
    """Return what megatron placed on each built stage, with its real DDP (or FSDP) buffers."""
    inputs = []
    fsdp = built.job.training.megatron_fsdp or built.job.training.torch_fsdp2
    for stage in built.stages:
        buffers = () if fsdp else tuple(
            BufferInput.from_layout(buffer) for chunk in stage.chunks for buffer in chunk.buffers()
        )
        inputs.append(
            StageInput(
                stage=stage.stage,
                chunks=tuple(chunk.layers for chunk in stage.chunks),
                has_embedding=any(chunk.has_embedding for chunk in stage.chunks),
                has_output=any(chunk.has_output for chunk in stage.chunks),
                mtp_layers=sum(chunk.mtp_depths for chunk in stage.chunks),
                buffers=buffers,
                parameters=stage.parameters,
                fsdp=fsdp_inputs(stage.chunks) if fsdp else (),
                symbols=tuple(s for chunk in stage.chunks for s in chunk.models[0].symbols),
                mtp_symbols=next((c.models[0].mtp_symbols for c in stage.chunks if c.mtp_layers), ()),
            )
        )
    return inputs


def fsdp_inputs(chunks: Sequence[Any]) -> tuple[FsdpBucketInput, ...]:
    """Return the Megatron-FSDP buckets (FSDP2 units) of a stage's chunks, units tied to layers.

    A unit is a TransformerLayer (the adapter's `fsdp_unit_modules`); its parameters are named
    `decoder.layers.I.` with I the layer's place in the chunk (an MTP layer's: `mtp.layers.`).
    Under FSDP2 every module `fully_shard` wraps is a unit, the root's parameters too.
    """
    result = []
    units: dict[tuple[int, int | None], int] = {}
    for index, chunk in enumerate(chunks):
        layout = chunk.fsdp()
        for bucket in layout.buckets:
            unit = layer = None
            if bucket.unit is not None or layout.strategy == "fsdp2":
                unit = units.setdefault((index, bucket.unit), len(units))
                found = LOCAL_LAYER.match(bucket.names[0])
                layer = chunk.layers[int(found.group(1))] if found else None
            result.append(
                FsdpBucketInput(
                    numel=bucket.numel,
                    param_bytes=bucket.param_itemsize,
                    grad_bytes=bucket.grad_itemsize,
                    expert=bucket.expert,
                    unit=unit,
                    layer=layer,
                )
            )
    return tuple(result)


def context_for(built: BuiltJob, compute: ComputeRate | ComputeProfile) -> Context:
    """Return the settings every stage's records share, from the Job."""
    job = built.job
    fsdp = job.training.megatron_fsdp or job.training.torch_fsdp2
    if job.model.mtp_use_repeated_layer and fsdp:
        # workload_fsdp.py gathers each MTP layer's unit once; the FSDP hooks of the one
        # repeated layer run at every depth, not modelled
        raise ConfigError("workload does not run --mtp-use-repeated-layer under FSDP yet")
    refuse_dsa(job.model, "workload")
    refuse_latent_moe(job.model, "workload")
    modules = job.training.recompute_modules if job.training.recompute == "selective" else ()
    unpriced = [m for m in modules if (m in NOT_GEMMS or m == "mla_up_proj")
                and isinstance(compute, ComputeProfile)]
    if unpriced:
        # workload_tp.py `recompute`: a profile's sections hold the norms, the expert activation
        # and MLA's up projections inside attention's and the MLP's measured times
        raise ConfigError(
            f"--recompute-modules {' '.join(unpriced)}: workload cannot time this module's "
            "recomputation (docs/limits.md); `memory` measures it"
        )
    if job.training.optimizer == "dist_muon" or job.layout.num_distributed_optimizer_instances > 1:
        raise ConfigError(  # their collectives: the layer-wise all-gather, the instances' all-reduce
            "workload writes the data-parallel collectives of one optimizer instance, Adam's or "
            "Muon's without dist_muon; `memory` and `params` measure --optimizer dist_muon and "
            "--num-distributed-optimizer-instances"
        )
    schedule = job.schedule()
    settings = Settings(
        micro_batch_size=schedule.micro_batch_size,
        num_microbatches=schedule.num_microbatches,
        world_size=job.layout.world_size,
        distributed_optimizer=job.training.use_distributed_optimizer,
        recompute=job.training.recompute,
        recompute_modules=modules,
        learned_positions=job.model.position_embedding_type == "learned_absolute",
        flex=job.training.moe_token_dispatcher_type == "flex",
        sharding=_sharding(job.training),
    )
    mamba = mamba_shape(job.model) if job.model.hybrid else None
    return Context(job.dims(), job.layout, settings, compute, mamba)


def _sharding(training: Any) -> str | None:
    """Return the FSDP the job runs: a Megatron-FSDP strategy, `fsdp2` (torch's), None (DDP)."""
    if training.torch_fsdp2:
        return "fsdp2"
    return str(training.sharding_strategy) if training.megatron_fsdp else None


def compute_for(
    gpu_tflops: float | None, mfu: float | None, profile: str | None,
    gpu: str | None = None, dtype_name: str = "float32", fp8: bool = False,
) -> ComputeRate | ComputeProfile:
    """Return where compute times come from: FLOPs at the peak x --mfu, or a measured profile.

    The peak is --gpu-tflops, else the --gpu type's for the model's dtype (job/hardware.py);
    an fp8 job's Transformer Engine GEMMs run at the --gpu type's fp8 peak (not with --gpu-tflops,
    which gives one peak for everything).
    `profile` is the text of the --compute-profile file (None when not given).
    """
    from inspector.formulas.flops import check_mfu, check_peak

    if (gpu_tflops is None and gpu is None) == (profile is None):
        raise ConfigError(
            "workload needs compute times: --gpu or --gpu-tflops (FLOPs at that peak, "
            "estimates) or --compute-profile FILE (measured), one of them"
        )
    if profile is not None:
        if mfu is not None:
            raise ConfigError("--mfu scales --gpu-tflops; a --compute-profile is already measured")
        from inspector.report.simai import parse_compute_profile

        return ComputeProfile.from_sections(parse_compute_profile(profile))
    fp8_peak = None
    if gpu_tflops is None:
        from inspector.job.hardware import get_gpu

        gpu_tflops = get_gpu(str(gpu)).peak_tflops(dtype_name)
        fp8_peak = get_gpu(str(gpu)).tflops_fp8 if fp8 else None
    peak = float(gpu_tflops)
    check_peak(peak)
    if mfu is not None:
        check_mfu(mfu)
    return ComputeRate(peak, 1.0 if mfu is None else mfu, fp8_peak)


def kernel_rate(job: Any, gpu: Gpu) -> ComputeRate:
    """Return compute times at the efficiency a kernel table gives the job's layers (--kernels):
    their kernel seconds on one rank (formulas/ops.py, recomputation aside: the records add it
    from FLOPs) against Megatron-LM's FLOPs over tp x cp ranks at the GPU's 16-bit peak, as plan
    --efficiency prices a layer. Every record's FLOPs then take the time the table gives them on
    average over the model's layers."""
    from inspector.formulas.flops import layer_flops
    from inspector.formulas.ops import Shard, layer_ops, layer_seconds

    dims, lay, mbs = job.dims(), job.layout, job.schedule().micro_batch_size
    shard = Shard(lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.sequence_parallel, mbs)
    flops = seconds = 0.0
    for layer in range(dims.num_layers):
        flops += layer_flops(dims, layer, mbs).total / (lay.tp * lay.cp)
        seconds += layer_seconds(layer_ops(dims, shard, dims.is_moe_layer(layer)), gpu, "none")
    return ComputeRate(gpu.tflops_16bit, flops / (gpu.tflops_16bit * 1e12) / seconds)
