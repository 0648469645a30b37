"""Faults and bad inputs of issue #46: Hugging Face values of the wrong type, inputs that never
end, outputs of one command written together, signals while other threads run, a cache entry
that names files outside the folder. Each case answers one `Error:` line (exit 2) and leaves
nothing damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import default_signals
from tests.test_versions import MOE_BIASES

ROOT = Path(__file__).resolve().parent.parent
HF = ROOT / "fixtures" / "hf"
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--vocab-size", "1000", "--transformer-impl", "local"]  # fmt: skip


def run(*argv: str, cwd: Path, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    env = {**os.environ, "INSPECT_MODEL_NO_CACHE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "inspector", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)  # fmt: skip


def error_line(result: subprocess.CompletedProcess) -> str:
    """Return the one Error: line of a refused run (exit 2, nothing on stdout, no traceback)."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("Note")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


def hf_config(folder: Path, **changes: Any) -> Path:
    data = json.loads((HF / "llama3.1-8b.json").read_text())
    for key, value in changes.items():
        if value is ...:
            del data[key]
        else:
            data[key] = value
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


HF_CASES = {
    "string-for-int": ({"num_hidden_layers": "32"}, '"num_hidden_layers" must be a whole number'),
    "bool-for-int": ({"num_hidden_layers": True}, '"num_hidden_layers" must be a whole number'),
    "float-for-int": ({"hidden_size": 4096.5}, '"hidden_size" must be a whole number'),
    "negative": ({"num_key_value_heads": -8}, '"num_key_value_heads" must be a whole number'),
    "list-for-int": ({"vocab_size": [1]}, '"vocab_size" must be a whole number'),
    "nan-dropout": ({"attention_dropout": float("nan")}, '"attention_dropout" must be a finite'),
    "string-bool": ({"tie_word_embeddings": "false"}, '"tie_word_embeddings" must be true or false'),
    "string-rope": ({"rope_scaling": "yarn"}, '"rope_scaling" must be a mapping'),
    "string-architectures": ({"architectures": "LlamaForCausalLM"}, '"architectures" must be a list'),
    "missing-layers": ({"num_hidden_layers": ...}, '"num_hidden_layers" is missing'),
    "null-hidden": ({"hidden_size": None}, '"hidden_size" is missing'),
    "missing-ffn": ({"intermediate_size": ...}, "--ffn-hidden-size"),
    # issue #46 sweep: the default model's sequence (1024) was taken, and the note said "(None)"
    "missing-positions": ({"max_position_embeddings": ...}, '"max_position_embeddings" is missing '
                          "(or null); every Llama config.json gives it (Megatron-LM's --seq-length)"),
    "null-positions": ({"max_position_embeddings": None}, '"max_position_embeddings" is missing'),
    "dense-past-layers": ({"first_k_dense_replace": 40}, '"first_k_dense_replace" 40 is more than '
                          '"num_hidden_layers" 32'),
}


@pytest.mark.parametrize("name", HF_CASES)
def test_hf_value_of_the_wrong_type_or_missing_is_an_error_naming_the_key(
    name: str, tmp_path: Path
) -> None:
    changes, words = HF_CASES[name]
    path = hf_config(tmp_path, **changes)
    line = error_line(run("params", "--hf-config", str(path), cwd=tmp_path))
    assert str(path) in line and words in line


# --- inputs that never end: a fifo nobody writes, an endless pipe, a huge or sparse file -------


@pytest.fixture
def quick_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    from inspector import output

    monkeypatch.setattr(output, "IDLE_SECONDS", 0.3)


def _refused_fifo(name: str, read: Any, message: str) -> None:
    """Read a fifo nobody writes to, named from its folder (the cwd: a message shortens a path
    over 80 characters, which the temporary folder's alone may be: a parallel run's worker
    folder, a long user name), and expect it refused, not waited on."""
    from inspector.errors import InputError

    os.mkfifo(name)
    with pytest.raises(InputError, match=message):
        read(name)


def test_a_fifo_nobody_writes_is_refused_not_waited_on(
    tmp_path: Path, quick_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector.output import read_text

    monkeypatch.chdir(tmp_path)
    _refused_fifo("pipe.yaml", read_text, r"^pipe.yaml sent nothing for 0.3 seconds")


def test_a_fifo_as_tokenizer_model_is_refused_not_waited_on(
    tmp_path: Path, quick_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector.inputs.tokenizers import vocabulary

    monkeypatch.chdir(tmp_path)
    _refused_fifo("tokenizer.json", lambda name: vocabulary("HuggingFaceTokenizer", name, None, None, "x"),
                  r"tokenizer.json sent nothing")  # fmt: skip


def test_a_fifo_that_is_written_is_read(tmp_path: Path) -> None:
    import threading

    from inspector.output import read_text

    path = tmp_path / "pipe.yaml"
    os.mkfifo(path)
    writer = threading.Thread(target=lambda: path.write_text("num-layers: 2\r\n"))
    writer.start()
    assert read_text(str(path)) == "num-layers: 2\n"
    writer.join()


def test_an_endless_pipe_as_config_is_refused_within_bounded_memory(tmp_path: Path) -> None:
    command = (f"ulimit -v 4000000; exec {sys.executable} -m inspector params --config <(yes "
               "'num-layers: 2')")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INSPECT_MODEL_NO_CACHE": "1"}
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert "holds more than 67,108,864 bytes" in error_line(result)


def test_a_huge_sparse_file_is_refused_by_its_size(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with open(path, "wb") as stream:
        stream.truncate(1 << 40)  # a terabyte of holes: reading it would never end
    # named from its folder (the cwd): a message shortens a path over 80 characters
    line = error_line(run("params", "--hf-config", path.name, cwd=tmp_path, timeout=60))
    assert line == (f"Error: {path.name} is 1,099,511,627,776 bytes; files read in are at most "
                    "67,108,864 bytes (docs/limits.md)")  # fmt: skip


def test_a_malformed_tokenizer_json_is_an_error_not_a_guess(tmp_path: Path) -> None:
    from inspector.errors import InputError
    from inspector.inputs.tokenizers import vocabulary

    path = tmp_path / "tokenizer.json"
    path.write_text("[" * 5000)
    with pytest.raises(InputError, match=r"nested more than 64 levels"):
        vocabulary("HuggingFaceTokenizer", str(path), None, None, "x")


# --- one command's outputs: checked together, written all or nothing -------------------------

MEMORY = ["memory", *SMALL, "--micro-batch-size", "1"]


def snapshot_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("argv, message", [
    ([*MEMORY, "--timeline", "a.out", "--snapshot", "a.out"],
     "Error: --snapshot a.out and --timeline a.out name the same file; give each its own"),
    ([*MEMORY, "--timeline", "a.out", "-o", "./a.out"],
     "Error: -o ./a.out and --timeline a.out name the same file; give each its own"),
    ([*MEMORY, "--snapshot", "link", "-o", "a.out"],
     "Error: -o a.out and --snapshot link name the same file; give each its own"),
    (["plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--svg", "a.out", "-o", "a.out"],
     "Error: -o a.out and --svg a.out name the same file; give each its own"),
])  # fmt: skip
def test_two_outputs_given_one_path_are_refused_before_any_work(
    argv: list[str], message: str, tmp_path: Path
) -> None:
    (tmp_path / "a.out").write_text("old\n")
    (tmp_path / "link").symlink_to("a.out")
    before = snapshot_of(tmp_path)
    assert error_line(run(*argv, cwd=tmp_path)) == message
    assert snapshot_of(tmp_path) == before


def test_a_later_output_that_fails_leaves_the_earlier_ones_unwritten(tmp_path: Path) -> None:
    for name in ("t.svg", "s.pickle", "m.txt"):
        (tmp_path / name).write_text("old\n")
    before = snapshot_of(tmp_path)
    # 20 KiB per file: the SVG (about 9 KB) fits, the snapshot (about 32 KB) does not
    command = (f"ulimit -f 20; exec {sys.executable} -m inspector {' '.join(MEMORY)} --timeline "
               "t.svg --snapshot s.pickle -o m.txt")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INSPECT_MODEL_NO_CACHE": "1"}
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert error_line(result).startswith("Error: --snapshot s.pickle: cannot write: ")
    assert snapshot_of(tmp_path) == before


def test_memory_checks_its_o_before_the_build(tmp_path: Path) -> None:
    line = error_line(run(*MEMORY, "--timeline", "t.svg", "-o", "missing/m.txt", cwd=tmp_path))
    assert line == f"Error: -o missing/m.txt: folder {tmp_path}/missing does not exist"
    assert not (tmp_path / "t.svg").exists()


# --- signals held over a write while other threads run (torch's workers) ---------------------

HELD_WITH_A_THREAD = """
import os, signal, sys, threading, time
from inspector import guard
threading.Thread(target=threading.Event().wait, daemon=True).start()  # signals not blocked there
with guard.write_guard():
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # to the process: any thread may take it
    for _ in range(200):
        time.sleep(0.001)  # points where Python runs a handler the other thread's signal set
    print("block finished", flush=True)
print("after the block", flush=True)
"""


@pytest.mark.parametrize("name, code", [("SIGTERM", -15), ("SIGHUP", -1), ("SIGINT", -2)])
def test_a_signal_taken_by_another_thread_waits_for_the_write(name: str, code: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", HELD_WITH_A_THREAD, name], env=env,
                            capture_output=True, text=True, timeout=60,
                            preexec_fn=default_signals)  # fmt: skip
    assert result.stdout == "block finished\n"
    assert result.returncode == code
    assert (name != "SIGINT") == ("KeyboardInterrupt" not in result.stderr)


SIGNALLED_WHILE_HANDLERS_ARE_SET = """
import os, signal
from inspector import guard
real = signal.signal
def setting(signum, handler):
    old = real(signum, handler)
    if signum == signal.SIGINT and old is signal.default_int_handler:  # the first one, guard's own
        signal.raise_signal(signal.SIGINT)  # noted by guard's handler before the others are set
    return old
signal.signal = setting
with guard.write_guard():
    print("block finished", flush=True)
print("after the block", flush=True)
"""


def test_a_signal_while_the_handlers_are_set_is_not_lost() -> None:
    # CI once hung on it: the signal was noted, then the list of noted signals was replaced
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", SIGNALLED_WHILE_HANDLERS_ARE_SET], env=env,
                            capture_output=True, text=True, timeout=60,
                            preexec_fn=default_signals)  # fmt: skip
    assert result.stdout == "block finished\n"
    assert "KeyboardInterrupt" in result.stderr


def test_a_signal_during_the_staged_files_leaves_every_target_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector import output

    for name in ("a", "b"):
        (tmp_path / name).write_text("old\n")
    calls = []

    def interrupted(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:  # the second file's fsync: the first is staged already
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output.write_files([("-o", str(tmp_path / "a"), "new\n"), ("--svg", str(tmp_path / "b"), b"new\n")])
    assert snapshot_of(tmp_path) == {"a": b"old\n", "b": b"old\n"}


# --- a cache entry written over, its checksum made to match ----------------------------------


def test_a_poisoned_workload_entry_is_a_miss_never_a_path_outside_the_folder(tmp_path: Path) -> None:
    from inspector.cli import cache

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "INSPECT_MODEL_NO_CACHE": "0"}
    argv = ["workload", *SMALL, "--micro-batch-size", "1", "--global-batch-size", "8", "--gpu", "h100"]

    def workload(out: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "inspector", *argv, "-o", out], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    assert workload("first").returncode == 0
    (entry,) = (tmp_path / "cache" / "inspect-model").glob("*.txt")
    poisoned = {"index.csv": "file\n../evil.sh\n", "../evil.sh": "echo owned\n"}
    secret = (entry.parent / cache.SECRET).read_bytes()  # the poisoner could read the secret
    entry.write_bytes(cache.encode(json.dumps(poisoned), entry.stem, secret))
    result = workload("second")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "evil.sh").exists()
    assert snapshot_of(tmp_path / "second") == snapshot_of(tmp_path / "first")


def test_a_workload_stage_entry_without_the_stage_file_is_a_miss_not_a_key_error(tmp_path: Path) -> None:
    # an entry whose MAC matches (written by someone holding the secret) but that lacks the asked
    # stage's file used to end in KeyError: 'stage001.txt'; it is now a miss and rebuilt
    from inspector.cli import cache

    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "INSPECT_MODEL_NO_CACHE": "0"}  # fmt: skip
    argv = [sys.executable, "-m", "inspector", "workload", *SMALL, "--pp", "2", "--stage", "1",
            "--micro-batch-size", "1", "--gpu", "h100"]  # fmt: skip
    first = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    (entry,) = (tmp_path / "cache" / "inspect-model").glob("*.txt")
    secret = (entry.parent / cache.SECRET).read_bytes()
    entry.write_bytes(cache.encode(json.dumps({"index.csv": "file\n"}), entry.stem, secret))
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (again.returncode, again.stdout) == (0, first.stdout), again.stderr[-2000:]


@pytest.mark.parametrize("name", ["../evil", "/tmp/evil", "", ".", "sub/x"])
def test_an_export_never_writes_a_name_outside_its_folder(name: str, tmp_path: Path) -> None:
    from inspector.errors import OutputError
    from inspector.export import write_export

    with pytest.raises(OutputError, match="not a file name in the folder; nothing was written"):
        write_export(str(tmp_path / "out"), {"index.csv": "file\n", name: "x\n"})
    assert list(tmp_path.iterdir()) == []


# --- words Megatron-LM's argparse refuses, never dropped ----------------------------------------

SCRIPT = ("#!/bin/bash\ntorchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
          "--num-attention-heads 4 --vocab-size 1000 --seq-length 128 --max-position-embeddings 128 "
          "--micro-batch-size 1 --transformer-impl local {}\n")  # fmt: skip


@pytest.mark.parametrize("words, message", [
    ("--swiglu=true", "--swiglu is a switch and takes no value; Megatron-LM's argparse refuses "
     "--swiglu=true"),
    ("--bf16=", "--bf16 is a switch and takes no value; Megatron-LM's argparse refuses --bf16="),
    ("--tensor-model-parallel-size 2 4", "'4' follows --tensor-model-parallel-size 2, which takes "
     "no further value (Megatron-LM's argparse refuses it as an unrecognised argument)"),
    ("--swiglu on", "'on' follows --swiglu, which takes no further value"),
    ("--seq-length=128 256", "'256' follows --seq-length 128, which takes no further value"),
    ("--tensor-model-parallel-size=2=3", "--tensor-model-parallel-size needs int value, got '2=3'"),
    # issue #46: values of arguments the tool ignores, checked as Megatron-LM 0.16.1's argparse
    # checks them (inputs/ignored_values.py, read off its own parser)
    ("--log-interval abc", "--log-interval needs int value, got 'abc' (Megatron-LM's argparse "
     "refuses it: invalid int value)"),
    ("--lr 1e-4x", "--lr needs float value, got '1e-4x'"),
    ("--lr-decay-style cosin", "--lr-decay-style 'cosin' is not one of: constant, linear, cosine"),
    ("--empty-unused-memory-level 3", "--empty-unused-memory-level '3' is not one of: 0, 1, 2"),
    ('--tokenizer-type ""', "--tokenizer-type '' is not one of: BertWordPieceLowerCase"),
    ("--rampup-batch-size 16 16 x", "--rampup-batch-size needs int value, got 'x'"),
    ("--log-interval", "--log-interval needs a value (Megatron-LM's argparse: expected one argument)"),
    ("--tokenizer-model --bf16", "--tokenizer-model needs a value"),
    ("--mock-data 1", "'1' follows --mock-data, which takes no further value"),
    ("--mock-data=1", "--mock-data is a switch and takes no value"),
    ("--log-interval 10 20", "'20' follows --log-interval 10, which takes no further value"),
    # Megatron-LM's parser has allow_abbrev=False: an abbreviation is not the flag it begins
    ("--seq-len 128", "--seq-len is not a Megatron-LM argument but the start of --seq-length; "
     "Megatron-LM's parser takes no abbreviations (allow_abbrev=False)"),
    ("--log-inter 10", "--log-inter is not a Megatron-LM argument but the start of --log-interval"),
    # issue #46 (sweep46b): a single-dash word and argparse's '--' were skipped, the job read
    # without them; Megatron-LM's parser has no single-dash options and no positional arguments
    ("-num-layers 4", "'-num-layers' is not a Megatron-LM argument (they begin with '--'); "
     "Megatron-LM's argparse refuses it as an unrecognised argument"),
    ("-- --hidden-size 128", "'--' is not a Megatron-LM argument"),
])  # fmt: skip
def test_a_word_argparse_refuses_is_an_error_not_dropped(
    words: str, message: str, tmp_path: Path
) -> None:
    (tmp_path / "train.sh").write_text(SCRIPT.format(words))
    line = error_line(run("topology", "--from-script", "train.sh", cwd=tmp_path))
    assert line.startswith("Error: train.sh line 2: ") and message in line


def test_a_yaml_list_for_a_one_value_flag_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "model_config.yaml").write_text(
        "MODEL_ARGS:\n  --num-layers: [2, 4]\n  --hidden-size: 64\n  --num-attention-heads: 4\n")
    line = error_line(run("topology", "--config", "model_config.yaml", cwd=tmp_path))
    assert "'4' follows --num-layers 2, which takes no further value" in line


# --- megatron-core's own refusals name the flags to change ------------------------------------


def test_a_megatron_refusal_names_the_flags_behind_the_fields_it_names() -> None:
    from inspector.errors import ConfigError
    from inspector.world.stage import _megatron_errors

    message = ("num_attention_heads (5) must be a multiple of tensor_model_parallel_size (2); "
               "self.config.num_moe_experts and gated_linear_unit too")  # fmt: skip
    with pytest.raises(ConfigError) as caught, _megatron_errors(0):
        raise AssertionError(message)
    assert str(caught.value) == (
        f"megatron-core refused to build stage 0: {message} (the flags it names: "
        "--num-attention-heads, --tensor-model-parallel-size, --num-experts, --swiglu; --debug "
        "shows its traceback)")


@pytest.mark.parametrize("message, flags", [
    ("Bias in Moe is only supported when ETP==1", "--expert-tensor-parallel-size, --disable-bias-linear"),
    ("Currently GroupedMLP for MoE only supports bf16.", "--moe-grouped-gemm, --bf16"),
    ("Flex token dispatcher requires TPxEP > 1",
     "--moe-token-dispatcher-type, --tensor-model-parallel-size, --expert-model-parallel-size"),
    ("full recompute is only supported with full iteration CUDA graph.",
     "--recompute-granularity, --cuda-graph-scope"),
    # issue #46 (sweep46b): raised by megatron's forward on the run, not its build
    ("Only support fusion of swiglu and quick_gelu with per_token_scale in MLP.",
     "--swiglu, --no-bias-gelu-fusion"),
    ("Storage size calculation overflowed with sizes=[4, 1073741824, 1073741824]",
     "--seq-length, --micro-batch-size"),
])  # fmt: skip
def test_a_megatron_refusal_that_names_no_field_names_the_flags_behind_it(message: str, flags: str) -> None:
    # issue #46: megatron-core asserts that name no TransformerConfig field reached the user with
    # no flag to change
    from inspector.errors import ConfigError
    from inspector.world.stage import _megatron_errors

    with pytest.raises(ConfigError) as caught, _megatron_errors(0):
        raise AssertionError(message)
    assert f"(the flags it names: {flags}; --debug shows its traceback)" in str(caught.value)


def test_a_refusal_on_the_run_names_the_flags_behind_it() -> None:
    # a GELU MoE with Megatron-LM's default bias-GELU fusion: SequentialMLP hands its experts the
    # routing probabilities, which megatron's fused bias activation takes for SwiGLU only; the
    # run's error (memory/engine/microbatch.py) named no flag to change
    from inspector.memory.engine.microbatch import megatron_failed

    error = megatron_failed("the forward", ValueError(
        "Only support fusion of swiglu and quick_gelu with per_token_scale in MLP."))
    assert str(error).endswith("(the flags it names: --swiglu, --no-bias-gelu-fusion; --debug shows "
                               "its traceback)")  # fmt: skip


def test_a_refusal_names_the_flags_as_megatron_lm_spells_them() -> None:
    # gpt-oss's preset with Megatron-LM's default bias-dropout fusion: TEGroupedMLP refuses its
    # biases; the refusal named --bias-dropout-fusion, which no parser takes (Megatron-LM's flag
    # is --no-bias-dropout-fusion), and the fields no Megatron-LM argument sets named flags too
    from inspector.world.config import flags_named

    reason = "bias_dropout_fusion is not supported in TEGroupedMLP when add_bias_linear=True"
    assert flags_named(reason) == ["--no-bias-dropout-fusion", "--disable-bias-linear"]
    assert flags_named("apply_rope_fusion with init_method and layernorm_epsilon") == [
        "--no-rope-fusion", "--norm-epsilon"]


def test_every_flag_a_refusal_names_is_an_argument(tmp_path: Path) -> None:
    import dataclasses

    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from inspector.inputs.arguments import BY_NAME
    from inspector.inputs.unmodelled import REFUSED
    from inspector.world.config import flags_named

    facts = (ROOT / "fixtures" / "megatron_lm_arguments.txt").read_text().split()
    known = {word[1:] if word.startswith(("+--", "---")) else word  # a release's +NAME, -NAME
             for word in facts if word.startswith(("--", "+--", "---"))}  # fmt: skip
    known |= {spec.flag for spec in BY_NAME.values()} | set(REFUSED)  # the tool's own spellings
    named = {flag for field in dataclasses.fields(MLATransformerConfig)
             for flag in flags_named(field.name)}  # fmt: skip
    assert named and sorted(named - known) == []


def test_a_refusal_without_field_names_reaches_the_command_line_with_its_flags(tmp_path: Path) -> None:
    argv = ["tree", "--num-layers", "2", "--num-experts", "2", "--tp", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "2", "--num-attention-heads", "4", "--hidden-size", "64",
            "--transformer-impl", "transformer_engine"]  # fmt: skip
    refusal = ("Bias in Moe is only supported when ETP==1 (the flags it names: "
               "--expert-tensor-parallel-size, --disable-bias-linear" if MOE_BIASES else
               "Bias is not supported for MoE (the flags it names: --disable-bias-linear")
    assert error_line(run(*argv, cwd=tmp_path)) == (
        f"Error: megatron-core refused to build stage 0: {refusal}; --debug shows its traceback)")


# --- extreme scales: an Error: within bounded time and memory ----------------------------------


def test_a_billion_micro_batches_is_refused_not_written(tmp_path: Path) -> None:
    argv = ["workload", *SMALL, "--micro-batch-size", "1", "--gpu", "h100", "--stage", "0",
            "--global-batch-size", "1000000000"]  # fmt: skip
    command = f"ulimit -v 6000000; exec {sys.executable} -m inspector {' '.join(argv)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "INSPECT_MODEL_NO_CACHE": "1"}
    result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert error_line(result).startswith(
        "Error: workload: 1,000,000,000 micro-batches x 9 records each is more than the "
        "2,000,000 records a stage's file holds here")


# --- YAML: nesting that aliases hide ----------------------------------------------------------


def test_aliases_nesting_an_anchor_inside_another_count_as_nested(tmp_path: Path) -> None:
    # each anchor 50 levels deep holds the one before: 40 of them are 2,000 levels once expanded
    lines = [f"k{i}: &a{i} " + "[" * 50 + (f"*a{i - 1}" if i else "1") + "]" * 50 for i in range(40)]
    (tmp_path / "deep.yaml").write_text("\n".join([*lines, "num-layers: *a39"]) + "\n")
    line = error_line(run("params", "--config", "deep.yaml", cwd=tmp_path))
    assert line == "Error: deep.yaml: nested more than 64 levels deep once its aliases are expanded"


def test_an_alias_within_the_depth_is_read(tmp_path: Path) -> None:
    from inspector.inputs.safe_parse import parse_yaml

    text = "a: &a " + "[" * 30 + "1" + "]" * 30 + "\nb: " + "[" * 33 + "*a" + "]" * 33 + "\n"
    data = parse_yaml(text, "ok.yaml")
    assert data["b"][0] is not None
    with pytest.raises(Exception, match="once its aliases are expanded"):
        parse_yaml(text.replace("[" * 33, "[" * 34).replace("]" * 33, "]" * 34), "deep.yaml")


def test_a_sourced_file_is_read_within_bounds(tmp_path: Path) -> None:
    with open(tmp_path / "common.sh", "wb") as stream:
        stream.truncate(1 << 40)  # a terabyte of holes
    (tmp_path / "train.sh").write_text("#!/bin/bash\nsource common.sh\n" + SCRIPT.format("").split("\n", 1)[1])
    line = error_line(run("topology", "--from-script", "train.sh", cwd=tmp_path))
    assert "common.sh is 1,099,511,627,776 bytes; files read in are at most 67,108,864" in line


@pytest.mark.parametrize("value", [".inf", "-.inf"])
def test_an_infinite_count_in_a_config_is_an_error(value: str, tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(f"num-layers: {value}\nhidden-size: 64\n")
    line = error_line(run("params", "--config", "c.yaml", cwd=tmp_path))
    shown = "inf" if value == ".inf" else "-inf"
    assert line == f"Error: c.yaml: --num-layers needs int value, got {shown}"


def test_a_fifo_nobody_writes_as_a_log_is_refused_not_waited_on(
    tmp_path: Path, quick_idle: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # read_head (check's log, --kernels) opened a fifo with open(), which waits for a writer
    # forever; it is now read as read_bytes reads, and one that sends nothing is refused by name
    from inspector.output import read_head

    monkeypatch.chdir(tmp_path)
    _refused_fifo("train.log", lambda name: read_head(name, 1000), r"^train.log sent nothing for 0.3 seconds")


def test_check_on_a_fifo_nobody_writes_answers_in_bounded_time(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "train.log")
    line = error_line(run("check", "train.log", cwd=tmp_path, timeout=60))
    assert line.startswith("Error: train.log sent nothing for")


@pytest.mark.parametrize("words, message", [
    # issue #46: an empty value is a value (bash passes '' and "$EMPTY" as one word); Megatron-LM's
    # tokenizers refuse an empty path, so the job is refused, not read with --vocab-size
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model ''",
     "--tokenizer-model is empty (''), which Megatron-LM's HuggingFaceTokenizer cannot load"),
    ('--tokenizer-type Llama2Tokenizer --tokenizer-model "$EMPTY"',
     "--tokenizer-model is empty (''), which Megatron-LM's Llama2Tokenizer cannot load"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file ''",
     "--vocab-file is empty (''), which Megatron-LM's GPT2BPETokenizer cannot load"),
    # "$UNSET" and ""$UNSET are one empty word too: the flag has a value the script never sets
    ('--tokenizer-type HuggingFaceTokenizer --tokenizer-model ""$UNSET',
     "--tokenizer-model is $UNSET, which the script never sets; give it with --set UNSET=VALUE"),
])  # fmt: skip
def test_an_empty_tokenizer_file_is_refused_by_its_flag(words: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text("\nEMPTY=''\n".join(SCRIPT.format(words).split("\n", 1)))
    line = error_line(run("topology", "--from-script", "train.sh", cwd=tmp_path))
    assert line.startswith("Error: train.sh line 3: ") and message in line


def test_an_empty_word_after_a_flag_with_a_value_is_its_value(tmp_path: Path) -> None:
    # `--data-path "$UNSET" --num-layers 2`: bash passes '' as --data-path's value; before the
    # fix "$UNSET" vanished and the launch shown lost the word
    from inspector.inputs.sources import parse_launch_script

    parsed = parse_launch_script('torchrun t.py --data-path "$UNSET" --num-layers 2\n', "s.sh")
    assert parsed.launch == ("torchrun", "t.py", "--data-path", "", "--num-layers", "2")
    assert parsed.args["num_layers"] == 2


def test_plan_says_its_svg_is_not_written_when_no_layout_fits(tmp_path: Path) -> None:
    # issue #46 (sweep46b): the --svg FILE of a plan that found no layout was silently not written,
    # so an old file of that name passed for this plan's drawing
    (tmp_path / "p.svg").write_text("old\n")
    result = run("plan", *SMALL, "--gpus", "8", "--global-batch-size", "8", "--gpu-memory", "0.001",
                 "--svg", "p.svg", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Note: --svg p.svg is not written: no layout fits" in result.stderr
    assert (tmp_path / "p.svg").read_text() == "old\n"
