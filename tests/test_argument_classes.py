"""Every Megatron-LM argument is classified: modelled, refused by name, ignored with its reason, or
one Megatron-LM itself stops on; and its presence in each Megatron-LM release is a dated fact.

The argument names are facts read off Megatron-LM's own parsers (`add_megatron_arguments` at
core_v0.13.1 to core_v0.19.0, and main at d98e8a6, megatron-core 0.20 there), committed as
fixtures/megatron_lm_arguments.txt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inspector.inputs.arguments import ARGUMENTS, BY_NAME
from inspector.inputs.ignored import IGNORED
from inspector.inputs.sources import parse_launch_script
from inspector.inputs.unmodelled import MEGATRON_LM_REFUSES, REFUSED, RENAMED
from inspector.inputs.versions import (
    ARGUMENT_VERSIONS,
    argument_unknown_note,
    megatron_core_version,
)

FACTS = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_lm_arguments.txt"
BASE = "core_v0.16.1"


def _lists() -> dict[str, set[str]]:
    """Each tag's argument names, rebuilt from the base list and each tag's +/- changes."""
    sections: dict[str, list[str]] = {}
    for line in FACTS.read_text().splitlines():
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        elif line and not line.startswith("#"):
            current.append(line)
    base = set(sections.pop(BASE))
    lists = {BASE: base}
    for tag, changes in sections.items():
        lists[tag] = (base | {c[1:] for c in changes if c[0] == "+"}) - {c[1:] for c in changes if c[0] == "-"}
    return lists


LISTS = _lists()
MODELLED = {spec.flag for spec in ARGUMENTS} | set(RENAMED)
# refused on some megatron-core releases and modelled on others (Refusal.modelled): modelled
SPLIT = {name for name, refusal in REFUSED.items() if refusal.modelled is not None}
CLASSES = {"modelled": MODELLED, "refused": set(REFUSED) - SPLIT, "ignored": set(IGNORED),
           "refused by Megatron-LM": set(MEGATRON_LM_REFUSES)}  # fmt: skip


def _version(tag: str) -> tuple[int, int]:
    if tag == "main":
        return (0, 20)
    major, minor = tag.removeprefix("core_v").split(".")[:2]
    return int(major), int(minor)


def test_the_facts_hold_eight_releases():
    assert sorted(LISTS, key=_version)[0] == "core_v0.13.1" and len(LISTS) == 8
    assert len(LISTS[BASE]) == 681  # option strings of core_v0.16.1's parser (--help included)
    assert "--num-layers" in LISTS["core_v0.13.1"] and "--use-mup" in LISTS["core_v0.19.0"]
    assert "--megatron-fsdp-main-grads-dtype" in LISTS["main"]


@pytest.mark.parametrize("tag", sorted(LISTS, key=_version))
def test_every_megatron_lm_argument_is_classified(tag):
    # issue #46 item 7: ~170 arguments of Megatron-LM 0.16.1 were "Not recognised" and the job
    # went on without them, memory ones (--moe-latent-size) included
    unclassified = sorted(name for name in LISTS[tag] if not any(name in c for c in CLASSES.values()))
    assert unclassified == []


def test_an_argument_refused_on_some_releases_is_modelled_on_the_others():
    assert "--fp4-param-gather" in SPLIT and SPLIT <= MODELLED


def test_each_argument_has_one_class():
    seen: dict[str, str] = {}
    for kind, names in CLASSES.items():
        for name in names:
            assert name not in seen, f"{name} is both {seen[name]} and {kind}"
            seen[name] = kind


@pytest.mark.parametrize("name", sorted(set().union(*LISTS.values()) | set(ARGUMENT_VERSIONS)))
def test_each_arguments_releases_are_a_dated_fact(name):
    # versions.ARGUMENT_VERSIONS says which releases' Megatron-LM accept it; the lists say the same
    first, gone = ARGUMENT_VERSIONS.get(name, ((0, 0), None))
    for tag, names in LISTS.items():
        version = _version(tag)
        assert (name in names) == (first <= version and (gone is None or version < gone)), tag


def test_an_argument_the_installed_release_lacks_is_noted():
    installed = megatron_core_version()
    tag = max((t for t in LISTS if _version(t) <= installed), key=_version)
    for name in ("--mtp-use-repeated-layer", "--use-custom-fsdp", "--moe-latent-size", "--padded-vocab-size"):
        assert (argument_unknown_note(name) is None) == (name in LISTS[tag]), name


def script(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "train.sh"
    path.write_text("torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 4 --hidden-size 64 "
                    "--num-attention-heads 4 --seq-length 32 --vocab-size 1000 --micro-batch-size 1 "
                    f"--bf16 --transformer-impl local {extra}\n")  # fmt: skip
    return str(path)


@pytest.mark.parametrize(("extra", "command"), [
    ("--ep-overlap-early-attn-memory-release", "memory"),  # another peak
    ("--hybrid-context-parallel", "topology"),  # other sequence lengths per cp rank
    ("--moe-hybridep-num-sms 32", "memory"),  # HybridEP's buffers for other SMs
    ("--optimizer-cuda-graph", "memory"),  # Megatron-LM 0.19: the optimizer step's graph pool
    ("--use-custom-fsdp", "topology"),  # Megatron-LM 0.13's Megatron-FSDP
    ("--disable-jit-fuser", "memory"),  # fused functions run op by op
])  # fmt: skip
def test_a_memory_argument_not_modelled_stops_the_job_by_name(cli, tmp_path, extra, command):
    result = cli(command, "--from-script", script(tmp_path, extra))
    assert (result.code, result.out) == (2, "")
    last = result.err.splitlines()[-1]
    assert last.startswith("Error: ") and f"line 1: {extra} is not modelled: " in last


def test_their_default_values_change_nothing(cli, tmp_path):
    result = cli("memory", "--from-script", script(tmp_path, "--moe-hybridep-num-sms 16"))
    assert result.code == 0, result.err
    assert "--moe-hybridep-num-sms" in result.err.splitlines()[0]  # "Ignored from ..."


@pytest.mark.parametrize("extra", [
    "--vision-pretraining --img-h 224",  # vision programs only
    "--fim-data --fim-rate 0.5",  # a data format
    "--inprocess-soft-timeout 60",  # fault tolerance
    "--tokenizer-hf-use-fast",
    "--batch-invariant-mode",  # the same tensors (a note says what plan does not price)
])  # fmt: skip
def test_an_argument_that_changes_nothing_reported_is_ignored_with_its_reason(cli, tmp_path, extra):
    path = script(tmp_path, extra)
    result = cli("memory", "--from-script", path)
    assert result.code == 0, result.err
    flags = [word for word in extra.split() if word.startswith("--")]
    assert f"Ignored from {path}: {' '.join(flags)}" in result.err.splitlines()
    assert "Not recognised" not in result.err
    assert all(IGNORED[flag] for flag in flags)


@pytest.mark.parametrize(("extra", "message"), [
    # read as core_v0.16.1's argparse reads them (a switch, a float)
    ("--fim-data 0.5", "'0.5' follows --fim-data, which takes no further value"),
    ("--inprocess-soft-timeout soon", "--inprocess-soft-timeout needs float value, got 'soon'"),
    ("--vision-backbone-type resnet", "--vision-backbone-type 'resnet' is not one of: vit, mit, swin"),
    ("--help", "--help is refused by Megatron-LM: argparse prints pretrain_gpt.py's help and exits"),
    # a string argument takes one word: argparse refuses the next plain word (it was dropped)
    ("--save /ckpt extra", "'extra' follows --save /ckpt, which takes no further value"),
])  # fmt: skip
def test_newly_classified_arguments_are_read_as_megatron_lm_reads_them(cli, tmp_path, extra, message):
    path = script(tmp_path, extra)
    result = cli("params", "--from-script", path)
    assert result.code == 2 and message in result.err.splitlines()[-1], result.err


def test_encoder_num_layers_is_num_layers():
    # validate_args: num_layers = encoder_num_layers when --num-layers is not given
    parsed = parse_launch_script("torchrun t.py --encoder-num-layers 6 --hidden-size 64\n", "s.sh")
    assert parsed.args["num_layers"] == 6 and BY_NAME["num_layers"].flag == "--num-layers"


# Megatron-LM's argparse (core_v0.16.1's parser, parse_args): an empty word is a positional
# argument, of which it has none, so `pretrain_gpt.py ... --bf16 ''` stops with "unrecognized
# arguments: "; as a value (`--save ''`) it is the value
@pytest.mark.parametrize(("words", "message"), [
    ("--bf16 ''", "argument 17 of the training program (after --bf16) is an empty word, '', where "
     "a flag should be; Megatron-LM's argparse stops on it as an unrecognised argument"),
    ("'' --bf16", "argument 16 of the training program (after local) is an empty word"),
    ('--bf16 "$UNSET"', "is an empty word, $UNSET, where a flag should be; Megatron-LM's argparse "
     "stops on it as an unrecognised argument; $UNSET is a value which the script never sets: "
     "give it with --set UNSET=VALUE or drop the word"),
])  # fmt: skip
def test_an_empty_word_where_a_flag_should_be_stops_as_argparse_does(cli, tmp_path, words, message):
    result = cli("params", "--from-script", script(tmp_path, words))
    assert (result.code, result.out) == (2, "")
    assert result.err.splitlines()[-1].startswith("Error: ") and message in result.err


@pytest.mark.parametrize("words", ["--save ''", "--bf16 $UNSET", '--data-path "$UNSET" a'])
def test_an_empty_value_or_a_dropped_word_is_no_stray_word(cli, tmp_path, words):
    result = cli("params", "--from-script", script(tmp_path, words))
    assert result.code == 0, result.err


def test_an_empty_word_on_the_command_line_is_named(cli):
    # click said "Got unexpected extra argument ()"
    result = cli("params", "--num-layers", "2", "")
    assert (result.code, result.out) == (2, "")
    assert result.err == ("Error: argument 4 of the command line (after 2) is an empty word, '', "
                          "where an option should be; drop it\n")  # fmt: skip
