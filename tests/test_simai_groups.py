"""SimAI exports whose groups SimAI sizes on its own (issue #30, the SimAI family).

SimAI-Analytical sizes every group from the header (aliyun/SimAI HEAD cef83f9d, Layer.cc
565-582): TP = tp, EP = ep, DP = all_gpus / (tp pp), DP_EP = DP / ep (integer division). A
collective on fewer than two ranks takes 0 ns and SimAI prints inf (-inf at 0 ranks). `simai_size`
below re-derives those sizes independently of the writer; every file here must put each
collective on at least two ranks, and the expert gradients on megatron's own count,
tp cp dp / (ep etp).
"""

from __future__ import annotations

import pytest

from inspector.report.simai import NONE, Header, Record, parse_workload

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--gpu-tflops", "100", "--bf16"]  # fmt: skip
MOE = [*BASE, "--num-experts", "4", "--disable-bias-linear"]
MLA = [*BASE[:2], "--hidden-size", "128", *BASE[4:], "--transformer-impl", "transformer_engine",
       "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "16", "--qk-head-dim",
       "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type", "rope"]  # fmt: skip


def simai_size(header: Header, comm: str, column: str) -> int:
    """Return the ranks SimAI-Analytical runs `comm` over (Layer.cc 565-582): the weight-gradient
    column DP / ep for `_DP_EP`, else DP; the forward and input-gradient columns ep for `_EP`,
    else tp (`_DP_EP` included)."""
    dp = header.all_gpus // (header.tp * header.pp)
    if column == "wg":
        return dp // header.ep if comm.endswith("_DP_EP") else dp
    return header.ep if comm.endswith("_EP") and not comm.endswith("_DP_EP") else header.tp


def collectives(record: Record) -> list[tuple[str, str]]:
    pairs = [("fwd", record.fwd_comm), ("ig", record.ig_comm), ("wg", record.wg_comm)]
    return [(column, comm) for column, comm in pairs if comm != NONE]


def stage0(cli, *args: str) -> tuple[Header, list[Record]]:
    result = cli("workload", *args, "--stage", "0")
    assert result.code == 0, result.err
    return parse_workload(result.out)


LAYOUTS = {
    # ep = dp at tp 1: megatron's expert data-parallel group has one rank (moe_grad_norm out),
    # SimAI's TP group one rank (optimizer1..4 out), the token counts go over EP.
    "ep-equals-dp-tp1": [*MOE, "--ep", "2", "--dp", "2"],
    # etp 1 < tp 2, ep 2: expert gradients over 2 x 4 / (2 x 1) = 4 ranks = SimAI's DP (cp dp).
    "etp1-ep-times-etp-is-tp": [*MOE, "--tp", "2", "--expert-tensor-parallel-size", "1", "--ep",
                                "2", "--dp", "4", "--sequence-parallel"],  # fmt: skip
    # etp = tp: 2 x 4 / (2 x 2) = 2 = SimAI's DP_EP (dp / ep).
    "etp-is-tp": [*MOE, "--tp", "2", "--ep", "2", "--dp", "4", "--sequence-parallel"],
    "dense-dp1-tp1": [*BASE, "--pp", "2"],
    "dense-tp2-dp1": [*BASE, "--tp", "2", "--use-distributed-optimizer"],
    "mla-tp2-cp2": [*MLA, "--tp", "2", "--context-parallel-size", "2", "--sequence-parallel"],
    # dp 1, ep 1: SimAI's DP_EP group is all_gpus / (tp pp) = cp ranks, megatron's CP group
    # in SimAI's ns-3 groups; SimAI-Analytical times it over tp = cp = 2 ranks
    "cp2-tp2-dp1": [*BASE, "--tp", "2", "--context-parallel-size", "2", "--transformer-impl",
                    "transformer_engine"],  # fmt: skip
}


def test_context_exchange_on_the_group_of_cp_ranks(cli):
    header, records = stage0(cli, *LAYOUTS["cp2-tp2-dp1"])
    kv = next(r for r in records if r.name == "attention_cp")
    assert (kv.fwd_comm, kv.ig_comm) == ("ALLGATHER_DP_EP", "REDUCESCATTER_DP_EP")
    assert simai_size(header, kv.fwd_comm, "fwd") == 2
    assert header.all_gpus // (header.tp * header.pp) // header.ep == 2  # ns-3's DP_EP group


def test_context_exchange_at_tp1_is_refused_and_other_counts_noted(cli):
    # SimAI-Analytical sizes a forward collective by tp, so at tp 1 it would time the exchange 0
    result = cli("workload", *BASE, "--context-parallel-size", "2", "--transformer-impl",
                 "transformer_engine", "--stage", "0")  # fmt: skip
    assert result.code == 2 and "--context-parallel-size 2 with --tp 1" in result.err
    result = cli("workload", *BASE, "--tp", "2", "--context-parallel-size", "4", "--transformer-impl",
                 "transformer_engine", "--stage", "0")  # fmt: skip
    assert result.code == 0, result.err
    assert "over its tensor-parallel group, 2 ranks, where megatron's context-parallel group has 4" in result.err


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_collective_has_two_ranks_in_simai(cli, name):
    header, records = stage0(cli, *LAYOUTS[name])
    for record in records:
        for column, comm in collectives(record):
            assert simai_size(header, comm, column) >= 2, (record, column)


@pytest.mark.parametrize(("name", "megatron"), [("etp1-ep-times-etp-is-tp", 4), ("etp-is-tp", 2)])
def test_expert_gradients_reduce_over_megatrons_count(cli, name, megatron):
    header, records = stage0(cli, *LAYOUTS[name])
    expert = [r for r in records if r.name.startswith("moe_grad_norm")]
    assert expert and all(simai_size(header, r.wg_comm, "wg") == megatron for r in expert)


def test_one_rank_groups_are_left_out(cli):
    header, records = stage0(cli, *LAYOUTS["ep-equals-dp-tp1"])
    names = {r.name for r in records}
    assert not names & {"moe_grad_norm1", "moe_grad_norm2", "optimizer1"}
    counts = next(r for r in records if r.name == "mlp_moelayer")
    assert (counts.fwd_comm, counts.fwd_bytes) == ("ALLGATHER_EP", 8 * 4 * 1 * 2)


def test_mla_gathers_the_compressed_widths(cli):
    """q latent 48 + kv latent 16 + RoPE key 8 = 72 of 128 columns, 2 bytes, 32/cp tokens."""
    _, records = stage0(cli, *LAYOUTS["mla-tp2-cp2"])
    column = next(r for r in records if r.name == "attention_column")
    row = next(r for r in records if r.name == "attention_row")
    assert (column.fwd_bytes, column.ig_bytes) == (2 * 16 * 72, 2 * 16 * 72)
    assert (row.fwd_bytes, row.ig_bytes) == (2 * 16 * 128, 2 * 16 * 128)
    # K = 4 heads x (16 + 8), V = 4 x 16 over the whole sequence, this rank's 2 heads
    kv = next(r for r in records if r.name == "attention_cp")
    assert kv.fwd_bytes == 2 * 32 * 4 * (16 + 8 + 16) // 2


def test_mla_without_sequence_parallel_all_reduces_the_latent_gradients(cli):
    _, records = stage0(cli, *MLA, "--tp", "2")
    layer = next(r for r in records if r.name == "attention_layer")
    assert (layer.fwd_bytes, layer.ig_bytes) == (2 * 32 * 128, 2 * 32 * (48 + 16))


REFUSED = {
    "etp-below-tp": ([*MOE, "--tp", "2", "--expert-tensor-parallel-size", "1", "--ep", "4",
                      "--dp", "4", "--sequence-parallel"],  # fmt: skip
        "Error: workload cannot write --expert-tensor-parallel-size 1 with --tp 2 and "
        "--expert-model-parallel-size 4 for SimAI: megatron reduces expert gradients over --tp 2 "
        "x --context-parallel-size 1 x --dp 4 / (ep 4 x etp 1) = 2 ranks, SimAI over cp x dp / "
        "ep = 1 (_DP_EP) or cp x dp = 4 (DP); use etp = tp, or ep x etp = tp (docs/simai.md)"),
    "etp-between": ([*MOE, "--tp", "4", "--expert-tensor-parallel-size", "2", "--dp", "2",
                     "--sequence-parallel"],  # fmt: skip
        "Error: workload cannot write --expert-tensor-parallel-size 2 with --tp 4 for SimAI: "
        "megatron gathers expert activations over 2 ranks, and SimAI's only tensor-parallel "
        "group holds --tp 4; use etp 1 or etp = tp (docs/simai.md)"),
    "cp-at-tp1-dp2": ([*BASE, "--context-parallel-size", "2", "--dp", "2", "--transformer-impl",
                       "transformer_engine"],  # fmt: skip
        "Error: workload cannot write --context-parallel-size 2 with --tp 1 for SimAI: SimAI has "
        "no context-parallel group, and SimAI-Analytical times a forward collective over the "
        "tensor-parallel group's ranks, one at --tp 1 (it times it 0 and prints inf); "
        "docs/simai.md"),
    "pp-comm-too-large": ([*BASE[:2], "--hidden-size", "16384", "--num-attention-heads", "128",
                           "--seq-length", "131072", "--max-position-embeddings", "131072",
                           *BASE[8:], "--pp", "2"],  # fmt: skip
        "Error: one pipeline send, --micro-batch-size 1 x --seq-length 131072 x --hidden-size "
        "16384 x 2 bytes = 4294967296 bytes, is more than SimAI's pp_comm holds (2147483647, "
        "std::stoi); docs/simai.md"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_refused_with_the_reason(cli, name):
    args, message = REFUSED[name]
    result = cli("workload", *args, "--stage", "0")
    assert (result.code, result.out, result.err) == (2, "", message + "\n")


def test_what_simai_s_format_cannot_express_is_noted(cli):
    # the allgather dispatcher (Megatron-LM's default) got the alltoall dispatcher's records,
    # SimAI's expert-parallel group at etp 1 < tp spans tp-strided ranks, and fp8 gathers were
    # written as bf16's, each without a note
    def notes(*args: str) -> str:
        result = cli("workload", *args, "--stage", "0")
        assert result.code == 0, result.err
        return result.err

    allgather = "Note: megatron's allgather dispatcher (Megatron-LM's default"
    assert allgather in notes(*LAYOUTS["etp-is-tp"])
    assert allgather not in notes(*LAYOUTS["etp-is-tp"], "--moe-token-dispatcher-type", "alltoall")
    strided = "ranks 2 apart, spanning 4 GPUs, where megatron's at --expert-tensor-parallel-size 1 are 2 consecutive ranks"
    assert strided in notes(*LAYOUTS["etp1-ep-times-etp-is-tp"])
    assert "ranks 2 apart" not in notes(*LAYOUTS["etp-is-tp"])
    fp8 = "Transformer Engine's fp8 linears gather their inputs in fp8"
    dense = [*BASE, "--hidden-size", "256", "--num-attention-heads", "8", "--tp", "2",
             "--sequence-parallel", "--transformer-impl", "transformer_engine"]  # fmt: skip
    assert fp8 in notes(*dense, "--fp8-format", "hybrid")
    assert fp8 not in notes(*dense)
