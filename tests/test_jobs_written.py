"""Jobs as written, the last gaps of Megatron-LM's examples and functional-test configs (issue #27):
optimizers of newer Megatron-LM versions, the tp-pp-dp rank order, YAML merge and duplicate keys,
tokenizer vocabularies, and the reader's precedence of a config file's transformer_impl.

Files here are written in the shapes of Megatron-LM's tests/functional_tests/test_cases/*/
model_config.yaml and examples/ scripts, not copied from them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import megatron.core
import pytest

VERSION = tuple(int(p) for p in megatron.core.__version__.split(".")[:2])
MUON_KNOWN = VERSION >= (0, 16)  # Megatron-LM's --optimizer choices gained muon in core_v0.16.0
# megatron-core 0.16-0.17's optimizer/muon.py and 0.18-0.19's emerging-optimizers registry build
# --optimizer muon here, and the layer-wise dist_muon (tests/test_muon.py, test_muon_layout.py)
MUON_MODELLED = (0, 16) <= VERSION < (0, 20)

MODEL_ARGS = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 32
  --max-position-embeddings: 32
  --vocab-size: 1000
  --micro-batch-size: 1
  --global-batch-size: 8
  --bf16: true
"""


def write(tmp_path: Path, text: str, name: str = "model_config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_muon_is_megatron_cores_own_from_0_16():
    # the version fact the refusal states, checked against the installed megatron-core itself
    found = importlib.util.find_spec("megatron.core.optimizer.muon") is not None
    assert found == MUON_KNOWN


def test_muon_is_refused_by_name_with_every_other_refusal(tmp_path, cli):
    # was: "--optimizer 'muon' is not one of: adam, sgd" (argparse's words for a choice that
    # megatron-core 0.16's Megatron-LM has); modelled on 0.16 (tests/test_muon.py), so only the
    # other refusal remains there; the muon hyper-parameters are ignored with it
    path = write(tmp_path, MODEL_ARGS + "  --optimizer: muon\n  --muon-momentum: 0.9\n"
                 "  --muon-scale-mode: spectral\n  --optimizer-cpu-offload: true\n")  # fmt: skip
    result = cli("memory", "--config", path)
    assert result.code == 2
    version = f"{VERSION[0]}.{VERSION[1]}"
    fact = f"--optimizer muon is a choice of Megatron-LM 0.16+; this tool builds with megatron-core {version}"
    later = ("--optimizer muon is not modelled: this megatron-core's Muon is not run by this tool "
             "(it runs megatron-core 0.16-0.19's --optimizer muon and layer-wise dist_muon) "
             f"({fact}); ")  # fmt: skip
    muon = ("" if MUON_MODELLED else later if MUON_KNOWN else
            f"--optimizer muon is refused by Megatron-LM: {fact}, whose Megatron-LM stops with "
            "'invalid choice'; ")  # fmt: skip
    offload = "--optimizer-cpu-offload is not modelled: optimizer state on the CPU is not modelled"
    assert result.err.splitlines()[-1] == f"Error: {path}: {muon}{offload}", result.err


def test_muon_leaves_params_alone_where_megatron_lm_knows_it(tmp_path, cli):
    # the parameters do not depend on it (their owners do: tests/test_muon.py)
    path = write(tmp_path, MODEL_ARGS + "  --optimizer: muon\n")
    result = cli("params", "--config", path, "--format", "json")
    assert (result.code == 0) == MUON_KNOWN, result.err


def test_muon_given_as_a_flag(cli):
    # the same refusal on the command line (it was click's "not one of: adam, sgd")
    result = cli("memory", "--micro-batch-size", "1", "--optimizer", "adaptive_muon")
    assert result.code == 2
    known = VERSION >= (0, 18)
    verb = "is not modelled" if known else "is refused by Megatron-LM"
    assert result.err.startswith(f"Error: --optimizer adaptive_muon {verb}: "), result.err
    assert "--optimizer adaptive_muon is a choice of Megatron-LM 0.18+" in result.err


def test_muon_in_a_plain_config_and_a_script(tmp_path, cli):
    plain = write(tmp_path, "num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\n"
                  "seq-length: 32\nmax-position-embeddings: 32\nvocab-size: 1000\n"
                  "optimizer: dist_muon\n", "plain.yaml")  # fmt: skip
    script = write(tmp_path, "torchrun --nproc-per-node 1 pretrain_gpt.py --num-layers 2 "
                   "--hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                   "--max-position-embeddings 32 --vocab-size 1000 --optimizer lion\n",
                   "train.sh")  # fmt: skip
    for argv, shown in ((("--config", plain), "--optimizer dist_muon"),
                        (("--from-script", script), "--optimizer lion")):  # fmt: skip
        if MUON_MODELLED and "dist_muon" in shown:
            continue  # modelled (tests/test_muon.py)
        result = cli("memory", *argv)
        assert result.code == 2
        assert shown in result.err and "not one of" not in result.err, result.err


MERGED = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
BASE_MODEL_ARGS: &BASE_MODEL_ARGS
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 32
  --max-position-embeddings: 32
  --vocab-size: 1000
  --micro-batch-size: 4
  --timing-log-level: 0
MODEL_ARGS:
  <<: *BASE_MODEL_ARGS
  --micro-batch-size: 1
  --global-batch-size: 8
  --timing-log-level: 1
  --hidden-size: 128
MODEL_ARGS_2:
  <<: *BASE_MODEL_ARGS
  --micro-batch-size: 2
"""


def test_yaml_merge_keys_as_yq_explodes_them(tmp_path, cli):
    # the runner reads MODEL_ARGS through `yq 'explode(.)'`: the merged map's keys, then
    # MODEL_ARGS' own keys over them (was: "could not determine a constructor for the tag
    # 'tag:yaml.org,2002:merge'")
    path = write(tmp_path, MERGED)
    merged = cli("params", "--config", path, "--format", "json")
    assert merged.code == 0, merged.err
    written = cli("params", *"--num-layers 2 --hidden-size 128 --num-attention-heads 4 "
                  "--seq-length 32 --max-position-embeddings 32 --vocab-size 1000 "
                  "--transformer-impl transformer_engine --dp 8".split(), "--format", "json")  # fmt: skip
    assert merged.out == written.out  # hidden 128 (MODEL_ARGS' own), the rest from the base


def test_a_key_given_twice_in_model_args_keeps_the_last(tmp_path, cli):
    # yq's to_entries passes both entries; Megatron-LM's argparse keeps the last
    text = MODEL_ARGS + "  --hidden-size: 128\n"
    path = write(tmp_path, text)
    result = cli("params", "--config", path, "--format", "json")
    assert result.code == 0, result.err
    assert (f"Note from {path}: line 13: --hidden-size is given again (first on line 5); the last "
            "value, 128, is taken, as Megatron-LM's argparse takes the last of the runner's "
            "arguments") in result.err  # fmt: skip
    again = cli("params", "--config", write(tmp_path, MODEL_ARGS.replace(
        "--hidden-size: 64", "--hidden-size: 128"), "once.yaml"), "--format", "json")  # fmt: skip
    assert result.out == again.out


def test_a_key_given_twice_elsewhere_is_still_refused(tmp_path, cli):
    # a plain argument map has no runner to say which value wins
    path = write(tmp_path, "num-layers: 2\nhidden-size: 64\nhidden-size: 128\n", "plain.yaml")
    result = cli("params", "--config", path)
    assert result.code == 2
    assert result.err == f"Error: {path} line 3: the key 'hidden-size' appears twice (first on line 2)\n"


def test_a_config_files_transformer_impl_holds_under_a_script_that_names_none(tmp_path, cli):
    # resolve's order is preset < config < script < flags; Megatron-LM's default (Transformer
    # Engine) lies under the files, so a script that does not name --transformer-impl keeps the
    # config file's `local` (it turned it back to transformer_engine)
    config = write(tmp_path, "transformer-impl: local\n", "impl.yaml")
    script = write(tmp_path, "torchrun --nproc-per-node 1 pretrain_gpt.py --num-layers 2 "
                   "--hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                   "--max-position-embeddings 32 --vocab-size 1000 --bf16\n", "train.sh")  # fmt: skip

    def impl(*argv: str) -> str:
        result = cli("params", *argv, "--format", "json")
        assert result.code == 0, result.err
        return json.loads(result.out)["header"]["config"]["transformer_impl"]

    assert impl("--config", config, "--from-script", script) == "local"
    assert impl("--from-script", script) == "transformer_engine"  # Megatron-LM's default
    assert impl("--config", config, "--from-script", script, "--transformer-impl",
                "transformer_engine") == "transformer_engine"  # flags win  # fmt: skip
    named = write(tmp_path, script_text := Path(script).read_text().replace(
        "--bf16", "--bf16 --transformer-impl transformer_engine"), "named.sh")  # fmt: skip
    assert "transformer_engine" in script_text
    assert impl("--config", config, "--from-script", named) == "transformer_engine"


def test_tp_pp_dp_mapping_places_ranks_as_megatron_does(tmp_path, cli):
    # was refused; Megatron-LM's initialize.py passes order "tp-cp-ep-pp-dp" to megatron-core's
    # initialize_model_parallel (tests/test_topology.py checks every rank against it)
    flags = "--tp 2 --pp 2 --dp 2 --use-tp-pp-dp-mapping".split()
    table = cli("topology", *flags, "--format", "table")
    assert table.code == 0, table.err
    rows = [line.split()[:3] for line in table.out.splitlines()[2:]]
    # rank, pipe, data: stages first (ranks 0-1 stage 0, 2-3 stage 1), then data replicas
    assert [row[:3] for row in rows[:5]] == [["0", "0", "0"], ["1", "0", "0"], ["2", "1", "0"],
                                              ["3", "1", "0"], ["4", "0", "1"]]  # fmt: skip
    view = cli("params", *flags, "--rank", "2", "--format", "table")
    assert "Rank 2 holds stage 1:" in view.out, view.out  # stage 0 in the default order
    path = write(tmp_path, MODEL_ARGS.replace("--bf16: true", "--bf16: true\n"
                 "  --pipeline-model-parallel-size: 2\n  --tensor-model-parallel-size: 2\n"
                 "  --transformer-impl: transformer_engine\n"
                 "  --use-tp-pp-dp-mapping: true"))  # fmt: skip
    mapped = cli("memory", "--config", path)
    assert mapped.code == 0, mapped.err
    assert "ranks in tp-pp-dp order" in mapped.out
    rows = [line.split()[:2] for line in mapped.out.splitlines() if line[:1].isdigit()]
    assert rows[:2] == [["0", "0"], ["1", "2"]]  # stage 1's first rank is 2 (4 by default)
    assert "not modelled" not in mapped.err


def test_tp_pp_dp_mapping_refusals(tmp_path, cli):
    # megatron asserts the attention and expert data-parallel sizes agree when pp is not last:
    # tp 2 x cp 2 x dp 2 x pp 2 = 16 ranks, experts (ep 1 x etp 2 x pp 2) leave 4 data replicas
    result = cli("topology", *"--tp 2 --pp 2 --dp 2 --cp 2 --use-tp-pp-dp-mapping".split())
    assert result.code == 2
    assert result.err.startswith("Error: --use-tp-pp-dp-mapping with --pp 2 needs the same "
                                 "data-parallel size for attention (2) and experts (4: ")  # fmt: skip
    model = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--max-position-embeddings 32 --vocab-size 1000 --micro-batch-size 1 "
             "--global-batch-size 8").split()  # fmt: skip
    plan = cli("plan", *model, "--gpus", "8", "--use-tp-pp-dp-mapping")
    assert plan.code == 2 and "plan does not search --use-tp-pp-dp-mapping" in plan.err, plan.err
    out = str(tmp_path / "w.txt")
    workload = cli("workload", *model, "--pp", "2", "--dp", "2", "--use-tp-pp-dp-mapping", "--gpu-tflops", "500",
                   "-o", out)  # fmt: skip
    assert workload.code == 2, workload.err
    assert "workload cannot write --use-tp-pp-dp-mapping for SimAI" in workload.err


def test_megatron_refuses_the_mapping_where_the_tool_does():
    # the refusal above is megatron-core's own assertion
    from inspector.job.layout import Layout
    from tests.test_topology import megatron_view

    layout = Layout(tp=2, pp=2, dp=2, cp=2, use_tp_pp_dp_mapping=True)
    with pytest.raises(AssertionError, match="data parallel size of the attention and moe layers"):
        megatron_view(layout, 0)


GUARD = """\
#!/bin/bash
if [[ -z "$CHECKPOINT" ]]; then
    echo "Error: --checkpoint is required" >&2
    exit 1
fi
"""


def _first_error(cli, path: str) -> str:
    result = cli("memory", "--from-script", path)
    assert result.code == 2
    return result.err.splitlines()[-1]


def test_a_guard_before_a_non_gpt_launch_names_the_program(tmp_path, cli):
    # examples/inference/run_offline_inference.sh's shape: a guard exits on the caller's value,
    # then torchrun runs an inference module; no --set makes it GPT training
    path = write(tmp_path, GUARD + "torchrun --nproc-per-node 8 \\\n    -m examples.inference."
                 "offline_inference --load \"$CHECKPOINT\" --num-layers 2\n", "s.sh")  # fmt: skip
    assert _first_error(cli, path) == (
        f"Error: {path} line 6: the script runs examples/inference/offline_inference.py, which "
        "runs inference or text generation, not training; this tool reads GPT training "
        "(pretrain_gpt.py) only (read from the script as written; it stops before that line: "
        f"{path} line 4: `exit 1`)"
    )


def test_a_guard_before_a_gpt_launch_still_asks_for_the_value(tmp_path, cli):
    path = write(tmp_path, GUARD + "torchrun --nproc-per-node 8 pretrain_gpt.py --num-layers 2\n",
                 "s.sh")  # fmt: skip
    error = _first_error(cli, path)
    assert "found no training command" in error and "--set CHECKPOINT=VALUE" in error, error


def test_modelopt_script_folder_program(tmp_path, cli):
    # ModelOpt's generate.sh: `${LAUNCH_SCRIPT} ${SCRIPT_DIR}/generate.py`, SCRIPT_DIR its folder
    folder = tmp_path / "examples/post_training/modelopt"
    folder.mkdir(parents=True)
    path = folder / "generate.sh"
    path.write_text('SCRIPT_DIR="$(dirname "$(readlink -f "$0")")"\n'
                    'if [ -z ${MLM_MODEL_CKPT} ]; then\n    exit 1\nfi\n'
                    '${LAUNCH_SCRIPT} ${SCRIPT_DIR}/generate.py \\\n    --load ${MLM_MODEL_CKPT}\n')
    error = _first_error(cli, str(path))
    assert "/examples/post_training/modelopt/generate.py, which runs inference" in error, error


def test_placeholders_bash_cannot_parse_before_or_after_a_non_gpt_launch(tmp_path, cli):
    # examples/academic_paper_scripts/msdp: `<PATH>` placeholders, a syntax error to bash
    before = write(tmp_path, "OUT=<PATH_OF_OUTPUT>\npython -m torch.distributed.launch "
                   "./tasks/msdp/main.py --num-layers 2\n", "before.sh")  # fmt: skip
    error = _first_error(cli, before)
    assert error.startswith(f"Error: {before} line 2: the script runs ./tasks/msdp/main.py, "
                            "which runs inference"), error  # fmt: skip
    assert "a redirection `>` has no target" in error
    after = write(tmp_path, "python -m torch.distributed.launch ./tasks/msdp/main.py "
                  "--num-layers 2\nnlg-eval --hypothesis=<PATH>\n", "after.sh")  # fmt: skip
    assert _first_error(cli, after) == (
        f"Error: {after} line 1: the script runs ./tasks/msdp/main.py, which runs inference or "
        "text generation, not training; this tool reads GPT training (pretrain_gpt.py) only")
    gpt = write(tmp_path, "OUT=<PATH_OF_OUTPUT>\npython pretrain_gpt.py --num-layers 2\n", "g.sh")
    assert "a redirection `>` has no target" in _first_error(cli, gpt)  # bash's own stop


def test_deepseek_v3_tokenizer_vocabulary():
    # the ModelOpt conf (deepseek-ai/DeepSeek-R1) and megatron_fsdp DeepSeek-V3 scripts name it;
    # 128000 BPE entries + 815 added tokens (ids 128000-128814), under config.json's 129280 rows
    from inspector.inputs.tokenizers import vocabulary

    for name in ("deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-R1"):
        vocab = vocabulary("HuggingFaceTokenizer", name, None, None, "s.sh")
        assert vocab.size == 128000 + 815 < 129280, name
    # matched whole: R1's distillation into Llama has Llama 3's tokenizer, not known by this row
    other = vocabulary("HuggingFaceTokenizer", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", None,
                       None, "s.sh")  # fmt: skip
    assert other.size is None and "give --vocab-size" in other.problem


def test_empty_model_args_gives_no_model(tmp_path, cli):
    # `MODEL_ARGS:` alone (a functional test driven by its own script): the runner passes no
    # arguments, and Megatron-LM's validate_args requires the model's (it said "not NoneType")
    path = write(tmp_path, "ENV_VARS:\n  CUDA_DEVICE_MAX_CONNECTIONS: 1\nMODEL_ARGS:\nTEST_TYPE: regular\n")
    result = cli("memory", "--config", path)
    assert result.code == 2
    assert result.err.splitlines()[-1] == (
        f"Error: {path} gives no --num-layers, --hidden-size, --num-attention-heads, which "
        "Megatron-LM requires (validate_args: required_args); give them with their flags (or "
        "--set the variables that hold them)")
