"""A stage's parameters under megatron's Muon, with their owners (muon.py builds it): what the
params table's owners and each rank's optimizer bytes in `memory` read."""

from __future__ import annotations

from inspector.job.job import Job
from inspector.memory.engine.muon import (
    MuonParam,
    build_muon,
    inner,
    layer_wise_part,
    model_params,
    muon_params,
    muon_taken,
)
from inspector.memory.engine.optimizer import optimizer_config, optimizer_world


def stage_muon(job: Job, stage: int) -> tuple[MuonParam, ...]:
    """Build `stage` (expert-parallel rank 0) in DDP as the engine does and return its Muon
    parameters with their owners."""
    from inspector.memory.engine.microbatch import MEGATRON_ERRORS, megatron_failed
    from inspector.memory.engine.runtime import runtime_config
    from inspector.memory.engine.stage import _ddp as ddp_wrapped
    from inspector.memory.engine.stage import moe_build
    from inspector.world.stage import stage_world

    world = stage_world(job.model, job.layout, stage, checkpoint=False, runtime=runtime_config(job))
    with moe_build(job), world as chunks:
        ddps = [ddp_wrapped(job, chunk.module, stage, index) for index, chunk in enumerate(chunks)]
        try:
            with optimizer_world(job, job.dims().fused_kernels), muon_taken() as taken:
                optimizer = build_muon(job, ddps, optimizer_config(job))
            if layer_wise_part(optimizer) is None:  # not layer-wise: every part whole
                taken = {id(p) for part in optimizer.chained_optimizers
                         if type(inner(part)).__name__ == "TensorParallelMuon"
                         for p in model_params(part)}  # fmt: skip
            return muon_params(job, ddps, optimizer, taken)
        except MEGATRON_ERRORS as exc:
            raise megatron_failed(f"megatron's Muon on stage {stage}", exc) from exc
