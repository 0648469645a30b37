"""Per-stage SimAI records: AICB compatibility, per-stage sums, goldens, compute times."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from inspector.errors import ConfigError, InputError
from inspector.formulas.flops import layer_flops, logit_flops, stage_flops
from inspector.job.dims import ModelDims
from inspector.job.layout import Layout
from inspector.report.simai import NONE, Record, parse_compute_profile, parse_workload
from inspector.report.workload import render_stage, stage_header, stage_records
from inspector.report.workload_index import render_index
from inspector.report.workload_inputs import (
    BufferInput,
    ComputeProfile,
    ComputeRate,
    Context,
    Settings,
    StageInput,
)


def checked_records(job: Context, stage: StageInput) -> list[Record]:
    """Return the stage's records after reading its file back with the strict reader."""
    records = stage_records(job, stage)
    header, parsed = parse_workload(render_stage(job, stage))
    assert parsed == records and header == stage_header(job)
    return records


# ---------------------------------------------------------------------------------------------
# AICB compatibility: the 405B-shaped job.
# AICB's records for it, read off aliyun/aicb HEAD 23eec3c,
# workload_generator/SimAI_training_workload_generator.py (`workload_generate_aiob`, the path
# behind its 405B example), with MockedMegatron.py's pre-order module walk (embedding, per layer
# attention qkv column / dense row / fused norm (no record) / mlp column / mlp row, final column):
#   tp_comm_size = 2 b s h                                                     (lines 167-169)
#   embedding_layer   fwd ALLREDUCE tp_comm_size, bwd NONE 0                   (lines 289-313)
#   *_row             fwd REDUCESCATTER tp_comm_size, bwd ALLGATHER tp_comm_size (lines 344-381)
#   *_column          fwd ALLGATHER tp_comm_size, bwd REDUCESCATTER 0           (lines 383-420;
#                     backward_comm_size is initialised to 0 at line 276 and never set)
#   final_column      as *_column                                 (MockedMegatron.py 648-659)
#   cross_entropy1..3 fwd ALLREDUCE s*b*4, all times 0                          (lines 547-561)
#   optimizer1..4     fwd ALLREDUCE 4, all times 0                              (lines 563-577)
#   grad_gather       wg ALLGATHER 2P; grad_param_comm wg REDUCESCATTER 4P;
#   grad_param_compute (no collective)                                          (lines 183-224)
#   header: ... pp: 16 vpp: num_layers // pp ... pp_comm: 2bsh/tp          (lines 841-861, and
#           utils/utils.py 698-699 divides num_layers by pp)
# ---------------------------------------------------------------------------------------------

B, S, H, L, PP, TP = 1, 4096, 16384, 128, 16, 8
A = 2 * B * S * H  # AICB's tp_comm_size: 134217728
AICB_LAYER = [
    ("attention_column", "ALLGATHER", A, "REDUCESCATTER", 0),
    ("attention_row", "REDUCESCATTER", A, "ALLGATHER", A),
    ("mlp_column", "ALLGATHER", A, "REDUCESCATTER", 0),
    ("mlp_row", "REDUCESCATTER", A, "ALLGATHER", A),
]
AICB_EMBEDDING = ("embedding_layer", "ALLREDUCE", A, NONE, 0)
AICB_FINAL = ("final_column", "ALLGATHER", A, "REDUCESCATTER", 0)
AICB_CROSS_ENTROPY = [
    Record(f"cross_entropy{i}", 0, "ALLREDUCE", S * B * 4, 0, NONE, 0, 0, NONE, 0, 100)
    for i in (1, 2, 3)
]
AICB_OPTIMIZER = [
    Record(f"optimizer{i}", 0, "ALLREDUCE", 4, 0, NONE, 0, 0, NONE, 0, 100) for i in (1, 2, 3, 4)
]
# Where we deliberately write what megatron does instead (notes/simai.md): a column-parallel
# linear under sequence parallelism reduce-scatters its full input gradient in backward, and the
# embedding's scatter to the sequence-parallel layout all-gathers the gradient in backward.
FIXED_BACKWARD = {
    "attention_column": ("REDUCESCATTER", A),
    "mlp_column": ("REDUCESCATTER", A),
    "final_column": ("REDUCESCATTER", A),
    "embedding_layer": ("ALLGATHER", A),
}


def big_job() -> Context:
    dims = ModelDims(L, H, 128, S, 50304, ffn_hidden_size=53248)  # 50257 padded to 128 x 8
    par = Layout(tp=TP, pp=PP, dp=8, sequence_parallel=True)
    return Context(dims, par, Settings(B, 16, 1024), ComputeRate(989.0, 0.4))


def big_stage(stage: int) -> StageInput:
    per_stage = L // PP
    layers = tuple(range(stage * per_stage, (stage + 1) * per_stage))
    return StageInput(
        stage,
        (layers,),
        has_embedding=stage == 0,
        has_output=stage == PP - 1,
        buffers=(BufferInput(numel=1_000_000 + stage, param_bytes=2, grad_bytes=4),),
    )


def shape_fields(record: Record) -> tuple[str, str, int, str, int]:
    return (record.name, record.fwd_comm, record.fwd_bytes, record.ig_comm, record.ig_bytes)


def as_aicb(fields: tuple[str, str, int, str, int]) -> tuple[str, str, int, str, int]:
    """Undo our documented backward fixes, to compare with AICB's record."""
    name, fwd, fwd_bytes, ig, ig_bytes = fields
    if name in FIXED_BACKWARD:
        assert (ig, ig_bytes) == FIXED_BACKWARD[name]
        ig, ig_bytes = AICB_EMBEDDING[3:] if name == "embedding_layer" else ("REDUCESCATTER", 0)
    return (name, fwd, fwd_bytes, ig, ig_bytes)


@pytest.mark.parametrize("stage", [0, 7, 15])
def test_aicb_micro_batch_block(stage: int) -> None:
    job, given = big_job(), big_stage(stage)
    records = checked_records(job, given)
    expected = [AICB_EMBEDDING] if stage == 0 else []
    expected += AICB_LAYER * (L // PP)
    expected += [AICB_FINAL] if stage == PP - 1 else []
    blocks = [r for r in records if r.name not in {"grad_gather", "grad_param_comm"}]
    blocks = [r for r in blocks if not r.name.startswith(("optimizer", "cross_entropy"))]
    blocks = [r for r in blocks if r.name != "grad_param_compute"]
    assert len(blocks) == 16 * len(expected)
    for mb in range(16):
        block = blocks[mb * len(expected) : (mb + 1) * len(expected)]
        assert [as_aicb(shape_fields(r)) for r in block] == expected
    assert all(r.wg_comm == NONE for r in blocks)  # no data-parallel traffic per micro-batch


def test_aicb_cross_entropy_and_optimizer_records() -> None:
    job = big_job()
    last = checked_records(job, big_stage(PP - 1))
    entropy = [r for r in last if r.name.startswith("cross_entropy")]
    assert entropy == AICB_CROSS_ENTROPY * 16  # once per micro-batch: megatron's loss
    for stage in (0, 7, 15):
        records = checked_records(job, big_stage(stage))
        assert records[-4:] == AICB_OPTIMIZER
        if stage != PP - 1:
            assert not any(r.name.startswith("cross_entropy") for r in records)


def test_aicb_data_parallel_records() -> None:
    # Same names, collectives and order as AICB; AICB's 2 and 4 bytes per parameter are
    # megatron's bf16 params and fp32 grads, applied to the real padded buffer here.
    records = checked_records(big_job(), big_stage(3))
    numel = 1_000_003
    assert records[:3] == [
        Record("grad_gather", wg_comm="ALLGATHER", wg_bytes=2 * numel),
        Record("grad_param_comm", wg_comm="REDUCESCATTER", wg_bytes=4 * numel),
        Record("grad_param_compute"),
    ]


def test_aicb_header() -> None:
    header = stage_header(big_job())
    assert (header.tp, header.ep, header.pp, header.ga, header.all_gpus) == (8, 1, 16, 16, 1024)
    assert header.pp_comm == A // TP  # AICB: 2bsh / tp with sequence parallelism
    assert header.vpp == 1  # AICB writes num_layers // pp = 8: an 8x smaller bubble


def test_big_job_files_parse() -> None:
    job = big_job()
    for stage in range(PP):
        header, records = parse_workload(render_stage(job, big_stage(stage)))
        assert header == stage_header(job)
        assert sum(r.name == "attention_column" for r in records) == 16 * (L // PP)


# ---------------------------------------------------------------------------------------------
# A small dense job built from hand-made stages (golden files), and what each file must hold.
# ---------------------------------------------------------------------------------------------

# Local parameters of one layer at tp 2 (h 64, f 256, biases): qkv 6144 + 96, proj 2048 + 64,
# fc1 8192 + 128, fc2 8192 + 64, two layer norms 2 x 128 = 25184.
LAYER_NUMEL = 25184
SMALL_DIMS = ModelDims(4, 64, 4, 128, 256)


def small_job(**par: object) -> Context:
    layout = {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True} | par
    return Context(SMALL_DIMS, Layout(**layout), Settings(2, 2, 8), ComputeRate(100.0, 0.5))  # type: ignore[arg-type]


SMALL_STAGES = [
    # embedding: word 128 x 64 + position 128 x 64; padded to a multiple of lcm(dp, 128) = 128
    StageInput(0, ((0, 1),), True, False, buffers=(BufferInput(66816, 2, 4),), parameters=66752),
    # final norm 128 + the tied output copy of the word embedding 8192
    StageInput(1, ((2, 3),), False, True, buffers=(BufferInput(58752, 2, 4),), parameters=58688),
]


@pytest.mark.parametrize("stage", [0, 1])
def test_small_dense_golden(stage: int, golden: Callable[[str, str], None]) -> None:
    job = small_job()
    text = render_stage(job, SMALL_STAGES[stage])
    golden(f"workload_dense_stage{stage}.txt", text)
    header, records = parse_workload(text)
    names = Counter(r.name for r in records)
    # 2 micro-batches x 2 layers x 4 records; embedding or output + 3 cross-entropy per batch.
    for name in ("attention_column", "attention_row", "mlp_column", "mlp_row"):
        assert names[name] == 2 * 2
    assert names["embedding_layer"] == (2 if stage == 0 else 0)
    assert names["final_column"] == (0 if stage == 0 else 2)
    assert names["cross_entropy1"] == (0 if stage == 0 else 2)
    assert len(records) == 3 + 2 * (8 + (1 if stage == 0 else 4)) + 4
    assert header.pp_comm == 2 * 2 * 128 * 64 // 2


def test_small_dense_index(golden: Callable[[str, str], None]) -> None:
    text = render_index(small_job(), SMALL_STAGES)
    golden("workload_dense_index.csv", text)
    assert text.splitlines()[1] == "0,0-1,0,1,0,66752,25,estimate,stage000.txt"


def test_data_parallel_bytes_are_buffers_times_dtypes() -> None:
    stage = StageInput(
        0,
        ((0, 1),),
        True,
        False,
        buffers=(
            BufferInput(1280, 2, 4),
            BufferInput(640, 4, 4),  # an fp32 parameter buffer (e.g. --fp32-residual ... norms)
            BufferInput(384, 2, 4, expert=True),
        ),
    )
    # dp 4, ep 2: megatron's expert data-parallel group 2 x 4 / (2 x 2) = 2 = SimAI's dp / ep
    records = {r.name: r for r in checked_records(small_job(ep=2, dp=4), stage)}
    assert records["grad_gather"].wg_bytes == 1280 * 2 + 640 * 4
    assert records["grad_param_comm"].wg_bytes == 1280 * 4 + 640 * 4
    assert records["moe_grad_norm1"] == Record(
        "moe_grad_norm1", wg_comm="ALLGATHER_DP_EP", wg_bytes=768
    )
    assert records["moe_grad_norm2"].wg_comm == "REDUCESCATTER_DP_EP"
    assert records["moe_grad_norm2"].wg_bytes == 384 * 4


def test_without_distributed_optimizer_grads_are_all_reduced() -> None:
    job = small_job()
    job = Context(job.dims, job.par, Settings(2, 2, 8, distributed_optimizer=False), job.compute)
    records = checked_records(job, SMALL_STAGES[0])
    assert [r.name for r in records[:2]] == ["grad_param_comm", "grad_param_compute"]
    assert records[0].wg_comm == "ALLREDUCE" and records[0].wg_bytes == 66816 * 4


def test_without_sequence_parallel_tensor_parallel_all_reduces() -> None:
    records = checked_records(small_job(sequence_parallel=False), SMALL_STAGES[1])
    size = 2 * 2 * 128 * 64
    layer = [r for r in records if r.name in ("attention_layer", "mlp_layer")]
    assert len(layer) == 2 * 2 * 2
    assert all(
        (r.fwd_comm, r.fwd_bytes, r.ig_comm, r.ig_bytes) == ("ALLREDUCE", size, "ALLREDUCE", size)
        for r in layer
    )
    final = next(r for r in records if r.name == "final_column")
    assert (final.fwd_comm, final.ig_comm, final.ig_bytes) == (NONE, "ALLREDUCE", size)
    assert stage_header(small_job(sequence_parallel=False)).pp_comm == size


def test_tp_1_has_no_tensor_parallel_collectives() -> None:
    job = small_job(tp=1, dp=4)
    records = checked_records(job, SMALL_STAGES[1])
    block = [r for r in records if not r.name.startswith(("grad", "optimizer"))]
    assert all(r.fwd_comm == NONE and r.ig_comm == NONE for r in block)


def test_rope_embedding_reduce_scatters() -> None:
    job = small_job()
    job = Context(job.dims, job.par, Settings(2, 2, 8, learned_positions=False), job.compute)
    embedding = next(
        r for r in checked_records(job, SMALL_STAGES[0]) if r.name == "embedding_layer"
    )
    assert (embedding.fwd_comm, embedding.ig_comm) == ("REDUCESCATTER", "ALLGATHER")


# ---------------------------------------------------------------------------------------------
# Uneven pipelines, virtual chunks, context parallelism, MoE, MTP.
# ---------------------------------------------------------------------------------------------


def test_uneven_pipeline_golden(golden: Callable[[str, str], None]) -> None:
    dims = ModelDims(5, 64, 4, 128, 256)
    job = Context(dims, Layout(tp=2, pp=2, dp=2, sequence_parallel=True), Settings(1, 2, 8))
    stage = StageInput(
        1, ((2, 3, 4),), False, True, buffers=(BufferInput(3 * LAYER_NUMEL + 8448, 2, 4),)
    )
    text = render_stage(job, stage)
    golden("workload_uneven_stage1.txt", text)
    records = parse_workload(text)[1]
    assert sum(r.name == "attention_column" for r in records) == 2 * 3  # the 3 layers given


def test_virtual_chunks_in_one_file() -> None:
    dims = ModelDims(8, 64, 4, 128, 256)
    job = Context(dims, Layout(tp=2, pp=2, vpp=2, dp=2, sequence_parallel=True), Settings(1, 4, 8))
    stage = StageInput(0, ((0, 1), (4, 5)), True, False, buffers=(BufferInput(1024, 2, 4),))
    header, records = parse_workload(render_stage(job, stage))
    assert header.vpp == 2
    assert sum(r.name == "attention_column" for r in records) == 4 * 4
    with pytest.raises(ConfigError, match="stage 0 has 1 chunks, the layout 2"):
        checked_records(job, StageInput(0, ((0, 1),), True, False))


def test_context_parallel_divides_the_sequence() -> None:
    job = small_job(cp=2, dp=1)
    records = checked_records(job, SMALL_STAGES[0])
    column = next(r for r in records if r.name == "attention_column")
    assert column.fwd_bytes == 2 * 2 * 64 * 64  # (s/c, b, h) at 2 bytes
    kv = next(r for r in records if r.name == "attention_cp")
    # K and V of the whole 128-token sequence, 2 of 4 heads (tp 2), 16 channels each, bf16;
    # dp 1: on SimAI's DP_EP group, all_gpus / (tp pp) / ep = cp ranks.
    assert (kv.fwd_comm, kv.fwd_bytes, kv.ig_comm) == (
        "ALLGATHER_DP_EP",
        2 * 2 * 2 * 128 * 2 * 16,
        "REDUCESCATTER_DP_EP",
    )
    kv2 = next(
        r
        for r in checked_records(small_job(cp=2, dp=2), SMALL_STAGES[0])
        if r.name == "attention_cp"
    )
    assert (kv2.fwd_comm, kv2.ig_comm) == ("ALLGATHER", "REDUCESCATTER")  # tp stands in
    row = next(r for r in records if r.name == "attention_row")
    assert row.fwd_bytes == column.fwd_bytes


MOE_DIMS = ModelDims(2, 64, 4, 128, 256, num_experts=4, moe_router_topk=2)


def test_moe_golden(golden: Callable[[str, str], None]) -> None:
    # dp 4: expert gradients reduce over 2 x 4 / (2 x 2) = 2 ranks (dp 2 would leave one rank)
    par = Layout(tp=2, pp=1, ep=2, dp=4, sequence_parallel=True)
    job = Context(MOE_DIMS, par, Settings(1, 2, 8), ComputeRate(100.0, 0.5))
    buffers = (BufferInput(13312, 2, 4), BufferInput(33024, 2, 4, expert=True))
    stage = StageInput(0, ((0, 1),), True, True, buffers=buffers)
    text = render_stage(job, stage)
    golden("workload_moe_stage0.txt", text)
    header, records = parse_workload(text)
    assert (header.ep, header.pp, header.pp_comm) == (2, 1, 0)
    moe = [r for r in records if r.name == "mlp_moelayer"]
    assert len(moe) == 2 * 2 * 5
    # This rank's 128/2 sequence-parallel tokens, each sent to 2 experts, 64 channels, bf16.
    dispatch = moe[1]
    assert (dispatch.fwd_comm, dispatch.fwd_bytes) == ("ALLTOALL_EP", 64 * 2 * 64 * 2)
    assert (moe[2].fwd_comm, moe[2].fwd_bytes) == ("ALLGATHER", 64 * 2 * 64 * 2 * 2)
    assert moe[4] == moe[1]  # combine mirrors dispatch
    expert_dp = [r for r in records if r.wg_comm.endswith("_DP_EP")]
    assert [r.wg_bytes for r in expert_dp] == [33024 * 2, 33024 * 4]


def test_moe_without_expert_parallel_has_no_all_to_all() -> None:
    par = Layout(tp=1, pp=1, ep=1, dp=2)
    job = Context(MOE_DIMS, par, Settings(1, 1, 2))
    records = checked_records(job, StageInput(0, ((0, 1),), True, True))
    assert not any(r.fwd_comm.startswith("ALLTOALL") for r in records)


def test_mtp_layers_on_the_last_stage() -> None:
    stage = StageInput(1, ((2, 3),), False, True, mtp_layers=1)
    records = checked_records(small_job(), stage)
    names = [r.name for r in records]
    assert names.count("mtp1_attention_column") == 2
    assert names.count("mtp1_cross_entropy1") == 2
    assert names.count("mtp1_eh_proj_column") == 2
    eh = records[names.index("mtp1_eh_proj_column")]
    assert eh.fwd_bytes == 2 * 2 * 2 * 128 * 64  # the concatenated (s, b, 2h) input


# ---------------------------------------------------------------------------------------------
# Compute times.
# ---------------------------------------------------------------------------------------------


def total_ns(records: list[Record]) -> int:
    return sum(r.fwd_compute + r.ig_compute + r.wg_compute for r in records)


def test_compute_time_is_megatron_flops_at_the_rate() -> None:
    job = small_job()
    records = checked_records(job, SMALL_STAGES[1])
    flops = stage_flops(SMALL_DIMS, (2, 3), 2, has_output_layer=True) / 2  # one micro-batch / tp
    expected = 2 * flops / (100.0 * 0.5 * 1e3)  # 2 micro-batches, ns at 100 TFLOP/s x 0.5
    assert total_ns(records) == pytest.approx(expected, abs=2 * 20)  # rounding per record


def test_forward_is_a_third() -> None:
    job = small_job()
    records = checked_records(job, SMALL_STAGES[1])
    row = next(r for r in records if r.name == "mlp_row")
    assert row.fwd_compute == row.ig_compute == row.wg_compute
    final = next(r for r in records if r.name == "final_column")
    assert final.fwd_compute == round(logit_flops(SMALL_DIMS, 2) / 2 / 3 / (100.0 * 0.5 * 1e3))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_adds_to_the_input_gradient(mode: str) -> None:
    base = checked_records(small_job(), SMALL_STAGES[0])
    job = small_job()
    job = Context(job.dims, job.par, Settings(2, 2, 8, recompute=mode), job.compute)
    records = checked_records(job, SMALL_STAGES[0])
    plain = next(r for r in base if r.name == "attention_column")
    again = next(r for r in records if r.name == "attention_column")
    flops = layer_flops(SMALL_DIMS, 0, 2)
    core = round(flops.core_attention / 2 / 3 / (100.0 * 0.5 * 1e3))
    extra = core if mode == "selective" else plain.fwd_compute
    assert again.ig_compute == plain.ig_compute + extra
    assert again.fwd_compute == plain.fwd_compute and again.wg_compute == plain.wg_compute


def _selective(job: Context, *modules: str) -> Context:
    settings = Settings(2, 2, 8, recompute="selective", recompute_modules=modules)
    return Context(job.dims, job.par, settings, job.compute)


def _by_name(records: list[Record]) -> dict[str, Record]:
    return {r.name: r for r in records}


def test_mlp_recomputation_adds_the_mlp_forward_only() -> None:
    """--recompute-modules mlp re-runs fc1 and fc2 (tests/test_time_ops.py records megatron's
    products): each MLP record's backward grows by its forward; attention, without core_attn,
    and layernorm, which re-runs no GEMM, add nothing."""
    plain = _by_name(checked_records(small_job(), SMALL_STAGES[0]))
    mlp = _by_name(checked_records(_selective(small_job(), "mlp", "layernorm"), SMALL_STAGES[0]))
    for name in ("mlp_column", "mlp_row"):
        assert mlp[name].fwd_compute > 0
        assert mlp[name].ig_compute == plain[name].ig_compute + plain[name].fwd_compute
        assert mlp[name].wg_compute == plain[name].wg_compute
    assert mlp["attention_column"] == plain["attention_column"]


SHARED_DIMS = ModelDims(2, 64, 4, 128, 256, num_experts=4, moe_router_topk=2,
                        moe_shared_expert_intermediate_size=128)  # fmt: skip


@pytest.mark.parametrize(("modules", "experts", "shared"),
                         [(("moe",), 1, 1), (("shared_experts",), 0, 1),
                          (("moe", "shared_experts"), 1, 2), (("mlp",), 0, 0)])  # fmt: skip
def test_moe_recomputation_repeats_the_experts_and_shared_experts(modules, experts, shared) -> None:
    """moe re-runs the whole MoE layer, shared experts included; shared_experts the shared MLP,
    once more inside a recomputed MoE layer (both: twice, as megatron's products show in
    tests/test_time_ops.py); mlp leaves an MoE layer alone."""
    base = Context(SHARED_DIMS, Layout(tp=1, pp=1, dp=2), Settings(2, 2, 8), ComputeRate(100.0, 0.5))
    stage = StageInput(0, ((0, 1),), True, True)
    plain, again = (checked_records(job, stage) for job in (base, _selective(base, *modules)))
    for before, after in zip(plain, again, strict=True):
        times = {"mlp_moelayer": experts, "shared_mlp_layer": shared}.get(before.name, 0)
        assert after.ig_compute == before.ig_compute + times * before.fwd_compute
    assert any(r.name == "shared_mlp_layer" and r.fwd_compute for r in plain)


PROFILE = """train_iter:10
Emb:
    time_gpu_avg: 799
layernorm:
    time_gpu_avg: 70
atten_qkv:
    time_gpu_avg: 889
atten_flash:
    time_gpu_avg: 512
atten_linear:
    time_gpu_avg: 349
layernorm2:
    time_gpu_avg: 71
mlp_linear_1:
    time_gpu_avg: 1408
mlp_gelu:
    time_gpu_avg: 257
mlp_linear_2:
    time_gpu_avg: 742
logit_time:
    time_gpu_avg: 12824
param_time:
    time_gpu_min: 16647
    time_gpu_avg: 17374
"""


def test_compute_profile_times() -> None:
    profile = ComputeProfile.from_sections(parse_compute_profile(PROFILE))
    assert profile == ComputeProfile(
        attention=(70 + 889 + 512 + 349) * 1000,
        mlp=(71 + 1408 + 257 + 742) * 1000,
        embedding=799_000,
        logits=12_824_000,
        optimizer=16_647_000 + 17_374_000,
        flash=512_000,
    )
    job = small_job()
    job = Context(job.dims, job.par, job.training, profile)
    records = {r.name: r for r in checked_records(job, SMALL_STAGES[0])}
    assert records["attention_column"].fwd_compute == profile.attention // 2  # AICB's halves
    assert records["mlp_row"].ig_compute == profile.mlp // 2
    assert records["embedding_layer"].fwd_compute == 799_000
    assert records["grad_param_compute"].ig_compute == profile.optimizer


def test_compute_profile_needs_layers() -> None:
    with pytest.raises(InputError, match="needs attention"):
        ComputeProfile.from_sections({"Emb": (1.0, 1.0)})


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------


def test_stage_outside_the_pipeline() -> None:
    with pytest.raises(ConfigError, match="--stage 2 is not a pipeline stage of --pp 2"):
        checked_records(small_job(), StageInput(2, ((0,),), False, False))


def test_layer_outside_the_model() -> None:
    with pytest.raises(ConfigError, match="stage 0 holds layers \\[4\\] outside --num-layers"):
        checked_records(small_job(), StageInput(0, ((3, 4),), False, False))


def test_pipeline_send_beyond_what_simai_reads() -> None:
    dims = ModelDims(2, 16384, 128, 131072, 256)
    job = Context(dims, Layout(pp=2), Settings(1, 1, 2))
    with pytest.raises(
        ConfigError,
        match=r"--micro-batch-size 1 x --seq-length 131072 x "
        r"--hidden-size 16384 x 2 bytes = 4294967296 bytes, is more than SimAI's ",
    ):
        render_stage(job, StageInput(0, ((0,),), True, False))


def test_bad_training_flags() -> None:
    with pytest.raises(ConfigError, match="--recompute-granularity"):
        Settings(1, 1, 1, recompute="some")
    with pytest.raises(ConfigError, match="micro_batch_size must be at least 1"):
        Settings(0, 1, 1)


def test_buffer_input_from_megatron_layout() -> None:
    import torch

    from inspector.world.shards import BufferLayout

    layout = BufferLayout(True, torch.bfloat16, torch.float32, 2, 256, 200, (), (100, 100))
    assert BufferInput.from_layout(layout) == BufferInput(256, 2, 4, expert=True)
