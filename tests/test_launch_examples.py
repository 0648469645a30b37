"""Shapes of Megatron-LM's examples that stopped the reader, written here (not copied from them):
ModelOpt's conf/ files giving --padded-vocab-size, examples/rl model configs that leave their
tokenizer to the caller while naming a model this tool refuses.
"""

from __future__ import annotations

from pathlib import Path

import megatron.core
import pytest

from inspector.errors import ConfigError
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
    from inspector.job.model import ModelConfig, make_model_config

    assert make_model_config({"vocab_size": 1000, "padded_vocab_size": 1000}).embedding_rows(8) == 1000
    assert ModelConfig(vocab_size=1000).embedding_rows(8) == 1024
    assert "padded_vocab_size" not in ModelConfig().to_args()  # outputs of other jobs unchanged
    with pytest.raises(ConfigError):
        make_model_config({"padded_vocab_size": 0})
