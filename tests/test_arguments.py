"""Megatron-LM arguments beyond the basic ones: each modelled (its effect on memory), refused
with an error, or ignored because it changes nothing a GPU holds (inspector/inputs/unmodelled.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inspector.inputs.arguments import BY_NAME
from inspector.inputs.ignored import IGNORED
from inspector.inputs.unmodelled import REFUSED
from inspector.inputs.versions import null_tokenizer_adds_eod
from tests.conftest import formula_activations

SMALL = ("--transformer-impl local --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--vocab-size 1000 --micro-batch-size 1 --bf16").split()  # fmt: skip
s, b, h, a, L = 32, 1, 64, 4, 4


def memory(cli, *extra: str) -> dict:
    result = cli("memory", *SMALL, *extra, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def activations(*extra: str) -> dict:
    """Stage 0's closed-form activations (the cross-check of the engine's numbers)."""
    return formula_activations("memory", *SMALL, *extra)[0]


def layers(cli, *extra: str) -> float:
    return activations(*extra)["layers"]


def test_recompute_activations_is_selective(cli):
    assert layers(cli, "--recompute-activations") == layers(
        cli, "--recompute-granularity", "selective"
    )
    # selective drops the 5as^2b score terms of every layer (Korthikanti Table 2)
    assert layers(cli) - layers(cli, "--recompute-activations") == L * 5 * a * s * s * b


def test_full_uniform_groups_keep_one_input_each(cli):
    full = ("--recompute-granularity", "full", "--recompute-method", "uniform")
    one = activations(*full, "--recompute-num-layers", "1")
    two = activations(*full, "--recompute-num-layers", "2")
    assert one["layers"] == L * 2 * s * b * h  # every layer keeps its 2sbh input
    assert two["layers"] == L // 2 * 2 * s * b * h  # one input per group of two
    # backward rebuilds a whole group: twice one layer's activations
    assert two["recompute_buffer"] == 2 * one["recompute_buffer"]
    # the CLI's default for full is uniform with one layer, as before
    assert activations("--recompute-granularity", "full") == one


def test_full_block_recomputes_only_the_first_layers(cli):
    none = layers(cli) / L  # one layer, nothing recomputed
    block = activations("--recompute-granularity", "full", "--recompute-method", "block",
                        "--recompute-num-layers", "1")  # fmt: skip
    assert block["layers"] == 2 * s * b * h + (L - 1) * none
    assert block["recompute_buffer"] == none


def test_uniform_needs_whole_groups(cli):
    result = cli("memory", *SMALL, "--recompute-granularity", "full", "--recompute-method",
                 "uniform", "--recompute-num-layers", "3")  # fmt: skip
    assert result.err == (
        "Error: --recompute-method uniform --recompute-num-layers 3 does not divide the 4 layers "
        "of stage 0 chunk 0: megatron-core checkpoints groups of N layers per chunk and fails on "
        "a partial group\n"
    )


def test_recompute_method_needs_full(cli):
    result = cli("memory", *SMALL, "--recompute-granularity", "selective", "--recompute-method",
                 "block")  # fmt: skip
    assert result.code == 2
    assert result.err.startswith("Error: --recompute-method needs --recompute-granularity full")


def test_recompute_layers_without_a_granularity_recompute_nothing(cli):
    # megatron-core's TransformerConfig checks recompute_method/num_layers only under a
    # granularity, and validate_args only under selective: Megatron-LM runs the job (Megatron-LM's
    # functional test gpt3_mcore_reruns_resume_check_grads passes --recompute-num-layers 1 alone)
    plain = cli("memory", *SMALL, "--format", "json")
    given = cli("memory", *SMALL, "--recompute-num-layers", "1", "--recompute-method", "block",
                "--format", "json")  # fmt: skip
    assert given.code == 0, given.err
    assert given.out == plain.out


@pytest.mark.parametrize(
    "backend, scores", [("auto", False), ("flash", False), ("fused", False), ("unfused", True)]
)
def test_attention_backend(cli, backend, scores):
    te = ("--transformer-impl", "transformer_engine")
    stored = layers(cli, *te, "--attention-backend", "unfused")
    got = layers(cli, *te, "--attention-backend", backend)
    assert (got == stored) == scores
    if not scores:
        assert got == layers(cli, *te, "--use-flash-attn")


TE = ("--transformer-impl", "transformer_engine")


def flash_attention(cli, *extra: str) -> bool:
    result = cli("memory", *SMALL, *extra, "--format", "json")
    assert result.code == 0, result.err
    return json.loads(result.out)["training"]["use_flash_attn"]


@pytest.mark.slow
def test_flags_alone_default_to_megatron_lms_auto_backend(cli):
    # Megatron-LM's --attention-backend default is auto: Transformer Engine picks flash/fused
    # attention in bf16, so a job given by flags alone stores no s x s scores either
    assert flash_attention(cli, *TE) is True
    assert flash_attention(cli, *TE, "--attention-backend", "unfused") is False
    assert flash_attention(cli, *TE, "--no-use-flash-attn") is False
    assert flash_attention(cli, *TE, "--no-use-flash-attn", "--attention-backend", "fused") is True
    assert flash_attention(cli) is False  # the local spec's unfused DotProductAttention
    assert layers(cli, *TE) == layers(cli, *TE, "--use-flash-attn")
    # by hand: unfused keeps per layer the bf16 softmax output (2as^2b), dropout mask (as^2b)
    # and dropout output (2as^2b); flash its fp32 log-sum-exp (4asb) instead
    unfused = layers(cli, *TE, "--attention-backend", "unfused")
    assert unfused - layers(cli, *TE) == L * (5 * a * s * s * b - 4 * a * s * b) == 79_872


@pytest.mark.slow
def test_the_engine_runs_the_backend_asked_for(cli):
    # megatron's engine builds the model with the job's backend (megatron's LanguageModule sets
    # TE's NVTE_* opt-outs from it): unfused keeps the s x s softmax output per layer, 2as^2b in
    # bf16, where fused keeps its fp32 log-sum-exp, 4asb (each allocation rounded to 512 bytes)
    seq = 256
    args = [str(seq) if flag == "--seq-length" else word
            for flag, word in zip(("", *SMALL), SMALL)] + list(TE)  # fmt: skip

    def engine(*extra: str) -> int:
        result = cli("memory", *args, *extra, "--format", "json")
        assert result.code == 0, result.err
        stage = json.loads(result.out)["stages"][0]["activations"]
        assert stage["source"] == "engine"
        return stage["total"]

    no_dropout = ("--attention-dropout", "0")
    unfused = ("--attention-backend", "unfused")
    stored = engine(*no_dropout, *unfused) - engine(*no_dropout)
    assert abs(stored - L * (2 * a * seq * seq * b - 4 * a * seq * b)) <= L * 512
    # with dropout, its 1-byte mask and 2-byte dropped copy of the scores, 3as^2b per layer
    assert engine(*unfused) - engine(*no_dropout, *unfused) == L * 3 * a * seq * seq * b
    assert engine() == engine(*no_dropout)  # fused attention's dropout keeps no mask


def test_a_build_gives_back_the_attention_environment(cli, monkeypatch):
    # megatron sets TE's NVTE_* opt-outs while it builds --attention-backend unfused; the process
    # gets its own values back after (world/environment.py), or TE used later in it would run the
    # unfused backend for a job that did not ask for it (CI ran test_te_engine after such a build)
    import os

    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    monkeypatch.delenv("NVTE_UNFUSED_ATTN", raising=False)
    result = cli("memory", *SMALL, *TE, "--attention-backend", "unfused")
    assert result.code == 0, result.err
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    assert [os.environ.get(name) for name in names] == ["1", None, None]


def test_the_default_backend_allows_context_parallelism_under_te(cli):
    # context parallelism runs only through TE's flash/fused attention, which auto picks in bf16
    assert flash_attention(cli, *TE, "--cp", "2") is True
    result = cli("memory", *SMALL, *TE, "--cp", "2", "--attention-backend", "unfused")
    assert result.code == 2
    # the error names the argument that turns flash attention off (it said --use-flash-attn)
    assert result.err == (
        "Error: --context-parallel-size 2 needs flash or fused attention, which "
        "--attention-backend unfused turns off: megatron runs context parallelism only through "
        "Transformer Engine's flash/fused attention\n"
    )
    fp32 = [x for x in SMALL if x != "--bf16"]
    result = cli("memory", *fp32, *TE, "--cp", "2")
    assert "which --attention-backend auto in fp32 (Transformer Engine picks unfused attention " \
        "without --bf16 or --fp16) turns off" in result.err, result.err
    result = cli("memory", *SMALL, "--transformer-impl", "local", "--cp", "2")
    assert result.err.startswith("Error: --context-parallel-size 2 needs --transformer-impl "
                                 "transformer_engine"), result.err  # fmt: skip


def test_auto_backend_in_fp32_stores_scores(cli):
    fp32 = [x for x in SMALL if x != "--bf16"]
    result = cli("memory", *fp32, "--attention-backend", "auto", "--format", "json")
    assert json.loads(result.out)["training"]["use_flash_attn"] is False


def test_use_flash_attn_contradicts_unfused(cli):
    result = cli("memory", *SMALL, "--transformer-impl", "transformer_engine", "--use-flash-attn",
                 "--attention-backend", "unfused")  # fmt: skip
    assert result.err == (
        "Error: --use-flash-attn contradicts --attention-backend unfused (which stores the "
        "s x s attention scores); pass one of them\n"
    )


@pytest.mark.parametrize("asked", [("--use-flash-attn",), ("--attention-backend", "flash")])
def test_the_local_spec_stores_the_scores_whatever_flash_flag_is_given(cli, asked):
    # megatron-core's local spec runs its own unfused DotProductAttention; no megatron-core
    # model reads --use-flash-attn (only Megatron-LM's legacy model does)
    result = cli("memory", *SMALL, *asked, "--format", "json")
    assert json.loads(result.out)["training"]["use_flash_attn"] is False
    assert result.err.startswith(f"Note: {' '.join(asked)} does not change megatron-core's local layer spec")
    assert layers(cli, *asked) == layers(cli, "--attention-backend", "unfused")


def test_grad_reduce_in_bf16_halves_gradients(cli):
    assert memory(cli, "--grad-reduce-in-bf16")["gradients"] * 2 == memory(cli)["gradients"]


def test_dropout_zero_stores_no_masks(cli):
    base = activations()
    no_attn = activations("--attention-dropout", "0")
    no_hidden = activations("--hidden-dropout", "0")
    # attention dropout: its as^2b mask and 2as^2b output per layer (Table 2's 5 becomes 2)
    assert base["layers"] - no_attn["layers"] == L * 3 * a * s * s * b
    # hidden dropout: the sbh masks after attention and MLP, and the embedding's
    assert base["layers"] - no_hidden["layers"] == L * 2 * s * b * h
    assert no_hidden["embedding"] == base["embedding"] - s * b * h


def test_sequence_parallel_at_tp1_is_turned_off(cli):
    result = cli("params", "--sequence-parallel")
    assert result.code == 0
    assert result.err == (
        "Note: --sequence-parallel is turned off because --tp is 1, as Megatron-LM does "
        '("Disabling sequence parallelism because tensor model parallelism is disabled")\n'
    )
    assert result.out == cli("params").out


def test_overlap_param_gather_needs_distributed_optimizer(cli):
    result = cli("memory", *SMALL, "--overlap-param-gather")
    assert result.err == (
        "Error: --overlap-param-gather needs --use-distributed-optimizer or --use-megatron-fsdp "
        '(Megatron-LM: "--overlap-param-gather only supported with distributed optimizer or '
        'megatron fsdp")\n'
    )


def test_sgd_is_refused(cli):
    result = cli("memory", *SMALL, "--optimizer", "sgd")
    assert result.code == 2 and "--optimizer sgd is not modelled" in result.err


def script(tmp_path: Path, extra: str) -> str:
    path = tmp_path / "train.sh"
    path.write_text(
        "torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 4 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 32 --vocab-size 1000 --micro-batch-size 1 --bf16 "
        f"--transformer-impl local {extra}\n"
    )
    return str(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward",
         "--torch-fsdp2-no-reshard-after-forward is not modelled: FSDP2 keeping the gathered "
         "parameters from the forward to the backward (ZeRO-2) is not modelled; --use-torch-fsdp2 "
         "alone (resharding after the forward) is"),
        ("--dsa-kernel-backend tilelang",
         "--dsa-kernel-backend tilelang is not modelled: DSA's fused TileLang and cuDNN kernels "
         "are not simulated; megatron's own PyTorch path (--dsa-kernel-backend none) is"),
        ("--export-force-local-attention --load /ckpt",
         "--export-force-local-attention is not modelled: ModelOpt's local attention "
         "(megatron-core DotProductAttention, which stores the attention scores) in place of "
         "Transformer Engine's is not modelled (ModelOpt's model provider builds it, given a "
         "ModelOpt checkpoint in --load)"),
    ],
)  # fmt: skip
def test_script_refusals(cli, tmp_path, extra, message):
    result = cli("memory", "--from-script", script(tmp_path, extra))
    assert (result.code, result.err) == (2, f"Error: {script(tmp_path, extra)} line 1: {message}\n")


def test_fp8_parameters_leave_params_alone(cli, tmp_path):
    # fp8 parameters change what training holds, not the parameters: params answers
    path = script(tmp_path, "--transformer-impl transformer_engine --fp8-format hybrid "
                  "--use-distributed-optimizer --fp8-param-gather")
    result = cli("params", "--from-script", path)
    assert result.code == 0, result.err


@pytest.mark.parametrize(
    "extra, message",
    [
        # megatron-core TransformerConfig.__post_init__ (fp8_param from core_transformer_config_from_args)
        ("--use-distributed-optimizer --fp8-param-gather",
         "--fp8-param-gather without --fp8-format is refused by Megatron-LM: megatron-core's "
         "TransformerConfig: 'fp8_param must be used together with fp8 mode.'"),
        # Megatron-LM validate_args
        ("--fp8-format hybrid --fp8-param-gather",
         "--fp8-param-gather without --use-distributed-optimizer is refused by Megatron-LM: "
         "validate_args: '--fp8-param-gather only supported with distributed optimizer, torch "
         "fsdp2, megatron fsdp, or inference mode'"),
    ],
)  # fmt: skip
def test_fp8_param_gather_megatron_lm_stops_even_params(cli, tmp_path, extra, message):
    # Megatron-LM would not start: even `params`, which the fp8 parameters leave alone, stops
    path = script(tmp_path, extra)
    result = cli("params", "--from-script", path)
    assert (result.code, result.err) == (2, f"Error: {path} line 1: {message}\n")


def test_fp8_param_gather_passes_megatron_lm_with_a_sharding_optimizer(cli, tmp_path):
    for sharding in ("--use-distributed-optimizer", "--use-torch-fsdp2 --untie-embeddings-and-output-weights"):
        path = script(tmp_path, f"--transformer-impl transformer_engine --fp8-format hybrid "
                      f"{sharding} --fp8-param-gather")
        result = cli("params", "--from-script", path)
        assert result.code == 0, result.err


def test_script_lists_only_harmless_arguments_as_ignored(cli, tmp_path):
    path = script(tmp_path, "--recompute-activations --attention-dropout 0 --grad-reduce-in-bf16 "
                  "--lr 3e-4 --save /ckpt --megatron-fsdp-main-params-dtype fp32 --made-up-flag 3")  # fmt: skip
    result = cli("memory", "--from-script", path)
    assert result.code == 0, result.err
    lines = result.err.splitlines()
    assert f"Ignored from {path}: --lr --save --megatron-fsdp-main-params-dtype" in lines
    assert (
        f"Not recognised from {path} (not a Megatron-LM argument this tool knows; check it "
        "changes nothing a GPU holds): --made-up-flag"
    ) in lines


def test_script_backend_defaults_to_auto(cli, tmp_path):
    # Megatron-LM's default --attention-backend auto runs fused/flash attention under TE in bf16
    te = script(tmp_path, "--transformer-impl transformer_engine")
    result = cli("memory", "--from-script", te, "--format", "json")
    assert json.loads(result.out)["training"]["use_flash_attn"] is True
    unfused = script(tmp_path, "--transformer-impl transformer_engine --attention-backend unfused")
    result = cli("memory", "--from-script", unfused, "--format", "json")
    assert json.loads(result.out)["training"]["use_flash_attn"] is False


def test_legacy_spellings(cli, tmp_path):
    path = script(tmp_path, "--use-rotary-position-embeddings --encoder-seq-length 64 "
                  "--max-position-embeddings 64")  # fmt: skip
    from inspector.inputs.sources import read_launch_script

    args = read_launch_script(path).args
    assert (args["position_embedding_type"], args["seq_length"]) == ("rope", 64)


def test_tables_are_disjoint():
    modelled = {spec.flag for spec in BY_NAME.values()}
    # a flag modelled on some megatron-core releases only is both, with those releases named
    assert not modelled & {flag for flag, refusal in REFUSED.items() if refusal.modelled is None}
    assert {flag for flag, refusal in REFUSED.items() if refusal.modelled} <= modelled
    assert not modelled & set(IGNORED)
    assert not set(REFUSED) & set(IGNORED)


def test_fp8_param_gather_under_fsdp2_is_turned_off_as_validate_args_does(cli, tmp_path):
    # Megatron-LM validate_args, --use-torch-fsdp2 with Transformer Engine >= 2.0: it sets
    # fp8_param_gather = False with a warning (before its own check), so the job is --fp8-format's
    fsdp2 = ("--transformer-impl transformer_engine --fp8-format hybrid --use-torch-fsdp2 "
             "--untie-embeddings-and-output-weights --no-gradient-accumulation-fusion")  # fmt: skip
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    with_flag = script(tmp_path / "with", f"{fsdp2} --fp8-param-gather")
    without = script(tmp_path / "without", fsdp2)
    result = cli("memory", "--from-script", with_flag)
    assert result.code == 0, result.err
    assert "--fp8-param-gather is turned off under --use-torch-fsdp2" in result.err
    plain = cli("memory", "--from-script", without)
    assert "--fp8-param-gather" not in plain.err
    assert result.out.replace(with_flag, without) == plain.out


def test_fp8_param_gather_under_fsdp2_in_a_config_file(cli, tmp_path):
    path = tmp_path / "args.yaml"
    path.write_text("num-layers: 2\nhidden-size: 64\nnum-attention-heads: 4\nseq-length: 32\n"
                    "vocab-size: 1000\nmicro-batch-size: 1\nbf16: true\nuse-torch-fsdp2: true\n"
                    "fp8-param-gather: true\n")  # fmt: skip
    result = cli("params", "--config", str(path))
    assert result.code == 0, result.err
    assert "--fp8-param-gather is turned off under --use-torch-fsdp2" in result.err


@pytest.mark.parametrize("extra", ["--megatron-fsdp-main-grads-dtype bf16",
                                   "--outer-dp-sharding-strategy optim",
                                   "--te-precision-config-file precision.yaml"])  # fmt: skip
def test_memory_flags_megatron_lm_has_stop_the_job_by_name(cli, tmp_path, extra):
    # Megatron-LM arguments that change what a GPU holds were listed as "Not recognised" and
    # the job went on without them
    result = cli("memory", "--from-script", script(tmp_path, extra))
    assert result.code == 2 and result.out == ""
    assert f"line 1: {extra} is not modelled: " in result.err.splitlines()[-1]


def test_their_default_values_change_nothing(cli, tmp_path):
    result = cli("params", "--from-script", script(tmp_path, "--megatron-fsdp-main-params-dtype fp32"))
    assert result.code == 0, result.err


@pytest.mark.parametrize(("flag", "error"), [
    ("--optimizer-cpu-offload", "Error: --optimizer-cpu-offload is not modelled: optimizer state on "
                                "the CPU is not modelled"),
    ("--batch-size", "Error: --batch-size is refused by Megatron-LM: validate_args: '--batch-size "
                     "argument is no longer valid, use --micro-batch-size instead'"),
    # issue #46 sweep: an ignored one still said "no such option: --manual-gc"
    ("--manual-gc", "Error: --manual-gc is a Megatron-LM argument that changes nothing this tool "
                    "reports: communication scheduling (buffers not counted); drop it here (a "
                    "launch script or config file may keep it)"),
])  # fmt: skip
def test_a_refused_flag_typed_on_the_command_line_says_why(cli, flag, error):
    # it said "no such option", as for a flag Megatron-LM does not have
    result = cli("memory", *SMALL, flag)
    assert (result.code, result.out, result.err) == (2, "", error + "\n")


def test_a_tokenizer_flag_on_the_command_line_says_where_it_is_read(cli):
    # it said the flag "changes nothing this tool reports", though a script's or config file's
    # tokenizer sets the vocabulary (NullTokenizer's end-of-document token up to 0.17)
    eod = " + 1" if null_tokenizer_adds_eod() else ""
    result = cli("memory", *SMALL, "--tokenizer-type", "NullTokenizer")
    assert (result.code, result.out) == (2, "")
    assert result.err == ("Error: --tokenizer-type is read from a launch script or config file "
                          "(--from-script, --config), where it sets the vocabulary; on the command "
                          "line give --vocab-size as Megatron-LM's tokenizer reports it "
                          f"(NullTokenizer: its --vocab-size{eod})\n")  # fmt: skip


def test_deterministic_mode_is_read_not_ignored(cli, tmp_path):
    # Megatron-LM's --deterministic-mode: the same tensors, other kernels; `plan` prices
    # Transformer Engine's deterministic attention backward (formulas/determinism.py), so no
    # note says it is left out
    result = cli("params", "--from-script", script(tmp_path, "--deterministic-mode"))
    assert result.code == 0, result.err
    assert "deterministic" not in result.err


@pytest.mark.parametrize(("other", "why"), [
    ("--use-flash-attn", "Flash attention can not be used in deterministic mode."),
    ("--cross-entropy-loss-fusion", "Cross Entropy Fusion is currently not deterministic."),
])  # fmt: skip
def test_deterministic_mode_refuses_what_validate_args_refuses(cli, other, why):
    # Megatron-LM validate_args: "if args.deterministic_mode: assert not args.use_flash_attn ...
    # assert not args.cross_entropy_loss_fusion"
    result = cli("memory", *SMALL, "--deterministic-mode", other)
    assert (result.code, result.out) == (2, "")
    assert result.err.endswith(f"Error: --deterministic-mode with {other}: Megatron-LM's "
                               f"validate_args refuses it ('{why}')\n")  # after the spec's notes
