"""The parameters of each piece a pipeline stage can hold, read off two small megatron builds.

The planner (memory/compose/pieces.py) composes any stage of any layout from these pieces: the embedding
(first stage), one transformer layer of each kind, and the final norm, output layer and MTP block
(last stage). A piece's local shapes depend only on (tp, ep, expert-tp, dtype, spec), never on
pp, dp or cp, so two builds serve every layout of a key: two layers on two pipeline stages, and
one layer on one stage (where a tied output layer has no weight of its own). The result is plain
records: megatron's parameter names, each parameter's numel and dtype, and the flags megatron's
DistributedDataParallel places it by (`allreduce`, `shared_embedding`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from inspector.job.job import Job, Training
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig


@dataclass(frozen=True)
class Param:
    """One parameter as megatron's DDP sees it: size, dtype, and the flags that place it."""

    numel: int
    dtype: Any  # torch.dtype
    expert: bool  # allreduce=False: an expert-parallel buffer
    shared_embedding: bool
    fp8: bool = False  # a Transformer Engine fp8 parameter (--fp8-param-gather)
    kept: int = 0  # bytes Transformer Engine keeps beside it (te/float8_tensor.py kept_bytes)
    mxfp8: bool = False  # an MXFP8Tensor (te/mxfp8_tensor.py): its buffer shares the grad buffer
    nvfp4: bool = False  # an NVFP4Tensor (te/nvfp4_tensor.py): packed in its param buffer

    @property
    def buffer_dtype(self) -> Any:
        """Return the dtype of DDP's param buffer holding it: uint8 for an fp8 parameter
        (distributed_data_parallel.py: "it is necessary to use torch.uint8, not the fake dtype")."""
        if not self.fp8:
            return self.dtype
        import torch

        return torch.uint8


Named = tuple[tuple[str, Param], ...]  # megatron's parameter names, and their Params, in order


@dataclass(frozen=True)
class Built:
    """Each piece's named parameters, as the small builds gave them.

    `layers` maps a layer's kind (True: an MoE MLP; a hybrid layer's pattern symbol) to its
    parameters. `output` is the last
    stage's final norm, output layer and MTP block with pp > 1, and `output_embedding` the
    embedding megatron also builds there for MTP (empty without MTP); `embedding_alone` and
    `output_alone` the same pieces with pp == 1 (a tied output layer then reuses the embedding's
    weight). `grad_dtype`: the gradient buffers' dtype.
    """

    embedding: Named
    embedding_alone: Named
    layers: dict[bool | str, Named]
    output_embedding: Named
    output: Named
    output_alone: Named
    grad_dtype: Any

    def parts(self) -> list[Named]:
        """Return every piece's parameters."""
        return [self.embedding, self.embedding_alone, *self.layers.values(),
                self.output_embedding, self.output, self.output_alone]


def build_pieces(job: Job) -> Built:
    """Build two small models (2 layers on 2 stages, 1 layer on 1 stage) and cut them in pieces,
    on the job's GPU (setup.py `on_job_gpu`)."""
    from inspector.world.setup import on_job_gpu

    with on_job_gpu(job.device):
        return _build_pieces(job)


def _build_pieces(job: Job) -> Built:
    model = job.model
    if model.hybrid:
        return _hybrid_pieces(job)
    if model.gdn:
        return _gdn_pieces(job)
    kinds = {model.is_moe_layer(i) for i in range(model.num_layers)}
    two, one = _small_jobs(job, kinds)
    stage_0, stage_1 = _first_chunks(two)
    first = _split(_params_of(stage_0))
    last = _split(_params_of(stage_1))
    alone = _split(_params_of(_first_chunks(one)[0]))
    return Built(
        embedding=first[0],
        embedding_alone=alone[0],
        layers={kind: first[1] if kind == two.model.is_moe_layer(0) else last[1] for kind in kinds},
        output_embedding=last[0],
        output=last[2],
        output_alone=alone[2],
        grad_dtype=_grad_dtype(first[1][0][1].dtype, job.training.fp32_grads),
    )


def _hybrid_pieces(job: Job) -> Built:
    """Build a hybrid model's pieces: its layer kinds once on each of two stages (the pattern
    of each distinct symbol, twice, split evenly by megatron's MambaStack), and once on one."""
    from inspector.job.hybrid_model import layer_symbols

    kinds = "".join(dict.fromkeys(layer_symbols(job.model)))
    pattern = job.model.hybrid_override_pattern or ""
    mtp = pattern[pattern.index("/"):] if "/" in pattern else ""  # the MTP depths, with the loss
    small = replace(job.model, num_layers=2 * len(kinds), hybrid_override_pattern=kinds * 2 + mtp,
                    hybrid_attention_ratio=None, hybrid_mlp_ratio=None,
                    mtp_num_layers=job.model.mtp_num_layers if mtp else None)
    one = replace(small, num_layers=len(kinds), hybrid_override_pattern=kinds + mtp)
    return _kinds_built(job, small, one, list(kinds))


def _kinds_built(job: Job, two_stages: ModelConfig, one_stage: ModelConfig, kinds: list[str]) -> Built:
    """Build `two_stages` (each kind once a stage) on 2 stages and `one_stage` on 1, and cut
    them in pieces, a layer a kind."""
    lay = job.layout
    two = Job(two_stages, Layout(tp=lay.tp, pp=2, dp=lay.ep * lay.expert_tp, ep=lay.ep,
                                 etp=lay.etp, sequence_parallel=lay.sequence_parallel),
              Training(micro_batch_size=1))  # fmt: skip
    one = Job(one_stage, replace(two.layout, pp=1), two.training)
    stage_0, stage_1 = _first_chunks(two)
    first, last = _split(_params_of(stage_0)), _split(_params_of(stage_1))
    alone = _split(_params_of(_first_chunks(one)[0]))
    return Built(
        embedding=first[0],
        embedding_alone=alone[0],
        layers=dict(zip(list[bool | str](kinds), _by_layer(first[1]), strict=True)),
        output_embedding=last[0],
        output=last[2],
        output_alone=alone[2],
        grad_dtype=_grad_dtype(first[1][0][1].dtype, job.training.fp32_grads),
    )


def _gdn_pieces(job: Job) -> Built:
    """Build a GPT model with gated delta nets in pieces: each layer kind (mixer and MLP,
    `gpt_kind`) once on each of two stages, the model's last layer's kind last (megatron builds
    the MTP block with the last layer's spec), and once on one stage."""
    from inspector.job.hybrid_model import layer_kinds

    every = [str(kind) for kind in layer_kinds(job.model)]  # gpt_kind's: "GE", "*-", ...
    kinds = [k for k in dict.fromkeys(every) if k != every[-1]] + [every[-1]]
    gdn, moe = tuple(int(k[0] == "G") for k in kinds), tuple(int(k[1] == "E") for k in kinds)
    experts = job.model.num_experts is not None

    def small_model(times: int) -> ModelConfig:
        return replace(job.model, num_layers=times * len(kinds), linear_attention_freq=gdn * times,
                       moe_layer_freq=moe * times if experts else job.model.moe_layer_freq)  # fmt: skip

    return _kinds_built(job, small_model(2), small_model(1), kinds)


def _by_layer(named: Named) -> list[Named]:
    """Return the decoder's parameters cut layer by layer (`decoder.layers.{i}.`), in order."""
    out: dict[str, list[tuple[str, Param]]] = {}
    for item in named:
        out.setdefault(item[0].split(".")[2], []).append(item)
    return [tuple(each) for each in out.values()]


def _small_jobs(job: Job, kinds: set[bool]) -> tuple[Job, Job]:
    """Return the job's model with 2 layers on 2 stages, and with 1 layer on 1 stage."""
    lay, model = job.layout, job.model
    dp = lay.ep * lay.expert_tp  # any dp megatron accepts; dp changes no shape
    small = _small_model(model, kinds)
    two = Job(
        small,
        Layout(tp=lay.tp, pp=2, dp=dp, ep=lay.ep, etp=lay.etp, sequence_parallel=lay.sequence_parallel),
        Training(micro_batch_size=1),
    )
    small_one = replace(small, num_layers=1)
    if model.num_experts is not None:
        # the last layer's kind: megatron builds the MTP block (output_alone) with the last
        # layer's spec (get_gpt_mtp_block_spec: the decoder's last layer spec)
        small_one = replace(small_one, moe_layer_freq=small.moe_layer_freq[-1:])  # type: ignore[index]
    return two, Job(small_one, replace(two.layout, pp=1), two.training)


def _small_model(model: ModelConfig, kinds: set[bool]) -> ModelConfig:
    """Return the model with two layers, of the kinds the pieces need."""
    small = replace(model, num_layers=2)
    if model.num_experts is not None:
        # stage 1's layer is of the model's last layer's kind (megatron builds an MTP block with
        # the last layer's spec); where the model mixes kinds, stage 0's is the other one
        tail = int(model.is_moe_layer(model.num_layers - 1))
        small = replace(small, moe_layer_freq=(1 - tail if len(kinds) == 2 else tail, tail))
    return small


def _grad_dtype(param_dtype: Any, fp32_grads: bool | None) -> Any:
    """Return the gradient buffers' dtype (ddp.py: megatron's default grad_reduce_in_fp32 = bf16)."""
    from inspector.world.stage import megatron

    megatron()
    import torch

    fp32 = param_dtype == torch.bfloat16 if fp32_grads is None else fp32_grads
    return torch.float32 if fp32 else param_dtype


def _params_of(module: Any) -> list[tuple[str, Param]]:
    """Return (name, Param) for every parameter with a gradient, in named_parameters() order."""
    from megatron.core.fp8_utils import is_float8tensor, is_mxfp8tensor

    from inspector.world.te.float8_tensor import kept_bytes
    from inspector.world.te.nvfp4_tensor import NVFP4Tensor

    out = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        expert = not getattr(p, "allreduce", True)
        shared = bool(getattr(p, "shared_embedding", False))
        fp8 = is_float8tensor(p)
        mx, nv = is_mxfp8tensor(p), isinstance(p, NVFP4Tensor)
        out.append((name, Param(p.numel(), p.dtype, expert, shared, fp8, kept_bytes(p), mx, nv)))
    return out


def _split(named: list[tuple[str, Param]]) -> tuple[Named, Named, Named]:
    """Split a stage's parameters into embedding, decoder layers and final norm / output."""
    head, layers, tail = [], [], []
    for item in named:
        if item[0].startswith("embedding."):
            head.append(item)
        elif item[0].startswith("decoder.layers."):
            layers.append(item)
        else:
            tail.append(item)
    return tuple(head), tuple(layers), tuple(tail)


def _first_chunks(job: Job) -> list[Any]:
    """Return each stage's GPTModel as megatron builds it on expert rank 0 (no checkpoint view)."""
    from inspector.world.stage import build_stage

    return [
        build_stage(job.model, job.layout, stage, 0, checkpoint=False)[0].module
        for stage in range(job.layout.pp)
    ]
