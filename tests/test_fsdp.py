"""Megatron-FSDP and PyTorch FSDP2: Megatron-LM's checks, and each rank's bytes by hand."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pytest

from inspector.inputs.versions import megatron_core_version
from tests.conftest import run_cli

TINY = ("--transformer-impl local --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size 1000 "
        "--micro-batch-size 1 --bf16").split()  # fmt: skip
MFSDP = "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor".split()
FSDP2 = "--use-torch-fsdp2 --no-gradient-accumulation-fusion".split()
FSDP_PP = 2 if megatron_core_version() < (0, 14) else 1  # job/versions.py fsdp_with_pipeline
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@functools.cache  # the same job asked by several tests (every strategy at dp 4) runs once
def memory(*args: str) -> dict[str, Any]:
    result = run_cli("memory", *TINY, "--format", "json", *args)
    assert result.code == 0, result.err
    stage: dict[str, Any] = json.loads(result.out)["stages"][0]
    return stage


def strategy(name: str, dp: int = 4, *extra: str) -> dict[str, Any]:
    return memory(*MFSDP, "--dp", str(dp), "--data-parallel-sharding-strategy", name, *extra)


# Shapes of TINY's parameters (rows, elements per row), by hand: megatron pads the vocabulary
# to a multiple of 128 (1000 -> 1024); learned positions; per layer two LayerNorms, fused QKV,
# projection, and a 4 x hidden MLP, all with biases; the final LayerNorm; an untied output layer.
H, F, V, S = 64, 256, 1024, 32
LAYER = [(H, 1), (H, 1), (3 * H, H), (3 * H, 1), (H, H), (H, 1), (H, 1), (H, 1), (F, H), (F, 1),
         (H, F), (H, 1)]  # fmt: skip
SHAPES = [(V, H), (S, H), *LAYER, *LAYER, (H, 1), (H, 1)]
P = sum(rows * row for rows, row in SHAPES)


def test_tiny_shapes_match_megatrons_count():
    # the hand list above is the tied model megatron builds
    assert memory()["parameters"] == P


def test_no_shard_holds_everything_unpadded():
    # no_shard: parameters in their own storage (2 bytes), fp32 grads (Megatron-LM turns on
    # --accumulate-allreduce-grads-in-fp32 for bf16), fp32 main weights + Adam's two moments
    got = strategy("no_shard")
    assert (got["weights"], got["gradients"], got["optimizer"]) == (2 * P, 4 * P, 12 * P)


@pytest.mark.parametrize("dp", [3, 4])
def test_sharded_state_is_total_over_dp_within_megatrons_padding(dp):
    # optim_grads_params shards all three; each bucket is padded to a multiple of dp x its row
    # size (param_and_grad_buffer.py _pad_if_needed, megatron-core 0.16; fc2's rows are the
    # longest, F elements), so a rank holds P / dp elements plus under F per bucket
    got = strategy("optim_grads_params", dp)
    buckets = 1 + 2  # the parameters outside the layers, and one per TransformerLayer unit
    for key, size in (("weights", 2), ("gradients", 4)):
        elements = got[key] / size
        assert P / dp <= elements < P / dp + buckets * F, (key, elements)


def test_strategies_shard_more_and_more():
    got = [strategy(name) for name in STRATEGIES]
    weights = [g["weights"] for g in got]
    grads = [g["gradients"] for g in got]
    optimizer = [g["optimizer"] for g in got]
    # optim shards main weights and moments: about 12 P / 4 bytes (one bucket, padded by under
    # dp x F elements)
    assert optimizer[0] == 12 * P and 12 * P / 4 <= optimizer[1] < 12 * (P / 4 + F)
    assert grads[1] >= 4 * P and grads[2] < grads[1] / 3  # optim_grads shards the gradients
    assert weights[2] >= 2 * P and weights[3] < weights[2] / 3  # optim_grads_params the weights
    assert optimizer[1] == optimizer[2]  # the same buckets (TransformerLayer units: only in the last)


def test_sharded_gradients_need_an_unsharded_bucket_in_flight():
    # without --overlap-grad-reduce megatron makes one bucket of all non-layer parameters; from
    # optim_grads on, the backward fills an unsharded fp32 bucket before reduce-scattering it;
    # optim reduce-scatters its persistent buffer into a fresh shard (torch.empty_like) up to
    # megatron-core 0.16; 0.17 and later reduce-scatter it in place (version fact: megatron_fsdp's
    # param_and_grad_buffer.py, checked on 0.17.1, 0.18.2 and 0.19.2)
    # (optim_grads' bucket is made in the engine's backward: engine/fsdp_grads.py; below)
    flight = {name: strategy(name)["buffers"].get("fsdp_in_flight", 0) for name in STRATEGIES}
    assert flight["no_shard"] == 0
    if megatron_core_version() >= (0, 17):
        assert flight["optim"] == 0
    else:
        assert P <= flight["optim"] < P + 4 * F  # one fp32 shard of the single bucket: 4 P / dp
    zero2 = strategy("optim_grads")
    assert flight["optim_grads"] == 0 and zero2["activations"]["moment"].startswith("backward")
    assert 4 * P <= zero2["activations"]["total"]
    assert flight["optim_grads_params"] > 0  # the gathered parameters


def test_zero2_keeps_every_gradient_bucket_of_a_small_model_above_zero1():
    # NVIDIA/Megatron-LM#6314: with --overlap-grad-reduce and small buckets, megatron's
    # GradReducePipeline frees a reduce-scattered bucket only once its queue holds more than
    # suggested_RS_queue_capacity (at least 1e9) elements, so all of TINY's unsharded fp32
    # gradient buckets (about 4 P bytes) are alive at the end of the backward, on top of the
    # optim_grads shard (P bytes at dp 4); optim keeps its 4 P persistent buffer and allocates
    # one shard per reduce-scatter. ZeRO-2 peaks above ZeRO-1. (Two neighbouring 20,000-element
    # buckets, the earlier count, are under P / 2 bytes and put ZeRO-2 below ZeRO-1.)
    extra = ("--overlap-grad-reduce", "--ddp-bucket-size", "20000")
    zero1, zero2 = strategy("optim", 4, *extra), strategy("optim_grads", 4, *extra)
    # the buckets, in the engine's backward now (engine/fsdp_grads.py), with its activations
    assert zero2["activations"]["moment"].startswith("backward")
    assert 4 * P <= zero2["activations"]["total"]
    assert zero1["buffers"].get("fsdp_in_flight", 0) < 4 * 20000  # a bucket's shard at a time
    assert zero2["gradients"] + zero2["activations"]["total"] > zero1["gradients"]
    assert zero2["total"] > zero1["total"]


def test_fsdp2_shards_rows_as_torch_pads_them():
    # torch FSDP2: each parameter's rows in ceil(rows / dp) chunks; bf16 params and grads, the
    # fp32 copy and moments of rank 0's rows (the most loaded: it holds a full chunk of each)
    dp = 3
    got = memory(*FSDP2, "--untie-embeddings-and-output-weights", "--dp", str(dp))
    shapes = [*SHAPES, (V, H)]
    shard = sum(math.ceil(rows / dp) * row for rows, row in shapes)
    assert got["parameters"] == P + V * H
    assert (got["weights"], got["gradients"], got["optimizer"]) == (2 * shard, 2 * shard, 12 * shard)


def test_json_names_the_strategy():
    result = run_cli("memory", *TINY, *MFSDP, "--data-parallel-sharding-strategy", "optim",
                     "--format", "json")  # fmt: skip
    training = json.loads(result.out)["training"]
    assert training["use_megatron_fsdp"] and training["data_parallel_sharding_strategy"] == "optim"


@pytest.mark.parametrize(
    "args, message",
    [
        # the Megatron-FSDP guide: "The custom FSDP must be used with a distributed optimizer"
        ("--use-megatron-fsdp --ckpt-format fsdp_dtensor",
         "--use-megatron-fsdp needs --use-distributed-optimizer (Megatron-LM's Megatron-FSDP "
         "guide: \"The custom FSDP must be used with a distributed optimizer\")"),
        # validate_args: Megatron-FSDP saves fsdp_dtensor checkpoints only
        ("--use-megatron-fsdp --use-distributed-optimizer",
         "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor, not torch_dist (Megatron-LM: "
         "\"Megatron FSDP only supports fsdp_dtensor checkpoint format\")"),
        ("--ckpt-format fsdp_dtensor",
         "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM: \"--ckpt-format "
         "fsdp_dtensor is only tested with Megatron FSDP\")"),
        ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
         "--pp 2",
         "--use-torch-fsdp2 needs --pipeline-model-parallel-size 1, not 2 (Megatron-LM: "
         "\"--use-torch-fsdp2 is not supported with pipeline parallelism\")"),
        ("--use-torch-fsdp2 --untie-embeddings-and-output-weights",
         "--use-torch-fsdp2 runs only with --no-gradient-accumulation-fusion (Megatron-LM: "
         "\"--use-torch-fsdp2 is not supported with gradient accumulation fusion\")"),
        ("--use-torch-fsdp2 --no-gradient-accumulation-fusion",
         "--use-torch-fsdp2 runs only with --untie-embeddings-and-output-weights (Megatron-LM: "
         "\"--use-torch-fsdp2 requires --untie-embeddings-and-output-weights\")"),
        ("--use-torch-fsdp2 --no-gradient-accumulation-fusion --untie-embeddings-and-output-weights "
         "--use-distributed-optimizer",
         "--use-torch-fsdp2 runs only without --use-distributed-optimizer (Megatron-LM: "
         "\"--use-torch-fsdp2 is not supported with MCore's distributed optimizer\")"),
        ("--use-torch-fsdp2 --use-megatron-fsdp",
         "--use-megatron-fsdp and --use-torch-fsdp2 are two FSDP implementations; pass one "
         "(Megatron-LM's get_model would wrap the model in torch's)"),
    ],
)  # fmt: skip
def test_megatron_lm_checks(args, message):
    result = run_cli("memory", *TINY, *args.split())
    assert (result.code, result.err) == (2, f"Error: {message}\n")


def test_sharding_strategy_alone_changes_nothing():
    # Megatron-LM reads --data-parallel-sharding-strategy only with --use-megatron-fsdp
    plain = run_cli("memory", *TINY, "--dp", "2")
    alone = run_cli("memory", *TINY, "--dp", "2", "--data-parallel-sharding-strategy", "optim")
    assert alone.code == 0 and alone.out == plain.out


def test_owned_elements_cover_every_parameter_once():
    # the Adam moments of all ranks together cover each parameter element exactly once
    from inspector.job.job import make_job
    from inspector.world.build import build, select_view

    for name in STRATEGIES:
        job = make_job(dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
            bf16=True, data_parallel_size=5, use_megatron_fsdp=True, use_distributed_optimizer=True,
            ckpt_format="fsdp_dtensor", data_parallel_sharding_strategy=name,
        ))  # fmt: skip
        (chunk,) = build(job, select_view(job)).chunks
        layout = chunk.fsdp()
        assert sum(b.parameters for b in layout.buckets) == P
        for bucket in layout.buckets:
            assert sum(bucket.owned_numel) == bucket.parameters
            assert bucket.numel % bucket.dp == 0 or name == "no_shard"


def test_params_owners_are_torch_chunks_and_megatron_shards():
    # FSDP2: a parameter's owners are the ranks torch.chunk gives rows to (1024 rows over 100
    # ranks: 94 chunks of 11 rows and less); Megatron-FSDP: ranks whose shard meets the parameter
    import torch

    from inspector.job.job import make_job
    from inspector.world.build import build, select_view

    job = make_job(dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        bf16=True, data_parallel_size=100, use_torch_fsdp2=True,
        no_gradient_accumulation_fusion=True, untie_embeddings_and_output_weights=True,
    ))  # fmt: skip
    (chunk,) = build(job, select_view(job)).chunks
    owners = {name: ranks for unit in chunk.fsdp().buckets for name, ranks in unit.owners().items()}
    for name, rows in (("embedding.word_embeddings.weight", V), ("decoder.final_layernorm.weight", H)):
        assert owners[name] == tuple(range(len(torch.chunk(torch.empty(rows, device="meta"), 100))))
    small = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --bf16".split()
    result = run_cli("params", *small, "--vocab-size", "1000", *MFSDP, "--dp", "3",
                     "--data-parallel-sharding-strategy", "optim")  # fmt: skip
    assert result.code == 0, result.err
    found = [line.split(";")[3] for line in result.out.splitlines()[2:] if not line.startswith("#")]
    assert {r for o in found for r in o.split(",")} == {"0", "1", "2"}


def test_fsdp_time_by_hand():
    # a ring collective moves bytes x (d - 1) / d per rank (cost._collective); the sharded
    # strategies gather d x the rank's shard
    from inspector.plan.cost import fsdp_seconds

    d, bandwidth, compute = 8, 1e9, 0.3
    grads, params = 4e8 / d, 2e8 / d  # a rank's shards
    ring = (d - 1) / d / bandwidth
    ag, rs = 2e8 * ring, 4e8 * ring
    # optim_grads_params: gathers before forward (hidden by a third of the compute), gathers
    # again and reduce-scatters in backward (two thirds), every micro-batch
    got = fsdp_seconds("optim_grads_params", compute, int(grads), int(params), d, (0.0, bandwidth))
    assert got == pytest.approx((0.0, max(0.0, ag - 0.1) + max(0.0, ag + rs - 0.2)))
    # optim_grads: a reduce-scatter per micro-batch, one gather of the whole weights per step
    got = fsdp_seconds("optim_grads", compute, int(grads), int(2e8), d, (0.0, bandwidth))
    assert got == pytest.approx((max(0.0, ag - 0.1), max(0.0, rs - 0.2)))
    # no_shard: an all-reduce (two ring passes) once, behind the last backward
    got = fsdp_seconds("no_shard", compute, int(4e8), int(2e8), d, (0.0, bandwidth))
    assert got == pytest.approx((max(0.0, 2 * rs - 0.2), 0.0))


@pytest.mark.parametrize("name", ["optim_grads", "optim_grads_params"])
def test_plan_state_is_memorys_within_padding(name):
    # the planner's composed Megatron-FSDP state (memory/compose/stage_state.py, from pieces) against memory's
    # (megatron's own buckets): equal but for the bucket padding, under dp x F elements per
    # bucket (a rank's shard of it: under F)
    from inspector.job.job import make_job
    from inspector.memory.compose.stage_state import ChunkKinds, stage_state
    from inspector.memory.fsdp_buffers import fsdp_state
    from inspector.world.build import build, select_view
    from inspector.world.ranks import rank_shard_indices

    job = make_job(dict(
        num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        bf16=True, data_parallel_size=3, pipeline_model_parallel_size=FSDP_PP, use_megatron_fsdp=True,
        use_distributed_optimizer=True, ckpt_format="fsdp_dtensor",
        data_parallel_sharding_strategy=name, micro_batch_size=1,
    ))  # fmt: skip
    built = build(job, select_view(job))
    pairs = sorted({(d, e) for p, d, e in rank_shard_indices(job.layout) if p == 0})
    for stage in built.stages:
        shapes = [ChunkKinds.of(job.model, c.layers, c.has_embedding, c.has_output)
                  for c in stage.chunks]  # fmt: skip
        plan, _ = stage_state(job, stage.stage, shapes, pairs)
        layouts = [c.fsdp() for c in stage.chunks]
        exact = fsdp_state(layouts, 0, 0)
        buckets = sum(len(x.buckets) for x in layouts)
        for composed, measured, size in zip((plan.weights, plan.gradients, plan.optimizer), exact,
                                            (2, 4, 12)):  # fmt: skip
            assert 0 <= measured - composed < buckets * 3 * F * size, (stage.stage, name)


def test_workload_and_plan_say_what_they_do_not_model():
    # workload writes both FSDPs (tests/test_workload_fsdp.py); plan searches Megatron-FSDP
    result = run_cli("plan", *TINY[:-3], "--gpus", "8", "--global-batch-size", "8", *FSDP2,
                     "--untie-embeddings-and-output-weights")  # fmt: skip
    assert (result.code, result.err) == (2, "Error: plan does not search --use-torch-fsdp2 jobs; "
                                         "`memory` measures one, and plan tries Megatron-FSDP "
                                         "(--use-megatron-fsdp) beside the distributed optimizer\n")  # fmt: skip


@pytest.mark.slow
def test_plan_searches_megatron_fsdp_strategies_when_asked():
    # --use-megatron-fsdp without a strategy: plan tries optim_grads and optim_grads_params;
    # every plan's flags name its strategy. Eight plans each (both strategies rank in the first
    # eight: the host's launches pace this tiny model's every layout, plan/host.py, so the
    # strategies' GPU time only orders equals): `plan` builds every stage of each printed FSDP
    # plan to confirm it (plan/confirm.py)
    args = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --vocab-size "
            "1000 --bf16 --gpus 8 --global-batch-size 16 --top 8 --format json").split()  # fmt: skip
    result = run_cli("plan", *args, *MFSDP)
    assert result.code == 0, result.err
    plans = json.loads(result.out)["plans"]
    assert len(plans) == 8
    assert {p["megatron_fsdp"] for p in plans} == {"optim_grads", "optim_grads_params"}
    result = run_cli("plan", *args, *MFSDP, "--data-parallel-sharding-strategy", "optim")
    assert {p["megatron_fsdp"] for p in json.loads(result.out)["plans"]} == {"optim"}
    plain = json.loads(run_cli("plan", *args).out)["plans"]
    assert {p["megatron_fsdp"] for p in plain} == {None}


def test_bucket_padding_differs_by_megatron_core_version():
    # optim at dp 3 puts TINY's P parameters in one bucket; megatron-core 0.16 pads it to a
    # multiple of dp x its row length (256: lcm of the rows 1, 64 and 256), 0.13 (custom_fsdp)
    # to a multiple of lcm(dp, 128)
    from megatron.core import __version__

    version = tuple(int(p) for p in __version__.split(".")[:2])
    if (0, 13) < version < (0, 16):
        pytest.skip("checked on megatron-core 0.13 and 0.16+, the versions installed here")
    from inspector.job.job import make_job
    from inspector.world.build import build, select_view

    job = make_job(dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        bf16=True, data_parallel_size=3, use_megatron_fsdp=True, use_distributed_optimizer=True,
        ckpt_format="fsdp_dtensor", data_parallel_sharding_strategy="optim",
    ))  # fmt: skip
    (chunk,) = build(job, select_view(job)).chunks
    (bucket,) = chunk.fsdp().buckets
    multiple = math.lcm(3, 128) if version == (0, 13) else 3 * F
    assert bucket.numel == math.ceil(P / multiple) * multiple


def test_gradient_buckets_are_made_as_the_backward_reaches_their_parameters():
    # optim_grads_params: each parameter's post-accumulate-grad hook fetches its unsharded
    # bucket (megatron_fsdp.py `_grad_acc`); the queue frees nothing before the root's
    # post-backward `reset` (param_and_grad_buffer.py GradReducePipeline): the buckets grow as
    # the backward goes from the last parameter to the first and all go at its end, and none
    # is held in the forward, whose peak sees only the gathered parameters
    from inspector.job.job import make_job
    from inspector.memory.engine.fsdp_grads import BUCKETS, gradient_buckets_peak
    from inspector.memory.engine.run import run_memory
    from inspector.world.build import build, select_view

    job = make_job(dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
        bf16=True, data_parallel_size=4, use_megatron_fsdp=True, use_distributed_optimizer=True,
        ckpt_format="fsdp_dtensor", data_parallel_sharding_strategy="optim_grads_params",
        micro_batch_size=1, transformer_impl="local",
    ))  # fmt: skip
    (chunk,) = build(job, select_view(job)).chunks
    (trace,) = run_memory(job, 0).replay.traces
    made = [e for e in trace.backward if e.where.endswith(BUCKETS)]
    assert sum(e.bytes for e in made) == gradient_buckets_peak(chunk.fsdp(), True) > 4 * P
    assert trace.backward[-1].where == f"backward: {BUCKETS} reset"
    assert trace.backward[-1].bytes == -sum(e.bytes for e in made)
    assert not any(BUCKETS in e.where for e in trace.forward)
    order = [e.where.split(":")[0].split(" ")[:2] for e in made]
    assert order[0] == ["decoder.final_layernorm"] and order[1:3] == [["layer", "1"], ["layer", "0"]]
