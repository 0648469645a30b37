"""Jobs as people write them: which programs are GPT training, and every refusal in one message.

Scripts here are written in the shapes of Megatron-LM's examples (examples/bert, examples/multimodal,
examples/rl, examples/post_training/modelopt), not copied from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inspector.errors import InputError
from inspector.inputs.sources import parse_launch_script
from inspector.inputs.unmodelled import refusal_message
from inspector.inputs.versions import null_tokenizer_adds_eod
from tests.test_versions import ROLLOUTS_MODELLED

SMALL = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --vocab-size 1000 --micro-batch-size 1")  # fmt: skip


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.sh"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "program, what",
    [
        ("pretrain_bert.py", "builds BERT (BertModel)"),
        ("examples/bert/pretrain_bert.py", "builds BERT (BertModel)"),
        ("pretrain_t5.py", "builds T5 (an encoder-decoder T5Model)"),
        (
            "pretrain_vlm.py",
            "builds a multimodal model (a vision or audio encoder beside the language model)",
        ),  # fmt: skip
        (
            "examples/multimodal/train.py",
            "builds a multimodal model (a vision or audio encoder beside the language model)",
        ),  # fmt: skip
        ("pretrain_hybrid.py",
         "builds a hybrid model as megatron-core 0.18+ does (HybridModel), not modelled yet"),
        ("tools/run_text_generation_server.py", "runs inference or text generation, not training"),
        (
            "examples/inference/advanced/gpt_dynamic_inference.py",
            "runs inference or text generation, not training",
        ),
        (
            "tools/checkpoint/convert.py",
            "converts, exports, quantizes or prunes a checkpoint, not training",
        ),
    ],
)
def test_non_gpt_programs_are_refused_by_name(tmp_path, program, what):
    # each of these would otherwise come out as a plausible GPT table
    _assert_refused(f"torchrun --nproc-per-node 8 {program}", program, what)


def _assert_refused(launch: str, program: str, what: str) -> None:
    """Assert the launch stops with the entry-point error naming `program`."""
    with pytest.raises(InputError) as error:
        parse_launch_script(f"{launch} {SMALL}\n", "s.sh")
    assert str(error.value) == (
        f"s.sh line 1: the script runs {program}, which {what}; this tool reads GPT training "
        "(pretrain_gpt.py) only"
    )


@pytest.mark.parametrize(
    ("launch", "program", "what"),
    [
        # Megatron-LM's examples/mimo/scripts: torch's launcher as a module, the program as one
        ("uv run --extra ssm python -m torch.distributed.run --standalone --nproc-per-node 8 "
         "-m examples.mimo.pretrain_mimo", "examples/mimo/pretrain_mimo.py",
         "builds a multimodal model (a vision or audio encoder beside the language model)"),
        # examples/inference/run_offline_inference.sh: torchrun's -m
        ("torchrun --nproc-per-node 8 -m examples.inference.offline_inference",
         "examples/inference/offline_inference.py", "runs inference or text generation, not training"),
        ("python -m tools.run_text_generation_server", "tools/run_text_generation_server.py",
         "runs inference or text generation, not training"),
    ],
)  # fmt: skip
def test_module_programs_are_refused_by_name(launch, program, what):
    # they used to stop with "no training command": the module was not seen as the program
    _assert_refused(launch, program, what)


def test_a_module_program_that_trains_gpt_is_read():
    for launch in ("torchrun --nproc-per-node 8 -m pretrain_gpt",
                   "python -m torch.distributed.run --nproc-per-node 8 --module pretrain_gpt"):  # fmt: skip
        parsed = parse_launch_script(f"{launch} {SMALL}\n", "s.sh")
        assert parsed.args["num_layers"] == 2 and parsed.notes == ()


def test_non_gpt_program_is_an_error_on_the_command_line(cli, tmp_path):
    path = write(tmp_path, f"python pretrain_bert.py {SMALL}\n")
    result = cli("params", "--from-script", path)
    assert (result.code, result.err) == (
        2, f"Error: {path} line 1: the script runs pretrain_bert.py, which builds BERT "
        "(BertModel); this tool reads GPT training (pretrain_gpt.py) only\n")  # fmt: skip
    assert result.out == ""


def test_gpt_training_programs_are_read():
    for program in ("pretrain_gpt.py", "/opt/megatron-lm/pretrain_gpt.py", "train_rl.py",
                    "examples/post_training/modelopt/finetune.py"):  # fmt: skip
        parsed = parse_launch_script(f"python {program} {SMALL}\n", "s.sh")
        assert parsed.args["num_layers"] == 2


def test_an_unknown_program_is_read_as_pretrain_gpt_with_a_note():
    parsed = parse_launch_script(f"python my_train.py {SMALL}\n", "s.sh")
    assert parsed.notes == ("my_train.py is not a Megatron-LM program this tool knows; its "
                            "arguments are read as pretrain_gpt.py reads them",)  # fmt: skip


needs_rollouts = pytest.mark.skipif(not ROLLOUTS_MODELLED, reason="refused before 0.16")


def test_before_megatron_core_0_16_the_grpo_step_is_refused(cli, tmp_path):
    path = write(tmp_path, f"python train_rl.py {SMALL} --transformer-impl local --perform-rl-step "
                 "--inference-dynamic-batching-max-requests 64\n")  # fmt: skip
    result = cli("memory", "--from-script", path)
    assert (result.code == 0) == ROLLOUTS_MODELLED
    if not ROLLOUTS_MODELLED:
        assert "--perform-rl-step is modelled with megatron-core 0.16 or later" in result.err


def _static(cli, path: str) -> int:
    result = cli("memory", "--from-script", path, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]["static"]


@needs_rollouts
def test_the_grpo_step_adds_the_rollout_engine_s_kv_cache(cli, tmp_path):
    # train_rl.py trains GPTModel as pretrain_gpt.py; --perform-rl-step adds the KV cache its
    # rollout engine keeps on the GPU through the training step (persist, the default)
    rl = f"python train_rl.py {SMALL} --transformer-impl local --grpo-group-size 16"
    plain = _static(cli, write(tmp_path, rl + "\n"))
    path = write(tmp_path, rl + " --perform-rl-step --inference-dynamic-batching-buffer-size-gb "
                 "0.01 --inference-max-seq-length 32\n")  # fmt: skip
    grpo = _static(cli, path)
    # dynamic_context.py: 2 (K, V) x 2 layers x 256 tokens x 4 heads x 16 x 4 bytes (fp32: no
    # --bf16) a block, int(0.01 GiB) // that = 40 blocks; beside them the context's tables and
    # the sampling's
    block = 2 * 2 * 256 * 4 * 16 * 4
    assert 40 * block < grpo - plain < 40 * block + 2 * 1024**2
    result = cli("memory", "--from-script", path)
    assert "with --perform-rl-step `memory` adds the KV cache" in result.err
    # 10.00 MiB of blocks, and the rest (0.16: 0.76 MiB of tables on the GPU; 0.17+ keeps most on
    # the host)
    assert re.search(r"GRPO: buffers include 10\.\d\d MiB the rollout engine keeps", result.out)
    held = json.loads(cli("memory", "--from-script", path, "--format", "json").out)
    assert held["stages"][0]["buffers"]["rollout"] == grpo - plain


@needs_rollouts
def test_the_grpo_step_refuses_what_moves_or_copies_the_policy(cli, tmp_path):
    rl = f"python train_rl.py {SMALL} --transformer-impl local --perform-rl-step"
    path = write(tmp_path, rl + " --rl-inference-tensor-model-parallel-size 2\n")
    result = cli("memory", "--from-script", path)
    assert result.code == 2
    assert result.err.startswith(f"Error: {path} line 1: --rl-inference-tensor-model-parallel-size "
                                 "2 is not modelled: a second copy of the model")  # fmt: skip
    result = cli("plan", "--from-script", write(tmp_path, rl + "\n"), "--gpus", "8")
    assert result.code == 2 and "--perform-rl-step is not modelled by plan" in result.err
    path = write(tmp_path, rl + " --context-parallel-size 2\n")
    result = cli("memory", "--from-script", path)  # training.py: a CP=1 copy for the rollouts
    assert result.code == 2 and "--perform-rl-step with --context-parallel-size 2 is not" in result.err
    path = write(tmp_path, rl + " --rl-kv-cache-management-mode offload\n")
    result = cli("memory", "--from-script", path)
    assert result.code == 2 and "--rl-kv-cache-management-mode offload is not modelled" in result.err


@needs_rollouts
def test_local_graphs_under_the_grpo_step_are_the_engine_s(cli, tmp_path):
    # rl_utils.py toggles the policy's graphs off for the training step: its memory is eager
    rl = f"python train_rl.py {SMALL} --transformer-impl local --cuda-graph-impl local"
    # without the GRPO step they are the policy's own per-layer graphs (engine/local_graphs.py)
    plain = cli("memory", "--from-script", write(tmp_path, rl + "\n"))
    assert plain.code == 0 and "CUDA graphs' memory pool" in plain.out
    path = write(tmp_path, rl + " --perform-rl-step\n")
    result = cli("memory", "--from-script", path)  # 40 GiB of blocks: 163,839 requests
    assert result.code == 2 and result.out == ""
    # the refused job's one line: the script's notes are said only for an accepted job
    assert result.err.startswith("Error: megatron-core's DynamicInferenceContext refuses the "
                                 "rollout engine's arguments: 'max_tokens (16384) must be >= "
                                 "max_requests (163836)") and result.err.count("\n") == 1
    assert _static(cli, write(tmp_path, rl + " --perform-rl-step "
                              "--inference-dynamic-batching-max-requests 64\n")) > 0


@needs_rollouts
def test_the_grpo_step_trains_with_the_policy_s_graphs_with_rl_training_cuda_graphs(cli, tmp_path):
    # rl_utils.py keeps the policy's CudaGraphManagers on for the training step: its per-layer
    # graphs' pool (engine/local_graphs.py) beside the rollout engine's graphs, kept through it
    rl = (f"python train_rl.py {SMALL} --transformer-impl local --cuda-graph-impl local "
          "--perform-rl-step --inference-dynamic-batching-max-requests 64")  # fmt: skip

    def pools(flags: str) -> list[str]:
        result = cli("memory", "--from-script", write(tmp_path, f"{rl} {flags}\n"), "--format", "json")
        assert result.code == 0, result.err
        rows = json.loads(result.out)["stages"][0]["buffers"]["persistent"]
        return [what for what, _ in rows if what.startswith("CUDA graphs' memory pool")]

    assert pools("") == [] and pools("--rl-training-cuda-graphs --no-rl-training-cuda-graphs") == []
    assert len(pools("--rl-training-cuda-graphs")) == 1
    # the engine's graphs are counted with the rollout's buffers, with or without the flag
    result = cli("memory", "--from-script", write(tmp_path, rl + " --rl-training-cuda-graphs\n"))
    assert "its CUDA graphs' outputs" in result.out


def test_checkpoint_args_are_read_only_with_the_whole_architecture(cli, tmp_path):
    # load_args_from_checkpoint takes the architecture from --load's checkpoint
    given = (f"{SMALL} --ffn-hidden-size 256 --num-query-groups 2 --group-query-attention "
             "--kv-channels 16 --normalization RMSNorm --position-embedding-type rope")  # fmt: skip
    path = write(tmp_path, f"python pretrain_gpt.py {given} --use-checkpoint-args\n")
    result = cli("params", "--from-script", path)
    assert result.code == 0, result.err
    assert "--use-checkpoint-args: Megatron-LM takes the architecture from the checkpoint" in result.err
    path = write(tmp_path, f"python pretrain_gpt.py {SMALL} --use-checkpoint-args\n")
    result = cli("params", "--from-script", path)
    assert result.code == 2
    assert ("the job does not give --ffn-hidden-size, --num-query-groups, --kv-channels, "
            "--normalization, --position-embedding-type; give them, or drop it") in result.err


def test_every_refused_flag_in_one_message(cli, tmp_path):
    # one run names them all (--fp8-param-gather, modelled, is not among them)
    path = write(tmp_path, f"python pretrain_gpt.py {SMALL} --fp8-format hybrid --use-distributed-optimizer "
                 "--fp8-param-gather "
                 "--fp4-param-gather --torch-fsdp2-no-reshard-after-forward --optimizer-cpu-offload\n")  # fmt: skip
    result = cli("memory", "--from-script", path)
    fp4 = refusal_message("--fp4-param-gather", None)  # None from megatron-core 0.18 (modelled)
    assert result.err == (
        f"Error: {path} line 1: {fp4 + '; ' if fp4 else ''}"
        "--torch-fsdp2-no-reshard-after-forward is not modelled: FSDP2 keeping the "
        "gathered parameters from the forward to the backward (ZeRO-2) is not modelled; "
        "--use-torch-fsdp2 alone (resharding after the forward) is; --optimizer-cpu-offload is not "
        "modelled: optimizer state on the CPU is not modelled\n"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--checkpoint-activations",
         "--checkpoint-activations is refused by Megatron-LM: validate_args: "
         "'--checkpoint-activations is no longer valid, use --recompute-activations, or, for more "
         "control, --recompute-granularity and --recompute-method'"),
        ("--DDP-impl local",
         "--DDP-impl is refused by Megatron-LM: pretrain_gpt.py stops with 'unrecognized "
         "arguments' (removed in 2023: megatron-core's DistributedDataParallel is the only one)"),
        ("--activations-checkpoint-method uniform",
         "--activations-checkpoint-method is refused by Megatron-LM: pretrain_gpt.py stops with "
         "'unrecognized arguments' (renamed --recompute-method in 2022)"),
        ("--global-batch-size 16 --step-batch-size-schedule '0:8 1B:16'",
         "--step-batch-size-schedule with --global-batch-size is refused by Megatron-LM: "
         "validate_args: 'Cannot specify both --step-batch-size-schedule and "
         "--global-batch-size'"),
        ("--freeze-LM --freeze-ViT",
         "--freeze-LM and --freeze-ViT are refused by Megatron-LM: pretrain_gpt.py stops with "
         "'unrecognized arguments': only Megatron-LM's multimodal entry points (pretrain_vlm.py, "
         "examples/multimodal/train.py) define it, and this tool builds GPT models only"),
    ],
)  # fmt: skip
def test_megatron_lm_refusals_stop_every_command(cli, tmp_path, extra, message):
    # Megatron-LM would not start, so even `params` (which reads no training flags) stops
    path = write(tmp_path, f"python pretrain_gpt.py {SMALL} {extra}\n")
    result = cli("params", "--from-script", path)
    assert (result.code, result.err) == (2, f"Error: {path} line 1: {message}\n")


def test_the_world_size_is_checked_before_validate_args_refusals(cli, tmp_path):
    # Megatron-LM's gpt3 175B example (examples/gpt3/train_gpt3_175b_distributed.sh, main): one
    # node of 8 GPUs for tp 8 x pp 16, with --step-batch-size-schedule and --global-batch-size.
    # validate_args asserts the world size first (arguments.py: `args.world_size %
    # total_model_size == 0`) and refuses the schedule only later: so must we
    for world, first in ((4, "--step-batch-size-schedule with --global-batch-size"),
                         (3, "world size 3")):  # fmt: skip
        path = write(tmp_path, f"torchrun --nproc_per_node {world} pretrain_gpt.py {SMALL} "
                     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                     "--global-batch-size 16 --step-batch-size-schedule '0:8 1B:16'\n")  # fmt: skip
        result = cli("params", "--from-script", path)
        assert result.code == 2 and first in result.err.splitlines()[-1], result.err


def test_step_batch_size_schedule_alone_is_a_schedule(tmp_path):
    parsed = parse_launch_script(
        f"python pretrain_gpt.py {SMALL} --step-batch-size-schedule '0:8 1B:16'\n", "s.sh"
    )
    assert parsed.refused == () and parsed.ignored == ("--step-batch-size-schedule",)


def test_freeze_all_layers_is_refused_for_memory(cli, tmp_path):
    path = write(tmp_path, f"python pretrain_gpt.py {SMALL} --transformer-impl local "
                 "--freeze-all-layers\n")  # fmt: skip
    assert cli("params", "--from-script", path).code == 0
    result = cli("memory", "--from-script", path)
    assert result.err.startswith(f"Error: {path} line 1: --freeze-all-layers is not modelled: "
                                 "frozen parameters hold no gradients")  # fmt: skip


FUNCTIONAL_TEST = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  NVTE_ALLOW_NONDETERMINISTIC_ALGO: 1
TEST_TYPE: "release"
MODEL_ARGS:
  # Distributed args
  --tensor-model-parallel-size: 2
  --pipeline-model-parallel-size: 2
  --use-distributed-optimizer: true
  --sequence-parallel: true
  --disable-bias-linear: true
  --micro-batch-size: 2
  --global-batch-size: 64
  --train-samples: 1000
  --tokenizer-type: NullTokenizer
  --vocab-size: 1000
  --data-path: ${DATA_PATH}/my_text_document
  --num-layers: 4
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 128
  --max-position-embeddings: 128
  --lr: 4.5e-4
  --adam-beta1: 0.9
  --bf16: true
  --my-new-flag: 3
METRICS:
  - "lm loss"
"""


def test_functional_test_config(tmp_path):
    from inspector.inputs.megatron_config import read_config

    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST)
    parsed = read_config(str(path))
    assert parsed.args == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "use_distributed_optimizer": True, "sequence_parallel": True, "disable_bias_linear": True,
        "micro_batch_size": 2, "global_batch_size": 64, "num_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "seq_length": 128, "max_position_embeddings": 128,
        "bf16": True,
        # NullTokenizer adds its end-of-document token up to megatron-core 0.17
        "vocab_size": 1000 + null_tokenizer_adds_eod(),
    }  # fmt: skip
    assert parsed.ignored == ("--train-samples", "--data-path", "--lr", "--adam-beta1")
    assert parsed.unrecognised == ("--my-new-flag",)
    assert parsed.notes[:2] == (
        "ENV_VARS set the job's environment, not its arguments: CUDA_DEVICE_MAX_CONNECTIONS "
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
        "keys for Megatron-LM's test runner, not arguments: TEST_TYPE METRICS",
    )


def test_functional_test_config_lists_every_refusal(cli, tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST.replace("  --bf16: true\n", "  --bf16: true\n  --fp8-format: hybrid\n"
                                            "  --fp4-param-gather: true\n  --checkpoint-activations: true\n"))  # fmt: skip
    result = cli("memory", "--config", str(path))
    fp4 = refusal_message("--fp4-param-gather", None)  # None from megatron-core 0.18 (modelled)
    assert result.err.startswith(f"Error: {path}: {fp4 or '--checkpoint-activations'}")
    assert result.err.endswith("--checkpoint-activations is refused by Megatron-LM: "
                               "validate_args: '--checkpoint-activations is no longer valid, use "
                               "--recompute-activations, or, for more control, "
                               "--recompute-granularity and --recompute-method'\n")  # fmt: skip


def test_config_tokenizer_is_honoured_not_gpt2(cli, tmp_path):
    # a tokenizer whose vocabulary cannot be known here asks for --vocab-size, never GPT-2's
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --num-layers: 2\n  --tokenizer-type: GPTSentencePieceTokenizer"
                    "\n  --tokenizer-model: ${DATA_PATH}/utils/private_32k.model\n")  # fmt: skip
    result = cli("params", "--config", str(path))
    assert result.code == 2
    assert "is not known here" in result.err and "give --vocab-size" in result.err


def test_nemotron_256k_sentencepiece_is_known_by_name():
    # Megatron-LM's functional tests train with ${DATA_PATH}/utils/nemotron_2_256k.model, a file
    # not on this machine: its 256,000 pieces come from the Nemotron-4 report, by file name
    from inspector.inputs.tokenizers import vocabulary

    found = vocabulary("GPTSentencePieceTokenizer", "${DATA_PATH}/utils/nemotron_2_256k.model",
                       None, None, "model_config.yaml")  # fmt: skip
    assert (found.size, found.problem) == (256000, "")
    # SentencePieceTokenizer adds its special tokens to the pieces: not known by name
    other = vocabulary("SentencePieceTokenizer", "/data/nemotron_2_256k.model", None, None, "x")
    assert other.size is None and "give --vocab-size" in other.problem


def test_plain_config_classifies_every_argument(cli, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nseq-length: 32\n"
                    "vocab-size: 1000\nlr: 3.0e-4\nadam-beta1: 0.9\nswiglu: false\n")  # fmt: skip
    result = cli("params", "--config", str(path))
    assert result.code == 0, result.err
    assert result.err == f"Ignored from {path}: --lr --adam-beta1\n"


def test_plain_config_lists_every_unknown_key(tmp_path):
    from inspector.errors import ConfigError
    from inspector.inputs.megatron_config import read_config

    path = tmp_path / "c.yaml"
    path.write_text("num-layers: 2\nhiden-size: 64\nnum-atention-heads: 4\n")
    with pytest.raises(ConfigError) as error:
        read_config(str(path))
    assert str(error.value) == (
        f"{path}: unknown arguments 'hiden-size' (did you mean --hidden-size?), "
        "'num-atention-heads' (did you mean --num-attention-heads?)"
    )


def test_hybrid_layer_pattern_to_a_gpt_builder_is_refused(cli, tmp_path):
    # ModelOpt's Nemotron-H config shape: newer Megatron-LM's --hybrid-layer-pattern and the
    # Mamba mixer's sizes, with no --is-hybrid-model: a hybrid model, never read as GPT
    path = write(tmp_path, f"torchrun finetune.py {SMALL} --hybrid-layer-pattern M-M* "
                 "--mamba-head-dim 64 --mamba-num-heads 128\n")  # fmt: skip
    result = cli("params", "--from-script", path)
    assert result.err == (
        f"Error: {path} line 1: finetune.py builds GPTModel whatever --hybrid-layer-pattern say "
        "(gpt_builders.py); Megatron-LM builds hybrid models with pretrain_mamba.py\n"
    )


def test_functional_test_config_with_the_flex_dispatcher_runs_memory(cli, tmp_path):
    # Megatron-LM's MoE functional tests set the flex dispatcher with DeepEP in MODEL_ARGS; --config
    # reads it as megatron-core takes it (0.13's --moe-enable-deepep) and `memory` runs it, DeepEP's
    # buffers on a line of their own (they were refused before: tests/test_flex_memory.py)
    moe = ("  --num-experts: 4\n  --moe-router-topk: 2\n  --expert-model-parallel-size: 2\n"
           "  --expert-tensor-parallel-size: 1\n  --moe-token-dispatcher-type: flex\n"
           "  --moe-enable-deepep: true\n")  # fmt: skip
    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST.replace("  --bf16: true\n", "  --bf16: true\n" + moe))
    memory = cli("memory", "--config", str(path))
    assert memory.code == 0, memory.err
    assert "flex dispatcher" in memory.out and "outside PyTorch's allocator" in memory.out
    params = cli("params", "--config", str(path))
    assert params.code == 0, params.err


@pytest.mark.parametrize(
    ("env", "layout", "noted"),
    [
        ("", "--tensor-model-parallel-size 2", "the launch does not set it"),
        ("export CUDA_DEVICE_MAX_CONNECTIONS=8\n", "--context-parallel-size 2", "the launch sets '8'"),
        ("export CUDA_DEVICE_MAX_CONNECTIONS=1\n", "--tensor-model-parallel-size 2", None),
        ("", "", None),  # tp = cp = 1: no check
        ("CUDA_DEVICE_MAX_CONNECTIONS=1 ", "--tensor-model-parallel-size 2", None),  # the command's own
        ("", "--tensor-model-parallel-size 2 --use-torch-fsdp2 --no-gradient-accumulation-fusion "
         "--untie-embeddings-and-output-weights", None),  # FSDP: Megatron-LM only warns
    ],
)  # fmt: skip
def test_megatron_lms_cuda_device_max_connections_check_is_noted(env, layout, noted):
    # Megatron-LM's validate_args asserts it on GPUs before Blackwell (core_v0.13.1-core_v0.16.1)
    launch = "torchrun --nproc-per-node 8 pretrain_gpt.py"
    if env.startswith("CUDA"):
        launch, env = env + launch, ""
    parsed = parse_launch_script(f"{env}{launch} {SMALL} {layout}\n", "s.sh")
    found = [n for n in parsed.notes if "CUDA_DEVICE_MAX_CONNECTIONS" in n]
    if noted is None:
        assert found == []
    else:
        line = 2 if env else 1
        assert found == [
            f"line {line}: on GPUs before Blackwell (H100, A100) Megatron-LM stops here: tp or cp "
            f"above 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 and {noted} (validate_args: 'Using tensor "
            "model parallelism or context parallelism require setting the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1'); on B200 and GB200 it runs"
        ]


def test_functional_test_config_splits_a_bracketed_string(tmp_path):
    # Megatron-LM's runner strips the brackets of "[a b]" and passes each word as an argument
    # (_run_training.sh), so a quoted list of recompute modules is the flag and its modules
    from inspector.inputs.megatron_config import read_config

    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST.replace(
        "  --bf16: true\n", '  --bf16: true\n  --recompute-granularity: selective\n'
        '  --recompute-modules: "[layernorm mlp]"\n  --moe-layer-freq: ([0]*1+[1]*3)\n'))  # fmt: skip
    parsed = read_config(str(path))
    assert parsed.args["recompute_modules"] == "layernorm mlp"  # as a script's two words give it
    # a value in parentheses stays one word (the runner quotes it)
    assert parsed.args["moe_layer_freq"] == "([0]*1+[1]*3)"


def test_functional_test_config_runs_on_the_runners_eight_gpus(cli, tmp_path):
    # Megatron-LM's runner starts the test on 1 node x 8 GPUs unless told otherwise
    # (_run_training.sh GPUS_PER_NODE=8, NUM_NODES=1): tp 2 x pp 2 leaves dp 2, which the
    # experts (ep 4) need; --dp gives another world
    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST.replace("  --bf16: true\n", "  --bf16: true\n  --num-experts: 4\n"
                                            "  --expert-model-parallel-size: 4\n  --expert-tensor-parallel-size: 1\n"))  # fmt: skip
    result = cli("memory", "--config", str(path))
    assert result.code == 0, result.err
    assert "tp 2 x pp 2 x dp 2 = 8 GPUs, ep 4" in result.out
    assert (f"Note from {path}: the world is 8 GPUs: Megatron-LM's functional-test runner, 1 node "
            "x 8 GPUs by default (_run_training.sh); --dp gives another\n") in result.err  # fmt: skip
    result = cli("memory", "--config", str(path), "--dp", "4")
    assert result.code == 0, result.err
    assert "tp 2 x pp 2 x dp 4 = 16 GPUs, ep 4" in result.out
    assert "the world is 8 GPUs" not in result.err


def test_functional_test_config_reads_activation_offloading(cli, tmp_path):
    from inspector.inputs.versions import megatron_core_version

    if megatron_core_version() < (0, 16):
        pytest.skip("fine-grained activation offloading is megatron-core 0.16+ (refused before)")
    # megatron-core's fine-grained activation offloading moves the listed modules' saved tensors
    # to pinned host memory: `memory` runs megatron's offload manager and names the host bytes
    path = tmp_path / "model_config.yaml"
    path.write_text(FUNCTIONAL_TEST.replace(
        "  --bf16: true\n", '  --bf16: true\n  --fine-grained-activation-offloading: true\n'
        '  --offload-modules: "[core_attn attn_proj]"\n  --min-offloaded-tensor-size: 0\n'))  # fmt: skip
    result = cli("memory", "--config", str(path))
    assert result.code == 0, result.err
    assert "offloaded activations take" in result.out and "of pinned host memory" in result.out


def test_functional_test_config_in_inference_mode_names_its_program(cli, tmp_path):
    # MODE: inference makes Megatron-LM's runner start an inference program (its recipes'
    # TRAINING_SCRIPT_PATH under examples/inference/), not pretrain_gpt.py: no table
    path = tmp_path / "model_config.yaml"
    path.write_text("MODE: inference\n" + FUNCTIONAL_TEST)
    result = cli("params", "--config", str(path))
    assert result.code == 2 and result.out == ""
    assert result.err == (f"Error: {path}: MODE: inference: Megatron-LM's test runner runs it with "
                          "an inference program (examples/inference/), which runs inference or "
                          "text generation, not training; this tool reads GPT training "
                          "(pretrain_gpt.py) only\n")  # fmt: skip


def test_functional_test_config_in_rl_mode_is_train_rl(cli, tmp_path):
    # MODE: rl runs train_rl.py: its model is read, and its memory as pretrain_gpt.py's without
    # --perform-rl-step (no rollout engine)
    path = tmp_path / "model_config.yaml"
    path.write_text("MODE: rl\n" + FUNCTIONAL_TEST)
    result = cli("params", "--config", str(path))
    assert result.code == 0, result.err
    assert (f"Note from {path}: train_rl.py trains GPTModel (gpt_builders.py) as pretrain_gpt.py "
            "does") in result.err  # fmt: skip
    assert cli("memory", "--config", str(path)).code == 0


SINKHORN = """\
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 128
  --max-position-embeddings: 128
  --micro-batch-size: 1
  --tokenizer-type: NullTokenizer
  --vocab-size: 1000
  --num-experts: 4
  --moe-router-topk: 1
  --moe-router-load-balancing-type: {balancing}
  --disable-bias-linear: true
  --bf16: true
"""


@pytest.mark.parametrize("balancing", ["sinkhorn", "aux_loss\n  --moe-router-pre-softmax: true"])
def test_functional_test_config_routes_top_1(cli, tmp_path, balancing):
    # 24 of Megatron-LM's 65 MoE functional tests route top-1 with sinkhorn balancing: megatron-core
    # accepts top-1 only with sinkhorn or --moe-router-pre-softmax (TransformerConfig), so both are
    # passed to it; the router's sinkhorn runs on meta tensors (one turn of its loop)
    path = tmp_path / "model_config.yaml"
    path.write_text(SINKHORN.format(balancing=balancing))
    result = cli("memory", "--config", str(path))
    assert result.code == 0, result.err
    assert "every expert gets tokens x 1 / 4 of each rank's tokens" in result.err + result.out


def test_top_1_routing_needs_what_megatron_core_needs(cli, tmp_path):
    # neither sinkhorn nor pre-softmax: megatron-core's own check stops it, as in Megatron-LM
    path = tmp_path / "model_config.yaml"
    path.write_text(SINKHORN.format(balancing="aux_loss"))
    result = cli("params", "--config", str(path))
    assert result.code == 2
    assert "Please use --moe-router-pre-softmax when topk is 1." in result.err
