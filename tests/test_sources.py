"""Config files and launch scripts: what they set, what they ignore, and how they fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.errors import ConfigError, InputError
from inspector.inputs.megatron_config import read_config
from inspector.inputs.presets import PRESETS
from inspector.inputs.sources import parse_launch_script, read_launch_script
from inspector.inputs.versions import null_tokenizer_adds_eod

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
    assert parsed.ignored == ("--rotary-base", "--lr", "--save", "--load")
    # the tokenizer file is not on this machine: the script's --vocab-size stands, with a note
    assert parsed.notes == (
        "HuggingFaceTokenizer /models/llama3/tokenizer.model cannot be read here; --vocab-size "
        "128256 from the script is used",
    )


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
    # passed to megatron-core's TransformerConfig (it decides whether top-1 routing is allowed)
    assert parsed.args["moe_router_load_balancing_type"] == "aux_loss"
    # --data-path's variable is never set, but we do not model it: ignored, not an error
    assert parsed.ignored == ("--moe-aux-loss-coeff", "--data-path")


def test_unset_variable_is_an_error():
    with pytest.raises(InputError) as error:
        read_launch_script(str(SCRIPTS / "unresolved.sh"))
    assert str(error.value).endswith(
        "unresolved.sh line 3: --hidden-size is $HIDDEN_SIZE, which the script never sets; "
        "give it with --set HIDDEN_SIZE=VALUE"
    )


def test_unset_variable_given_with_set():
    parsed = read_launch_script(str(SCRIPTS / "unresolved.sh"), {"HIDDEN_SIZE": "512"})
    assert parsed.args["hidden_size"] == 512


def test_command_substitution_is_not_run():
    with pytest.raises(InputError) as error:
        parse_launch_script("L=$(cat layers.txt)\ntorchrun train.py --num-layers $L\n", "s.sh")
    assert str(error.value) == (
        "s.sh line 2: --num-layers is $L, set on line 1 from $(cat layers.txt), which the reader "
        "never runs; give it with --set L=VALUE"
    )
    given = parse_launch_script(
        "L=$(cat layers.txt)\ntorchrun train.py --num-layers $L\n", "s.sh", {"L": "6"}
    )
    assert given.args == {"num_layers": 6}


def test_script_without_training_command():
    with pytest.raises(InputError, match="found no training command"):
        read_launch_script(str(SCRIPTS / "no_launch.sh"))


def test_bad_value_in_script():
    with pytest.raises(ConfigError, match=r"s.sh line 1: --num-layers needs int value, got 'many'"):
        parse_launch_script("python pretrain_gpt.py --num-layers many\n", "s.sh")


def test_comments_quotes_and_equals():
    text = 'python pretrain_gpt.py --normalization "RMSNorm" --num-layers=8 # --hidden-size 9\n'
    assert parse_launch_script(text, "s.sh").args == {"normalization": "RMSNorm", "num_layers": 8}


def test_yaml_and_json_configs():
    yaml = read_config(str(CONFIGS / "llama3_8b.yaml")).args
    preset = {k: v for k, v in PRESETS["llama3-8b"].args.items() if k != "transformer_impl"}
    assert {k: v for k, v in yaml.items() if k in preset} == preset
    assert read_config(str(CONFIGS / "small.json")).args == {
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
        read_config(str(CONFIGS / name))
    assert str(raised.value).endswith(message)


def test_from_script_prints_the_same_table_as_flags(cli):
    script = cli("params", "--from-script", str(SCRIPTS / "llama3_8b.sh"))
    # torchrun --nproc_per_node 8 --nnodes 2: 16 GPUs / (tp 2 x pp 2) = dp 4, as Megatron-LM computes it
    # its --use-distributed-optimizer makes megatron's shards the owners (--partitioning distopt)
    flags = cli("params", "--model", "llama3-8b", "--tp", "2", "--pp", "2", "--bf16", "--dp", "4",
                "--use-distributed-optimizer")  # fmt: skip
    assert script.code == 0, script.err
    assert script.out == flags.out
    # the arguments it does not model are listed once, on stderr, with how the vocabulary was found
    path = SCRIPTS / "llama3_8b.sh"
    assert script.err == (
        f"Ignored from {path}: --rotary-base --lr --save --load\n"
        f"Note from {path}: HuggingFaceTokenizer /models/llama3/tokenizer.model cannot be read here; "
        "--vocab-size 128256 from the script is used\n"
    )


def test_data_parallel_comes_from_the_launchers_world(cli):
    path = str(SCRIPTS / "llama3_8b.sh")
    header = cli("params", "--from-script", path, "--format", "json")
    assert header.code == 0, header.err
    import json

    assert json.loads(header.out)["header"]["topology"]["data_parallel_size"] == 4
    assert cli("params", "--from-script", path, "--dp", "4").code == 0
    wrong = cli("params", "--from-script", path, "--dp", "2")
    assert (wrong.code, wrong.out) == (2, "")
    assert wrong.err == (
        "Error: --dp 2 contradicts the script's world: 16 GPUs (torchrun --nproc_per_node 8 --nnodes 2 "
        f"({path} line 60)) / (--tp 2 x --pp 2 x --cp 1) = 4 data-parallel ranks\n"
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
    from inspector.inputs.resolve import Sources, merge_sources

    groups = ("model", "layout")
    script = merge_sources(Sources(script=str(SCRIPTS / "llama3_8b.sh")), groups).args
    config = merge_sources(Sources(config_file=str(CONFIGS / "small.json")), groups).args
    flagged = merge_sources(
        Sources(config_file=str(CONFIGS / "small.json"), flags={"transformer_impl": "local"}), groups
    ).args
    assert script["transformer_impl"] == config["transformer_impl"] == "transformer_engine"
    assert flagged["transformer_impl"] == "local"
    assert "transformer_impl" not in merge_sources(Sources(), groups).args  # the default model


@pytest.mark.parametrize(
    "name, text, message",
    [
        # a repeated key: YAML and JSON would silently keep the last one
        ("twice.yaml", "num-layers: 4\nhidden-size: 64\nnum-layers: 8\n",
         "twice.yaml line 3: the key 'num-layers' appears twice (first on line 1)"),
        ("twice.json", '{"num_layers": 4, "num_layers": 8}',
         "twice.json: the key 'num_layers' appears twice"),
        # two spellings of one argument
        ("spellings.yaml", "num-layers: 4\nnum_layers: 8\n",
         "spellings.yaml: 'num-layers' and 'num_layers' both set --num-layers"),
        ("spellings.json", '{"--hidden-size": 4, "hidden_size": 8}',
         "spellings.json: '--hidden-size' and 'hidden_size' both set --hidden-size"),
    ],
)  # fmt: skip
def test_duplicate_keys_in_config_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(InputError) as raised:
        read_config(str(path))
    assert str(raised.value) == f"{tmp_path}/{message}"


def test_a_key_repeated_with_its_value_is_one_setting(tmp_path):
    # Megatron-LM's functional-test model_config.yaml files repeat a few keys, each time with
    # the same value: one meaning, read as PyYAML reads it
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --ffn-hidden-size: 256\n"
                    "  --ffn-hidden-size: 256\n  --hidden-size: 64\n")  # fmt: skip
    assert read_config(str(path)).args["ffn_hidden_size"] == 256


def test_the_runners_run_counters_read_as_its_first_run(tmp_path):
    # Megatron-LM's runner envsubsts its own variables into the file (_run_training.sh); a seed
    # written ${REPEAT} is 1 on the first run, which argparse then reads as an int
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 4\n  --hidden-size: 64\n  --seed: ${REPEAT}\n"
                    "  --log-interval: $RUN_NUMBER\n")  # fmt: skip
    parsed = read_config(str(path))
    assert parsed.args["num_layers"] == 4
    assert "the runner's $REPEAT and $RUN_NUMBER are read as 1 (its first run, which it envsubsts)" \
        in parsed.notes


@pytest.mark.parametrize(
    "name, world, origin",
    [
        ("gpt3_175b.sh", 1024, "python -m torch.distributed.run --nproc_per_node 8 --nnodes 128"),
        ("llama3_8b.sh", 16, "torchrun --nproc_per_node 8 --nnodes 2"),
        ("mixtral_8x7b.sh", 8, "torchrun --nproc_per_node 8"),
    ],
)
def test_world_size_of_example_scripts(name, world, origin):
    parsed = read_launch_script(str(SCRIPTS / name))
    assert parsed.world_size == world
    assert parsed.world_origin.startswith(f"{origin} ({SCRIPTS / name} line ")


def _sentencepiece_model(pieces: int) -> bytes:
    """A minimal sentencepiece ModelProto: `pieces` SentencePiece messages (field 1) and a
    trainer spec (field 2), as protobuf encodes them."""
    piece = b"\x0a\x01a\x15\x00\x00\x00\x00"  # piece: "a", score: 0.0
    return (b"\x0a" + bytes([len(piece)]) + piece) * pieces + b"\x12\x02\x08\x01"


def _launch(tokenizer: str) -> str:
    return f"torchrun pretrain_gpt.py --num-layers 2 {tokenizer}\n"


def test_vocabulary_from_local_tokenizer_files(tmp_path):
    model = tmp_path / "tokenizer.model"
    model.write_bytes(_sentencepiece_model(300))
    parsed = parse_launch_script(
        _launch(f"--tokenizer-type Llama2Tokenizer --tokenizer-model {model}"), "s.sh"
    )
    assert parsed.args["vocab_size"] == 300
    assert parsed.notes == (f"Llama2Tokenizer {model}: 300 tokens (300 pieces in {model})",)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps({
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "<s>": 2}},
        "added_tokens": [{"id": 2, "content": "<s>"}, {"id": 3, "content": "<pad>"}],
    }))  # fmt: skip
    parsed = parse_launch_script(
        _launch(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {folder}"), "s.sh"
    )
    assert parsed.args["vocab_size"] == 4  # 3 in the model + <pad>; <s> is already there
    assert "--tokenizer-type" not in parsed.ignored


@pytest.mark.parametrize(
    "tokenizer, size, problem",
    [
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B",
         128256, ""),
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model mistralai/Mixtral-8x7B-v0.1",
         32000, ""),
        ("--tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json", 50257, ""),
        # len(tokenizer), added tokens included (_HuggingFaceTokenizer.vocab_size): Qwen3's
        # tokenizer.json holds ids 0-151668, Qwen2.5's 0-151664
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen3-8B", 151669, ""),
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen2.5-7B-Instruct",
         151665, ""),
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Llama-3.2-1B-Instruct",
         128256, ""),
        # DeepSeek's Qwen distillations: Qwen2.5's BPE, their own 22 added tokens (ids 151643-151664)
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model "
         "unsloth/DeepSeek-R1-Distill-Qwen-7B", 151665, ""),
        ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model nvidia/Llama-3.1-70B-Instruct-FP8",
         128256, ""),
        # its end-of-document token up to megatron-core 0.17 (tests/test_versions.py)
        ("--tokenizer-type NullTokenizer --vocab-size 1000", 1000 + null_tokenizer_adds_eod(), ""),
        # not on this machine, not a known hub name, no --vocab-size: never a silent default
        ("--tokenizer-type Llama2Tokenizer --tokenizer-model /models/x/tokenizer.model", None,
         "s.sh line 1: the vocabulary of --tokenizer-type Llama2Tokenizer --tokenizer-model "
         "/models/x/tokenizer.model is not known here (no such file on this machine, nor a "
         "tokenizer this tool knows); give --vocab-size"),
        ("--tokenizer-type NullTokenizer", None, "s.sh line 1: NullTokenizer needs --vocab-size"),
    ],
)  # fmt: skip
def test_vocabulary_from_tokenizer_names(tokenizer, size, problem):
    parsed = parse_launch_script(_launch(tokenizer), "s.sh")
    assert parsed.args.get("vocab_size") == size
    assert parsed.vocab_problem == problem
