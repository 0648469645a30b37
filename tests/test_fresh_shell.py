"""Launch scripts read as bash reads them on a fresh login shell of the job's machine (issue #27):
unset variables are empty, file guards pass with a note, `$RANDOM` and `pwd` stand as placeholders,
every value the model or layout needs and the script leaves unset is named in one error, and the
launch forms of Megatron-LM's examples (`uv run`, `sbatch <<EOF`, `srun ... sh -c`, `#SBATCH`) give
the world. Each script goes through the real command line; tests/test_bash.py runs the
fixtures/scripts/bash ones under real bash too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.errors import InputError
from inspector.inputs.sources import parse_launch_script

SCRIPTS = Path(__file__).resolve().parent.parent / "fixtures" / "scripts"


def _header(result) -> dict:
    assert result.code == 0, result.err
    return json.loads(result.out)["header"]


def _layout(header: dict) -> tuple[int, ...]:
    top = header["topology"]
    return tuple(top[k] for k in ("world_size", "tensor_model_parallel_size",
                                  "pipeline_model_parallel_size", "data_parallel_size"))  # fmt: skip


def test_llama3_script_with_guards_reads_as_written(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = SCRIPTS / "llama3_8b_guards.sh"
    script = cli("params", "--from-script", str(path))
    # 8 GPUs / tp 2 = dp 4: the model and layout Megatron-LM builds for the script as written
    flags = cli("params", "--model", "llama3-8b", "--tp", "2", "--pp", "1", "--dp", "4", "--bf16")
    assert (script.code, script.out) == (0, flags.out)
    assert script.err.replace(str(tmp_path), "CWD") == "".join(f"{line}\n" for line in [
        f"Ignored from {path}: --rotary-base --log-interval --save --load",
        f"Note from {path}: line 6: $PWD (or `pwd`) is the folder the job starts in; the reader "
        "takes the folder it runs in",
        f"Note from {path}: line 11: took `-f pretrain_gpt.py` as true (the reader assumes "
        "pretrain_gpt.py is a file on the job's machine)",
        f"Note from {path}: line 15: took `-d CWD/checkpoints` as true (the reader assumes "
        "CWD/checkpoints is a folder on the job's machine)",
        f"Note from {path}: line 17: ${{WANDB_API_KEY}} is not set, so it reads as empty, as in "
        "bash; give it with --set WANDB_API_KEY=VALUE",
        f"Note from {path}: line 23: $RANDOM is a number bash draws at random; the reader uses 0 "
        "where it builds a path or a port",
        # the script does not export CUDA_DEVICE_MAX_CONNECTIONS=1 as Megatron-LM's examples do
        f"Note from {path}: line 33: on GPUs before Blackwell (H100, A100) Megatron-LM stops here: "
        "tp or cp above 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 and the launch does not set it "
        "(validate_args: 'Using tensor model parallelism or context parallelism require setting "
        "the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1'); on B200 and GB200 it runs",
    ])  # fmt: skip


def test_every_missing_value_in_one_error(cli):
    path = SCRIPTS / "missing_values.sh"
    result = cli("params", "--from-script", str(path))
    assert (result.code, result.out) == (2, "")
    assert result.err == (
        f"Error: {path} line 5: the model and layout need 4 values the script leaves unset: "
        "torchrun's GPUs per node is ${GPUS_PER_NODE}, which the script never sets; --num-layers "
        "is $NUM_LAYERS, which the script never sets; --hidden-size is $((HIDDEN * 64)), where "
        "$HIDDEN is a value which the script never sets; --tensor-model-parallel-size is "
        "$(cat tp.txt), which the reader never runs; give them with --set GPUS_PER_NODE=VALUE "
        "--set NUM_LAYERS=VALUE --set HIDDEN=VALUE; give --tensor-model-parallel-size with its "
        "own flag instead\n"
    )
    given = cli("params", "--from-script", str(path), "--set", "GPUS_PER_NODE=8", "--set",
                "NUM_LAYERS=4", "--set", "HIDDEN=4", "--tp", "2", "--format", "json")  # fmt: skip
    header = _header(given)
    assert (header["config"]["num_layers"], header["config"]["hidden_size"]) == (4, 256)
    assert _layout(header) == (8, 2, 1, 4)


def test_a_flag_stands_in_for_a_missing_value(cli):
    path = SCRIPTS / "missing_values.sh"
    result = cli("params", "--from-script", str(path), "--num-layers", "2", "--hidden-size", "64",
                 "--tp", "1", "--dp", "2", "--format", "json")  # fmt: skip
    assert _layout(_header(result)) == (2, 1, 1, 2)


def test_here_document_given_to_sbatch(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    header = _header(cli("params", "--from-script", str(SCRIPTS / "bash" / "sbatch_heredoc.sh"),
                         "--format", "json"))  # fmt: skip
    # sbatch --nodes=4 with #SBATCH --ntasks-per-node=8: srun's 32 tasks; ${TP:-2} read in the job
    assert _layout(header) == (32, 2, 1, 16)
    assert header["config"]["num_layers"] == 4


def test_uv_run_and_unset_variables(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    header = _header(cli("params", "--from-script", str(SCRIPTS / "bash" / "fresh_shell.sh"),
                         "--format", "json"))  # fmt: skip
    assert _layout(header) == (16, 2, 1, 8)  # ${NUM_NODES:-2} nodes x 8


@pytest.mark.parametrize(
    "batch, launch, world",
    [
        ("#SBATCH -N 2\n#SBATCH --gpus-per-node=4\n",
         "srun torchrun --nnodes $SLURM_NNODES --nproc_per_node gpu", 8),
        ("#SBATCH --nodes=2\n#SBATCH --gpus-per-node=h100:8\n",
         "torchrun --nnodes $SLURM_JOB_NUM_NODES --nproc_per_node $SLURM_GPUS_PER_NODE", 16),
        ("#SBATCH --nodes 3\n#SBATCH --ntasks-per-node 8\n", "srun python", 24),
        ("#SBATCH -N 2 --ntasks-per-node=4\n",
         'srun --container-image x sh -c "python -u', 8),
    ],
)  # fmt: skip
def test_sbatch_counts_give_the_world(batch, launch, world):
    close = '"' if launch.endswith("-u") else ""
    text = (f"#!/bin/bash\n{batch}\n{launch} pretrain_gpt.py --num-layers 2 --hidden-size 64 "
            f"--num-attention-heads 4{close}\n")  # fmt: skip
    assert parse_launch_script(text, "s.sh").world_size == world


def test_set_u_stops_where_bash_stops():
    text = "set -euo pipefail\n[ -z \"$KEY\" ] && echo no key\npython pretrain_gpt.py --num-layers 2\n"
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value) == (
        "s.sh: found no training command (a line running torchrun/python/deepspeed on a .py "
        "file); the script stops before any: s.sh line 2: $KEY is not set, which stops bash "
        "under `set -u`; unset on the way: $KEY (s.sh line 2); give it with --set KEY=VALUE"
    )
    assert parse_launch_script(text, "s.sh", {"KEY": "k"}).args == {"num_layers": 2}


def test_a_guard_on_an_unset_variable_names_it():
    text = ('if [ -z "$MLM_MODEL_CFG" ]; then echo "set MLM_MODEL_CFG"; exit 1; fi\n'
            "python pretrain_gpt.py --num-layers 2\n")  # fmt: skip
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith(
        "the script stops before any: s.sh line 1: `exit 1`; unset on the way: $MLM_MODEL_CFG "
        "(s.sh line 1); give it with --set MLM_MODEL_CFG=VALUE"
    )


@pytest.mark.parametrize("test", ["[ -z $1 ]", "test -z ${1}"])  # fmt: skip
def test_a_guard_on_an_unquoted_positional_parameter_names_it(test):
    # ModelOpt's conf/arguments.sh: `if [ -z $1 ]; then ... exit 1; fi`. The unquoted unset word
    # vanishes, as in bash (`[ -z ]` is true), yet it decided the guard: named with its --set
    text = f"if {test}; then echo 'name the model'; exit 1; fi\npython pretrain_gpt.py --num-layers 2\n"
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith(
        "the script stops before any: s.sh line 1: `exit 1`; unset on the way: $1 (s.sh line 1); "
        "give it with --set 1=VALUE"
    )
    assert parse_launch_script(text, "s.sh", {"1": "m"}).args == {"num_layers": 2}


def test_the_guard_that_exits_names_its_own_unset_values():
    # ModelOpt's generate.sh: conf/arguments.sh first reads a dozen unset variables it gives
    # defaults (`if [ -z ${TP} ]; then TP=1; fi`); the guard that exits names only what it read
    text = ("if [ -z ${TP} ]; then TP=1; fi\n[ -z \"$EP\" ] && EP=1\n"
            "if [ -z ${CKPT} ]; then echo 'set CKPT'; exit 1; fi\n"
            "python pretrain_gpt.py --num-layers 2\n")  # fmt: skip
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith("`exit 1`; unset on the way: $CKPT (s.sh line 3); give it "
                                     "with --set CKPT=VALUE")  # fmt: skip
    # with `[ -z $CKPT ] && exit 1` too; a bare `exit` names every unset value read
    text = text.replace("if [ -z ${CKPT} ]; then echo 'set CKPT'; exit 1; fi", "[ -z $CKPT ] && exit 1")
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith("unset on the way: $CKPT (s.sh line 3); give it with --set CKPT=VALUE")
    text = text.replace("[ -z $CKPT ] && exit 1", "exit 1")
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith("unset on the way: $TP (s.sh line 1), $EP (s.sh line 2); give "
                                     "them with --set TP=VALUE --set EP=VALUE")  # fmt: skip


def test_an_unquoted_guard_on_a_named_variable_names_it():
    # ModelOpt's generate.sh: `if [ -z ${MLM_MODEL_CKPT} ]; then ... exit 1; fi`
    text = ("if [ -z ${CKPT} ]; then echo 'set CKPT'; exit 1; fi\n"
            "python pretrain_gpt.py --num-layers 2 --load $CKPT\n")  # fmt: skip
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value).endswith("unset on the way: $CKPT (s.sh line 1); give it with --set "
                                     "CKPT=VALUE")  # fmt: skip


@pytest.mark.parametrize(
    "text, args",
    [
        # an unset word where a flag stands vanishes, as in bash
        ("python pretrain_gpt.py --num-layers 2 $EXTRA\n", {"num_layers": 2}),
        # arithmetic reads an unset variable as 0; `$LAUNCHER` unset leaves the command
        ("L=$((BASE + 3))\n$LAUNCHER python pretrain_gpt.py --num-layers $L\n", None),
        # `[ -e ]`, `-r`, `-x` are taken as the script hopes
        ("[ -e a ] && [ -r a ] && [ -x a ] && L=3\npython pretrain_gpt.py --num-layers $L\n",
         {"num_layers": 3}),
        ('case "$MODE" in "") L=5;; *) L=1;; esac\npython pretrain_gpt.py --num-layers $L\n',
         {"num_layers": 5}),
    ],
)  # fmt: skip
def test_unset_readings(text, args):
    if args is None:  # the layer count derives from an unset variable: it is missing
        with pytest.raises(InputError, match=r"--num-layers is \$\(\(BASE \+ 3\)\), where \$BASE"):
            parse_launch_script(text, "s.sh")
        assert parse_launch_script(text, "s.sh", {"BASE": "1"}).args == {"num_layers": 4}
        return
    assert parse_launch_script(text, "s.sh").args == args


def test_sbatch_follows_its_job_file(tmp_path, monkeypatch):
    # In the shape of a submit script that hands sbatch a job file (with #SBATCH lines and srun
    # inside): the file runs as the batch job, the command line's --nodes after its #SBATCH lines.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.sh").write_text(
        "#!/bin/bash\n#SBATCH -t 0:30:00 --exclusive --nodes=1 --ntasks-per-node=8\n"
        'srun -l sh -c "python -u pretrain_gpt.py ${PARAMS}"\n'
    )  # fmt: skip
    text = ('export PARAMS="--num-layers 3 --hidden-size 64 --num-attention-heads 4"\n'
            "sbatch -p batch -A acct --job-name=x --nodes=2 --export=PARAMS job.sh\n")  # fmt: skip
    parsed = parse_launch_script(text, "submit.sh")
    assert parsed.world_size == 16
    assert parsed.args["num_layers"] == 3


def test_sbatch_without_a_job_file_runs_nothing():
    text = "sbatch --wrap 'python pretrain_gpt.py --num-layers 2'\n"
    with pytest.raises(InputError, match="found no training command"):
        parse_launch_script(text, "s.sh")


def test_read_gets_no_input_in_a_launch():
    # `read` meets the end of input: its variable is empty and it fails, so `|| L=3` runs
    text = ('read -p "layers? " -t 5 L || L=3\nwhile read line; do L=9; done\n'
            "python pretrain_gpt.py --num-layers $L --hidden-size 64 --num-attention-heads 4\n")  # fmt: skip
    parsed = parse_launch_script(text, "s.sh")
    assert parsed.args["num_layers"] == 3
    assert any("`read` gets no input in a launch" in note and "--set L=VALUE" in note
               for note in parsed.notes)  # fmt: skip
    assert parse_launch_script("read L\n" + text.split("\n", 1)[1], "s.sh",
                               {"L": "5"}).args["num_layers"] == 5  # fmt: skip


def test_home_is_a_placeholder_with_a_note(monkeypatch):
    monkeypatch.setenv("HOME", "/home/reader")
    text = ('[ -d ~/ckpt ] && L=4 || L=2\nD="$HOME/data"\n[ "$D" = /home/reader/data ] || L=1\n'
            "python pretrain_gpt.py --num-layers $L --hidden-size 64 --num-attention-heads 4\n")  # fmt: skip
    parsed = parse_launch_script(text, "s.sh")
    assert parsed.args["num_layers"] == 4
    assert any("$HOME (or ~) is the home folder of the job's user" in n for n in parsed.notes)


def test_exit_status_of_the_command_before():
    # "which srun; BATCH=$((1-$?))" (the shape of Megatron-LM's multimodal scripts): the reader
    # skips `which` as succeeding, so $? is 0; after `false` it is 1
    text = ("which srun\nBATCH=$((1-$?))\nfalse\nS=$?\n"
            "if [[ $BATCH -eq 1 && $S = 1 ]]; then L=6; else L=2; fi\n"
            "python pretrain_gpt.py --num-layers $L --hidden-size 64 --num-attention-heads 4\n")  # fmt: skip
    parsed = parse_launch_script(text, "s.sh")
    assert parsed.args["num_layers"] == 6
    assert any("$? reads 0, the status the reader gives the command before it" in note
               for note in parsed.notes)  # fmt: skip
