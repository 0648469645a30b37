"""The launch-script reader on hostile and huge scripts (issue 30): each gives the right answer or one
error naming the script and line, within the caps docs/launch-scripts.md lists (no RecursionError,
no exponential matching, no unbounded memory); and the readings bash gives where the reader used to
differ (`set -e`, `python -c`, POSIX classes, braces), checked against real bash where it can be."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from inspector.errors import ConfigError, InputError
from inspector.inputs.bash.context import Context
from inspector.inputs.bash.interpreter import interpret
from inspector.inputs.bash.runtime import MAX_NESTING, MAX_RUN_DEPTH
from inspector.inputs.sources import parse_launch_script

BASH = shutil.which("bash")
LAUNCH = "torchrun t.py --num-layers 2\n"


def refused(text: str) -> str:
    with pytest.raises(InputError) as error:
        parse_launch_script(text, "s.sh")
    return str(error.value)


def layers(text: str) -> int:
    return int(parse_launch_script(text, "s.sh").args["num_layers"])


def launched(text: str) -> list[str]:
    """The words of the one command the reader records (whatever it launches)."""
    ctx = Context("s.sh", {}, lambda argv: argv[0] == "torchrun")
    interpret(ctx, text)
    assert len(ctx.commands) == 1
    return list(ctx.commands[0].argv[2:])


# ------------------------------------------------------------------------------ unbounded work


@pytest.mark.parametrize(
    "text, message",
    [
        # each eval runs two more: bash would never end; the reader stops at its depth cap
        ("c='eval \"$c\"; eval \"$c\"'\neval \"$c\"\n" + LAUNCH,
         f"s.sh line 2: commands, functions, `eval`s and sourced files run more than "
         f"{MAX_RUN_DEPTH} deep inside one another; the reader stops there"),
        # a value doubling without end
        ("c=:\nwhile true; do c=\"$c;$c\"; done\n" + LAUNCH,
         "s.sh line 2: c grows past 1048576 characters"),
        # a glob whose backtracking would take 2^40 steps is matched position by position
        ("v=" + "a" * 40 + "\ncase $v in *a*a*a*a*a*a*a*a*a*a*c) exit;; esac\n" + LAUNCH, None),
        # ... and a replacement whose honest cost is too high stops at the matching budget
        ("v=" + "a" * 3000 + "\nw=${v//*a*a*a*c/}\n" + LAUNCH,
         "s.sh line 2: pattern matching takes more than 5000000 steps in all; the reader stops "
         "there"),
        # a regex Python would backtrack on exponentially is refused before it runs
        ("v=" + "a" * 40 + "\nif [[ $v =~ (a+)+b ]]; then exit; fi\n" + LAUNCH,
         "s.sh line 2: the regular expression `(a+)+b` repeats a group that itself repeats or "
         "alternates; the reader refuses it (its matching time can grow exponentially)"),
        ("v=" + "a" * 5000 + "\nif [[ $v =~ a*a*a*b ]]; then exit; fi\n" + LAUNCH,
         "s.sh line 2: the regular expression `a*a*a*b` against a value of 5000 characters "
         "could take more than 5000000 steps; the reader stops there"),
        # a brace expansion is refused, not cut short (the last word of `{1..20000}` matters)
        ("torchrun t.py --num-layers={1..20000}\n",
         "s.sh line 1: a brace expansion makes more than 10000 words or 4194304 characters; the "
         "reader stops there"),
        ("A=" + "x" * 2_000_000 + "\n" + LAUNCH, "s.sh line 1: A grows past 1048576 characters"),
    ],
)  # fmt: skip
def test_unbounded_work_stops_with_one_error(text, message):
    if message is None:
        assert layers(text) == 2
    else:
        assert refused(text) == message


def test_a_script_that_sources_itself_stops_at_the_depth_cap(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text('source "$0" "x$1"\n' + LAUNCH)
    with pytest.raises(InputError) as error:
        parse_launch_script(script.read_text(), str(script))
    assert str(error.value).endswith("sourced files include each other too deeply")


@pytest.mark.slow
def test_a_huge_script_is_read_in_seconds():
    """100,000 assignments (300,000 take about 4 s of CPU): read one command at a time."""
    text = "".join(f"V{i}={i}\n" for i in range(100_000)) + "torchrun t.py --num-layers $V99999\n"
    assert layers(text) == 99999


# ------------------------------------------------------------------------------ nesting


def _nested(kind: str, depth: int) -> str:
    shapes = {
        "if": ("if true; then ", "X=1; ", "fi; "),
        "case": ("case a in a) ", "X=1 ", ";; esac "),
        "subshell": ("( ", "X=1 ", ") "),
        "braces": ("{ ", "X=1; ", "}; "),
        "function": ("f() { ", "X=1; ", "}; "),
        "while": ("while true; do ", "break 999; ", "done; "),
    }
    opener, middle, closer = shapes[kind]
    return opener * depth + middle + closer * depth + "\n" + LAUNCH


@pytest.mark.parametrize("kind", ["if", "case", "subshell", "braces", "function", "while"])
def test_nesting_up_to_the_cap_is_read_and_past_it_refused(kind):
    assert layers(_nested(kind, MAX_NESTING - 1)) == 2
    assert refused(_nested(kind, 400)) == (
        f"s.sh line 1: commands nest more than {MAX_NESTING} deep; the reader stops there"
    )


def test_nested_arithmetic_is_read_up_to_the_cap():
    depth = MAX_NESTING - 1
    assert layers(f"L=$(({'(' * depth}2{')' * depth}))\ntorchrun t.py --num-layers $L\n") == 2
    assert refused("L=$((" + "(" * 400 + "1" + ")" * 400 + "))\n").endswith(
        f"nests more than {MAX_NESTING} deep; the reader stops there"
    )
    assert refused("L=$((" + "- " * 400 + "1))\n").endswith("the reader stops there")


def test_recursion_with_deep_bodies_never_reaches_pythons_limit():
    body = "if true; then " * 20 + 'if [ $1 -lt 90 ]; then f $(($1+1)); fi; ' + "fi; " * 20
    message = refused(f"f() {{ {body} }}\nf 0\n" + LAUNCH)
    assert message.startswith("s.sh line 1: ") and "deep" in message


# ------------------------------------------------------------------------------ wrong readings


@pytest.mark.parametrize(
    "text, launches",
    [
        ("set -e\nfalse\n" + LAUNCH, False),
        ("set -euo pipefail\n[ a = b ] && echo\nX=$((1-1))\n(( X ))\n" + LAUNCH, False),
        ("set -e\nif false; then :; fi\n! false\nfalse || true\nf() { return 3; }\nf || true\n"
         "while false; do :; done\n[[ a == b ]] && exit 1\n" + LAUNCH, True),
        ("set -e\n( false )\n" + LAUNCH, False),
        ("set -e\nset +e\nfalse\n" + LAUNCH, True),
        ("set -o errexit\nf() { false; echo; }\nf\n" + LAUNCH, False),
        ("set -e\nf() { false; echo; }\nf && echo\n" + LAUNCH, True),  # -e is off in a tested call
    ],
)  # fmt: skip
def test_set_e_stops_where_bash_stops(text, launches, tmp_path):
    if BASH is not None:
        stub = tmp_path / "torchrun"
        stub.write_text("#!/bin/sh\necho launched\n")
        stub.chmod(0o755)
        ran = subprocess.run([BASH, "-c", text], capture_output=True, text=True, timeout=20,
                             env={"PATH": f"{tmp_path}:/usr/bin:/bin"})  # fmt: skip
        assert ("launched" in ran.stdout) == launches
    if launches:
        assert layers(text) == 2
    else:
        assert "under `set -e`" in refused(text)


def test_set_e_error_names_the_failing_command():
    assert refused("set -e\ni=0\n(( i++ ))\n" + LAUNCH) == (
        "s.sh: found no training command (a line running torchrun/python/deepspeed on a .py "
        "file); the script stops before any: s.sh line 3: `(( i++ ))` fails (status 1) under "
        "`set -e`"
    )


@pytest.mark.parametrize(
    "text",
    ["python -c 'import torch; print(1)' t.py\n", "python3 -m pip install t.py\n",
     "python -u -c pass t.py --num-layers 4\n"],
)  # fmt: skip
def test_python_running_code_or_a_module_is_not_a_launch(text):
    assert refused(text).startswith("s.sh: found no training command")


def test_torch_launcher_module_is_still_a_launch():
    text = "python -m torch.distributed.run --nproc_per_node 2 t.py --num-layers 2\n"
    assert parse_launch_script(text, "s.sh").world_size == 2


def _bash_words(text: str) -> list[str]:
    out = subprocess.run([BASH, "-c", text.replace("torchrun t.py", "printf '%s\\n'")],
                         capture_output=True, text=True, timeout=20).stdout  # fmt: skip
    return out.split("\n")[:-1]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_glob_patterns_agree_with_bash():
    """`case`, `${v#p}`, `${v##p}`, `${v%p}`, `${v%%p}`, `${v/p/X}`, `${v//p/X}` on generated
    patterns (POSIX classes, negated and odd brackets, escaped wildcards) against real bash."""
    alphabet = ["a", "b", "-", "*", "?", "[ab]", "[!a]", "[[:digit:]]", "[[:alpha:]]", "1", "[a-]",
                "\\*", "[]a]", "[^b]", "[[:space:]]", "[[:upper:][:digit:]]"]  # fmt: skip
    values = ["", "a", "ab", "aab", "a1b", "b-a", "1", "a*b", "]a", "abab1", "A 9"]
    rng = random.Random(7)
    script = ""
    for _ in range(200):
        pattern = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        value = rng.choice(values)
        script += (f"v='{value}'\ncase $v in {pattern}) m=1;; *) m=0;; esac\n"
                   f'torchrun t.py "$m|${{v#{pattern}}}|${{v##{pattern}}}|${{v%{pattern}}}|'
                   f'${{v%%{pattern}}}|${{v/{pattern}/X}}|${{v//{pattern}/X}}"\n')  # fmt: skip
    ctx = Context("s.sh", {}, lambda argv: argv[0] == "torchrun")
    interpret(ctx, script)
    assert [command.argv[2] for command in ctx.commands] == _bash_words(script)


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@pytest.mark.parametrize(
    "text",
    ["v=5\ncase $v in [[:digit:]]) L=4;; *) L=8;; esac\ntorchrun t.py $L\n",
     "v=a5\n[[ $v =~ ^[[:alpha:]][[:digit:]]+$ ]] && L=4\ntorchrun t.py ${L:-8} ${BASH_REMATCH[0]}\n",
     "v=node12\n[[ $v =~ ^node([0-9]+)$ ]]\ntorchrun t.py ${BASH_REMATCH[1]}\n",
     "torchrun t.py --num-layers={4,8} {{a,b} {a..C} x{a,b}{1,2}\n",
     "v=abc\ntorchrun t.py ${v/#a/X} ${v/%c/X} ${v/#b/X}\n"],
)  # fmt: skip
def test_classes_regexes_and_braces_agree_with_bash(text):
    assert launched(text) == _bash_words(text)


def test_any_hostile_text_is_read_or_refused_cleanly():
    """Generated deep and repetitive texts: an answer or one of the tool's errors, never another."""
    rng = random.Random(3)
    bits = ["$((", "))", "(", ")", "{ ", "}; ", "if true; then ", "fi; ", "eval ", "'", '"', "*",
            "[[:digit:]]", "${v//", "/}", "case a in a) ", ";; esac ", "{a,b}", "\\", "\n"]  # fmt: skip
    for _ in range(200):
        text = "".join(rng.choice(bits) for _ in range(rng.randint(1, 300)))
        try:
            parse_launch_script(text + "\n" + LAUNCH, "s.sh")
        except (InputError, ConfigError):
            pass


def test_bash_source_relative_sourcing_from_another_folder(tmp_path, monkeypatch):
    """Megatron-LM's scripts are run from the repository's root: `bash examples/x/train.sh`."""
    folder = tmp_path / "examples" / "x"
    folder.mkdir(parents=True)
    (folder / "common.sh").write_text("LAYERS=6\n")
    (folder / "train.sh").write_text(
        'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"\ntorchrun t.py --num-layers $LAYERS\n'
    )
    monkeypatch.chdir(tmp_path)
    script = "examples/x/train.sh"
    assert parse_launch_script((folder / "train.sh").read_text(), script).args["num_layers"] == 6
