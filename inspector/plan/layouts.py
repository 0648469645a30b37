"""The layouts a search tries: parallel sizes that divide the GPUs and batch, splits, vpp.

Each size follows Megatron-LM's rules: tp a power of two within a node dividing the heads and
query groups, cp only with Transformer Engine's flash attention and a sequence it cuts in 2c
chunks, pp up to the layers, dp dividing the global batch, ep dividing the experts. Per pipeline
size the layer split comes from the even and accounted splits and split.balance on time alone;
`layout_for` turns a split into the Layout megatron would get from its flags.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import inspector.caches as caches
from inspector.job.dsa import absorbed
from inspector.job.gdn import gdn_shape
from inspector.job.layout import Layout
from inspector.job.model import ModelConfig
from inspector.job.pipeline_layout import expand_layout
from inspector.job.versions import fsdp_with_pipeline, mtp_in_layouts
from inspector.plan.hybrid import (
    context_built,
    hybrid_splits,
    hybrid_vpps,
    pattern_stages,
    pinned_by_pattern,
)
from inspector.plan.request import Request, divisors, expert_biases
from inspector.plan.split import (
    Split,
    accounted_split,
    balance,
    even_split,
    pinned_split,
    split_flags,
)


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if (1 << k) <= limit]


def _tp_choices(req: Request) -> list[int]:
    m, gdn = req.model, gdn_shape(req.model)
    if "tp" in req.fixed:
        return [req.fixed["tp"]]
    return [
        t for t in _powers(req.gpus_per_node)
        if m.num_attention_heads % t == 0 and m.query_groups % t == 0 and req.gpus % t == 0
        and (m.padded_vocab_size or 0) % t == 0  # a given --padded-vocab-size splits evenly
        and not (m.gdn and (gdn.key_heads % t or gdn.value_heads % t))  # GatedDeltaNet's heads
    ]


def _cp_choices(req: Request, tp: int) -> list[int]:
    if "cp" in req.fixed:
        return [req.fixed["cp"]]
    m = req.model
    if m.transformer_impl != "transformer_engine" or not req.flash:
        return [1]
    if m.dsa or m.hybrid and not context_built(m):  # G or D layers (plan/hybrid.py)
        return [1]
    return [c for c in _powers(req.gpus // tp) if c == 1 or m.seq_length % (2 * c) == 0][:4]


def _expert_choices(req: Request, tp: int, cp: int, dp: int) -> list[tuple[int, int | None]]:
    experts = req.model.num_experts
    if experts is None:
        return [(1, None)]
    eps = [req.fixed["ep"]] if "ep" in req.fixed else [
        e for e in divisors(experts) if experts // e <= req.local_experts_cap
    ]
    etps = [req.fixed["etp"]] if "etp" in req.fixed else sorted({1, tp})
    if expert_biases(req.model):  # megatron-core refuses them at expert tp > 1
        etps = [t for t in etps if t == 1]
    return [
        (e, None if t == tp else t)
        for e in eps for t in etps if (tp * cp * dp) % (e * t) == 0
    ]


def layouts(req: Request) -> Iterator[Layout]:
    """Yield every parallel size combination (no split yet) that divides the GPUs and batch."""
    m = req.model
    sp_ok = m.transformer_impl == "transformer_engine" or m.use_apex
    for tp in _tp_choices(req):
        for cp in _cp_choices(req, tp):
            if req.gpus % (tp * cp):
                continue
            pps = [req.fixed["pp"]] if "pp" in req.fixed else divisors(req.gpus // (tp * cp))
            if pinned_by_pattern(m):  # `|` segments: stages and virtual stages (plan/hybrid.py)
                pps = [p for p in pps if pattern_stages(m, p)]
            for pp in pps:
                if pp > m.num_layers or req.gpus % (tp * cp * pp):
                    continue
                dp = req.gpus // (tp * cp * pp)
                if req.global_batch_size % dp:
                    continue
                for ep, etp in _expert_choices(req, tp, cp, dp):
                    # --sequence-parallel as given (Megatron-LM turns it off at tp 1), else on
                    sp = tp > 1 and req.fixed.get("sp", sp_ok)
                    if sp and (m.seq_length // cp) % tp:  # job.checks.check_sequence_split
                        if "sp" in req.fixed:
                            continue
                        sp = False  # megatron's first forward cannot split these tokens over tp
                    # MoE; megatron-core 0.19's AbsorbedMLA (DSA) asserts SP above tp 1
                    if (m.num_experts is not None or m.dsa and absorbed()) and tp > 1 and not sp:
                        continue
                    yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, sequence_parallel=sp)


def vpp_choices(req: Request, pp: int, m: int) -> list[int]:
    pinned = _pinned_vpp(req, pp)
    if pinned is not None:
        return pinned
    if req.model.hybrid:  # a hybrid stack: its pattern's virtual stages (plan/hybrid.py)
        return hybrid_vpps(req.model, pp, req.fixed.get("vpp"))
    if "vpp" in req.fixed:
        return [req.fixed["vpp"]]
    if pp == 1:
        return [1]
    out = [1]
    for v in (2, 3, 4, 6, 8):
        # + 2: an accounted split may leave the embedding (output layer) a chunk of its own
        if req.model.num_layers + 2 >= pp * v and m % pp == 0 and m >= pp:
            out.append(v)
    return out


def _pinned_vpp(req: Request, pp: int) -> list[int] | None:
    """Return the virtual pipeline size a pinned layout string or layers per chunk gives."""
    pin = req.fixed.get("pin", {})
    if "pipeline_model_parallel_layout" in pin:
        stages = len(expand_layout(pin["pipeline_model_parallel_layout"]))
        # megatron-core's schedule without pipelining refuses more than one model chunk
        return [stages // pp] if stages % pp == 0 and (pp > 1 or stages == 1) else []
    per_chunk = req.fixed.get("layers_per_chunk")
    if per_chunk is None:
        return None
    # Megatron-LM: (layers per stage) // (layers per virtual stage), with pp > 1
    v = (req.model.num_layers // pp) // per_chunk
    return [v] if pp > 1 and v >= 1 else []


def layout_for(
    lay: Layout, model: ModelConfig, split: Split, vpp: int, pin: tuple[Any, ...] = ()
) -> Layout | None:
    """Return the Layout megatron would get from the split's flags (None if they are invalid).

    `pin`: the user's own split flags, (name, value) pairs, kept as given.
    """
    if pinned_by_pattern(model):  # the pattern's `|` place the layers, no flag does
        return replace(lay, vpp=vpp if vpp > 1 else None)
    return _layout_for(lay, model.num_layers, model.mtp_num_layers or 0, split, vpp, pin)


@caches.memo(maxsize=65536)
def _layout_for(
    lay: Layout, num_layers: int, mtp: int, split: Split, vpp: int, pin: tuple[Any, ...]
) -> Layout | None:
    flags = dict(pin) if pin else split_flags(split, num_layers, lay.pp, vpp, mtp)
    if mtp and "pipeline_model_parallel_layout" in flags and not mtp_in_layouts():
        return None
    values: dict[str, Any] = {"vpp": vpp if vpp > 1 else None}
    for name, value in flags.items():
        if name == "num_virtual_stages_per_pipeline_rank":
            continue
        values[name] = value
    if "pipeline_model_parallel_layout" in flags:
        values["vpp"] = vpp if vpp > 1 else None
    return replace(lay, **values)


def splits(req: Request, lay: Layout, v: int, first: float, last: float) -> list[Split]:
    layers, stages = req.model.num_layers, lay.pp * v
    found: list[Split] = []
    if "split" in req.fixed:
        return [req.fixed["split"]]
    if req.model.hybrid and "pin" not in req.fixed:  # megatron's stack splits by its own rules
        return hybrid_splits(req.model, lay.pp, v)
    if "pin" in req.fixed:
        pinned = pinned_split(req.fixed["pin"], layers, lay.pp, v)
        return [pinned] if pinned is not None else []
    if "layers_per_chunk" in req.fixed:  # Megatron-LM: every chunk that many layers
        even = even_split(layers, stages)
        return [even] if even is not None and even[0] == req.fixed["layers_per_chunk"] else []
    for candidate in (
        even_split(layers, stages),
        accounted_split(layers, stages, True, True),
        balance(layers, stages, round(first, 2), round(last, 2)),
    ):
        if candidate is not None and candidate not in found:
            found.append(candidate)
    return found


# Megatron-FSDP strategies the plan tries under --use-megatron-fsdp without a strategy: gradients
# and optimizer sharded (what Llama 3's sharded fp32 gradients are), and everything sharded
FSDP_STRATEGIES = ("optim_grads", "optim_grads_params")
SEARCH_FSDP = "fsdp"  # req.fixed["distopt"]: --use-megatron-fsdp, its strategy searched


def distopts(req: Request, base: Layout) -> list[bool | str]:
    """Return the optimizer choices to try: distributed optimizer on, off, or FSDP strategies."""
    fixed = req.fixed.get("distopt")
    if isinstance(fixed, str) and base.pp > 1 and not fsdp_with_pipeline():
        return []  # megatron-core 0.14-0.19's Megatron-FSDP cannot run pp > 1 (job/fsdp.py)
    if fixed == SEARCH_FSDP:
        return list(FSDP_STRATEGIES) if base.dp * base.cp > 1 else [FSDP_STRATEGIES[-1]]
    if fixed is not None:
        return [fixed]
    return [True, False] if base.dp * base.cp > 1 else [False]


@caches.memo(maxsize=4096)
def unsplit_layout(lay: Layout) -> Layout:
    """Return the layout less how its pipeline is split (virtual stages, first / last stage
    layers, a layout string): a stage's time reads none of them, only its own layers."""
    return replace(lay, vpp=None, decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None,
                   account_for_embedding_in_pipeline_split=False,
                   account_for_loss_in_pipeline_split=False,
                   pipeline_model_parallel_layout=None)
