"""One attention layer on one rank, step by step, under three ways of splitting it over P ranks.

Modes (symbols: N sequence, b micro-batch, H hidden, h heads, g key/value groups, d head dim,
P the degree):
  - "tp": Megatron tensor parallelism (Shoeybi et al. 2019): heads split over P, the QKV weight
    column-parallel and the output weight row-parallel; with sequence parallelism (Korthikanti
    et al. 2022) the layer input and output are split along N, gathered and reduce-scattered.
  - "ulysses": DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509): the sequence is split
    over P, full weights project the local tokens, an all-to-all trades the sequence split for a
    head split around the core attention, and a second all-to-all trades it back.
  - "cp": Megatron context parallelism (ring attention): the sequence is split over P (as 2P
    chunks, two per rank, to balance the causal mask), queries stay local, and K/V blocks travel
    round the ring in P steps; each step scores N/P queries against N/P keys.
When g < P, "tp" and "ulysses" replicate each key/value head on P/g ranks (as Ulysses
implementations and inference engines do); megatron-core itself requires g % tp == 0.

Every step records what one rank holds: a logical layout, the concrete shape, its elements and
bytes (16-bit tensors, fp32 softmax statistics), and the forward FLOPs of that step, for the whole
layer across all ranks and for this rank. FLOPs are dense matrix products (2 per multiply-add),
the whole N x N score matrix included; Megatron-LM's throughput formula halves the core
attention for the causal mask and triples everything for backward. Flash attention does the same
FLOPs but never materialises the scores: rows marked "naive" exist only without it, rows marked
"flash" only with it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from inspector.errors import ConfigError
from inspector.formulas.walkthrough_steps import (
    Mode,
    Walk,
    WalkthroughStep,
    comm_step,
    weight_step,
)
from inspector.job.checks import check_at_least_one
from inspector.job.dims import ModelDims

if TYPE_CHECKING:
    from inspector.job.job import Job

DEGREE_FLAGS = {"tp": "--tp", "ulysses": "--ulysses-degree", "cp": "--context-parallel-size"}
FP32 = 4  # bytes of the softmax statistics


@dataclass(frozen=True)
class _Sizes:
    """Concrete sizes and per-rank head counts for one walkthrough."""

    n: int
    b: int
    hid: int
    a: int
    g: int
    d: int
    p: int
    a_rank: int
    g_rank: int
    g_label: str  # "g/P", or "1" when key/value heads are replicated


def _sizes(dims: ModelDims, mode: Mode, degree: int, micro_batch_size: int) -> _Sizes:
    """Check divisibility and return the sizes one rank works with."""
    if mode not in DEGREE_FLAGS:
        raise ConfigError(f"the walkthrough mode must be one of tp, ulysses, cp, got {mode!r}")
    flag = DEGREE_FLAGS[mode]
    a, g, n = dims.num_attention_heads, dims.query_groups, dims.seq_length
    check_at_least_one(flag, degree)
    if mode != "cp" and a % degree:
        raise ConfigError(
            f"--num-attention-heads {a} is not divisible by {flag} {degree} ({a} % {degree} = "
            f"{a % degree})"
        )
    if mode != "cp" and g % degree and degree % g:
        raise ConfigError(
            f"--num-query-groups {g} and {flag} {degree} must divide one another "
            f"({g} % {degree} = {g % degree})"
        )
    split = 2 * degree if mode == "cp" else degree
    if n % split:
        by = f"2 x {flag} {degree} = {split}" if mode == "cp" else f"{flag} {degree}"
        raise ConfigError(
            f"--seq-length {n} is not divisible by {by} ({n} % {split} = {n % split})"
        )
    g_rank, g_label = (g // degree, "g/P") if g % degree == 0 else (1, "1")
    a_rank = a if mode == "cp" else a // degree
    return _Sizes(
        n, micro_batch_size, dims.hidden_size, a, g, dims.head_dim, degree, a_rank, g_rank, g_label
    )


def _projections(
    z: _Sizes, tokens: int, tok: str, heads: tuple[int, str], kv: tuple[int, str], note: str = ""
) -> WalkthroughStep:
    """Return the fused Q, K, V projection of `tokens` local tokens into (count, label) heads.

    One GEMM, as megatron's linear_qkv: its output holds the query heads, then the key and the
    value heads; its FLOPs are the three projections' together.
    """
    (q, q_label), (k, k_label) = heads, kv
    per_head = 2 * z.b * z.hid * z.d  # FLOPs per token per output head
    return WalkthroughStep(
        "Q, K, V = x W_qkv",
        f"[{tok}, b, {q_label} + {'2' if k_label == '1' else '2' + k_label}, d]",
        (tokens, z.b, q + 2 * k, z.d),
        float(per_head * z.n * (z.a + 2 * z.g)),
        float(per_head * tokens * (q + 2 * k)),
        note=note,
    )


def _core(
    z: _Sizes, queries: tuple[int, str], keys: tuple[int, str], heads: str, note: str = ""
) -> list[WalkthroughStep]:
    """Return scores, softmax, softmax statistics and context, queries x keys per rank."""
    (q, q_lab), (k, k_lab) = queries, keys
    flops = float(2 * z.b * z.a * z.n * z.n * z.d)  # each of Q K^T and S V, dense
    layout = f"[b, {heads}, {q_lab}, {k_lab}]"
    shape = (z.b, z.a_rank, q, k)
    return [
        WalkthroughStep(
            "S = Q K^T: attention scores",
            layout,
            shape,
            flops,
            flops / z.p,
            materialized="naive",
            note=note,
        ),
        WalkthroughStep("P = softmax(S)", layout, shape, 0.0, 0.0, materialized="naive", note=note),
        WalkthroughStep(
            "softmax statistics (log-sum-exp)",
            f"[b, {heads}, {q_lab}]",
            (z.b, z.a_rank, q),
            0.0,
            0.0,
            materialized="flash",
            bytes_per_element=FP32,
        ),
        WalkthroughStep(
            "O = P V", f"[{q_lab}, b, {heads}, d]", (q, z.b, z.a_rank, z.d), flops, flops / z.p
        ),
    ]


def _output(z: _Sizes, tokens: int, tok: str, heads: int, name: str) -> WalkthroughStep:
    """Return Y = O W_o for `tokens` local tokens and `heads` local heads."""
    return WalkthroughStep(
        name,
        f"[{tok}, b, H]",
        (tokens, z.b, z.hid),
        float(2 * z.n * z.b * z.a * z.d * z.hid),
        float(2 * tokens * z.b * heads * z.d * z.hid),
    )


def _replication_note(z: _Sizes) -> str:
    """Return the note for key/value heads replicated because g < P."""
    if z.g_label == "g/P":
        return ""
    return f"g = {z.g} < P = {z.p}: each key/value head is replicated on {z.p // z.g} ranks"


def _tensor_parallel(z: _Sizes, sequence_parallel: bool) -> list[WalkthroughStep]:
    """Return the steps of Megatron tensor parallelism (with or without sequence parallel)."""
    n, b, hid, d, p = z.n, z.b, z.hid, z.d, z.p
    steps = [
        WalkthroughStep(
            "x: layer input",
            "[N/P, b, H]" if sequence_parallel else "[N, b, H]",
            (n // p if sequence_parallel else n, b, hid),
            0.0,
            0.0,
        )
    ]
    if sequence_parallel:
        steps.append(comm_step("x: all-gather along N", "[N, b, H]", (n, b, hid)))
    qkv_layout = "[(h + 2g) d/P, H]" if z.g_label == "g/P" else "[(h/P + 2) d, H]"
    shard = ((z.a_rank + 2 * z.g_rank) * d, hid)
    steps.append(weight_step("W_qkv: QKV weight, column shard", qkv_layout, shard))
    note = _replication_note(z)
    steps.append(_projections(z, n, "N", (z.a_rank, "h/P"), (z.g_rank, z.g_label), note))
    steps += _core(z, (n, "N"), (n, "N"), "h/P")
    steps.append(weight_step("W_o: output weight, row shard", "[H, h d/P]", (hid, z.a_rank * d)))
    steps.append(_output(z, n, "N", z.a_rank, "Y = O W_o (partial sums)"))
    if sequence_parallel:
        steps.append(comm_step("Y: reduce-scatter along N", "[N/P, b, H]", (n // p, b, hid)))
    else:
        steps.append(replace(comm_step("Y: all-reduce", "[N, b, H]", (n, b, hid)), in_place=True))
    return steps


def _ulysses(z: _Sizes) -> list[WalkthroughStep]:
    """Return the steps of DeepSpeed-Ulysses sequence parallelism."""
    n, b, hid, d, p = z.n, z.b, z.hid, z.d, z.p
    local = n // p
    steps = [
        WalkthroughStep("x: layer input", "[N/P, b, H]", (local, b, hid), 0.0, 0.0),
        weight_step("W_qkv: QKV weight, whole", "[(h + 2g) d, H]", ((z.a + 2 * z.g) * d, hid)),
    ]
    steps.append(_projections(z, local, "N/P", (z.a, "h"), (z.g, "g")))
    note = _replication_note(z)
    steps += [
        comm_step("Q: all-to-all, gather N, scatter heads", "[N, b, h/P, d]", (n, b, z.a_rank, d)),
        comm_step(
            "K: all-to-all, gather N, scatter heads",
            f"[N, b, {z.g_label}, d]",
            (n, b, z.g_rank, d),
            note,
        ),
        comm_step(
            "V: all-to-all, gather N, scatter heads",
            f"[N, b, {z.g_label}, d]",
            (n, b, z.g_rank, d),
            note,
        ),
    ]
    steps += _core(z, (n, "N"), (n, "N"), "h/P")
    steps += [
        comm_step("O: all-to-all, scatter N, gather heads", "[N/P, b, h, d]", (local, b, z.a, d)),
        weight_step("W_o: output weight, whole", "[H, h d]", (hid, z.a * d)),
        _output(z, local, "N/P", z.a, "Y = O W_o"),
    ]
    return steps


def _context_parallel(z: _Sizes) -> list[WalkthroughStep]:
    """Return the steps of Megatron context parallelism (ring attention)."""
    n, b, hid, d, p = z.n, z.b, z.hid, z.d, z.p
    local = n // p
    steps = [
        WalkthroughStep(
            "x: layer input",
            "[N/P, b, H]",
            (local, b, hid),
            0.0,
            0.0,
            note="two chunks of N/(2P) tokens, balancing the causal mask",
        ),
        weight_step("W_qkv: QKV weight, whole", "[(h + 2g) d, H]", ((z.a + 2 * z.g) * d, hid)),
    ]
    steps.append(_projections(z, local, "N/P", (z.a, "h"), (z.g, "g")))
    steps.append(
        comm_step(
            "K, V: received from the previous rank",
            "[2, N/P, b, g, d]",
            (2, local, b, z.g, d),
            f"each of {p - 1} ring steps",
        )
    )
    steps += _core(
        z, (local, "N/P"), (local, "N/P"), "h", note=f"one block per ring step, {p} steps"
    )
    steps += [
        weight_step("W_o: output weight, whole", "[H, h d]", (hid, z.a * d)),
        _output(z, local, "N/P", z.a, "Y = O W_o"),
    ]
    return steps


def attention_walkthrough(
    dims: ModelDims,
    mode: Mode,
    degree: int,
    micro_batch_size: int = 1,
    sequence_parallel: bool = False,
) -> list[WalkthroughStep]:
    """Return one attention layer's steps on one of `degree` ranks, in execution order.

    Args:
        dims: model dimensions; N is `dims.seq_length`.
        mode: "tp" (tensor parallel), "ulysses" (all-to-all sequence parallel) or "cp"
            (context parallel, ring attention).
        degree: P, the ranks the layer is split over.
        micro_batch_size: b.
        sequence_parallel: with "tp", split the layer input and output along N.
    """
    z = _sizes(dims, mode, degree, micro_batch_size)
    if mode == "tp":
        return _tensor_parallel(z, sequence_parallel)
    if mode == "ulysses":
        return _ulysses(z)
    return _context_parallel(z)


def mlp_walkthrough(
    dims: ModelDims, dp: int, tp: int, micro_batch_size: int = 1, layers: int | None = None
) -> list[WalkthroughStep]:
    """Return one MLP layer on one rank under 2-D model parallelism (data x tensor).

    The tokens N = b x s x DP of one micro-batch step are split over the DP ranks, the weights of
    the stage's L layers over the TP ranks (W1 column-parallel, W2 row-parallel, Shoeybi et al.
    2019): input [N/DP, H], W1 [L, H, F/TP], W2 [L, F/TP, H], inter = input W1 [N/DP, F/TP],
    Y = inter W2 [N/DP, H] partial sums, all-reduced over TP in place. Forward only: `inter` is
    freed once Y exists (training keeps it for backward). A gated MLP (SwiGLU) has a W1 of 2F
    columns. FLOPs are 2 per multiply-add; "layer" counts all DP x TP ranks.
    """
    check_at_least_one("--dp", dp)
    check_at_least_one("--tp", tp)
    f, gate, hid = dims.ffn, dims.gated_multiplier, dims.hidden_size
    if f % tp:
        raise ConfigError(
            f"--ffn-hidden-size {f} is not divisible by --tp {tp} ({f} % {tp} = {f % tp})"
        )
    local, shard, count = micro_batch_size * dims.seq_length, f // tp, layers or dims.num_layers
    w1 = "[L, H, 2F/TP]" if gate == 2 else "[L, H, F/TP]"
    return [
        WalkthroughStep("input: this rank's tokens", "[N/DP, H]", (local, hid), 0.0, 0.0),
        weight_step("W1: fc1 weights of L layers, column shard", w1, (count, hid, gate * shard)),
        weight_step("W2: fc2 weights of L layers, row shard", "[L, F/TP, H]", (count, shard, hid)),
        *_mlp_products(dims, local, dp, tp),
        replace(comm_step("Y: all-reduce over TP, in place", "[N/DP, H]", (local, hid)), in_place=True),
    ]


def _mlp_products(dims: ModelDims, local: int, dp: int, tp: int) -> list[WalkthroughStep]:
    """Return the MLP's two matrix products on one rank of `local` tokens (N/DP)."""
    f, gate, hid = dims.ffn, dims.gated_multiplier, dims.hidden_size
    tokens, shard = local * dp, f // tp
    fc1 = float(2 * tokens * hid * gate * f)
    fc2 = float(2 * tokens * f * hid)
    inter = "[N/DP, 2F/TP]" if gate == 2 else "[N/DP, F/TP]"
    return [
        WalkthroughStep(
            "inter = input W1",
            inter,
            (local, gate * shard),
            fc1,
            fc1 / (dp * tp),
            freed=True,
            note="freed once Y exists (forward only; training keeps it for backward)",
        ),
        WalkthroughStep(
            "Y = inter W2 (partial sums)", "[N/DP, H]", (local, hid), fc2, fc2 / (dp * tp)
        ),
    ]


def job_walkthroughs(job: Job, ulysses_degree: int | None) -> list[Walk]:
    """Return the job's attention layer under tp, and Ulysses / context parallel when asked."""
    layout = job.layout
    micro = job.schedule().micro_batch_size
    modes: list[tuple[Mode, int]] = [("tp", layout.tp)]
    if ulysses_degree is not None:
        modes.append(("ulysses", ulysses_degree))
    if layout.cp > 1:
        modes.append(("cp", layout.cp))
    dims = job.dims()
    walks: list[Walk] = [
        (
            mode,
            degree,
            attention_walkthrough(
                dims, mode, degree, micro, mode == "tp" and layout.sequence_parallel
            ),
        )
        for mode, degree in modes
    ]
    layers = -(-job.model.num_layers // layout.pp)  # one pipeline stage's (rounded up)
    walks.append(("mlp", layout.tp, mlp_walkthrough(dims, layout.dp, layout.tp, micro, layers)))
    return walks
