"""DistributedOptimizer ownership: exact cover, equal shards, and agreement with megatron's code."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from inspector.errors import ConfigError
from inspector.world.ddp import (
    StandInGroup,
    distopt_layout,
    distopt_owners,
    layout_from_ddp,
    wrap_in_megatron_ddp,
)
from inspector.world.shards import (
    DistOptLayout,
    DistOptSettings,
    ParamShards,
    resolve_bucket_size,
)


@dataclass(frozen=True)
class Stage:
    """A tiny GPTModel stage to build: parallel sizes, which stage/chunk, and model options."""

    tp: int = 1
    pp: int = 1
    stage: int = 0
    tied: bool = True
    bf16: bool = False
    ep: int = 0  # 0: dense; else 4 experts over ep expert-parallel ranks
    vpp: int = 0
    chunk: int = 0
    cast: bool = True  # bf16 only: wrap in Float16Module as Megatron-LM does


@functools.cache
def build_stage(spec: Stage) -> torch.nn.Module:
    """Build one stage (chunk) of a tiny GPTModel on meta in a fake world, then tear it down."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    replicas = max(spec.ep, 1)  # expert parallelism needs ep data-parallel replicas in the world
    rank = spec.stage * spec.tp * replicas  # megatron's default order tp-cp-ep-dp-pp
    torch.distributed.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=spec.tp * spec.pp * replicas
    )
    try:
        ps.initialize_model_parallel(
            spec.tp,
            spec.pp,
            virtual_pipeline_model_parallel_size=spec.vpp or None,
            expert_model_parallel_size=max(spec.ep, 1),
            expert_tensor_parallel_size=1,
            create_gloo_process_groups=False,
        )
        ps._EMBEDDING_GROUP = None
        ps._EMBEDDING_GLOBAL_RANKS = None
        assert ps.get_pipeline_model_parallel_rank() == spec.stage
        model = _build_gpt(spec, ps, GPTModel, get_gpt_layer_local_spec, TransformerConfig)
        return Float16Module(model.config, model) if spec.bf16 and spec.cast else model
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _build_gpt(spec: Stage, ps: Any, gpt: Any, layer_spec: Any, config_class: Any) -> Any:
    from inspector.world.setup import simulate_apex

    """Build the GPTModel of `spec` under the meta device (world already set up)."""
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    moe: dict[str, Any] = {}
    if spec.ep:
        # portable across megatron-core 0.13-0.16: no MoE biases (0.13-0.14 refuse them), and
        # sequence parallel (with apex's norm) where experts meet tensor parallelism
        moe = dict(
            num_moe_experts=4,
            moe_router_topk=2,
            expert_model_parallel_size=spec.ep,
            expert_tensor_parallel_size=1,
            add_bias_linear=False,
            sequence_parallel=spec.tp > 1 and spec.ep > 1,
        )
        simulate_apex(spec.tp > 1 and spec.ep > 1)
    else:
        simulate_apex(False)
    config = config_class(
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=192,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp or None,
        pipeline_dtype=dtype if spec.pp > 1 else None,
        bf16=spec.bf16,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        **moe,
    )
    vp_stage = spec.chunk if spec.vpp else None
    first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    with torch.device("meta"):
        return gpt(
            config,
            layer_spec(num_experts=4 if spec.ep else None),
            vocab_size=512,
            max_sequence_length=128,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=spec.tied,
            vp_stage=vp_stage,
        )


def settings_for(spec: Stage, dp: int, **flags: Any) -> DistOptSettings:
    """Return settings for `spec` at data-parallel size dp (expert dp = dp*tp / (etp*ep))."""
    expert_dp = dp * spec.tp // spec.ep if spec.ep else dp  # etp is 1 in these models
    return DistOptSettings(dp_size=dp, expert_dp_size=expert_dp, **flags)


def layout_of(spec: Stage, dp: int, **flags: Any) -> DistOptLayout:
    """Return the layout of `spec`'s stage at data-parallel size dp."""
    model = build_stage(spec)
    settings = settings_for(spec, dp, **flags)
    return distopt_layout(model, settings, pipeline_rank=spec.stage, chunk=spec.chunk)


# (stage, dp, DDP flags): tp and pp 1..4, dp 1..64, tied/untied, fp32/bf16, MoE, vpp,
# buckets small enough to make several, overlap on and off.
SMALL = dict(overlap_grad_reduce=True, bucket_size=20_000)
LAYOUTS = [
    (Stage(), 1, {}),
    (Stage(), 8, {}),
    (Stage(), 64, SMALL),
    (Stage(tied=False), 3, SMALL),
    (Stage(bf16=True), 16, SMALL),
    (Stage(bf16=True, tied=False), 5, {}),
    (Stage(tp=2), 4, SMALL),
    (Stage(tp=4, bf16=True), 32, dict(overlap_grad_reduce=True, bucket_size=5_000)),
    (Stage(pp=2, stage=0), 2, SMALL),
    (Stage(pp=2, stage=1), 2, SMALL),
    (Stage(pp=2, stage=0, tied=False), 7, SMALL),
    (Stage(pp=2, stage=1, tied=False, bf16=True), 64, {}),
    (Stage(tp=2, pp=4, stage=0, bf16=True), 8, SMALL),
    (Stage(tp=2, pp=4, stage=2), 12, SMALL),
    (Stage(tp=2, pp=4, stage=3), 48, dict(overlap_grad_reduce=True)),
    (Stage(pp=2, vpp=2, chunk=0), 4, SMALL),
    (Stage(pp=2, vpp=2, chunk=1), 4, SMALL),
    (Stage(pp=2, stage=1, vpp=2, chunk=1), 6, SMALL),
    (Stage(ep=2), 2, SMALL),
    (Stage(ep=2, bf16=True), 8, dict(overlap_grad_reduce=True, bucket_size=3_000)),
    (Stage(ep=2, tp=2, pp=2, stage=1), 16, SMALL),
    (Stage(ep=4), 64, {}),
    (Stage(), 24, dict(overlap_grad_reduce=True, bucket_size=0)),
    (Stage(bf16=True), 2, dict(SMALL, pad_buckets_for_high_nccl_busbw=True)),
]
LAYOUT_IDS = [f"{s}-dp{dp}-{flags}" for s, dp, flags in LAYOUTS]


@pytest.mark.parametrize(("spec", "dp", "flags"), LAYOUTS, ids=LAYOUT_IDS)
def test_every_element_is_owned_exactly_once(spec: Stage, dp: int, flags: dict[str, Any]) -> None:
    layout = layout_of(spec, dp, **flags)
    numels = {name: p.numel() for name, p in build_stage(spec).named_parameters()}
    assert sorted(p.name for p in layout.params) == sorted(numels)
    for shards in layout.params:
        group = layout.buffers[shards.buffer].dp_size
        covered = 0
        for piece in shards.slices:  # ascending, distinct ranks, contiguous pieces
            assert piece.start == covered < piece.end
            covered = piece.end
        assert covered == numels[shards.name]
        assert list(shards.owners) == sorted(set(shards.owners))
        assert all(0 <= r < group for r in shards.owners)


@pytest.mark.parametrize(("spec", "dp", "flags"), LAYOUTS, ids=LAYOUT_IDS)
def test_shards_are_equal_and_padded(spec: Stage, dp: int, flags: dict[str, Any]) -> None:
    layout = layout_of(spec, dp, **flags)
    divisor_extra = 2**16 if flags.get("pad_buckets_for_high_nccl_busbw") else 1
    for index, buffer in enumerate(layout.buffers):
        divisor = math.lcm(buffer.dp_size, 128, divisor_extra)  # param_and_grad_buffer.py
        assert all(b.numel % divisor == 0 for b in buffer.buckets)
        assert sum(b.numel for b in buffer.buckets) == buffer.numel
        assert buffer.shard_numel * buffer.dp_size == buffer.numel
        held = [p for p in layout.params if p.buffer == index]
        assert sum(buffer.owned_numel) == sum(p.end - p.start for p in held)
        assert max(buffer.owned_numel) <= buffer.shard_numel
        for p in held:
            bucket = buffer.buckets[p.bucket]
            assert p.start % 64 == 0
            assert bucket.offset <= p.start <= p.end <= bucket.offset + bucket.numel_unpadded
            for piece in p.slices:  # each piece lies inside its rank's window of the bucket
                window = bucket.offset + piece.rank * (bucket.numel // buffer.dp_size)
                assert window <= p.start + piece.start
                assert p.start + piece.end <= window + bucket.numel // buffer.dp_size


def megatron_slices(ddp: Any, names: dict[Any, str]) -> set[tuple[str, int, int, int]]:
    """Run megatron's own DistributedOptimizer range maps once per rank of every buffer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found = set()
    for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        for rank in range(buffer.data_parallel_world_size):
            buffer.data_parallel_group = StandInGroup(buffer.data_parallel_world_size, rank)
            (per_bucket,) = DistributedOptimizer._build_gbuf_range_map(buffer).values()
            for bucket_map in per_bucket:
                for param, ranges in bucket_map["param_map"].items():
                    piece = ranges["param"]
                    found.add((names[param], rank, piece.start, piece.end))
    return found


@pytest.mark.parametrize(("spec", "dp", "flags"), LAYOUTS[::3], ids=LAYOUT_IDS[::3])
def test_ownership_equals_megatrons_range_map(spec: Stage, dp: int, flags: dict[str, Any]) -> None:
    model = build_stage(spec)
    ddp = wrap_in_megatron_ddp(
        model, settings_for(spec, dp, **flags), pipeline_rank=spec.stage, chunk=spec.chunk
    )
    ours = {
        (p.name, s.rank, s.start, s.end)
        for p in layout_from_ddp(ddp, model).params
        for s in p.slices
    }
    names = {param: name for name, param in model.named_parameters()}
    assert ours == megatron_slices(ddp, names)


def bucket_names(layout: DistOptLayout, buffer: int = 0) -> list[list[str]]:
    """Return each bucket's parameter names, in buffer order."""
    buckets: list[list[str]] = [[] for _ in layout.buffers[buffer].buckets]
    for p in sorted(layout.params, key=lambda p: p.start):
        if p.buffer == buffer:
            buckets[p.bucket].append(p.name)
    return buckets


def test_small_buckets_split_the_buffer_in_reverse_parameter_order() -> None:
    layout = layout_of(Stage(), 4, **SMALL)
    buckets = bucket_names(layout)
    assert len(buckets) > 3
    assert buckets[0][0] == "decoder.final_layernorm.bias"  # last parameter comes first
    assert buckets[-1][-1] == "embedding.word_embeddings.weight"


def test_no_overlap_means_one_bucket() -> None:
    layout = layout_of(Stage(), 4, bucket_size=20_000)
    assert layout.bucket_size is None
    assert len(layout.buffers[0].buckets) == 1


def test_later_pipeline_stages_and_chunks_are_not_bucketed() -> None:
    # distributed_data_parallel.py: bucket_size = None when pp rank > 0 or disable_bucketing,
    # which Megatron-LM sets for every chunk after the first.
    assert len(layout_of(Stage(pp=2, stage=0, tied=False), 4, **SMALL).buffers[0].buckets) > 1
    assert len(layout_of(Stage(pp=2, stage=1, tied=False), 4, **SMALL).buffers[0].buckets) == 1
    assert len(layout_of(Stage(pp=2, vpp=2, chunk=1), 4, **SMALL).buffers[0].buckets) == 1


def test_shared_embedding_gets_a_bucket_of_its_own() -> None:
    first = bucket_names(layout_of(Stage(pp=2, stage=0), 4))
    assert first[-1] == ["embedding.word_embeddings.weight"] and len(first) == 2
    last = bucket_names(layout_of(Stage(pp=2, stage=1), 4))
    assert last[0] == ["output_layer.weight"] and len(last) == 2
    untied = bucket_names(layout_of(Stage(pp=2, stage=1, tied=False), 4))
    assert len(untied) == 1


def test_bf16_cast_as_megatron_lm_keeps_one_buffer() -> None:
    cast = layout_of(Stage(bf16=True), 4)
    assert [(b.param_dtype, b.grad_dtype) for b in cast.buffers] == [
        (torch.bfloat16, torch.float32)  # Megatron-LM accumulates bf16 grads in fp32
    ]
    uncast = layout_of(Stage(bf16=True, cast=False), 4)  # torch norms stay fp32
    assert {b.param_dtype for b in uncast.buffers} == {torch.bfloat16, torch.float32}


def test_expert_parameters_are_sharded_over_the_expert_data_parallel_group() -> None:
    layout = layout_of(Stage(ep=2), 8)
    assert [(b.expert, b.dp_size) for b in layout.buffers] == [(False, 8), (True, 4)]
    for p in layout.params:
        assert layout.buffers[p.buffer].expert == (".experts." in p.name)
        assert max(p.owners) < layout.buffers[p.buffer].dp_size


def test_experts_without_expert_parallelism_share_the_dense_buffer() -> None:
    # tensor_parallel/layers.py: allreduce = not (is_expert and expert_model_parallel_size > 1),
    # and DDP puts every allreduce parameter in the dense buffers.
    layout = layout_of(Stage(ep=1), 8)
    assert [(b.expert, b.dp_size) for b in layout.buffers] == [(False, 8)]
    assert any(".experts." in p.name for p in layout.params)


def test_model_is_left_as_found_and_answers_repeat() -> None:
    spec = Stage(pp=2, stage=1, bf16=True)
    model = build_stage(spec)
    settings = settings_for(spec, 16, **SMALL)
    first = distopt_owners(model, settings, pipeline_rank=1)
    assert all(p._base is None and not hasattr(p, "main_grad") for p in model.parameters())
    assert distopt_owners(model, settings, pipeline_rank=1) == first
    assert not torch.distributed.is_initialized()


def test_runs_inside_a_live_simulated_world_too() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = Stage(tp=2)
    settings = settings_for(spec, 8, **SMALL)
    alone = distopt_owners(build_stage(spec), settings)
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=3, world_size=16)
    try:
        assert distopt_owners(build_stage(spec), settings) == alone
    finally:
        torch.distributed.destroy_process_group()


def test_huge_data_parallel_costs_no_more_than_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing loops over ranks but the per-rank totals: each parameter's slices are cut at most
    # twice (its first and last owner), however many of the 131,072 ranks it spans; a loop over
    # every owner would cut about dp of them. Counted, not timed (timings depend on the load).
    model = build_stage(Stage(tp=2))
    cuts = {"n": 0}
    slice_of = ParamShards.slice_of

    def counted(self: ParamShards, rank: int) -> Any:
        cuts["n"] += 1
        return slice_of(self, rank)

    monkeypatch.setattr(ParamShards, "slice_of", counted)
    for dp in (1, 131072):
        cuts["n"] = 0
        layout = distopt_layout(model, DistOptSettings(dp_size=dp, overlap_grad_reduce=True))
        owners = layout.owners()
        assert len(layout.buffers[0].owned_numel) == dp
        assert max(max(o) for o in owners.values()) < dp
        assert sum(layout.buffers[0].owned_numel) == sum(p.numel() for p in model.parameters())
        assert 0 < cuts["n"] <= 2 * len(list(model.parameters()))


def test_megatron_lm_default_bucket_size() -> None:
    # Megatron-LM training.py get_model: max(40M, 1M * dp*cp) with overlap, None without.
    assert resolve_bucket_size(None, overlap_grad_reduce=False, dp_cp_size=8) is None
    assert resolve_bucket_size(None, overlap_grad_reduce=True, dp_cp_size=8) == 40_000_000
    assert resolve_bucket_size(None, overlap_grad_reduce=True, dp_cp_size=128) == 128_000_000
    assert resolve_bucket_size(1234, overlap_grad_reduce=True, dp_cp_size=128) == 1234
    assert layout_of(Stage(), 64, overlap_grad_reduce=True).bucket_size == 64_000_000


def test_rejects_non_positive_data_parallel_size() -> None:
    # --dp 0 would shard nothing; megatron divides by it.
    with pytest.raises(ConfigError, match="--dp 0"):
        DistOptSettings(dp_size=0)


def test_rejects_negative_bucket_size() -> None:
    # A negative --ddp-bucket-size is meaningless (megatron would treat it like 0).
    with pytest.raises(ConfigError, match="--ddp-bucket-size -5 must not be negative"):
        DistOptSettings(dp_size=2, bucket_size=-5)


def test_distributed_optimizer_implies_distopt_ownership(cli) -> None:
    # --use-distributed-optimizer means megatron's own shards own the optimizer work, unless
    # another --partitioning is asked for
    small = ["params", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--vocab-size", "1000", "--seq-length", "32", "--dp", "4"]  # fmt: skip
    implied = cli(*small, "--use-distributed-optimizer")
    asked = cli(*small, "--use-distributed-optimizer", "--partitioning", "distopt")
    layers = cli(*small, "--use-distributed-optimizer", "--partitioning", "layers")
    assert implied.code == asked.code == layers.code == 0
    assert implied.out == asked.out != layers.out
    assert layers.out == cli(*small).out
