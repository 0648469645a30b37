"""`plan` for hybrid (Mamba) models: each layer kind's kernels and FLOPs, and what is searched.

megatron-core's MambaStack (HybridStack from 0.18) builds one module a layer, by the pattern's
symbol: `*` a TransformerLayer of attention alone, `-` of a dense MLP alone, `E` of an MoE MLP
alone, `M` a MambaLayer (norm fused into in_proj, MambaMixer, out_proj). The first three run
exactly the kernels of a GPT layer's attention half or MLP half (formulas/ops.py `layer_ops`,
cut at its pre-MLP norm: `_half`). A Mamba layer runs (ssm/mamba_mixer.py `_ssm_training`):
in_proj (Transformer Engine's LayerNormColumnParallelLinear), causal_conv1d over x, B and C,
Mamba-2's chunked scan (mamba_ssm `mamba_split_conv1d_scan_combined`), the gated RMSNorm and
out_proj. The scan has no measured kernel in the tables: its matrix products per chunk (Dao &
Gu 2024, "Transformers are SSMs", arXiv:2405.21060, Section 6: the chunks' C B^T, their states
B^T X, the diagonal blocks' (C B^T o L) X and the off-diagonal C states, in mamba_ssm's
ssd_bmm.py, ssd_chunk_state.py and ssd_chunk_scan.py) are priced as batched GEMMs of those
shapes from the GEMM table, its backward as two such products each, and the state passing
between chunks and the convolution as memory passes: an estimate (`SCAN_NOTE`, printed with
every hybrid plan), not a measurement.

Megatron-LM's FLOPs of a layer are `hybrid_flops`' terms (formulas/hybrid_flops.py) for every
kind. What the search leaves out for hybrid jobs, each refused by name when asked for
(`check_hybrid_plan`): full recomputation (megatron-core 0.16's MambaStack has no
checkpointed forward: `--recompute-granularity full` recomputes nothing there), the MoE
all-to-all overlap and the flex dispatcher, and splits megatron's stack does not make (its own
rules: `hybrid_splits`). Virtual pipeline stages are the pattern's `|` segments (megatron-core
0.17+: `hybrid_vpps`; megatron refuses them without `|`, every release). Context parallelism is
searched as megatron runs it (`context_time`): ring attention for `*` layers as cost.py prices a
GPT layer's, and for `M` layers MambaContextParallel's all-to-alls between the sequence split and
the head split (ssm/mamba_context_parallel.py `pre_conv_ssm` / `post_conv_ssm`), the scan then
running the whole sequence on heads / (tp x cp) (`_mamba_ops`); `G` and `D` layers with it are
refused as `memory` refuses them (job/gdn.py, job/dsa.py: megatron-core's own refusals named).
A `D` layer (DeepSeek sparse attention) is an MLA layer's attention half whose core attention is
formulas/dsa_ops.py's (the indexer, top-k and masked fp32 attention megatron runs). MTP
depths (`/`) are priced on the last stage as cost.py prices a GPT model's MTP layer, with the
MTP pattern's layers each by its kind (`mtp_depth_time`); `G` layers by plan/gdn_ops.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import inspector.caches as caches
from inspector.errors import ConfigError
from inspector.formulas.flops import layer_flops
from inspector.formulas.hybrid_flops import hybrid_layer_flops as layer_flops_of
from inspector.formulas.kernels import Gemm, Memory, Op
from inspector.formulas.ops import LayerOps, Shard, layer_ops, layer_seconds, linear
from inspector.job.dims import ModelDims
from inspector.job.dsa import check_dsa_layout, refuse_dsa
from inspector.job.gdn import GdnShape, validate_gdn
from inspector.job.hybrid_model import (
    LATER_SYMBOLS,
    LAYER_SYMBOLS,
    PIPE,
    MambaShape,
    layer_symbols,
    main_layers,
    pipe_segments,
)
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.job.versions import (
    hybrid_pattern_separators,
    hybrid_stage_sizes_read,
    megatron_version,
)
from inspector.plan.context import ring_attention
from inspector.plan.flex import moe_exchange
from inspector.plan.gdn_ops import GDN_NOTE, gdn_ops
from inspector.plan.kernel_seconds import compute_seconds, core_seconds
from inspector.plan.network import Network, collective

SCAN_NOTE = (
    "Mamba layers: the chunked scan of Mamba-2 has no measured kernel here; its matrix "
    "products per chunk are priced as batched GEMMs from the measured GEMM table, an estimate "
    "(docs/hybrid-models.md)"
)
PRICED = ("M", "*", "-", "E", "G", "D")  # the layer kinds plan prices (later kinds: +)
CHUNK = 128  # MambaMixer's chunk_size (ssm/mamba_mixer.py, core_v0.16.1 and 0.19.2)
CONV = 4  # MambaMixer's d_conv: the causal convolution's width


def estimate_notes(model: ModelConfig) -> list[str]:
    """Return the notes a plan prints for the kernels it estimates: the Mamba scan's (every
    hybrid plan), the gated delta rule's (GDN layers)."""
    return [SCAN_NOTE] * model.hybrid + [GDN_NOTE] * model.gdn


def check_hybrid_plan(model: ModelConfig, fixed: dict[str, Any], ep_overlap: bool, flex: bool,
                      recompute_modules: tuple[str, ...]) -> None:  # fmt: skip
    """Raise ConfigError for what `plan` does not search for a hybrid model (module docstring)."""
    if not model.hybrid:
        return
    others = sorted(set(layer_symbols(model)) - set(PRICED))  # ratios without a pattern: named there
    if others:
        named = ", ".join(f"{s} ({(LAYER_SYMBOLS.get(s) or LATER_SYMBOLS[s][0])})" for s in others)
        raise ConfigError(
            f"plan does not price the {named} layers of --hybrid-override-pattern yet (it "
            f"prices {', '.join(PRICED)}); memory measures them where megatron-core builds them"
        )
    _check_built(model, fixed)
    pin = fixed.get("pin", {})
    # megatron's stack reads --decoder-first/last-pipeline-num-layers only, from 0.16
    reads_split = hybrid_stage_sizes_read()
    unread = sorted(name for name in pin if not (name.startswith("decoder_") and reads_split))
    reasons = {
        "--recompute-granularity full": fixed.get("recompute") == "full" or "recompute_method" in fixed,
        "--overlap-moe-expert-parallel-comm": ep_overlap,
        "--moe-token-dispatcher-type flex": flex,
        f"--recompute-modules {' '.join(recompute_modules)}": recompute_modules != ("core_attn",),
        "--num-layers-per-virtual-pipeline-stage (the pattern's '|' set the virtual stages)":
            "layers_per_chunk" in fixed,
        **{"--" + name.replace("_", "-"): True for name in unread},
    }
    refused = [name for name, on in reasons.items() if on]
    if refused:
        raise ConfigError(
            f"plan does not search {refused[0]} for a hybrid (Mamba) model yet; memory "
            "measures such a layout"
        )


def check_dsa_plan(model: ModelConfig, efficiency: float | None) -> None:
    """Raise ConfigError for what plan does not price of DeepSeek sparse attention: the top-k
    shared across layers (job/dsa.py `refuse_dsa`), and --efficiency, which prices Megatron-LM's
    FLOPs: its formulas leave the indexer and the masked fp32 attention out (a hybrid D layer
    counts none, formulas/hybrid_flops.py)."""
    refuse_dsa(model, "plan")
    if model.dsa and efficiency is not None:
        raise ConfigError(
            f"--efficiency {efficiency} prices Megatron-LM's FLOPs, which leave DeepSeek sparse "
            "attention's indexer and its masked fp32 attention out (a hybrid D layer counts "
            "none): plan prices DSA from the kernel tables only"
        )


def _check_built(model: ModelConfig, fixed: dict[str, Any]) -> None:
    """Raise ConfigError, as `memory` does, for a fixed size megatron-core refuses for this
    pattern: virtual stages without `|` (job/hybrid_model.py), context parallelism with `G` or
    `D` layers (job/gdn.py, job/dsa.py name the releases)."""
    cp = fixed.get("cp") or 1
    validate_gdn(model, 1, cp)
    check_dsa_layout(model, cp)
    if (fixed.get("vpp") or 1) > 1 and not pinned_by_pattern(model):
        installed = ".".join(map(str, megatron_version()))
        raise ConfigError(
            f"--num-virtual-stages-per-pipeline-rank {fixed['vpp']}: megatron-core {installed} "
            "refuses virtual pipeline stages for a hybrid model without '|' in its "
            "--hybrid-layer-pattern (add '|' stage boundaries, megatron-core 0.17+)"
        )


def hybrid_splits(model: ModelConfig, pp: int, v: int) -> list[tuple[int, ...]]:
    """Return the splits megatron's stack makes of a hybrid model at pp x v virtual stages: the
    pattern's `|` segments, in virtual-stage order (megatron-core 0.17+ `select_pipeline_segment`:
    chunk c of pipeline rank r builds segment c x pp + r), else the even split (MambaStack
    `_select_layers_for_pipeline_parallel`: num_layers // pp each, no virtual stages)."""
    pattern = model.hybrid_override_pattern or ""
    main = pattern.split("/")[0]
    if pinned_by_pattern(model):
        segments = tuple(len(part) for part in main.split(PIPE))
        return [segments] if len(segments) == pp * v else []
    if v > 1:
        return []
    layers = len(main_layers(pattern)) if pattern else model.num_layers
    return [(layers // pp,) * pp] if layers % pp == 0 else []


def pinned_by_pattern(model: ModelConfig) -> bool:
    """Return whether the pattern's `|` place the layers (megatron then takes no split flags)."""
    pattern = (model.hybrid_override_pattern or "").split("/")[0]
    return model.hybrid and hybrid_pattern_separators() and PIPE in pattern


def pattern_stages(model: ModelConfig, pp: int) -> bool:
    """Return whether megatron takes --pp `pp` for the pattern's `|` segments: they divide among
    the stages, more segments than stages being virtual stages, which need pp > 1 (Megatron-LM's
    validate_args; job/hybrid_model.py)."""
    segments = pipe_segments(model.hybrid_override_pattern)
    return segments % pp == 0 and (pp > 1 or segments == 1)


def hybrid_vpp(model: ModelConfig, pp: int) -> int | None:
    """Return the virtual stages a rank gets from the pattern at --pp `pp` (Megatron-LM's
    validate_args: "Derive VPP from pipe segments in the pattern"), None for one."""
    v = pipe_segments(model.hybrid_override_pattern) // pp if pinned_by_pattern(model) else 1
    return v if v > 1 else None


def hybrid_vpps(model: ModelConfig, pp: int, given: int | None) -> list[int]:
    """Return the virtual pipeline sizes to search for a hybrid model at pp: the pattern's
    (`hybrid_vpp`), none if a given --num-virtual-stages-per-pipeline-rank differs."""
    v = hybrid_vpp(model, pp) or 1
    return [v] if given in (None, v) else []


def context_built(model: ModelConfig) -> bool:
    """Return whether the search tries context parallelism for a hybrid model: not with `G` or
    `D` layers (`_check_built`: megatron-core refuses them, or `memory` does not model them)."""
    return not (model.gdn or model.dsa)


@caches.memo(maxsize=1024)
def hybrid_kernels(dims: ModelDims, shard: Shard, symbol: str) -> LayerOps:
    """Return one hybrid layer's kernels on one rank for one micro-batch."""
    if symbol == "M":
        return _mamba_ops(dims, shard)
    if symbol == "G":
        return gdn_ops(dims, shard, _residual(dims, shard))
    gpt = layer_ops(_gpt_dims(dims, symbol), shard, symbol == "E")  # D: MLA with DSA's core
    return _half(gpt, symbol in "*D")


def hybrid_layer_flops(dims: ModelDims, symbol: str, sequences: int) -> float:
    """Return one layer's FLOPs, forward and backward, over `sequences` sequences, as
    Megatron-LM's hybrid formula counts them (formulas/hybrid_flops.py)."""
    return layer_flops_of(_sizes(dims.mamba, dims.gdn_shape()), dims, symbol, sequences)


@caches.memo(maxsize=64)
def _sizes(shape: MambaShape, gdn: GdnShape) -> ModelConfig:
    """Return the Mamba and GDN sizes as the model arguments Megatron-LM's formula reads."""
    return ModelConfig(mamba_state_dim=shape.state, mamba_head_dim=shape.d_inner // shape.heads,
                       mamba_num_groups=shape.groups, mamba_num_heads=shape.heads,
                       linear_num_key_heads=gdn.key_heads, linear_num_value_heads=gdn.value_heads,
                       linear_key_head_dim=gdn.key_dim, linear_value_head_dim=gdn.value_dim,
                       linear_conv_kernel_dim=gdn.conv_kernel)  # fmt: skip


def hybrid_layer_time(
    dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int, recompute: str, i: int,
    modules: tuple[str, ...], *overlap: Any,
) -> tuple[float, float, float, float]:
    """Return hybrid layer i's compute, TP, CP (`context_time`) and EP seconds for one
    micro-batch, as cost.py's `_layer_time` returns a GPT layer's (`overlap`: its MoE overlap
    terms, never set for a hybrid model): its kind's kernels, its module's 2 tensor-parallel
    collectives forward and 2 backward (an MoE layer's none with expert TP 1 and no shared
    experts, as cost.py counts a GPT layer's halves), its experts' exchange."""
    return symbol_time(dims, lay, net, rate, mbs, recompute, dims.layer_symbols[i], modules)


def mtp_depth_time(dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int,
                   recompute: str) -> tuple[float, ...]:  # fmt: skip
    """Return one MTP depth's layers' seconds, as `hybrid_layer_time` (HybridModel's
    MultiTokenPredictionLayer runs a HybridStack of the pattern after `/`)."""
    parts = [symbol_time(dims, lay, net, rate, mbs, recompute, s, ("core_attn",))
             for s in dims.mtp_symbols]  # fmt: skip
    return tuple(sum(column) for column in zip(*parts, strict=True))


def symbol_time(dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int, recompute: str,
                symbol: str, modules: tuple[str, ...]) -> tuple[float, float, float, float]:  # fmt: skip
    """Return the seconds of one layer of kind `symbol` (`hybrid_layer_time`)."""
    flops = hybrid_layer_flops(dims, symbol, mbs)
    if recompute == "selective" and "core_attn" in modules and symbol == "*":  # a third again
        flops += layer_flops(_gpt_dims(dims, symbol), 0, mbs).core_attention / 3
    shard = Shard(lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.sequence_parallel, mbs)
    compute = compute_seconds(flops, lambda d: layer_seconds(
        hybrid_kernels(dims, shard, symbol), d, recompute, modules), lay, net, rate)  # fmt: skip
    moe = symbol == "E"
    count = 0 if moe and not (dims.shared_expert_ffn or lay.expert_tp > 1) else 4
    tokens = dims.seq_length * mbs / lay.cp
    tensor = collective(count, tokens * dims.hidden_size, dims.activation_bytes, lay.tp,
                        net.tensor_link(lay))  # fmt: skip
    context = context_time(dims, lay, net, rate, mbs, recompute, symbol, modules)
    return compute, tensor, context, moe_exchange(dims, lay, net, tokens, False) if moe else 0.0


def context_time(dims: ModelDims, lay: Layout, net: Network, rate: float, mbs: int,
                 recompute: str, symbol: str, modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return a layer's exposed context-parallel seconds for one micro-batch: ring attention's
    for `*` (a GPT layer's, plan/context.py), MambaContextParallel's all-to-alls for `M`
    (`pre_conv_ssm`: z, x, B, C and dt one each, B and C repeated `group_repeat_count` times
    where a rank's groups are fewer than its cp ranks; `post_conv_ssm`: the scan's output;
    backward the same six the other way), none for MLP and MoE layers."""
    if lay.cp == 1 or symbol not in "*M":
        return 0.0
    tokens = dims.seq_length * mbs / lay.cp
    if symbol == "*":
        gpt = _gpt_dims(dims, symbol)
        shard = Shard(lay.tp, lay.cp, lay.ep, lay.expert_tp, lay.sequence_parallel, mbs)
        attention = compute_seconds(layer_flops(gpt, 0, mbs).core_attention,  # 3 forwards' worth
                                    lambda d: 3 * core_seconds(gpt, shard, False, d), lay, net, rate)
        forwards = 2 if recompute == "selective" and "core_attn" in modules else 1
        return ring_attention(gpt, lay, net, tokens, attention, forwards)
    shape = dims.mamba
    repeat = max(1, lay.cp * lay.tp // shape.groups)  # mamba_context_parallel.py __init__
    width = shape.in_width + 2 * shape.groups * shape.state * (repeat - 1) + shape.d_inner
    alpha, bandwidth = net.link(lay.tp * lay.cp)  # the cp group strides over tp ranks
    moved = tokens * width / lay.tp * dims.activation_bytes * (lay.cp - 1) / lay.cp
    return 2 * (6 * alpha + moved / bandwidth)


@caches.memo(maxsize=256)
def _gpt_dims(dims: ModelDims, symbol: str) -> ModelDims:
    """Return the dims a GPT layer of this kind is priced with: MoE only for `E`."""
    plain = replace(dims, layer_symbols="", mamba=None)
    return plain if symbol == "E" else replace(plain, num_experts=None)


def _half(ops: LayerOps, attention: bool) -> LayerOps:
    """Return a GPT layer's attention half (input norm to its bias-dropout-add) or MLP half
    (pre-MLP norm on): formulas/ops.py `layer_ops` adds them in that order, forward and, kept
    reversed, backward."""
    cut_f = next(k for k, op in enumerate(ops.forward) if op.name == "pre-MLP norm")
    cut_b = next(k for k, op in enumerate(ops.backward) if op.name == "pre-MLP norm backward")
    if attention:
        core = dict(ops.modules).get("core_attn", ())
        return LayerOps(ops.forward[:cut_f], ops.backward[cut_b + 1:], ops.core,
                        (("core_attn", core),))  # fmt: skip
    return LayerOps(ops.forward[cut_f:], ops.backward[: cut_b + 1], ())


def _residual(dims: ModelDims, z: Shard) -> tuple[list[Op], list[Op], list[Op], list[Op]]:
    """Return a layer's input norm and residual add, forward and backward (a GPT layer's)."""
    residual = _half(layer_ops(_gpt_dims(dims, "-"), z, False), True)
    add_f = [op for op in residual.forward if "bias-dropout-add" in op.name]
    add_b = [op for op in residual.backward if "bias-dropout-add" in op.name]
    return list(residual.forward[:1]), add_f, list(residual.backward[-1:]), add_b


@caches.memo(maxsize=256)
def gdn_layer_ops(dims: ModelDims, shard: Shard, moe: bool) -> LayerOps:
    """Return a GPT layer's kernels whose mixer is a gated delta net (`--experimental-attention-
    variant gated_delta_net`): the GDN's (plan/gdn_ops.py), then the layer's MLP half."""
    mlp = _half(layer_ops(dims, shard, moe), False)
    gdn = gdn_ops(dims, shard, _residual(dims, shard))
    return LayerOps(gdn.forward + mlp.forward, mlp.backward + gdn.backward, ())


def _mamba_ops(dims: ModelDims, z: Shard) -> LayerOps:
    """Return a Mamba layer's kernels (module docstring), on one rank for one micro-batch."""
    shape, act, h = dims.mamba, dims.activation_bytes, dims.hidden_size
    tokens = dims.seq_length * z.micro_batch // z.cp
    # with cp the convolution and scan run the whole sequence on heads / (tp x cp)
    # (MambaContextParallel; groups repeated to one a rank where fewer: ngroups_local_tpcp)
    whole, ranks, d = tokens * z.cp, z.tp * z.cp, shape.d_inner // z.tp
    heads, groups = shape.heads // ranks, max(1, shape.groups // ranks)
    head_dim, n, chunks = shape.d_inner // shape.heads, shape.state, -(-whole // CHUNK)
    fp8 = dims.fp8 is not None
    norm_f, add_f, norm_b, add_b = _residual(dims, z)
    in_proj = linear("in_proj", tokens, h, shape.in_width // z.tp, fp8=fp8)
    out_proj = linear("out_proj", tokens, d, h, fp8=fp8)
    conv = whole * (d // z.cp + 2 * groups * n)  # x, B and C: the convolution's channels here
    # the chunk products (ssd_bmm.py C B^T per group; ssd_chunk_state.py B^T X, ssd_chunk_scan.py
    # (C B^T o L) X and C states per head), as batched GEMMs
    products = [Gemm("ssd C B^T", CHUNK, CHUNK, n, "fwd", chunks * groups),
                Gemm("ssd chunk states", n, head_dim, CHUNK, "fwd", chunks * heads),
                Gemm("ssd diagonal blocks", CHUNK, head_dim, CHUNK, "fwd", chunks * heads),
                Gemm("ssd off-diagonal blocks", CHUNK, head_dim, n, "fwd", chunks * heads)]
    states = chunks * heads * head_dim * n  # fp32 states passed from chunk to chunk
    forward: list[Op] = [
        *norm_f, in_proj[0],
        Memory("conv1d", "copy", conv, 2 * act + act * CONV / tokens),
        *products, Memory("ssd state passing", "copy", states, 8),
        Memory("gated norm", "rms_norm", tokens * d, 3 * act), out_proj[0], *add_f,
    ]
    backward: list[Op] = [
        *add_b, *out_proj[1:], Memory("gated norm backward", "rms_norm", tokens * d, 5 * act),
        Memory("ssd state passing backward", "copy", states, 16),
        *(replace(g, name=g.name + " " + o, orient=o) for g in products for o in ("dgrad", "wgrad")),
        Memory("conv1d backward", "copy", conv, 3 * act), *in_proj[1:], *norm_b,
    ]
    return LayerOps(tuple(forward), tuple(backward), ())
