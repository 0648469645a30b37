"""Transformer Engine's userbuffers (`--tp-comm-overlap`): each tensor-parallel collective of a
layer's linears runs beside the GEMM that feeds or drains it, as TE overlaps them by default.

Megatron-LM's `_initialize_tp_communicators` (training/initialize.py) calls TE's `initialize_ub`
with the `--tp-comm-overlap-cfg` file's settings, or none; the defaults are priced here (the file
is not read). TE's defaults (transformer_engine/pytorch/module/base.py `initialize_ub`,
`methods` and `get_default_config`, TransformerEngine d0067d0), per linear and pass:

- ring_exchange, an all-gather (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad): the GEMM in tp
  chunks, the next chunk sent by the copy engines (`use_ce`) while one multiplies, on every SM
  (`set_sm_margin` off): the pair takes (tp - 1) max(g / tp, c / (tp - 1)) + g / tp, so
  max(0, c - g (tp - 1) / tp) beyond the GEMM;
- pipeline, a reduce-scatter (proj_fprop, fc2_fprop): the GEMM in 4 splits (`num_splits`) on the
  SMs less the 16 its communication kernel takes (`num_sm`, `set_sm_margin`: common/
  comm_gemm_overlap/comm_gemm_overlap.cpp `_math_sms = sm_count - num_comm_sm`), each split's
  reduce-scatter beside the next split's GEMM: max(g', c) + min(g', c) / 4, g' = g x SMs /
  (SMs - 16);
- bulk (qkv_dgrad and fc1_dgrad: the input's all-gather for the weight gradient beside the data
  gradient's GEMM; qkv_wgrad and fc1_wgrad: the data gradient's reduce-scatter beside the weight
  gradient's GEMM): all of it beside all of the GEMM on the SMs less 16: max(g', c);
- external (proj_wgrad, fc2_wgrad): no collective of their own.

g is the GEMM's seconds on the whole GPU (the compute term has it), c the collective's
(network.collective, [tokens, h] on the tensor-parallel link; the all-gathers' buffers in fp8
under an fp8 recipe, `fp8_buf` for `layers_all_gather_overlap`), and what a pair takes beyond g
is its exposed time. The layers TE registers buffers for are GPT attention's QKV and output
projections and a dense MLP's fc1 and fc2; an MoE layer's MLP collectives (shared experts,
expert tensor parallelism) are priced as without the overlap (cost.py `_tensor_time` prices
the collectives the pairs leave, `covered` counts those they take).
"""

from __future__ import annotations

from inspector.formulas.kernels import Gemm
from inspector.formulas.ops import Shard
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout
from inspector.plan.kernel_seconds import gemm_seconds, layer_kernels
from inspector.plan.network import Network, collective

COMM_SMS = 16  # get_default_config "num_sm" of the pipeline and bulk methods
PIPELINE_SPLITS = 4  # get_default_config "num_splits" of the pipeline method
# the column-parallel linears whose weight-gradient gathers are bulk pairs (BACKWARD)
GATHERED = ("QKV", "MLP fc1")
# (TE's name, its method, the layer's GEMM it runs beside, whether it gathers), per pass
FORWARD = (("qkv_fprop", "ring_exchange", "QKV", True),
           ("proj_fprop", "pipeline", "attention output", False),
           ("fc1_fprop", "ring_exchange", "MLP fc1", True),
           ("fc2_fprop", "pipeline", "MLP fc2", False))  # fmt: skip
BACKWARD = (("proj_dgrad", "ring_exchange", "attention output dgrad", True),
            ("qkv_dgrad", "bulk", "QKV dgrad", True),
            ("qkv_wgrad", "bulk", "QKV wgrad", False),
            ("fc2_dgrad", "ring_exchange", "MLP fc2 dgrad", True),
            ("fc1_dgrad", "bulk", "MLP fc1 dgrad", True),
            ("fc1_wgrad", "bulk", "MLP fc1 wgrad", False))  # fmt: skip


def overlapped(dims: ModelDims, lay: Layout, gdn: bool) -> bool:
    """Return whether the layer's tensor-parallel collectives run in TE's userbuffers: the job
    asks for it (Megatron-LM then has sequence parallelism and TE: job/tp_overlap.py) on a GPT
    attention layer (not multi-latent attention, a gated delta net or a hybrid model's)."""
    return (dims.tp_comm_overlap and lay.tp > 1 and lay.sequence_parallel and dims.te_attention
            and not dims.multi_latent_attention and not gdn and not dims.layer_symbols)  # fmt: skip


def pair_seconds(method: str, gemm: float, comm: float, tp: int, sms: int) -> float:
    """Return what one overlapped pair takes beyond its GEMM's `gemm` seconds (module docstring)."""
    if method == "ring_exchange":
        return max(0.0, comm - gemm * (tp - 1) / tp)
    slowed = gemm * sms / (sms - COMM_SMS)
    extra = min(slowed, comm) / PIPELINE_SPLITS if method == "pipeline" else 0.0
    return max(slowed, comm) + extra - gemm


def userbuffers_seconds(dims: ModelDims, lay: Layout, net: Network, shard: Shard, moe: bool,
                        rate: float, recompute: str, modules: tuple[str, ...]) -> float:  # fmt: skip
    """Return the exposed seconds of a layer's overlapped pairs for one micro-batch (its dense
    MLP's too; an MoE layer's MLP is not overlapped): the forward's once, again where the forward
    runs again (full recomputation; a dense MLP's under `--recompute-modules mlp`), the
    backward's once. `rate`: --efficiency's FLOP/s, else the kernel tables price each GEMM."""
    ops = layer_kernels(dims, shard, moe)
    gemms = {op.name: op for op in (*ops.forward, *ops.backward) if isinstance(op, Gemm)}
    tokens = dims.seq_length * shard.micro_batch // shard.cp
    gathered = 1 if dims.fp8 is not None else dims.activation_bytes  # `fp8_buf`
    link, sms = net.tensor_link(lay), net.gpu.sms or 132  # H100's where no count is cited

    def exposed(pairs: tuple[tuple[str, str, str, bool], ...]) -> float:
        total = 0.0
        for _, method, name, gathers in pairs:
            gemm = gemms.get(name)
            if gemm is None:  # an MoE layer's MLP
                continue
            seconds = gemm_seconds(gemm, net.gpu, rate)
            comm = collective(1, tokens * dims.hidden_size,
                              gathered if gathers else dims.activation_bytes, lay.tp, link)
            total += pair_seconds(method, seconds, comm, lay.tp, sms)
        return total

    forward = exposed(FORWARD)
    again = forward if recompute == "full" else 0.0
    if recompute == "selective" and "mlp" in modules and not moe:
        again = exposed(FORWARD[2:])
    return forward + again + exposed(BACKWARD)


def covered(moe: bool, recompute: str, modules: tuple[str, ...]) -> int:
    """Return how many of a layer's tensor-parallel collectives (cost.py's count, the weight
    gradients' gathers apart) run in pairs: attention's 2 a pass and a dense MLP's 2, the
    forward's again under full recomputation, a dense MLP's under `--recompute-modules mlp`."""
    each = 2 if moe else 4
    runs = 3 if recompute == "full" else 2
    return each * runs + (2 if recompute == "selective" and "mlp" in modules and not moe else 0)


def paired(dims: ModelDims, lay: Layout, net: Network, shard: Shard, moe: bool, gdn: bool, rate: float,
           recompute: str, modules: tuple[str, ...]) -> tuple[float, int]:  # fmt: skip
    """Return what a layer's overlapped pairs take for one micro-batch (`userbuffers_seconds`)
    and how many of its collectives they are (`covered`); nothing where it is not `overlapped`."""
    if not overlapped(dims, lay, gdn):
        return 0.0, 0
    return (userbuffers_seconds(dims, lay, net, shard, moe, rate, recompute, modules),
            covered(moe, recompute, modules))
