"""The command line itself: help, version, and the `Error:` contract for bad flags."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

COMMANDS = ["tree", "topology", "params", "memory", "models"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(cli, command):
    result = cli(command, "--help")
    assert result.code == 0
    assert "Usage:" in result.out and len(result.out.splitlines()) > 3


def test_no_arguments_prints_help(cli):
    result = cli()
    assert result.code == 0
    assert all(command in result.out for command in COMMANDS)


def test_version(cli):
    from inspector import __version__

    assert cli("--version").out == f"inspect-model {__version__}\n"


def test_model_flags_are_megatron_spellings(cli):
    text = cli("params", "--help-all").out
    for flag in (
        "--num-layers",
        "--hidden-size",
        "--untie-embeddings-and-output-weights",
        "--tensor-model-parallel-size",
        "--tp",
        "--pipeline-model-parallel-size",
        "--pp",
    ):
        assert flag in text


@pytest.mark.parametrize(
    "args, message",
    [
        # not an option of ours
        (["tree", "--bogus"], "Error: no such option: --bogus\n"),
        # sizes must be positive
        (["params", "--tp", "0"], "Error: --tp must be at least 1, got 0\n"),
        (["params", "--num-layers", "-1"], "Error: --num-layers must be at least 1, got -1\n"),
        # the partitioning policy must be one we know
        (
            ["params", "--partitioning", "x"],
            "Error: --partitioning 'x' is not one of: layers, cost, distopt\n",
        ),
        # --stage and --rank both pick a stage
        (
            ["params", "--pp", "2", "--stage", "0", "--rank", "0"],
            "Error: --stage and --rank select the same thing two ways; pass one of them\n",
        ),
        # hidden must split into heads unless kv-channels says otherwise
        (
            ["tree", "--hidden-size", "100"],
            "Error: --hidden-size 100 is not divisible by --num-attention-heads 12 (100 % 12 = 4); "
            "pass --kv-channels to set the head size\n",
        ),
        # choice flags are checked on the command line, as in config files and scripts
        (
            ["tree", "--normalization", "rmsnorm"],
            "Error: --normalization 'rmsnorm' is not one of: LayerNorm, RMSNorm\n",
        ),
        (
            ["params", "--position-embedding-type", "rop"],
            "Error: --position-embedding-type 'rop' is not one of: learned_absolute, rope, yarn, none\n",
        ),
        (
            ["tree", "--transformer-impl", "fast"],
            "Error: --transformer-impl 'fast' is not one of: local, transformer_engine\n",
        ),
        (
            ["memory", "--micro-batch-size", "1", "--recompute-granularity", "some"],
            "Error: --recompute-granularity 'some' is not one of: none, selective, full\n",
        ),
    ],
)
def test_bad_input_is_one_error_line(cli, args, message):
    result = cli(*args)
    assert (result.code, result.out, result.err) == (2, "", message)


def test_non_integer_is_rejected(cli):
    # typer's wording of the reason varies between releases; the flag and the exit code do not
    result = cli("tree", "--num-layers", "x")
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("Error: Invalid value for '--num-layers': ")
    assert result.err.count("\n") == 1


def test_help_does_not_import_torch():
    code = "import sys; from inspector.cli import main; main(['--help']); print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().endswith("False")


def test_console_script_exit_codes(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "inspector", "--version"], capture_output=True, text=True
    )
    assert ok.returncode == 0
    bad = subprocess.run(
        [sys.executable, "-m", "inspector", "tree", "--tp", "5"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.startswith("Error: ")
    assert "Traceback" not in bad.stderr


def test_debug_keeps_megatrons_traceback(cli):
    # megatron's own refusal is one sentence normally, and its traceback with --debug
    args = ["--num-layers", "2", "--hidden-size", "4", "--num-attention-heads", "1", "--swiglu",
            "--ffn-hidden-size", "8", "--num-experts", "2", "--moe-router-topk", "1"]  # fmt: skip
    plain = cli("params", *args)
    assert plain.code == 2 and plain.err.count("\n") == 1
    assert plain.err.startswith("Error: megatron-core refused to build stage 0: ")
    debug = cli("--debug", "params", *args)
    assert debug.code == 2 and "Traceback" in debug.err
    assert debug.err.endswith(plain.err)


def test_help_is_grouped_in_panels(cli):
    # Options in panels (plain text: rich is never imported), in a fixed order.
    text = cli("memory", "--help-all").out
    panels = [line for line in text.splitlines() if line and not line.startswith(" ")][1:]
    assert panels == [
        "Options:",
        "Input: the model and where its arguments come from:",
        "Model: Megatron-LM model arguments:",
        "Parallel layout:",
        "Training: Megatron-LM training arguments:",
        "Output:",
        "Examples:",
    ]
    # --micro-batch-size is marked required in help; click itself does not require it (a config
    # file or a launch script may give it), our own Error: says it is missing
    assert re.search(r"--micro-batch-size INTEGER +Sequences per micro-batch\.  \[required\]", text)
    assert cli("memory").err.startswith("Error: --micro-batch-size is required")
    # file options show FILE, choices are listed
    for option in ("--config FILE", "--from-script FILE", "-o, --output FILE", "--set NAME=VALUE"):
        assert option in text, option
    assert "--recompute-granularity [none|selective|full]" in text
    assert "--check FILE" in cli("params", "--help").out
    assert "--micro-batch-size INTEGER" in cli("memory", "-h").out
    assert "-o, --output DIR" in cli("workload", "--help").out
    assert "Arguments:\n  OLD" in cli("diff", "-h").out


def test_short_help_and_completion(cli):
    top = cli("-h")
    assert top.code == 0 and "--install-completion" in top.out and "--show-completion" in top.out
    assert cli("params", "-h").out == cli("params", "--help").out


def test_debug_after_the_command(cli):
    # --debug works before or after the command: the traceback behind the translated error
    args = ["tree", "--num-layers", "2", "--num-experts", "2", "--moe-router-topk", "1",
            "--disable-bias-linear"]  # fmt: skip
    for argv in (["--debug", *args], [*args, "--debug"]):
        result = cli(*argv)
        assert result.code == 2 and "Traceback" in result.err, argv
    assert "Traceback" not in cli(*args).err


HELP_COMMANDS = ["tree", "topology", "params", "memory", "plan", "workload", "diff", "models", "calibrate",
                 "check"]


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_short_help_is_a_page_with_examples(cli, command):
    # -h fits a screen (40 lines): own options, input, the most used flags, two examples,
    # --help-all
    short = cli(command, "-h").out
    assert len(short.splitlines()) <= 40, len(short.splitlines())
    for section in ("Options:", "Examples:"):
        assert f"\n{section}\n" in short, section
    examples = short.split("Examples:\n")[1].splitlines()
    assert [line.startswith("  inspect-model ") for line in examples[:2]] == [True, True]
    if command not in ("diff", "models", "calibrate"):
        assert f"`inspect-model {command} --help-all` lists every Megatron-LM flag" in short
        full = cli(command, "--help-all")
        assert full.code == 0 and len(full.out.splitlines()) > 100
        assert "--help-all` lists" not in full.out
        assert "--untie-embeddings-and-output-weights" in full.out
        assert "--untie-embeddings-and-output-weights" not in short


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_help_examples_parse(command):
    # each example's options exist on its command and take the values shown
    import shlex

    from typer.main import get_command

    from inspector.cli.app import app
    from inspector.cli.help import EXAMPLES

    group = get_command(app)
    for example in EXAMPLES[command]:
        words = shlex.split(example.split(" > ")[0])[1:]
        sub = group.commands[words[0]]  # type: ignore[attr-defined]
        sub.make_context(words[0], words[1:])


def test_command_summaries_are_whole_sentences(cli):
    text = cli("--help").out.split("Commands:\n")[1]
    assert "..." not in text
    for command in HELP_COMMANDS:
        assert re.search(rf"\b{command} [A-Z][^.]+\.", " ".join(text.split())), command


def test_a_megatron_list_flag_takes_the_words_that_follow_it(cli) -> None:
    """Megatron-LM declares --recompute-modules nargs='*': `--recompute-modules core_attn mlp` is
    one value of two modules there, and so it is here (plan prints it that way)."""
    from inspector.cli.entry import _join_many

    assert _join_many(["memory", "--recompute-modules", "core_attn", "mlp", "--bf16", "--", "x"]) == [
        "memory", "--recompute-modules", "core_attn mlp", "--bf16", "--", "x"]  # fmt: skip
    assert _join_many(["--recompute-modules", "--bf16"]) == ["--recompute-modules", "--bf16"]
    tiny = ["memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--vocab-size", "1000", "--micro-batch-size", "1", "--bf16",
            "--disable-bias-linear",
            "--recompute-granularity", "selective", "--recompute-modules"]  # fmt: skip
    spaced, commas = cli(*tiny, "core_attn", "mlp"), cli(*tiny, "core_attn,mlp")
    assert spaced.code == 0, spaced.err
    assert "recompute selective (core_attn, mlp)" in spaced.out
    assert spaced.out == commas.out


# Each line runs after the one before in one process: options given, then left to their defaults
# (--gpu-memory's finite-float type, --debug's traceback, --tp), help, version, click's errors.
IN_TURN = [
    ("params", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--tp", "2",
     "--vocab-size", "1000", "--format", "json"),
    ("params", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
     "--vocab-size", "1000", "--format", "json"),
    ("memory", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
     "--micro-batch-size", "1", "--gpu-memory", "nan"),
    ("--debug", "params", "--num-layers", "2", "--hidden-size", "4", "--num-attention-heads", "1",
     "--swiglu", "--ffn-hidden-size", "8", "--num-experts", "2", "--moe-router-topk", "1"),
    ("params", "--num-layers", "2", "--hidden-size", "4", "--num-attention-heads", "1",
     "--swiglu", "--ffn-hidden-size", "8", "--num-experts", "2", "--moe-router-topk", "1"),
    ("params", "--help"), ("--version",), ("params", "--no-such-flag"), ("tree", "--tp", "x"),
]  # fmt: skip


def test_one_command_serves_every_call_as_a_fresh_one_would(cli):
    # the entry point builds typer's click command once per process (cli/entry.py): each answer,
    # in turn, is byte for byte the one a command built for that call alone gives
    from inspector.cli import entry

    shared = [cli(*argv) for argv in IN_TURN]
    assert entry._command() is entry._command()
    fresh = []
    for argv in IN_TURN:
        entry._command.cache_clear()
        fresh.append(cli(*argv))
    assert [r.code for r in shared] == [0, 0, 2, 2, 2, 0, 0, 2, 2]
    assert shared == fresh
    assert "Traceback" in shared[3].err and "Traceback" not in shared[4].err


def test_help_all_works_at_the_top_level_and_for_every_command(cli):
    # it was "no such option" at the top level and for diff and models
    for command in ("diff", "models"):
        full = cli(command, "--help-all")
        assert full.code == 0 and full.out.startswith(f"Usage: inspect-model {command} ")
    top = cli("--help-all")
    assert top.code == 0, top.err
    for command in HELP_COMMANDS:  # each command's whole page, every Megatron-LM flag included
        assert f"\ninspect-model {command}\n\nUsage: inspect-model {command} " in top.out
    assert top.out.count("--untie-embeddings-and-output-weights") >= 5
