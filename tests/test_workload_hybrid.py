"""workload on hybrid (Mamba) models: each layer kind's records, Mamba's counted by hand."""

from __future__ import annotations

from tests.test_hybrid import SMALL
from tests.test_workload import PROFILE

# 4 layers M*M-, h 256, 8 heads, bf16, micro-batch 1 x 1024 tokens, FLOPs at 1000 TFLOPS: 1 ns
# per 1e6 FLOPs. Mamba: d_inner 512 (2 h), 8 heads of 64, 8 groups of state 128
JOB = (*SMALL, "--hybrid-override-pattern", "M*M-", "--micro-batch-size", "1",
       "--global-batch-size", "1", "--seq-length", "1024", "--bf16", "--gpu-tflops", "1000",
       "--stage", "0", "--no-cache")  # fmt: skip


def _records(cli, *args: str) -> list[list[str]]:
    result = cli("workload", *JOB, *args)
    assert result.code == 0, result.err
    return [line.split("\t") for line in result.out.splitlines()[2:]]


def _names(records: list[list[str]]) -> list[str]:
    return [r[0] for r in records]


def test_each_layer_kind_writes_its_own_records(cli):
    records = _records(cli, "--tp", "2", "--sequence-parallel")
    layers = _names(records)[4:-8]  # between the embedding and the output, loss, optimizer
    assert layers == ["mamba_column", "mamba_row", "attention_column", "attention_row",
                      "mamba_column", "mamba_row", "mlp_column", "mlp_row"]  # fmt: skip
    column, row = records[4], records[5]
    # in_proj: 2 x 1024 tokens x 256 x (2 x 512 + 2 x 8 x 128 + 8 = 3080) / tp 2 = 807.4e6 FLOPs
    # a phase; scan: Megatron-LM's 7 x 1024 x 512 x 128 / 2 = 234.9e6 forward, twice backward
    assert column[2:5] == [str(807 + 235), "ALLGATHER", str(2 * 1024 * 256)]
    assert column[5:8] == [str(807 + 2 * 235), "REDUCESCATTER", str(2 * 1024 * 256)]
    assert column[8] == "807"  # weight gradients: in_proj's only
    # out_proj: 2 x 1024 x 512 x 256 / 2 = 134.2e6 a phase, reduce-scatters h
    assert row[2:9] == ["134", "REDUCESCATTER", str(2 * 1024 * 256), "134", "ALLGATHER",
                        str(2 * 1024 * 256), "134"]  # fmt: skip


def test_context_parallel_mamba_trades_sequence_for_channels(cli):
    records = _records(cli, "--tp", "2", "--cp", "2", "--sequence-parallel",
                       "--mamba-num-groups", "2")  # fmt: skip
    cp = [r for r in records if r[0] == "mamba_cp"][:2]
    # 512 tokens a rank, 2 bytes; one group a tp rank for 2 cp ranks: B and C repeated twice
    # (group_repeat_count 2): z x (512 + 512) + B C (2 x 2 x 128) + dt 8, all / tp 2
    into = 2 * 512 * (2 * 512 + 2 * 2 * 2 * 128 + 8) // 2
    assert cp[0][2:8] == ["0", "ALLTOALL_DP_EP", str(into), "0", "ALLTOALL_DP_EP", str(into)]
    assert cp[1][3:5] == ["ALLTOALL_DP_EP", str(2 * 512 * 512 // 2)]  # the scan's output back


def test_full_recomputation_reruns_nothing_in_a_hybrid_stack(cli):
    plain = _records(cli, "--tp", "2", "--sequence-parallel")
    full = _records(cli, "--tp", "2", "--sequence-parallel", "--recompute-granularity", "full",
                    "--recompute-method", "uniform", "--recompute-num-layers", "1")  # fmt: skip
    assert plain == full


def test_a_compute_profile_cannot_time_mamba_layers(cli, tmp_path):
    profile = tmp_path / "profile.txt"
    profile.write_text(PROFILE)
    at = JOB.index("--gpu-tflops")
    args = JOB[:at] + JOB[at + 2:]
    result = cli("workload", *args, "--compute-profile", str(profile))
    assert result.code == 2 and "cannot time a Mamba layer from a --compute-profile" in result.err
