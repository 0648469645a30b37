"""Shapes of Megatron-LM's examples that stopped the reader, written here (not copied from them):
ModelOpt's conf/ files giving --padded-vocab-size, examples/rl model configs that leave their
tokenizer to the caller while naming a model this tool refuses.
"""

from __future__ import annotations

from pathlib import Path

import megatron.core
import pytest

from inspector.errors import ConfigError, InputError
from inspector.inputs.sources import parse_launch_script
from inspector.inputs.tokenizers import vocabulary

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
PADDED_VOCAB_KNOWN = VERSION >= (0, 18)  # training_config.py TokenizerConfig.padded_vocab_size
SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 1 --transformer-impl local")  # fmt: skip

# conf/NAME.sh sets MODEL_ARGS and the tokenizer; the launcher script sources it by name ($1)
CONF = """\
TOKENIZER_MODEL=my-org/my-model
MODEL_ARGS=" \\
    {small} \\
    --padded-vocab-size {rows} \\
    --tokenizer-type HuggingFaceTokenizer \\
"
"""
LAUNCH = """\
SCRIPT_DIR="$(dirname "$(readlink -f "$0")")"
source "${{SCRIPT_DIR}}/conf/${{1}}.sh"
torchrun --nproc_per_node={gpus} ${{SCRIPT_DIR}}/finetune.py ${{MODEL_ARGS}} \\
    --tensor-model-parallel-size {tp} --tokenizer-model ${{TOKENIZER_MODEL}}
"""


def _modelopt(tmp_path: Path, rows: int, tp: int = 1, gpus: int = 1) -> str:
    (tmp_path / "conf").mkdir(exist_ok=True)
    (tmp_path / "conf" / "mine.sh").write_text(CONF.format(small=SMALL, rows=rows))
    launch = tmp_path / "finetune.sh"
    launch.write_text(LAUNCH.format(gpus=gpus, tp=tp))
    return str(launch)


def test_padded_vocab_size_is_the_embedding_rows(tmp_path, cli):
    # 1000 rows: no padding to a multiple of 128, and the tokenizer (unknown here) is not needed
    path = _modelopt(tmp_path, 1000)
    result = cli("params", "--from-script", path, "--set", "1=mine")
    assert result.code == 0, result.err
    assert "embedding.word_embeddings.weight;VocabParallelEmbedding();(1000, 64);" in result.out
    assert (f"Note from {path}: --padded-vocab-size 1000: the embedding has 1000 rows whatever "
            "the tokenizer's vocabulary (HuggingFaceTokenizer), as Megatron-LM 0.18+ builds "
            "it\n") in result.err  # fmt: skip
    # the same job without it needs the tokenizer's vocabulary, which is not known here
    assert vocabulary("HuggingFaceTokenizer", "my-org/my-model", None, None, "s").size is None


def test_padded_vocab_size_notes_an_older_megatron_lm(tmp_path, cli):
    path = _modelopt(tmp_path, 1024)
    result = cli("params", "--from-script", path, "--set", "1=mine")
    assert result.code == 0, result.err
    note = (f"--padded-vocab-size is not an argument of Megatron-LM {VERSION[0]}.{VERSION[1]} "
            "(the installed megatron-core; added in 0.18)")  # fmt: skip
    assert (note in result.err) == (not PADDED_VOCAB_KNOWN)


def test_padded_vocab_size_at_tensor_parallel_two(tmp_path, cli):
    path = _modelopt(tmp_path, 1000, tp=2, gpus=2)
    result = cli("params", "--from-script", path, "--set", "1=mine")
    assert result.code == 0, result.err
    assert "VocabParallelEmbedding();(500, 64);" in result.out  # each rank holds half


def test_padded_vocab_size_must_split_over_tensor_parallel_ranks(tmp_path, cli):
    path = _modelopt(tmp_path, 1002, tp=4, gpus=4)
    result = cli("params", "--from-script", path, "--set", "1=mine")
    assert result.code == 2
    assert result.err.endswith(
        "\nError: --padded-vocab-size 1002 is not divisible by --tp 4 (1002 % 4 = 2); megatron "
        "splits the embedding rows evenly over tensor-parallel ranks\n")  # fmt: skip


def test_padded_vocab_size_on_the_command_line():
    from inspector.job.model import ModelConfig
    from inspector.job.model_args import make_model_config

    assert make_model_config({"vocab_size": 1000, "padded_vocab_size": 1000}).embedding_rows(8) == 1000
    assert ModelConfig(vocab_size=1000).embedding_rows(8) == 1024
    assert "padded_vocab_size" not in ModelConfig().to_args()  # outputs of other jobs unchanged
    with pytest.raises(ConfigError):
        make_model_config({"padded_vocab_size": 0})


# examples/rl/model_configs/NAME.sh, sourced before the README's `torchrun ... train_rl.py`
RL_CONFIG = """\
TP=${{TP:-2}}
MODEL_OPTIONS="\\
  {small} {model} \\
  --tokenizer-type TikTokenizer \\
  --tokenizer-model ${{TOKENIZER_MODEL}} \\
  --tensor-model-parallel-size $TP"
"""
RL_LAUNCH = """\
source {config}
torchrun --nproc-per-node=2 train_rl.py --perform-rl-step ${{MODEL_OPTIONS}} $@
"""


def _rl(tmp_path: Path, model: str) -> str:
    config = tmp_path / "my_model.sh"
    config.write_text(RL_CONFIG.format(small=SMALL, model=model))
    launch = tmp_path / "rl.sh"
    launch.write_text(RL_LAUNCH.format(config=config))
    return str(launch)


def test_a_refused_model_and_its_unset_values_in_one_error(tmp_path):
    # the tokenizer is left to the caller, and the model is hybrid: both named at once
    path = _rl(tmp_path, "--hybrid-layer-pattern M*M- --mamba-head-dim 64")
    with pytest.raises(InputError) as error:
        parse_launch_script(Path(path).read_text(), path)
    assert str(error.value) == (
        f"{path} line 2: --hybrid-layer-pattern M*M- and --mamba-head-dim 64 are not modelled: "
        "this tool builds megatron-core's GPTModel; hybrid (Mamba) models are not modelled; "
        f"{path} line 2: --tokenizer-model is ${{TOKENIZER_MODEL}}, which the script never sets; "
        "give it with --set TOKENIZER_MODEL=VALUE"
    )


def test_unset_values_alone_when_nothing_is_refused(tmp_path):
    path = _rl(tmp_path, "")
    with pytest.raises(InputError) as error:
        parse_launch_script(Path(path).read_text(), path)
    assert str(error.value) == (
        f"{path} line 2: --tokenizer-model is ${{TOKENIZER_MODEL}}, which the script never sets; "
        "give it with --set TOKENIZER_MODEL=VALUE"
    )


def test_use_checkpoint_args_is_refused(tmp_path, cli):
    # Megatron-LM's load_args_from_checkpoint replaces num_layers, hidden_size, ... (most with
    # force=True): the script's own model is not the one trained
    path = _rl(tmp_path, "--use-checkpoint-args --vocab-size 1000")
    result = cli("params", "--from-script", path, "--set", "TOKENIZER_MODEL=t")
    assert result.code == 2
    assert result.err.endswith(
        f"Error: {path} line 2: --use-checkpoint-args is not modelled: Megatron-LM then takes "
        "the model's architecture from the checkpoint it loads (over the script's own "
        "arguments), which this tool cannot read; drop it and give the model's arguments\n"
    )


def test_plan_offers_only_tensor_parallel_sizes_that_split_the_rows():
    from inspector.job.hardware import DEFAULT_GPU, get_gpu
    from inspector.job.model import ModelConfig
    from inspector.plan.layouts import _tp_choices
    from inspector.plan.request import Request

    gpu = get_gpu(DEFAULT_GPU)
    for rows, choices in ((1024, [1, 2, 4, 8]), (1002, [1, 2]), (None, [1, 2, 4, 8])):
        model = ModelConfig(num_attention_heads=8, hidden_size=64, padded_vocab_size=rows)
        request = Request(model, gpus=8, gpu=gpu, memory=80 << 30, global_batch_size=8)
        assert _tp_choices(request) == choices, rows


def test_spec_is_named_with_both_its_words(tmp_path):
    # Megatron-LM's --spec takes nargs='*' (<module> <function>): the refusal shows both
    path = _rl(tmp_path, "--vocab-size 1000 --spec my.module my_spec_fn")
    with pytest.raises(InputError) as error:
        parse_launch_script(Path(path).read_text(), path)
    assert str(error.value).startswith(
        f"{path} line 2: --spec my.module my_spec_fn is not modelled: a custom layer spec module "
        "cannot be imported here; "
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        # megatron-core gpt_layer_specs: L2Norm (no weights) in place of the q/k layernorms
        ("--qk-layernorm --export-qk-l2-norm",
         "--export-qk-l2-norm is not modelled: Llama 4's L2 norm of queries and keys "
         "(megatron-core L2Norm, no weights, in place of --qk-layernorm's norms) is not modelled"),
        ("--qk-l2-norm",
         "--qk-l2-norm is not modelled: Llama 4's L2 norm of queries and keys (megatron-core "
         "L2Norm, no weights, in place of --qk-layernorm's norms) is not modelled"),
        ("--export-kd-teacher-load /ckpt/teacher",
         "--export-kd-teacher-load /ckpt/teacher is not modelled: ModelOpt's distillation holds a "
         "teacher model beside the one trained, which this tool does not build"),
        ("--export-model-type HybridModel",
         "--export-model-type HybridModel is not modelled: this tool builds megatron-core's "
         "GPTModel; hybrid (Mamba) models are not modelled"),
        ("--no-position-embedding",
         "--no-position-embedding without rope is refused by Megatron-LM: validate_args: "
         "'--no-position-embedding is deprecated, use --position-embedding-type'"),
    ],
)  # fmt: skip
def test_modelopt_and_megatron_lm_arguments_that_change_the_model(tmp_path, cli, extra, message):
    path = tmp_path / "s.sh"
    path.write_text(f"python finetune.py {SMALL} --vocab-size 1000 {extra}\n")
    result = cli("params", "--from-script", str(path))
    assert result.code == 2
    assert result.err.endswith(f"Error: {path} line 1: {message}\n")


def test_modelopt_arguments_that_change_nothing_a_gpu_holds(tmp_path, cli):
    path = tmp_path / "s.sh"
    path.write_text(f"python finetune.py {SMALL} --vocab-size 1000 --position-embedding-type rope "
                    "--no-position-embedding --export-model-type GPTModel --export-te-mcore-model "
                    "--finetune-hf-dataset my/data --export-moe-apply-probs-on-input\n")  # fmt: skip
    result = cli("params", "--from-script", str(path))
    assert result.code == 0, result.err
    assert "Not recognised" not in result.err


def test_tokenizer_hf_include_special_tokens_lives_from_0_16_to_0_17():
    # examples/rl's Qwen3-30B-A3B config still passes it; 0.18 folded it into TokenizerConfig
    from inspector.inputs.unmodelled import IGNORED
    from inspector.inputs.versions import argument_unknown_note

    assert "--tokenizer-hf-include-special-tokens" in IGNORED
    note = argument_unknown_note("--tokenizer-hf-include-special-tokens")
    assert (note is None) == ((0, 16) <= VERSION < (0, 18))
