"""--mtp-use-repeated-layer: megatron-core 0.17+ builds one MTP layer and runs it --mtp-num-layers
times (MultiTokenPredictionBlock, multi_token_prediction.py); earlier releases have no such field
and the argument is refused by name."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from inspector.inputs.versions import MTP_REPEATED_RELEASES, megatron_core_version, within

REPEATED = within(MTP_REPEATED_RELEASES, megatron_core_version())
H = 64
# one MTP layer by hand (--transformer-impl local, LayerNorm, biases): enorm, hnorm (2h each),
# eh_proj (2h -> h, no bias), a transformer layer (two norms 2h each, qkv 3h^2 + 3h, proj h^2 + h,
# fc1 4h^2 + 4h, fc2 4h^2 + h) and the layer's final norm (2h)
MTP_LAYER = 4 * H + 2 * H * H + (4 * H + 3 * H * H + 3 * H + H * H + H + 8 * H * H + 5 * H) + 2 * H


def script(tmp_path: Path, extra: str, depths: int = 3) -> str:
    path = tmp_path / "train.sh"
    path.write_text(f"torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 4 --hidden-size {H} "
                    "--num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
                    "--vocab-size 1000 --micro-batch-size 1 --bf16 --transformer-impl local "
                    f"--position-embedding-type rope --mtp-num-layers {depths} {extra}\n")  # fmt: skip
    return str(path)


def mtp_parameters(out: str) -> dict[str, int]:
    """Return the MTP rows of `params`' table (name;module;shape;...): name -> elements."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("mtp."):
            name, _, shape, *_ = line.split(";")
            rows[name] = math.prod(int(n) for n in re.findall(r"\d+", shape))
    return rows


def test_the_field_is_the_installed_transformer_configs():
    # versions.MTP_REPEATED_RELEASES: the releases whose TransformerConfig has the field
    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert ("mtp_use_repeated_layer" in fields) == REPEATED


@pytest.mark.skipif(REPEATED, reason="megatron-core 0.17+ builds the repeated MTP layer")
def test_refused_by_name_before_0_17(cli, tmp_path):
    result = cli("params", "--from-script", script(tmp_path, "--mtp-use-repeated-layer"))
    assert (result.code, result.out) == (2, "")
    assert result.err.splitlines()[-1].endswith(
        "--mtp-use-repeated-layer is not modelled: megatron-core before 0.17 has no repeated MTP "
        "layer (TransformerConfig's mtp_use_repeated_layer)")


@pytest.mark.skipif(not REPEATED, reason="megatron-core before 0.17 has no repeated MTP layer")
def test_params_hold_one_mtp_layer(cli, tmp_path):
    repeated = cli("params", "--from-script", script(tmp_path, "--mtp-use-repeated-layer"))
    assert repeated.code == 0, repeated.err
    got = mtp_parameters(repeated.out)
    assert {name.split(".")[2] for name in got} == {"0"}  # mtp.layers.0 only
    assert sum(got.values()) == MTP_LAYER
    separate = cli("params", "--from-script", script(tmp_path, ""))
    assert sum(mtp_parameters(separate.out).values()) == 3 * MTP_LAYER


def _activations(cli, path: str) -> tuple[float, float]:
    """Return (weights MiB, activations MiB) of `memory`'s one stage."""
    result = cli("memory", "--from-script", path)
    assert result.code == 0, result.err
    row = next(line for line in result.out.splitlines() if line.startswith("0 "))
    cells = row.split()
    return float(cells[4]), float(cells[8])


@pytest.mark.skipif(not REPEATED, reason="megatron-core before 0.17 has no repeated MTP layer")
def test_memory_keeps_each_depths_activations(cli, tmp_path):
    # megatron's forward runs the one layer at each depth, each depth's activations kept for
    # the backward: as much as three layers', with a third of their weights
    weights, activations = _activations(cli, script(tmp_path, "--mtp-use-repeated-layer"))
    three_weights, three = _activations(cli, script(tmp_path, ""))
    one_weights, one = _activations(cli, script(tmp_path, "--mtp-use-repeated-layer", depths=1))
    assert activations == three > one
    assert weights == one_weights < three_weights


@pytest.mark.skipif(not REPEATED, reason="megatron-core before 0.17 has no repeated MTP layer")
def test_workload_runs_each_depth(cli, tmp_path):
    # FLOPs per depth (Megatron-LM's num_floating_point_operations counts --mtp-num-layers)
    repeated = cli("workload", "--from-script", script(tmp_path, "--mtp-use-repeated-layer"),
                   "--gpu", "h100", "--stage", "0")  # fmt: skip
    separate = cli("workload", "--from-script", script(tmp_path, ""), "--gpu", "h100", "--stage", "0")
    assert repeated.code == 0, repeated.err
    assert [line for line in repeated.out.splitlines() if line.startswith("mtp3_")]
    assert repeated.out == separate.out


@pytest.mark.skipif(not REPEATED, reason="megatron-core before 0.17 has no repeated MTP layer")
def test_workload_refuses_it_under_megatron_fsdp(cli, tmp_path):
    # the FSDP hooks of the one layer gather it at every depth: not modelled
    fsdp = ("--mtp-use-repeated-layer --use-megatron-fsdp --use-distributed-optimizer "
            "--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor")
    result = cli("workload", "--from-script", script(tmp_path, fsdp), "--gpu", "h100", "--stage", "0")
    assert (result.code, result.out) == (2, "")
    assert result.err.splitlines()[-1] == (
        "Error: workload does not run --mtp-use-repeated-layer under FSDP yet")
