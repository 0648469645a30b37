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
    job = make_job({**BASE, "recompute_granularity": "selective", "recompute_modules": "core_attn"})
    assert job.training.recompute_modules == ("core_attn",)


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
        (dict(recompute_granularity="selective", recompute_modules="core_attn,mlp"),
         "--recompute-modules mlp is not modelled"),
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
