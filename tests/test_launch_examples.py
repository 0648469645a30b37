"""Shapes of Megatron-LM's examples that stopped the reader, written here (not copied from them):
ModelOpt's conf/ files giving --padded-vocab-size, examples/rl model configs that leave their
tokenizer to the caller while naming a model this tool refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import megatron.core
import pytest

from inspector.errors import ConfigError, InputError
from inspector.inputs.sources import parse_launch_script
from inspector.inputs.tokenizers import vocabulary
from inspector.inputs.unmodelled import refusal_message
from tests.test_versions import GPT_OSS as GPT_OSS_BUILDS

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
PADDED_VOCAB_KNOWN = VERSION >= (0, 14)  # arguments.py --padded-vocab-size (core_v0.14.0)
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
            "the tokenizer's vocabulary (HuggingFaceTokenizer), as Megatron-LM 0.14+ builds "
            "it\n") in result.err  # fmt: skip
    # the same job without it needs the tokenizer's vocabulary, which is not known here
    assert vocabulary("HuggingFaceTokenizer", "my-org/my-model", None, None, "s").size is None


def test_padded_vocab_size_notes_an_older_megatron_lm(tmp_path, cli):
    path = _modelopt(tmp_path, 1024)
    result = cli("params", "--from-script", path, "--set", "1=mine")
    assert result.code == 0, result.err
    note = (f"--padded-vocab-size is not an argument of Megatron-LM {VERSION[0]}.{VERSION[1]} "
            "(the installed megatron-core; added in 0.14)")  # fmt: skip
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
    assert result.err == (  # the script's notes are said only once the job is accepted
        "Error: --padded-vocab-size 1002 is not divisible by --tp 4 (1002 % 4 = 2); megatron "
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
    # the tokenizer is left to the caller, and the model is refused: both named at once
    path = _rl(tmp_path, "--qk-l2-norm")
    with pytest.raises(InputError) as error:
        parse_launch_script(Path(path).read_text(), path)
    assert str(error.value) == (
        f"{path} line 2: --qk-l2-norm is not modelled: Llama 4's L2 norm of queries and keys "
        "(megatron-core L2Norm, no weights, in place of --qk-layernorm's norms) is not modelled; "
        f"{path} line 2: --tokenizer-model is ${{TOKENIZER_MODEL}}, which the script never sets; "
        "give it with --set TOKENIZER_MODEL=VALUE"
    )


def test_unset_values_alone_when_nothing_is_refused(tmp_path):
    path = _rl(tmp_path, "")
    with pytest.raises(InputError) as error:
        parse_launch_script(Path(path).read_text(), path)
    assert str(error.value) == (
        f"{path} line 2: --tokenizer-model is ${{TOKENIZER_MODEL}}, which the script never sets; "
        "give it with --set TOKENIZER_MODEL=VALUE; the tokenizer's vocabulary is then read from "
        "that file where it is on this machine (or from a tokenizer this tool knows); "
        "--vocab-size gives it otherwise"
    )
    # --vocab-size alone is enough: the tokenizer's file is then not needed (Mixtral's example
    # leaves --tokenizer-model to its $2)
    args = parse_launch_script(Path(path).read_text(), path, given={"vocab_size"}).args
    assert args["num_layers"] == 2


def test_use_checkpoint_args_is_refused(tmp_path, cli):
    # Megatron-LM's load_args_from_checkpoint replaces num_layers, hidden_size, ... (most with
    # force=True): the script's own model is not the one trained
    path = _rl(tmp_path, "--use-checkpoint-args --vocab-size 1000")
    result = cli("params", "--from-script", path, "--set", "TOKENIZER_MODEL=t")
    assert result.code == 2
    assert result.err.endswith(
        f"Error: {path} line 2: --use-checkpoint-args is not modelled: Megatron-LM then takes "
        "the model's architecture from the checkpoint it loads (checkpointing.py "
        "load_args_from_checkpoint), which this tool cannot read, and the job does not give "
        "--ffn-hidden-size, --num-query-groups, --kv-channels, --normalization, "
        "--position-embedding-type; give them, or drop it\n"
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
         "--export-model-type HybridModel is not modelled: ModelOpt's builder for a model "
         "other than GPTModel (its own MambaModel layer spec) is not modelled"),
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
    from inspector.inputs.ignored import IGNORED
    from inspector.inputs.versions import argument_unknown_note

    assert "--tokenizer-hf-include-special-tokens" in IGNORED
    note = argument_unknown_note("--tokenizer-hf-include-special-tokens")
    assert (note is None) == ((0, 16) <= VERSION < (0, 18))


# examples/post_training/modelopt/eagle3.sh: conf/arguments.sh reads the model's conf by name ($1),
# then the EAGLE-3 conversion runs only where its checkpoint folder is missing, then finetune.py
# trains from that checkpoint
EAGLE_ARGUMENTS = """\
set -e
MLM_MODEL_CFG=${1}
if [ -z $1 ]; then
    printf "give a model name\\n"
    exit 1
fi
if [ -z ${MLM_WORK_DIR} ]; then
    export MLM_WORK_DIR=/tmp/workspace
fi
if [ -z ${TP} ]; then
    TP=1
fi
LAUNCH_SCRIPT="torchrun --nproc_per_node=${TP}"
source "${SCRIPT_DIR}/conf/${MLM_MODEL_CFG}.sh"
"""
EAGLE_CONF = f"""\
TOKENIZER_MODEL=my-org/my-model
MODEL_ARGS=" {SMALL} --vocab-size 1000 --tokenizer-type NullTokenizer "
"""
EAGLE_LAUNCH = """\
SCRIPT_DIR="$(dirname "$(readlink -f "$0")")"
source "${{SCRIPT_DIR}}/conf/arguments.sh"
CONVERT_ARGS="{convert}"
if [ -z ${{MLM_MODEL_SAVE}} ]; then
    MLM_MODEL_SAVE=${{MLM_WORK_DIR}}/${{MLM_MODEL_CFG}}-Draft
fi
{guard}
${{LAUNCH_SCRIPT}} ${{SCRIPT_DIR}}/finetune.py ${{MODEL_ARGS}} \\
    --tensor-model-parallel-size ${{TP}} --tokenizer-model ${{TOKENIZER_MODEL}} \\
    --load ${{MLM_MODEL_SAVE}} --save ${{MLM_MODEL_SAVE}} --finetune
"""
CONVERT = ("${LAUNCH_SCRIPT} ${SCRIPT_DIR}/convert_model.py ${MODEL_ARGS} "
           "--tensor-model-parallel-size ${TP} --save ${MLM_MODEL_SAVE} ${CONVERT_ARGS}")  # fmt: skip
GUARDS = {
    "if": f"if [[ ! -d ${{MLM_MODEL_SAVE}} ]]; then\n    {CONVERT}\nfi",
    "else": f"if [ -d ${{MLM_MODEL_SAVE}} ]; then\n    echo found\nelse\n    {CONVERT}\nfi",
    "or": f"[ -d ${{MLM_MODEL_SAVE}} ] || {CONVERT}",
    "none": CONVERT,  # run every time: two launches, the conversion first
}


def _eagle(tmp_path: Path, guard: str, convert: str = "--algorithm eagle3") -> Path:
    folder = tmp_path / "examples" / "post_training" / "modelopt"
    (folder / "conf" / "org").mkdir(parents=True)
    (folder / "conf" / "arguments.sh").write_text(EAGLE_ARGUMENTS)
    (folder / "conf" / "org" / "small.sh").write_text(EAGLE_CONF)
    launch = folder / "eagle3.sh"
    launch.write_text(EAGLE_LAUNCH.format(convert=convert, guard=GUARDS[guard]))
    return launch


@pytest.mark.parametrize("guard", ["if", "else", "or", "none"])
def test_eagle3_draft_training_is_refused(tmp_path, cli, guard):
    path = _eagle(tmp_path, guard)
    result = cli("params", "--from-script", str(path), "--set", "1=org/small")
    assert (result.code, result.out) == (2, "")  # one error, no table
    line = {"if": 8, "else": 10, "or": 7, "none": 7}[guard]
    assert result.err == (
        f"Error: {path} line {line}: the script converts its model for speculative decoding "
        "(convert_model.py --algorithm eagle3): ModelOpt's finetune.py then trains the draft "
        "module that conversion adds (its architecture is ModelOpt's) on a frozen base model; "
        "this tool builds and trains the GPTModel of the arguments only, and does not model the "
        "draft module or frozen parameters\n"
    )


@pytest.mark.parametrize("convert", ["", "--algorithm None", "--algorithm=None"])
def test_a_conversion_without_a_draft_module_leaves_the_finetune_read(tmp_path, cli, convert):
    # the same script, converting without a speculative algorithm: finetune.py trains GPTModel
    path = _eagle(tmp_path, "if", convert)
    result = cli("params", "--from-script", str(path), "--set", "1=org/small")
    assert result.code == 0, result.err
    assert "embedding.word_embeddings.weight;VocabParallelEmbedding();(1024, 64);" in result.out
    assert "took `-d /tmp/workspace/org/small-Draft` as true" in result.err


def test_a_skipped_branch_changes_nothing_but_its_launches(tmp_path):
    # the branch a file test skips is read for its launches only: its assignments, notes, exits
    # and unset values stay out of the reading
    path = tmp_path / "s.sh"
    path.write_text(
        "if [ ! -f /data/index ]; then\n  LAYERS=8; echo $NEVER_SET; exit 1\nfi\n"
        f"[ -e /data/index ] || LAYERS=6\npython pretrain_gpt.py {SMALL.replace('2', '${LAYERS:-2}', 1)} "
        "--vocab-size 1000\n"
    )  # fmt: skip
    script = parse_launch_script(path.read_text(), str(path))
    assert script.args["num_layers"] == 2
    assert [n.split(": ", 1)[1] for n in script.notes if "took" in n] == [
        "took `-f /data/index` as true (the reader assumes /data/index is a file on the job's "
        "machine)",
        "took `-e /data/index` as true (the reader assumes /data/index exists on the job's "
        "machine)",
    ]


def test_sft_tokenizer_reports_the_hugging_face_tokenizer_length(tmp_path, cli):
    # examples/post_training/modelopt/train.sh: --sft --tokenizer-type SFTTokenizer, whose
    # vocab_size is len() of the Hugging Face tokenizer, as HuggingFaceTokenizer's
    path = tmp_path / "train.sh"
    path.write_text(f"torchrun --nproc_per_node=1 pretrain_gpt.py {SMALL} --sft "
                    "--tokenizer-type SFTTokenizer "
                    "--tokenizer-model nvidia/Llama-3.1-70B-Instruct-FP8\n")  # fmt: skip
    result = cli("params", "--from-script", str(path))
    assert result.code == 0, result.err
    assert "VocabParallelEmbedding();(128256, 64);" in result.out  # 128256 = 1002 x 128
    assert ("SFTTokenizer nvidia/Llama-3.1-70B-Instruct-FP8: 128256 tokens (Llama 3.1's "
            "tokenizer: 128000 BPE + 256 special tokens)") in result.err  # fmt: skip
    unknown = vocabulary("SFTTokenizer", "my-org/my-model", None, None, "s")
    assert unknown.size is None and "give --vocab-size" in unknown.problem


def test_flex_token_dispatcher_with_hybridep_is_read(tmp_path, cli):
    # examples/megatron_fsdp's DeepSeek-V3 script: Megatron-LM accepts `flex` (DeepEP/HybridEP);
    # both are modelled (tests/test_flex_memory.py, tests/test_hybrid_ep.py): memory stops on the
    # fp4 parameters alone, and the parameters are still read
    moe = "--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2 --disable-bias-linear"
    path = tmp_path / "s.sh"
    path.write_text(f"torchrun --nproc_per_node=2 pretrain_gpt.py {SMALL} --vocab-size 1000 {moe} "
                    "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
                    "--fp4-param-gather\n")  # fmt: skip
    memory = cli("memory", "--from-script", str(path))
    assert memory.code == 2
    refused = refusal_message("--fp4-param-gather", None)  # modelled from megatron-core 0.18
    assert memory.err.startswith(f"Error: {path} line 1: {refused}" if refused else
                                 "Error: --fp4-param-gather needs --fp4-format")  # fmt: skip
    params = cli("params", "--from-script", str(path))  # 0.18+: megatron's TransformerConfig stops
    assert params.code == (0 if refused else 2), params.err


# examples/gptoss/02_train.sh (Megatron-LM 0.17+), in its shape: options parsed from the caller,
# guards on paths, MODEL_ARGS with gpt-oss's layers, MoE with grouped GEMM, fp8 with fp8
# parameters, the pipeline over every GPU, mock data by default (NullTokenizer, --vocab-size)
GPT_OSS = """\
CHECKPOINT_PATH="NO_VALUE_PROVIDED"
TOKENIZER_ARG="MOCK"
while [[ $# -gt 0 ]]; do
    case $1 in
        --checkpoint-path) CHECKPOINT_PATH="$2"; shift 2 ;;
        --tokenizer) TOKENIZER_ARG="$2"; shift 2 ;;
        *) echo "Unknown option: $1"; exit 1 ;;
    esac
done
GPUS_PER_NODE=${{GPUS_PER_NODE:-8}}
NUM_NODES=${{NUM_NODES:-1}}
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))
PRETRAIN_SCRIPT_PATH="pretrain_gpt.py"
MODEL_ARGS=(
    --no-masked-softmax-fusion --transformer-impl transformer_engine --disable-bias-linear
    --untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm
    --num-layers 8 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8
    --group-query-attention --num-query-groups 2 --seq-length 64 --max-position-embeddings 64
    --use-mcore-models --rotary-percent 1.0 --rope-type rope --position-embedding-type rope
    --rotary-base 10000 --no-bias-gelu-fusion --export-force-local-attention
    --no-bias-dropout-fusion --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable
    --window-attn-skip-freq 2 --activation-func-clamp-value 7.0 --window-size 127,0
    --enable-gpt-oss
)
MOE_ARGS=(
    --num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-ffn-hidden-size 128
)
DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]]; then
    DATA_ARGS_LIST+=("--mock-data" "--tokenizer-type NullTokenizer" "--vocab-size 128256")
else
    DATA_ARGS_LIST+=("--tokenizer-type HuggingFaceTokenizer" "--tokenizer-model $TOKENIZER_ARG")
fi
TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 16 --bf16 --use-flash-attn --recompute-activations
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size ${{WORLD_SIZE}}
    --expert-model-parallel-size 1 --sequence-parallel --use-distributed-optimizer
    --fp8-format hybrid --fp8-param-gather
)
if [ ! -f "$PRETRAIN_SCRIPT_PATH" ]; then
    echo "Error: pretrain_gpt.py not found"
    exit 1
fi
python -m torch.distributed.run --nproc_per_node $GPUS_PER_NODE ${{PRETRAIN_SCRIPT_PATH}} \
    ${{MODEL_ARGS[@]}} ${{MOE_ARGS[@]}} ${{DATA_ARGS_LIST[@]}} ${{TRAINING_ARGS[@]}} \
    ${{MODEL_PARALLEL_ARGS[@]}}
"""


@pytest.mark.skipif(not GPT_OSS_BUILDS, reason="gpt-oss needs megatron-core 0.15")
def test_gpt_oss_script_reads_as_written(tmp_path, cli):
    # its layers are megatron's own (test_gpt_oss.py); --export-force-local-attention acts only
    # through ModelOpt's model provider, which pretrain_gpt.py uses with a ModelOpt --load only
    path = tmp_path / "02_train.sh"
    path.write_text(GPT_OSS.format())
    result = cli("params", "--from-script", str(path), "--format", "json")
    assert result.code == 0, result.err
    rows = json.loads(result.out)["parameters"]
    assert sum(r["name"].endswith("core_attention.softmax_offset") for r in rows) == 8
    assert json.loads(result.out)["header"]["config"]["window_size"] == [127, 0]
    assert "--export-force-local-attention" in result.err  # ignored, with its reason
    memory = cli("memory", "--from-script", str(path))
    assert memory.code == 0, memory.err
    assert "8 GPUs" in memory.out.splitlines()[0]  # the pipeline over GPUS_PER_NODE


@pytest.mark.skipif(not GPT_OSS_BUILDS, reason="gpt-oss needs megatron-core 0.15")
def test_gpt_oss_local_attention_is_refused_where_modelopt_builds(tmp_path, cli):
    path = tmp_path / "02_train.sh"
    path.write_text(GPT_OSS.format().replace("--enable-gpt-oss", "--enable-gpt-oss --load /ckpt"))
    result = cli("params", "--from-script", str(path))
    assert result.code == 0, result.err  # params: a training refusal leaves it alone
    memory = cli("memory", "--from-script", str(path))
    assert memory.code == 2 and "--export-force-local-attention is not modelled" in memory.err


@pytest.mark.skipif(not GPT_OSS_BUILDS, reason="gpt-oss needs megatron-core 0.15")
def test_gpt_oss_script_with_an_unknown_tokenizer_names_it(tmp_path, cli):
    path = tmp_path / "02_train.sh"
    path.write_text(GPT_OSS.format())
    result = cli("params", "--from-script", str(path), "--set", "1=--tokenizer",
                 "--set", "2=my-org/my-tokenizer")  # fmt: skip
    assert result.code == 2
    assert "the vocabulary of --tokenizer-type HuggingFaceTokenizer --tokenizer-model " \
        "my-org/my-tokenizer is not known here" in result.err
    given = cli("params", "--from-script", str(path), "--set", "1=--tokenizer",
                "--set", "2=my-org/my-tokenizer", "--vocab-size", "1000")  # fmt: skip
    assert given.code == 0, given.err


@pytest.mark.parametrize("dispatcher", ["", "--moe-token-dispatcher-type alltoall"])
def test_deepep_without_the_flex_dispatcher_is_refused_as_megatron_core_refuses_it(
        tmp_path, cli, dispatcher):  # fmt: skip
    moe = "--num-experts 4 --moe-router-topk 2 --disable-bias-linear"
    path = tmp_path / "s.sh"
    path.write_text(f"python pretrain_gpt.py {SMALL} --vocab-size 1000 {moe} {dispatcher} "
                    "--moe-enable-deepep\n")  # fmt: skip
    result = cli("params", "--from-script", str(path))
    assert result.code == 2
    assert result.err.endswith(
        f"Error: {path} line 1: --moe-enable-deepep without --moe-token-dispatcher-type flex is "
        "refused by Megatron-LM: megatron-core's TransformerConfig: 'DeepEP backend is only "
        "supported with flex token dispatcher.'\n"
    )
    # with flex, DeepEP is what Megatron-LM runs, and megatron-core's own rule stops it: the flex
    # dispatcher needs expert parallelism (this script has none)
    path.write_text(f"python pretrain_gpt.py {SMALL} --vocab-size 1000 {moe} "
                    "--moe-token-dispatcher-type flex --moe-enable-deepep\n")  # fmt: skip
    memory = cli("memory", "--from-script", str(path))
    assert memory.code == 2 and memory.err.endswith(
        "--moe-token-dispatcher-type flex needs expert parallelism: --expert-tensor-parallel-size 1 x --ep 1 = 1 "
        "(megatron-core's MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP > 1')\n")
    assert "Traceback" not in memory.err


def test_combining_checkpoints_is_named_as_a_conversion(tmp_path, cli):
    # examples/multimodal/combine_lm_vision_checkpoints.sh: its arguments are checkpoint paths
    # (`--input $2/...`), which used to be asked for as values the model needs
    path = tmp_path / "combine.sh"
    path.write_text("python examples/multimodal/combine_state_dicts.py --input $1/a.pt $2/b.pt "
                    "--prefixes language_model vision_model --output $3/c.pt\n")  # fmt: skip
    result = cli("params", "--from-script", str(path))
    assert (result.code, result.out) == (2, "")
    assert result.err.endswith(
        f"Error: {path} line 1: the script runs examples/multimodal/combine_state_dicts.py, which "
        "converts, exports, quantizes or prunes a checkpoint, not training; this tool reads GPT "
        "training (pretrain_gpt.py) only\n"
    )


# Hub tokenizers of Megatron-LM's GPT examples whose size this tool does not carry (DeepSeek-V2-Lite's,
# Nemotron's, gpt-oss's): never sized from a guess; --vocab-size from the script is used, and
# without it the error asks for it by name
@pytest.mark.parametrize("hub_id", ["deepseek-ai/DeepSeek-V2-Lite", "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
                                    "openai/gpt-oss-20b"])  # fmt: skip
def test_an_unknown_hub_tokenizer_asks_for_the_vocabulary_size(tmp_path, cli, hub_id):
    path = tmp_path / "s.sh"
    launch = (f"torchrun --nproc_per_node=1 pretrain_gpt.py {SMALL} "
              f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {hub_id}")  # fmt: skip
    path.write_text(launch + "\n")
    missing = cli("params", "--from-script", str(path))
    assert missing.code == 2
    assert missing.err.endswith(
        f"Error: {path} line 1: the vocabulary of --tokenizer-type HuggingFaceTokenizer "
        f"--tokenizer-model {hub_id} is not known here (no such file on this machine, nor a "
        "tokenizer this tool knows); give --vocab-size\n"
    )
    path.write_text(launch + " --vocab-size 1000\n")
    given = cli("params", "--from-script", str(path))
    assert given.code == 0, given.err
    assert "VocabParallelEmbedding();(1024, 64);" in given.out  # 1000 padded to a multiple of 128
    assert f"HuggingFaceTokenizer {hub_id} cannot be read here; --vocab-size 1000" in given.err


def test_a_launch_that_gives_no_model_is_refused(tmp_path, cli):
    # sc21's SRUN.sh run alone: `python -u .../pretrain_gpt.py ${MEGATRON_PARAMS}` with the
    # arguments left to the caller (run_figure_*.sh exports them); Megatron-LM requires a model
    # (validate_args' required_args), so no default preset's table
    path = tmp_path / "SRUN.sh"
    path.write_text('CMD="python -u ${CODE}/pretrain_gpt.py ${PARAMS}"\nsrun -N 1 sh -c "${CMD}"\n')
    result = cli("params", "--from-script", str(path))
    assert result.code == 2 and result.out == ""
    assert result.err.endswith(
        f"Error: {path} gives no --num-layers, --hidden-size, --num-attention-heads, which "
        "Megatron-LM requires (validate_args: required_args); give them with their flags (or "
        "--set the variables that hold them)\n"
    )
    result = cli("params", "--from-script", str(path), "--set", "PARAMS=--num-layers 2 "
                 "--hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                 "--max-position-embeddings 32")  # fmt: skip
    assert result.code == 0, result.err
