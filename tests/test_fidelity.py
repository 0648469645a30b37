"""The built-in fidelity checks catch a broken engine: exit 3, no table printed."""

from __future__ import annotations

import dataclasses

from inspector.world import stage as world
from inspector.world import walk

ARGS = [
    "params",
    "--num-layers",
    "4",
    "--pp",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
]


def test_dropping_a_parameter_is_caught(cli, monkeypatch):
    original = walk.walk_params

    def lossy(stage, tp, etp):
        records = list(original(stage, tp, etp))
        return [r for r in records if r.name != "decoder.layers.3.mlp.linear_fc2.weight"]

    monkeypatch.setattr(walk, "walk_params", lossy)
    result = cli(*ARGS)
    assert result.code == 3 and result.out == ""
    assert result.err.startswith(
        "Error: internal check failed, this is a bug in inspect-model: stage 1:"
    )
    assert "sharded_state_dict() reports" in result.err


def test_wrong_global_shape_is_caught(cli, monkeypatch):
    original = walk.walk_params

    def unsharded(stage, tp, etp):  # forgets the tensor-parallel factor
        return list(original(stage, 1, 1))

    monkeypatch.setattr(walk, "walk_params", unsharded)
    result = cli(*ARGS, "--tp", "2")
    assert result.code == 3 and result.out == ""


def test_dropping_a_layer_is_caught(cli, monkeypatch):
    original = world.build_stage

    def forgetful(model, layout, stage, expert_rank=0):
        chunks = original(model, layout, stage, expert_rank)
        if stage == 1:  # an engine that loses the stage's last layer after megatron built it
            for chunk in chunks:
                layers = chunk.module.decoder.layers
                del layers[len(layers) - 1]
            chunks = [dataclasses.replace(c, layer_numbers=c.layer_numbers[:-1]) for c in chunks]
        return chunks

    monkeypatch.setattr(world, "build_stage", forgetful)
    result = cli(*ARGS)
    assert result.code == 3 and result.out == ""
    assert "this is a bug" in result.err


def test_the_unmutated_engine_passes(cli):
    assert cli(*ARGS).code == 0
