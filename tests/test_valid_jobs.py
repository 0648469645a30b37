"""Valid jobs that used to crash inside megatron-core or our arithmetic (issue #30, family 1).

Each runs through the real command line (in-process) and asserts the answer, not only exit 0:
- dp (x cp) not dividing a gradient buffer without the distributed optimizer: megatron
  all-reduces whole, unpadded buckets (param_and_grad_buffer.py asserts numel ==
  numel_unpadded), so every rank holds and updates every element, whatever dp is;
- DeepSeek-V3 (MLA, YaRN rotary embedding) under context parallelism: megatron pins a CPU index
  and copies it to CUDA while building; the simulated CUDA answers that on meta;
- a sequence that 2 x cp does not divide is refused first, naming both flags.
"""

from __future__ import annotations

import json

import pytest

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
SMALL += ["--vocab-size", "1000", "--micro-batch-size", "1"]
CP = ["--transformer-impl", "transformer_engine", "--use-flash-attn", "--bf16"]
# DeepSeek-V3 cut to four layers (one dense, three MoE) so that a build takes seconds.
DEEPSEEK = ["--model", "deepseek-v3", "--num-layers", "4", "--moe-layer-freq", "[0]*1+[1]*3"]
DEEPSEEK += ["--micro-batch-size", "1", "--pp", "2", "--ep", "8", "--bf16", "--use-flash-attn"]
DEEPSEEK += ["--no-rope-fusion"]  # megatron-core 0.13 runs MLA's fused RoPE only as experimental


def _stage(cli, *argv: str) -> dict:
    result = cli("memory", *argv, "--format", "json")
    assert (result.code, result.err) == (0, ""), result.err
    return json.loads(result.out)["stages"][0]


@pytest.mark.parametrize("dp", ["5", "11"])
def test_memory_with_dp_not_dividing_the_buffer(cli, dp):
    # 231,168 parameters: 231168 % 5 = 3, 231168 % 11 = 3. Without the distributed optimizer
    # nothing is sharded: fp32 weights and grads (4 bytes each), Adam's two moments (8 bytes).
    stage = _stage(cli, *SMALL, "--dp", dp)
    assert stage["parameters"] == 231168 and 231168 % int(dp)
    assert (stage["weights"], stage["gradients"]) == (4 * 231168, 4 * 231168)
    assert stage["optimizer"] == 8 * 231168
    assert stage["optimizer"] == _stage(cli, *SMALL, "--dp", "1")["optimizer"]


def test_memory_with_dp_not_dividing_the_buffer_shards_under_distopt(cli):
    # With the distributed optimizer megatron pads each bucket to lcm(dp, 128): the shards
    # together cover every parameter once.
    stage = _stage(cli, *SMALL, "--dp", "5", "--use-distributed-optimizer")
    assert stage["optimizer"] < 8 * 231168 / 4


@pytest.mark.parametrize("flags", [["--dp", "5"], ["--context-parallel-size", "3", "--tp", "2", *CP]])
def test_workload_with_dp_cp_not_dividing_the_buffer(cli, tmp_path, flags):
    # (SimAI-Analytical times the context-parallel exchange over tp ranks: refused at tp 1)
    seq = ["--seq-length", "1020"] if "--context-parallel-size" in flags else []
    out = tmp_path / "w"
    result = cli("workload", *SMALL, *flags, *seq, "--gpu-tflops", "100", "-o", str(out))
    assert result.code == 0 and "Error" not in result.err, result.err
    assert sorted(p.name for p in out.iterdir()) == ["index.csv", "stage000.txt"]


@pytest.mark.slow
def test_deepseek_v3_builds_under_context_parallelism(cli):
    stage = _stage(cli, *DEEPSEEK, "--context-parallel-size", "2", "--dp", "4")
    flat = _stage(cli, *DEEPSEEK, "--dp", "8")
    # Context parallelism splits activations, never weights: the same stage 0 parameters.
    assert stage["parameters"] == flat["parameters"] > 0


@pytest.mark.parametrize("command", ["memory", "params", "tree"])
def test_seq_length_not_split_by_context_parallelism_is_refused(cli, command):
    extra = [*CP, "--micro-batch-size", "1"] if command == "memory" else CP[:2]
    result = cli(command, *SMALL[:8], *extra, "--context-parallel-size", "3", "--seq-length", "1000")
    assert result.code == 2 and result.out == ""
    assert result.err == (
        "Error: --seq-length 1000 is not divisible by 2 x --context-parallel-size 3 = 6 "
        "(1000 % 6 = 4): megatron splits every sequence into 2 x cp equal chunks\n"
    )


@pytest.mark.parametrize("cp, message", [
    ("1", "--seq-length 1026 is not divisible by --tp 4 (1026 % 4 = 2)"),
    ("3", "--seq-length 1026 / --context-parallel-size 3 = 342 is not divisible by --tp 4 "
          "(342 % 4 = 2)"),
])  # fmt: skip
def test_seq_length_not_split_by_sequence_parallelism_is_refused_naming_the_flags(cli, cp, message):
    # issue #46 sweep: megatron's first forward scatters each sequence's tokens over the tp ranks
    # (mappings.py _split_along_first_dim asserts); it reached the user as megatron's assert,
    # naming no flag, after the engine had run
    result = cli("memory", *SMALL[:8], *CP, "--micro-batch-size", "1", "--num-attention-heads",
                 "12", "--hidden-size", "96", "--tp", "4", "--sequence-parallel",
                 "--context-parallel-size", cp, "--seq-length", "1026")  # fmt: skip
    assert result.code == 2 and result.out == ""
    assert result.err == (f"Error: {message}: --sequence-parallel splits each sequence's tokens "
                          "over the tensor-parallel ranks\n")  # fmt: skip


def test_simulated_cuda_moves_a_pinned_index_to_meta_and_restores_torch():
    import torch

    from inspector.world.te.cuda import simulated_cuda

    tensor, to_cuda = torch.tensor, torch.Tensor.cuda
    with simulated_cuda():
        index = torch.tensor([1, 2], device="cpu", pin_memory=True).cuda(non_blocking=True)
        assert index.device.type == "meta" and index.shape == (2,)
    assert (torch.tensor, torch.Tensor.cuda) == (tensor, to_cuda)


def test_simulated_cuda_runs_megatrons_cp_slice_of_the_rotary_table():
    import torch
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    from inspector.world.ddp import StandInGroup
    from inspector.world.te.cuda import simulated_cuda

    with simulated_cuda():
        table = torch.empty(1024, 1, 1, 64, device="meta")
        part = get_pos_emb_on_this_cp_rank(table, 0, StandInGroup(4, 1))
    assert part.shape == (256, 1, 1, 64)  # two of 2 x 4 chunks of 128 positions
