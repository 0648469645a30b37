"""--recompute-modules and --moe-layer-recompute: read and checked as megatron-core 0.16 does."""

from __future__ import annotations

import pytest

from inspector.errors import ConfigError
from inspector.job.job import make_job

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
            micro_batch_size=1, bf16=True, transformer_impl="local")  # fmt: skip


def test_default_modules_are_core_attn_as_in_transformer_config():
    job = make_job({**BASE, "recompute_granularity": "selective"})
    assert job.training.recompute_modules == ("core_attn",)


def test_modules_read_space_or_comma_separated():
    job = make_job({**BASE, "recompute_granularity": "selective", "recompute_modules": "core_attn, mlp",
                    "disable_bias_linear": True})  # fmt: skip
    assert job.training.recompute_modules == ("core_attn", "mlp")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (dict(recompute_granularity="selective", recompute_modules="attn"), "--recompute-modules attn"),
        (dict(recompute_modules="core_attn"), "needs --recompute-granularity selective"),
        (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              moe_layer_recompute=True), "--moe-layer-recompute"),
        (dict(recompute_granularity="selective", recompute_modules="moe_act"), "--moe-grouped-gemm"),
        (dict(recompute_granularity="selective", recompute_modules="mla_up_proj"),
         "--multi-latent-attention"),
        (dict(recompute_granularity="selective", recompute_modules="core_attn,layernorm"),
         "--recompute-modules layernorm is not modelled"),
        (dict(recompute_granularity="selective", recompute_modules="mlp"), "--disable-bias-linear"),
    ],  # fmt: skip
)
def test_invalid_combinations_name_the_flag(flags, words):
    with pytest.raises(ConfigError, match=words):
        make_job({**BASE, **flags})


def test_moe_layer_recompute_turns_selective_and_adds_moe():
    from inspector.job.recompute_modules import parse_modules

    assert parse_modules({"moe_layer_recompute": True}, "none") == ("selective", ("core_attn", "moe"))


def test_a_script_passes_every_word_after_the_flag(tmp_path):
    from inspector.inputs.sources import read_launch_script

    script = tmp_path / "train.sh"
    script.write_text(
        "torchrun pretrain_gpt.py --num-layers 2 --recompute-granularity selective "
        "--recompute-modules core_attn mlp --bf16\n"
    )
    args = read_launch_script(str(script)).args
    assert args["recompute_modules"] == "core_attn mlp" and args["bf16"] is True


def test_engine_stops_saving_the_mlp_inner_tensors_under_mlp():
    """transformer_layer.py _forward_mlp: tensor_parallel.checkpoint keeps the MLP's input only, so
    each layer stops holding fc1's output (saved by the gelu, [s, b, ffn/tp] bf16) and the gelu's
    output (saved by fc2, the same shape): 2 x 32 x 2 x 128 x 2 bytes per layer (ffn 4h = 256, tp 2)."""
    from inspector.engine.memory import chunk_shapes
    from inspector.engine.stage import trace_chunks
    from inspector.world.build import View, build

    args = dict(BASE, micro_batch_size=2, global_batch_size=8, tensor_model_parallel_size=2,
                data_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0,
                disable_bias_linear=True)  # fmt: skip

    def held(**flags):
        job = make_job({**args, **flags})
        shapes = chunk_shapes(build(job, View((0,)), expert_ranks=(0,)).stages[0])
        return trace_chunks(job, 0, shapes, whole=True)[0].held

    plain, mlp = held(), held(recompute_granularity="selective", recompute_modules="mlp")
    per_layer = 2 * 32 * 2 * 128 * 2
    # the checkpoint itself keeps at most one 512-byte allocator block per layer
    assert 2 * per_layer - 2 * 512 <= plain - mlp <= 2 * per_layer


def test_the_formula_fallback_refuses_modules_it_does_not_count(cli):
    result = cli("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
                 "--disable-bias-linear", "--transformer-impl", "transformer_engine",
                 "--cp", "2", "--use-flash-attn",  # TE's context parallelism: not run by the engine
                 "--recompute-granularity", "selective", "--recompute-modules", "core_attn mlp")  # fmt: skip
    assert result.code == 2 and result.err.startswith("Error: --recompute-modules mlp is measured by the engine only")
