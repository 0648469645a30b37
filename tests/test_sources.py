"""Config files and launch scripts: what they set, what they ignore, and how they fail."""

from __future__ import annotations

from pathlib import Path

import pytest

from inspector.errors import ConfigError, InputError
from inspector.presets import PRESETS
from inspector.sources import load_config_file, parse_launch_script, read_launch_script

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SCRIPTS, CONFIGS = FIXTURES / "scripts", FIXTURES / "configs"


def test_llama3_script_matches_the_preset():
    parsed = read_launch_script(str(SCRIPTS / "llama3_8b.sh"))
    preset = {k: v for k, v in PRESETS["llama3-8b"].args.items() if k != "transformer_impl"}
    architecture = {k: v for k, v in parsed.args.items() if k in preset}
    assert architecture == preset
    assert {
        k: parsed.args[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    } == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
    }
    assert parsed.args["bf16"] is True and parsed.args["use_distributed_optimizer"] is True
    # Batch sizes are training arguments `memory` reads; the rest is not modelled.
    assert (parsed.args["micro_batch_size"], parsed.args["global_batch_size"]) == (1, 1024)
    assert parsed.ignored == ("--rotary-base", "--lr", "--train-iters", "--tokenizer-type",
                              "--tokenizer-model", "--save", "--load")  # fmt: skip


def test_gpt3_script_with_string_variables():
    parsed = read_launch_script(str(SCRIPTS / "gpt3_175b.sh"))
    assert parsed.args == {
        "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "seq_length": 2048,
        "max_position_embeddings": 2048, "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 16, "fp16": True, "vocab_size": 50257,
        "micro_batch_size": 1, "global_batch_size": 1536,
    }  # fmt: skip
    assert parsed.ignored == ("--lr", "--lr-decay-style", "--vocab-file", "--merge-file",
                              "--save")  # fmt: skip


def test_mixtral_script_with_defaults_and_srun():
    parsed = read_launch_script(str(SCRIPTS / "mixtral_8x7b.sh"))
    assert parsed.args["expert_model_parallel_size"] == 8  # ${EP:-8}
    assert parsed.args["moe_grouped_gemm"] is True and parsed.args["num_experts"] == 8
    # --data-path's variable is never set, but we do not model it: ignored, not an error
    assert parsed.ignored == (
        "--moe-router-load-balancing-type",
        "--moe-aux-loss-coeff",
        "--data-path",
    )


def test_unset_variable_is_an_error():
    with pytest.raises(ConfigError) as error:
        read_launch_script(str(SCRIPTS / "unresolved.sh"))
    assert str(error.value).endswith(
        "unresolved.sh: --hidden-size is $HIDDEN_SIZE, and the script never sets HIDDEN_SIZE"
    )


def test_command_substitution_is_not_run():
    with pytest.raises(ConfigError, match=r"--num-layers is .*never sets \$\(\.\.\.\)"):
        parse_launch_script("L=$(cat layers.txt)\ntorchrun train.py --num-layers $L\n", "s.sh")


def test_script_without_training_command():
    with pytest.raises(InputError, match="found no training command"):
        read_launch_script(str(SCRIPTS / "no_launch.sh"))


def test_bad_value_in_script():
    with pytest.raises(ConfigError, match=r"s.sh: --num-layers needs int value, got 'many'"):
        parse_launch_script("python pretrain_gpt.py --num-layers many\n", "s.sh")


def test_comments_quotes_and_equals():
    text = 'python pretrain_gpt.py --normalization "RMSNorm" --num-layers=8 # --hidden-size 9\n'
    assert parse_launch_script(text, "s.sh").args == {"normalization": "RMSNorm", "num_layers": 8}


def test_yaml_and_json_configs():
    yaml = load_config_file(str(CONFIGS / "llama3_8b.yaml"))
    preset = {k: v for k, v in PRESETS["llama3-8b"].args.items() if k != "transformer_impl"}
    assert {k: v for k, v in yaml.items() if k in preset} == preset
    assert load_config_file(str(CONFIGS / "small.json")) == {
        "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1000,
        "pipeline_model_parallel_size": 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    "name, error, message",
    [
        (
            "broken.yaml",
            InputError,
            "broken.yaml line 3: not valid YAML (expected ',' or ']', but got '<stream end>')",
        ),
        (
            "typo.yaml",
            ConfigError,
            "typo.yaml: unknown argument 'hiden-size' (did you mean --hidden-size?)",
        ),
        ("missing.yaml", InputError, "missing.yaml does not exist"),
    ],
)
def test_config_errors(name, error, message):
    with pytest.raises(error) as raised:
        load_config_file(str(CONFIGS / name))
    assert str(raised.value).endswith(message)


def test_from_script_prints_the_same_table_as_flags(cli):
    script = cli("params", "--from-script", str(SCRIPTS / "llama3_8b.sh"))
    flags = cli("params", "--model", "llama3-8b", "--tp", "2", "--pp", "2", "--bf16")
    assert script.code == 0, script.err
    assert script.out == flags.out
    # the arguments it does not model are listed once, on stderr
    assert (
        script.err
        == f"Ignored from {SCRIPTS / 'llama3_8b.sh'}: --rotary-base --lr --train-iters --tokenizer-type --tokenizer-model --save --load\n"
    )


def test_precedence_flags_over_script_over_config_over_preset(cli):
    base = [
        "params",
        "--format",
        "json",
        "--model",
        "gpt2-small",
        "--config",
        str(CONFIGS / "small.json"),
    ]
    import json

    config = json.loads(cli(*base).out)["header"]["config"]
    assert (config["num_layers"], config["hidden_size"]) == (4, 64)
    flagged = json.loads(cli(*base, "--num-layers", "2").out)["header"]["config"]
    assert flagged["num_layers"] == 2


def test_scripts_and_config_files_mean_megatron_lms_default_transformer_impl():
    """A Megatron-LM job that names no --transformer-impl runs Transformer Engine; flags win."""
    from inspector.resolve import Sources, merge_sources

    groups = ("model", "layout")
    script = merge_sources(Sources(script=str(SCRIPTS / "llama3_8b.sh")), groups).args
    config = merge_sources(Sources(config_file=str(CONFIGS / "small.json")), groups).args
    flagged = merge_sources(
        Sources(config_file=str(CONFIGS / "small.json"), flags={"transformer_impl": "local"}), groups
    ).args
    assert script["transformer_impl"] == config["transformer_impl"] == "transformer_engine"
    assert flagged["transformer_impl"] == "local"
    assert "transformer_impl" not in merge_sources(Sources(), groups).args  # the default model
