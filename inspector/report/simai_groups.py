"""Which of SimAI's four groups carries each of megatron's collectives, and what SimAI cannot hold.

SimAI-Analytical (aliyun/SimAI HEAD cef83f9d, astra-sim/workload/Layer.cc 565-582) sizes its
groups from the header alone: TP = `model_parallel_NPU_group`, EP = `ep`, DP =
all_gpus / (tp pp) = cp dp, and DP_EP = DP / ep in integer division. A collective whose group
holds one rank (or zero) takes 0 ns (Layer.cc 955-1035) and SimAI prints its bandwidth as
size / 0 = inf, or -inf for a 0-rank group (`compute_busbw`, 1037-1050). So the writer never puts
a collective on a group of fewer than two ranks, and refuses a layout whose expert groups no
SimAI group matches in size, rather than have SimAI reduce over the wrong count.
"""

from __future__ import annotations

from inspector.errors import ConfigError
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout

INT_MAX = 2**31 - 1  # SimAI reads header values with std::stoi (Workload.cc 1180-1260)


def simai_dp(par: Layout) -> int:
    """Return SimAI's data-parallel group size, all_gpus / (tp pp): megatron's dp x cp."""
    return par.dp * par.cp


def expert_grad_group(par: Layout) -> str | None:
    """Return the weight-grad suffix of the expert gradient collectives, None when there are none.

    Megatron reduces expert gradients over the expert data-parallel group, tp cp dp / (ep etp)
    ranks (parallel_state). SimAI's `_DP_EP` holds cp dp / ep ranks, the same count when etp
    equals tp; its DP group (no suffix) holds cp dp ranks, the same count when ep x etp equals tp.
    `check_groups` refuses every other layout first.
    """
    if par.expert_dp == 1:
        return None
    if par.expert_tp == par.tp:
        return "_DP_EP"
    return ""


def tokens_gather_group(par: Layout) -> str | None:
    """Return the group of the MoE dispatcher's token-count all-gather, None when it has one rank.

    Megatron gathers the counts over the tp_ep group, ep x etp ranks (MoEAlltoAllTokenDispatcher
    `preprocess`). With etp 1 that is SimAI's EP group; otherwise the TP group (etp = tp there,
    `check_groups`), which leaves out the ep factor of a few-kilobyte gather.
    """
    if par.ep * par.expert_tp == 1:
        return None
    return "_EP" if par.expert_tp == 1 else ""


def context_group(par: Layout) -> str:
    """Return the group of the context-parallel K/V exchange (SimAI has no context group).

    With dp 1 and ep 1, SimAI's DP_EP group is all_gpus / (tp pp) = cp ranks at stride tp:
    megatron's context-parallel group exactly, as SimAI's ns-3 backend builds its groups
    (MockNcclGroup). Otherwise the tensor-parallel group stands in. SimAI-Analytical sizes
    every forward and input-gradient collective by tp ranks (ep for `_EP`; Layer.cc 576-579,
    `_DP_EP` included), so there the exchange runs over tp ranks in both cases: `check_groups`
    refuses it at tp 1, where that is one rank, and the CLI notes the count otherwise.
    """
    return "_DP_EP" if par.dp == 1 and par.ep == 1 else ""


def check_groups(dims: ModelDims, par: Layout) -> None:
    """Raise ConfigError for a layout whose collectives SimAI would run on the wrong ranks."""
    if par.use_tp_pp_dp_mapping and par.pp > 1 and par.dp > 1:
        raise ConfigError(
            "workload cannot write --use-tp-pp-dp-mapping for SimAI: the workload file gives "
            "group sizes only, and SimAI places the ranks itself, not in megatron's tp-pp-dp "
            "order (pipeline stages before data-parallel replicas)"
        )
    if par.cp > 1 and par.tp == 1:
        raise ConfigError(
            f"workload cannot write --context-parallel-size {par.cp} with --tp 1 for SimAI: "
            "SimAI has no context-parallel group, and SimAI-Analytical times a forward "
            "collective over the tensor-parallel group's ranks, one at --tp 1 (it times it 0 "
            "and prints inf); docs/simai.md"
        )
    if dims.num_experts is None:
        return
    etp, tp = par.expert_tp, par.tp
    if etp not in (1, tp):
        raise ConfigError(
            f"workload cannot write --expert-tensor-parallel-size {etp} with --tp {tp} for SimAI: "
            f"megatron gathers expert activations over {etp} ranks, and SimAI's only "
            f"tensor-parallel group holds --tp {tp}; use etp 1 or etp = tp (docs/simai.md)"
        )
    if par.expert_dp > 1 and etp != tp and par.ep * etp != tp:
        dense = tp * par.cp * par.dp
        raise ConfigError(
            f"workload cannot write --expert-tensor-parallel-size {etp} with --tp {tp} and "
            f"--expert-model-parallel-size {par.ep} for SimAI: megatron reduces expert gradients "
            f"over --tp {tp} x --context-parallel-size {par.cp} x --dp {par.dp} / (ep {par.ep} x "
            f"etp {etp}) = {dense // (par.ep * etp)} ranks, SimAI over cp x dp / ep = "
            f"{simai_dp(par) // par.ep} (_DP_EP) or cp x dp = {simai_dp(par)} (DP); use etp = tp, "
            "or ep x etp = tp (docs/simai.md)"
        )


def pipeline_send(dims: ModelDims, par: Layout, micro_batch_size: int) -> int:
    """Return the bytes of one pipeline send, (s/c, b, h)/t with sequence parallelism.

    SimAI reads it as the header's `pp_comm` with std::stoi into a uint32_t (Workload.cc 1260,
    Layer.cc 568), so a send over 2^31 - 1 bytes is refused here with the flags that made it.
    """
    if par.pp == 1:
        return 0
    send = dims.activation_bytes * micro_batch_size * dims.seq_length * dims.hidden_size
    send //= par.cp * par.sp_divisor
    if send > INT_MAX:
        split = f" / --context-parallel-size {par.cp}" if par.cp > 1 else ""
        split += f" / --tp {par.tp} (sequence parallel)" if par.sp_divisor > 1 else ""
        raise ConfigError(
            f"one pipeline send, --micro-batch-size {micro_batch_size} x --seq-length "
            f"{dims.seq_length} x --hidden-size {dims.hidden_size} x {dims.activation_bytes} bytes"
            f"{split} = {send} bytes, is more than SimAI's pp_comm holds ({INT_MAX}, std::stoi); "
            "docs/simai.md"
        )
    return send
