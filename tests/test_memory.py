"""`inspect-model memory`: state bytes against the params rows, activations and FLOPs by hand."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.conftest import formula_activations, run_cli
from tests.test_flops import megatron_flops

SMALL = ["--transformer-impl", "local", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8"]
SMALL += ["--seq-length", "128", "--vocab-size", "1000"]


def _json(*args: str) -> dict:
    result = run_cli(*args)
    assert result.code == 0, result.err
    return json.loads(result.out)


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def buffer_by_hand(
    numels: list[int], shared: list[bool], size: int, bucket_size: int | None
) -> tuple[int, list[int]]:
    """Lay out one grad buffer as megatron-core's _ParamAndGradBuffer does, re-derived here.

    With the distributed optimizer: parameters in reverse order, each starting at a multiple of
    64, a shared embedding in a bucket of its own, a bucket closed once it holds `bucket_size`
    elements, every bucket padded to a multiple of lcm(size, 128) and cut into `size` equal
    shards. Returns the padded size and, per rank, the parameter elements in its shards.
    """
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = []
    state = {"bucket_start": 0, "params": []}

    def close(end: int) -> int:
        padded = _pad(end, math.lcm(size, 128))
        buckets.append((state["bucket_start"], padded, state["params"]))
        state["bucket_start"], state["params"] = padded, []
        return padded

    start = end = 0
    for numel, is_shared in reversed(list(zip(numels, shared, strict=True))):
        start = _pad(start, 64)
        if is_shared and state["params"]:
            start = close(start)
        end = start + numel
        state["params"].append((start, end))
        full = bucket_size is not None and end - state["bucket_start"] >= bucket_size
        start = close(end) if full or is_shared else end
    if state["params"]:
        close(end)
    owned = [0] * size
    for first, last, params in buckets:
        shard = (last - first) // size
        for rank in range(size):
            lo, hi = first + rank * shard, first + (rank + 1) * shard
            owned[rank] += sum(max(0, min(hi, e) - max(lo, s)) for s, e in params)
    return buckets[-1][1], owned


def _flag(args: list[str], name: str, default: int | None = None) -> int | None:
    return int(args[args.index(name) + 1]) if name in args else default


TRAINING_FLAGS = {"--micro-batch-size": 1, "--global-batch-size": 1}  # flag -> values it takes


def _without_training(args: list[str]) -> list[str]:
    """Return the flags `params` takes: the training ones are `memory`'s alone."""
    kept, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in TRAINING_FLAGS:
            skip = TRAINING_FLAGS[arg]
        elif arg != "--accumulate-allreduce-grads-in-fp32":
            kept.append(arg)
    return kept


def expected_state(args: list[str]) -> dict[int, dict[str, int]]:
    """Return each stage's most loaded rank and its bytes, summed from the params json rows."""
    rows = _json("params", "--format", "json", *_without_training(args))["parameters"]
    tp, pp, dp = (_flag(args, f, 1) for f in ("--tp", "--pp", "--dp"))
    ep = _flag(args, "--ep", 1)
    assert tp and pp and dp and ep
    edp = tp * dp // (tp * ep)  # expert tensor parallel = tp here
    half = "--bf16" in args or "--fp16" in args
    param_bytes = 2 if half else 4
    fp16_grads = "--fp16" in args and "--accumulate-allreduce-grads-in-fp32" not in args
    grad_bytes = 2 if fp16_grads else 4  # Megatron-LM: fp32 grads for bf16, always
    per_element = 8 + (4 if half else 0)  # Adam moments, plus the fp32 master copy
    tied = "--untie-embeddings-and-output-weights" not in args
    distributed = "--use-distributed-optimizer" in args
    bucket = _flag(args, "--ddp-bucket-size") if "--overlap-grad-reduce" in args else None
    result = {}
    for stage in range(pp):
        mine = [
            r for r in rows if r["stage"] == stage and r["expert_parallel_rank"] in (None, 0)
        ]
        numel = sum(r["numel"] for r in mine)
        state = {"parameters": numel, "weights": numel * param_bytes}
        if not distributed:
            state |= {"gradients": numel * grad_bytes, "optimizer": numel * per_element}
            state["rank"] = stage * tp * dp
            result[stage] = state
            continue
        padded, dense, expert = 0, [0] * dp, [0] * edp
        for chunk in sorted({r["chunk"] for r in mine}):
            for is_expert, size, owned in ((False, dp, dense), (True, edp, expert)):
                group = [
                    r
                    for r in mine
                    if r["chunk"] == chunk
                    and (ep > 1 and r["expert_parallel_rank"] is not None) == is_expert
                ]
                if not group:
                    continue
                shared = [
                    pp > 1
                    and tied
                    and (r["tied"] or r["name"] == "embedding.word_embeddings.weight")
                    for r in group
                ]
                size_here = bucket if stage == 0 and chunk == 0 else None
                n, per_rank = buffer_by_hand([r["numel"] for r in group], shared, size, size_here)
                padded += n
                owned[:] = [a + b for a, b in zip(owned, per_rank, strict=True)]
        # Megatron's rank order tp-cp-ep-dp-pp: data index rank // tp % dp, expert data index
        # rank // (tp * ep) % edp.
        ranks = range(stage * tp * dp, (stage + 1) * tp * dp)
        worst = max(ranks, key=lambda r: (dense[r // tp % dp] + expert[r // (tp * ep) % edp], -r))
        updated = dense[worst // tp % dp] + expert[worst // (tp * ep) % edp]
        state |= {
            "weights": padded * param_bytes,
            "gradients": padded * grad_bytes,
            "optimizer": updated * per_element,
            "rank": worst,
        }
        result[stage] = state
    return result


LAYOUTS = [
    pytest.param([], id="default-fp32"),
    pytest.param([*SMALL, "--tp", "2", "--pp", "2", "--bf16"], id="tp2-pp2-bf16"),
    pytest.param(
        [*SMALL, "--pp", "3", "--decoder-first-pipeline-num-layers", "2", "--dp", "2", "--bf16",
         "--use-distributed-optimizer"],
        id="uneven-distopt-dp2",
    ),  # fmt: skip
    pytest.param(
        [*SMALL, "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--dp", "8",
         "--bf16", "--use-distributed-optimizer", "--global-batch-size", "16"],
        id="vpp-distopt-dp8",
    ),  # fmt: skip
    pytest.param(
        [*SMALL, "--num-experts", "4", "--ep", "2", "--dp", "4", "--tp", "2", "--sequence-parallel",
         "--disable-bias-linear", "--bf16", "--use-distributed-optimizer"],
        id="moe-ep2-distopt",
    ),  # fmt: skip
    pytest.param(
        [*SMALL, "--num-experts", "4", "--ep", "2", "--dp", "2", "--pp", "2", "--fp16",
         "--disable-bias-linear"],
        id="moe-ep2-fp16",
    ),  # fmt: skip
    pytest.param([*SMALL, "--use-distributed-optimizer", "--bf16"], id="distopt-dp1"),
    pytest.param(
        [*SMALL, "--dp", "64", "--pp", "2", "--fp16", "--use-distributed-optimizer"],
        id="distopt-dp64-fp16-grads",
    ),
    pytest.param(
        [*SMALL, "--dp", "2", "--fp16", "--accumulate-allreduce-grads-in-fp32",
         "--use-distributed-optimizer", "--untie-embeddings-and-output-weights"],
        id="distopt-dp2-fp32-grads-untied",
    ),  # fmt: skip
    pytest.param(
        [*SMALL, "--dp", "8", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--ddp-bucket-size", "300000"],
        id="distopt-dp8-buckets",
    ),  # fmt: skip
]


@pytest.mark.slow
@pytest.mark.parametrize("args", LAYOUTS)
def test_state_bytes_equal_the_params_rows(args: list[str]) -> None:
    report = _json("memory", "--format", "json", "--micro-batch-size", "1", *args)
    expected = expected_state(args)
    for stage in report["stages"]:
        got = {k: stage[k] for k in ("parameters", "weights", "gradients", "optimizer", "rank")}
        assert got == expected[stage["stage"]], f"stage {stage['stage']}"


def test_megatron_lms_bytes_per_parameter() -> None:
    # Megatron-LM theoretical_memory_usage.py: 18 bytes per parameter without the distributed
    # optimizer (bf16 weight 2, fp32 grad 4, fp32 master and Adam moments 12), 6 + 12/dp with it.
    args = [*SMALL, "--bf16", "--micro-batch-size", "1"]
    plain = _json("memory", "--format", "json", *args)["stages"][0]
    assert plain["weights"] + plain["gradients"] + plain["optimizer"] == 18 * plain["parameters"]
    dist = _json("memory", "--format", "json", *args, "--dp", "8", "--use-distributed-optimizer")
    stage = dist["stages"][0]
    state = stage["weights"] + stage["gradients"] + stage["optimizer"]
    assert state == pytest.approx((6 + 12 / 8) * stage["parameters"], rel=1e-3)  # padding only


@pytest.mark.parametrize(
    "sizes",
    [dict(tp=2, pp=2, dp=4, ep=2), dict(pp=3, dp=4, ep=4), dict(tp=4, dp=2, ep=2, etp=1)],
)
def test_shard_indices_of_large_worlds_match_megatrons_rank_generator(sizes, monkeypatch) -> None:
    from inspector.job.layout import Layout
    from inspector.world import ranks

    layout = Layout(**sizes)
    expected = [(c.pipe, c.data, c.expert_data) for c in ranks.rank_coords(layout)]
    monkeypatch.setattr(ranks, "RANK_GENERATOR_LIMIT", 0)  # the direct path of large worlds
    assert ranks.rank_shard_indices(layout) == expected


def test_distributed_optimizer_shards_are_not_divide_by_dp() -> None:
    # Hidden 200: biases of 200 elements leave gaps when every parameter starts at a multiple
    # of 64, and 64 ranks pad the bucket to a multiple of lcm(64, 128): real memory.
    args = ["--num-layers", "2", "--hidden-size", "200", "--num-attention-heads", "8"]
    args += ["--dp", "64", "--bf16", "--use-distributed-optimizer"]
    stage = _json("memory", "--format", "json", "--micro-batch-size", "1", *args)["stages"][0]
    assert stage["weights"] > 2 * stage["parameters"]  # the param buffer holds padding
    assert stage["optimizer"] != 12 * stage["parameters"] / 64


def _stage_activations(args: list[str]) -> list[int]:
    return [s["total"] for s in formula_activations("memory", *args)]


# Korthikanti et al. 2022, Table 2, bytes per layer per micro-batch (t = tensor parallel size).
def table2(mode: str, sp: bool, s: int, b: int, h: int, a: int, t: int) -> float:
    if mode == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        return s * b * h / t * (34 + (5 * a * s / h if mode == "none" else 0))
    return s * b * h * (10 + 24 / t + (5 * a * s / (h * t) if mode == "none" else 0))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True])
def test_activations_follow_table_2(mode: str, sp: bool) -> None:
    # 4 layers of GPT on tp 2, pp 2, 2 micro-batches of 2: stage 0 holds both in flight (1F1B
    # warm-up p - s - 1 = 1), stage 1 one; bf16 activations as the paper assumes.
    s, b, h, a, t, v = 128, 2, 256, 8, 2, 1024
    args = ["--transformer-impl", "local", "--num-layers", "4", "--hidden-size", "256"]
    args += ["--num-attention-heads", "8", "--seq-length", "128", "--vocab-size", "1000"]
    args += ["--tp", "2", "--pp", "2", "--bf16"]
    args += ["--micro-batch-size", "2", "--global-batch-size", "4"]
    args += ["--recompute-granularity", mode] + (["--sequence-parallel"] if sp else [])
    layer = table2(mode, sp, s, b, h, a, t)
    split = t if sp else 1
    embedding = 8 * s * b + s * b * h / split  # token ids, dropout mask (Section 4.4)
    output = 2 * (2 * s * b * h / split) + 4 * s * b * v / t  # norm, projection inputs; logits
    rebuilt = table2("none", sp, s, b, h, a, t) if mode == "full" else 0
    first = 2 * (2 * layer + embedding) + rebuilt
    # the loss's 16-bit logits beside its fp32 copy, in the forward (a rebuild: in the backward)
    last = 1 * (2 * layer + output) + max(rebuilt, 2 * s * b * v / t)
    assert _stage_activations(args) == [math.ceil(first), math.ceil(last)]


def test_activations_scale_with_the_micro_batches_in_flight() -> None:
    base = [*SMALL, "--pp", "4", "--bf16", "--micro-batch-size", "1"]
    one = formula_activations("memory", *base)
    many = formula_activations("memory", *base, "--global-batch-size", "16")
    assert [s["in_flight"] for s in one] == [[1]] * 4
    # 1F1B: stage s keeps min(p - s, m) micro-batches.
    assert [s["in_flight"] for s in many] == [[4], [3], [2], [1]]
    assert many[1]["layers"] == 3 * one[1]["layers"]


def test_fp32_training_has_4_byte_activations() -> None:
    args = [*SMALL, "--micro-batch-size", "1", "--recompute-granularity", "full"]
    fp32 = formula_activations("memory", *args)[0]["layers"]
    bf16 = formula_activations("memory", *args, "--bf16")[0]
    assert fp32 == 2 * bf16["layers"] == 8 * 4 * 128 * 256  # 8 layer inputs, 4 bytes each


@pytest.mark.slow
def test_flops_equal_megatron_lms_formula() -> None:
    args = [*SMALL, "--pp", "2", "--tp", "2", "--dp", "2", "--micro-batch-size", "2"]
    report = _json("memory", "--format", "json", *args, "--global-batch-size", "8")
    # 8 sequences; d = 256 / 8 = 32; vocab 1000 padded to 1024 (128 x tp 2).
    expected = megatron_flops(8, 128, 8, 256, 8, 8, 32, 1024, 1024)
    assert report["iteration_flops"] == expected
    assert sum(s["flops"] for s in report["stages"]) == expected
    assert report["stages"][0]["flops"] < report["stages"][1]["flops"]  # logits on the last


def test_time_per_iteration() -> None:
    args = ["--micro-batch-size", "4", "--dp", "2", "--gpu-tflops", "100", "--mfu", "0.5"]
    report = _json("memory", "--format", "json", *args)
    assert report["seconds_per_iteration"] == report["iteration_flops"] / (2 * 100e12 * 0.5)


def test_gpu_memory_verdict() -> None:
    args = [*SMALL, "--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "2"]
    stages = _json("memory", "--format", "json", *args)["stages"]
    between = (stages[0]["total"] + stages[1]["total"]) / 2 / 2**30
    result = run_cli("memory", *args, "--gpu-memory", str(between))
    assert result.code == 0
    small, large = sorted(stages, key=lambda s: s["total"])
    assert f"Does not fit in --gpu-memory {between:.2f} GiB: stage(s) {large['stage']}." in result.out
    assert "DOES NOT FIT" in result.out and "fits," in result.out


def test_text_report_golden(golden) -> None:
    args = [*SMALL, "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--use-distributed-optimizer"]
    args += ["--micro-batch-size", "2", "--global-batch-size", "16", "--gpu-memory", "0.1"]
    args += ["--gpu-tflops", "312", "--mfu", "0.5"]
    text = run_cli("memory", *args).out
    golden("memory_small.txt", text)
    report = _json("memory", "--format", "json", *args)
    worst = max(report["stages"], key=lambda s: s["total"])
    assert f"Worst: stage {worst['stage']} (rank {worst['rank']})" in text
    chart = [line for line in text.splitlines() if line.startswith("stage ") and "█" in line]
    assert len(chart) == 2
    bars = [sum(line.count(c) for c in "█▓▒▪░") for line in chart]
    # 48 cells stand for the largest of the stages and --gpu-memory.
    scale = max([s["total"] for s in report["stages"]] + [report["hardware"]["gpu_memory"]])
    assert bars == [round(48 * s["total"] / scale) for s in report["stages"]]


def test_table_format_has_exact_bytes() -> None:
    args = [*SMALL, "--pp", "2", "--micro-batch-size", "1"]
    table = run_cli("memory", "--format", "table", *args).out
    report = _json("memory", "--format", "json", *args)
    for stage in report["stages"]:
        assert f"{stage['total']:,}" in table


def test_walkthrough_405b_at_60000_tokens_on_16_ranks() -> None:
    args = ["--model", "llama3.1-405b", "--seq-length", "60000", "--bf16", "--micro-batch-size", "1"]
    args += ["--attention-walkthrough", "--format", "json", "--cp", "16"]
    walks = _json("memory", *args, "--ulysses-degree", "16")["walkthrough"]
    assert [w["mode"] for w in walks] == ["tp", "ulysses", "cp", "mlp"]
    ulysses = {s["name"]: s for s in walks[1]["steps"]}
    # the running allocation is every step's bytes so far, the score matrix included
    kept = [s for s in walks[1]["steps"] if s["materialized"] != "flash"]
    assert ulysses["Y = O W_o"]["peak_allocated"] == sum(s["bytes"] for s in kept)
    mlp = {s["name"]: s for s in walks[3]["steps"]}
    # one rank, --tp 1 --dp 1: the whole 126 layers' fc1 (2 x 53248 columns with SwiGLU)
    assert mlp["W1: fc1 weights of L layers, column shard"]["shape"] == [126, 16384, 106496]
    assert mlp["inter = input W1"]["freed"] and not mlp["Y = inter W2 (partial sums)"]["freed"]
    scores = ulysses["S = Q K^T: attention scores"]
    # 128 heads / 16 = 8 per rank, 60000 x 60000 each, 2 bytes: 57.6 GB on every rank.
    assert scores["shape"] == [1, 8, 60000, 60000]
    assert scores["bytes"] == 8 * 60000 * 60000 * 2 == 57_600_000_000
    # Ulysses K: 8 key/value groups on 16 ranks, one (replicated) head per rank.
    assert ulysses["K: all-to-all, gather N, scatter heads"]["shape"] == [60000, 1, 1, 128]
    ring = {s["name"]: s for s in walks[2]["steps"]}
    # Context parallel: 3750 local queries against 3750 keys per ring step, all 128 heads.
    assert ring["S = Q K^T: attention scores"]["shape"] == [1, 128, 3750, 3750]
    assert ring["S = Q K^T: attention scores"]["bytes"] == 128 * 3750 * 3750 * 2


def test_walkthrough_text_names_the_modes() -> None:
    result = run_cli("memory", "--micro-batch-size", "1", "--attention-walkthrough", "--tp", "2")
    assert result.code == 0, result.err
    assert result.out.startswith("# attention walkthrough: tensor parallel, P = 2; N = 1024, b = 1")
    assert "32-bit activations" in result.out.splitlines()[0]


@pytest.mark.parametrize(
    "args, message",
    [
        # activations scale with the micro-batch, so it must be given
        ([], "--micro-batch-size is required: activations scale with it"),
        # Megatron-LM needs whole micro-batches per data-parallel rank
        (
            ["--micro-batch-size", "2", "--dp", "2", "--global-batch-size", "6"],
            "--global-batch-size 6 is not divisible by --micro-batch-size 2 x --dp 2 (6 % 4 = 2)",
        ),
        # an empty batch is not Megatron-LM's default batch
        (["--micro-batch-size", "1", "--global-batch-size", "0"], "--global-batch-size must be at least 1, got 0"),
        (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1, got 0"),
        # an MFU is a fraction of a peak
        (["--micro-batch-size", "1", "--mfu", "0.5"], "--mfu needs --gpu-tflops (the peak it is a fraction of)"),
        (["--micro-batch-size", "1", "--gpu-tflops", "100", "--mfu", "2"], "--mfu must lie in (0, 1], got 2.0"),
        (["--micro-batch-size", "1", "--gpu-memory", "0"], "--gpu-memory must be a finite number of GiB greater than 0, got 0.0"),
        # megatron-core has no Ulysses attention to train with
        (
            ["--micro-batch-size", "1", "--ulysses-degree", "2"],
            "--ulysses-degree only shapes --attention-walkthrough: megatron-core trains with tensor "
            "and context parallelism, not Ulysses",
        ),
        # flash attention kernels are 16-bit
        (
            ["--micro-batch-size", "1", "--transformer-impl", "transformer_engine", "--use-flash-attn"],
            "--use-flash-attn needs --bf16 or --fp16: flash attention kernels have no fp32 path",
        ),
        # the interleaved schedule needs at least pp micro-batches
        (
            [*SMALL, "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1"],
            "the interleaved schedule groups 2 micro-batches per virtual stage, which must lie between "
            "--pp 2 and the 1 micro-batches per iteration (--global-batch-size / (--micro-batch-size x --dp))",
        ),
        (["--micro-batch-size", "1", "--format", "csv"], "--format 'csv' is not one of: text, table, json"),
        (
            ["--micro-batch-size", "1", "--recompute-granularity", "most"],
            "--recompute-granularity 'most' is not one of: none, selective, full",
        ),
    ],
)  # fmt: skip
def test_bad_memory_input(args: list[str], message: str) -> None:
    result = run_cli("memory", *args)
    assert (result.code, result.out, result.err) == (2, "", f"Error: {message}\n")


# The engine's numbers: megatron's forward and backward run on meta tensors (inspector/memory/engine),
# on the small job of tests/test_engine.py.
ENGINE = ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64"]
ENGINE += ["--num-attention-heads", "4"]
ENGINE += ["--seq-length", "32", "--vocab-size", "1000", "--tp", "2", "--pp", "2", "--dp", "2"]
ENGINE += ["--micro-batch-size", "2", "--global-batch-size", "8", "--bf16"]
ENGINE += ["--use-distributed-optimizer"]
MOMENT = re.compile(
    r"((forward|backward) of micro-batch \d+( \(chunk \d+\))?|optimizer step): \S"
)


def test_engine_static_is_megatrons_buffers_plus_the_runs_persistent_buffers() -> None:
    from inspector.memory.engine.run import run_memory
    from tests.test_engine import _job

    report = _json("memory", "--format", "json", *ENGINE)
    expected = expected_state(ENGINE)  # megatron's DDP buffers, by hand from the params rows
    for stage in report["stages"]:
        got = {k: stage[k] for k in ("parameters", "weights", "gradients", "optimizer", "rank")}
        assert got == expected[stage["stage"]]
        run = run_memory(_job(), stage["stage"])  # the engine on its own, the stage built anew
        buffers = stage["buffers"]
        assert buffers["persistent"] == [[where, size] for where, size in run.persistent]
        assert buffers["persistent"], "megatron keeps buffers after a micro-batch"
        assert buffers["total"] == run.static == sum(s for _, s in run.persistent) + (2 * 32 << 20)
        state = stage["weights"] + stage["gradients"] + stage["optimizer"]
        assert stage["static"] == state + run.static  # to the byte


def test_engine_peak_is_above_static_and_names_a_pass() -> None:
    report = _json("memory", "--format", "json", *ENGINE)
    for stage in report["stages"]:
        a = stage["activations"]
        assert a["source"] == "engine"
        assert 0 <= a["held"] < a["total"]
        assert stage["total"] == stage["static"] + a["total"] > stage["static"]
        assert MOMENT.match(a["moment"]), a["moment"]
    # 1F1B: stage 0 holds a second micro-batch beneath the one running at its peak
    assert [s["activations"]["in_flight"] for s in report["stages"]] == [[2], [1]]
    assert report["stages"][0]["activations"]["held"] > 0 == report["stages"][1]["activations"]["held"]
    text = run_cli("memory", *ENGINE).out
    assert "megatron's forward, backward and optimizer step run on meta tensors" in text
    assert "Stage 1: static " in text and " at the forward of micro-batch" in text


TE_CP = ["--transformer-impl", "transformer_engine", "--cp", "2", "--use-flash-attn"]


def test_a_te_job_with_context_parallelism_runs_through_the_engine() -> None:
    """TE's p2p context-parallel attention runs (world/te P2PAttnFunction), on this cp rank's
    half of the sequence (megatron-core's get_batch_on_this_cp_rank)."""
    result = run_cli("memory", *ENGINE, *TE_CP)
    assert result.code == 0, result.err
    assert "megatron's forward, backward and optimizer step run on meta tensors" in result.out
    assert "closed forms" not in result.out
    report = _json("memory", "--format", "json", *ENGINE, *TE_CP)
    assert [s["activations"]["source"] for s in report["stages"]] == ["engine"] * 2
    # half the sequence per rank: every stage holds less than without context parallelism
    whole = _json("memory", "--format", "json", *ENGINE, *TE_CP[:2], "--use-flash-attn")
    for cp2, cp1 in zip(report["stages"], whole["stages"]):
        assert 0 < cp2["activations"]["total"] < cp1["activations"]["total"]


@pytest.mark.parametrize("extra", [[], TE_CP], ids=["local", "te-cp"])
def test_formulas_answer_where_the_engine_cannot_run(
    extra: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspector.memory.engine import run as engine

    why = "Some layer is not run yet"  # every job the engine knows runs: a reason made up here
    monkeypatch.setattr(engine, "not_runnable", lambda job: why)
    report = _json("memory", "--format", "json", *ENGINE, *extra)
    formulas = formula_activations("memory", *ENGINE, *extra)
    for stage, closed in zip(report["stages"], formulas):
        assert stage["buffers"] is None
        assert stage["activations"] == {"source": "formulas", **closed}
        assert stage["static"] == stage["weights"] + stage["gradients"] + stage["optimizer"]
    text = run_cli("memory", *ENGINE, *extra).out
    (line,) = [x for x in text.splitlines() if x.startswith("Activations: closed forms")]
    assert why in line and "not run yet" in line
    # the buffers only megatron running finds: "not counted", never a count of 0
    for out in (text, run_cli("memory", "--format", "table", *ENGINE, *extra).out):
        rows = [x for x in out.splitlines() if re.match(r"^[01] ", x)][:2]
        assert len(rows) == 2 and all("not counted" in row for row in rows), out


@pytest.mark.slow
def test_mixtral_runs_through_the_engine_with_balanced_routing() -> None:
    """An MoE job's activations come from megatron running, and the report says how it routed."""
    args = ["memory", "--model", "mixtral-8x7b", "--transformer-impl", "local", "--bf16",
            "--tp", "1", "--pp", "4", "--ep", "8", "--dp", "8", "--micro-batch-size", "1",
            "--seq-length", "4096", "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip
    report = _json(*args, "--format", "json")
    assert [s["activations"]["source"] for s in report["stages"]] == ["engine"] * 4
    # every MoE layer's token dispatcher keeps its last routing metadata (persistent, per layer)
    for stage in report["stages"]:
        kept = {where.split()[1] for where, _ in stage["buffers"]["persistent"] if where.startswith("layer ")}
        assert kept == {str(layer) for layer in stage["layers"][0]}
    text = run_cli(*args).out
    assert "Note: MoE routing is balanced: every expert gets tokens x 2 / 8 of each rank's tokens" in text
    assert "alltoall dispatcher, dropless." in text


def test_a_small_moe_job_on_tensor_and_expert_parallel_ranks_runs_through_the_engine() -> None:
    extra = ["--num-experts", "4", "--ep", "2", "--sequence-parallel", "--disable-bias-linear"]
    report = _json("memory", "--format", "json", *ENGINE, *extra)
    assert [s["activations"]["source"] for s in report["stages"]] == ["engine", "engine"]
    assert all(s["static"] > s["weights"] + s["gradients"] + s["optimizer"] for s in report["stages"])


def test_an_engine_run_does_not_depend_on_the_runs_before_it_in_the_process() -> None:
    """megatron keeps its MTP loss-logging values per process (MTPLossLoggingHelper.tracker,
    allocated by the first forward): every run starts without them, as `memory` in a new
    process does, so `plan`, which measures plan after plan in one process, agrees with it."""
    mtp = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--vocab-size", "1000", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--bf16", "--position-embedding-type", "rope",
           "--mtp-num-layers", "1"]  # fmt: skip
    first = _json("memory", "--format", "json", *mtp)
    assert first == _json("memory", "--format", "json", *mtp)
    kept = [size for where, size in first["stages"][0]["buffers"]["persistent"] if where == "model"]
    from inspector.inputs.versions import megatron_core_version

    # the tracker's [mtp layers] fp32 values, in one 512-byte block (megatron-core 0.13 keeps
    # none on the GPU)
    assert (512 in kept) == (megatron_core_version() >= (0, 14))


def test_a_time_at_full_peak_says_so_and_counts_are_singular() -> None:
    # `memory --gpu h100` printed "at 67 TFLOP/s and MFU 1." (every FLOP at the peak) without
    # saying so, over "1 sequences" and "1 GPUs"
    text = run_cli("memory", *SMALL, "--micro-batch-size", "1", "--gpu", "h100").out
    assert "(1 sequence of 128 tokens, " in text
    time = next(line for line in text.splitlines() if line.startswith("Time per iteration"))
    assert " on 1 GPU at " in time and "MFU 1: every FLOP at the GPU's peak" in time
    given = run_cli("memory", *SMALL, "--micro-batch-size", "1", "--gpu", "h100", "--mfu", "0.4").out
    assert "and MFU 0.4.\n" in given


def test_the_table_format_keeps_the_fits_verdict() -> None:
    args = ["memory", *SMALL, "--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "2"]
    stages = _json(*args, "--format", "json")["stages"]
    between = (stages[0]["total"] + stages[1]["total"]) / 2 / 2**30
    table = run_cli(*args, "--gpu-memory", str(between), "--format", "table").out
    header, _, *rows = [line.split() for line in table.splitlines() if line][-4:]
    assert header[-3:] == ["fits", "spare", "B"]
    budget = round(between * 2**30)
    for row, stage in zip(rows, stages, strict=True):
        assert row[-2:] == ["yes" if stage["total"] <= budget else "NO", f"{budget - stage['total']:,}"]
