"""Render a job's SimAI workloads: one file per pipeline stage and an index (notes/simai.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from inspector.report.workload import render_stage
from inspector.report.workload_index import file_name, render_index
from inspector.report.workload_inputs import Context, StageInput

INDEX = "index.csv"


def workload_files(context: Context, stages: Sequence[StageInput]) -> dict[str, str]:
    """Return file name -> text: each stage's workload and the index naming them."""
    files = {file_name(stage.stage): render_stage(context, stage) for stage in stages}
    files[INDEX] = render_index(context, list(stages))
    return files


def workload_notes(args: Mapping[str, Any]) -> list[str]:
    """Return the notes (stderr lines) on what SimAI runs differently from the job megatron runs."""
    notes = []
    if args.get("overlap_moe_expert_parallel_comm"):
        notes.append(
            "Note: SimAI runs a layer's records one after another: the all-to-alls that "
            "--overlap-moe-expert-parallel-comm hides behind another micro-batch's compute are "
            "written as they are sent, not overlapped (`plan` prices the overlap)\n"
        )
    tp, cp = args.get("tensor_model_parallel_size") or 1, args.get("context_parallel_size") or 1
    if cp > 1 and tp != cp:
        notes.append(
            f"Note: SimAI-Analytical times the context-parallel K/V exchange (attention_cp) over "
            f"its tensor-parallel group, {tp} ranks, where megatron's context-parallel group has "
            f"{cp} (SimAI has no context-parallel group; docs/simai.md)\n"
        )
    if args.get("use_megatron_fsdp") or args.get("use_torch_fsdp2"):
        which = "Megatron-FSDP" if args.get("use_megatron_fsdp") else "FSDP2"
        notes.append(
            f"Note: SimAI runs {which}'s parameter all-gathers and gradient reduce-scatters "
            "in the weight-gradient column, adds them up and overlaps none of them: megatron "
            "prefetches the next unit's all-gather behind the current unit's compute and "
            "reduce-scatters behind the backward (docs/simai.md)\n"
        )
    notes += _moe_notes(args, tp)
    if args.get("fp8_format") and tp > 1 and args.get("sequence_parallel"):
        notes.append(
            "Note: the tensor-parallel all-gathers are written at 2 bytes per element, as for a "
            "bf16 job: Transformer Engine's fp8 linears gather their inputs in fp8, 1 byte "
            "(SimAI's format has no dtype; the files equal the bf16 job's)\n"
        )
    if args.get("moe_token_dispatcher_type") == "flex":
        notes.append(
            "Note: SimAI has no collective that sends a token once per node and forwards it "
            "over NVLink (DeepEP's and HybridEP's kernels): the flex dispatcher's exchanges are "
            "written as ALLTOALL_EP of the bytes it moves, each token once per rank holding one "
            "of its experts (`plan` prices the per-node forwarding)\n"
        )
    return notes


def _moe_notes(args: Mapping[str, Any], tp: int) -> list[str]:
    """Return the notes on an MoE job's exchanges that SimAI's format cannot express."""
    if not args.get("num_experts"):
        return []
    notes = []
    if (args.get("moe_token_dispatcher_type") or "allgather") == "allgather":
        notes.append(
            "Note: megatron's allgather dispatcher (Megatron-LM's default "
            "--moe-token-dispatcher-type) all-gathers every token over the tensor x "
            "expert-parallel ranks and reduce-scatters the experts' output, a group SimAI does "
            "not have: the expert exchange is written as the alltoall dispatcher's ALLTOALL_EP "
            "records (the files equal the alltoall job's)\n"
        )
    ep = args.get("expert_model_parallel_size") or 1
    etp = args.get("expert_tensor_parallel_size") or tp
    if ep > 1 and etp == 1 < tp:
        notes.append(
            f"Note: SimAI forms each expert-parallel group from the same position in {ep} "
            f"consecutive tensor-parallel groups (astra-sim MockNcclGroup.cc, init EP): ranks "
            f"{tp} apart, spanning {ep * tp} GPUs, where megatron's at "
            f"--expert-tensor-parallel-size 1 are {ep} consecutive ranks; SimAI times the "
            "all-to-all over links megatron's does not cross\n"
        )
    return notes
