"""megatron-core's MoE all-to-all overlap (`--overlap-moe-expert-parallel-comm`, with
`--delay-wgrad-compute`): which jobs megatron accepts, and the extra micro-batch it schedules.

With the flag, megatron-core's schedules run the forward of one micro-batch and the backward of
another together, layer by layer, so that each one's expert all-to-all hides behind the other's
compute (models/common/model_chunk_schedule_plan.py, pipeline_parallel/combined_1f1b.py). To keep
the two independent in every 1F1B step, the interleaved schedule runs one more warm-up forward
(pipeline_parallel/schedules.py `get_pp_rank_microbatches`: "we schedule one extra micro-batch
forward step before the 1f1b stages"), and without a pipeline the combined schedule runs the
first forward alone, then each forward with the previous micro-batch's backward
(`combined_1f1b_schedule_for_no_pipelining`): one micro-batch more in flight either way. Each
1F1B step then runs the two passes together, layer by layer: memory/engine/schedule.py `combined`.
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError


def extra_warmup(training: Any) -> int:
    """Return the forwards megatron adds to the warm-up under the overlap: 1 with it, else 0."""
    return 1 if training.ep_overlap else 0


def check_ep_overlap(model: Any, layout: Any, training: Any) -> None:
    """Raise ConfigError where megatron-core 0.16's TransformerConfig.__post_init__ (and
    Megatron-LM's validate_args) refuse the overlap or the delayed weight gradients."""
    if training.delay_wgrad and not training.ep_overlap:
        raise ConfigError(
            "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core: "
            "'overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute')"
        )
    if training.delay_wgrad and model.transformer_impl != "transformer_engine":
        raise ConfigError(
            "--delay-wgrad-compute needs --transformer-impl transformer_engine (Megatron-LM's "
            "validate_args: 'Delaying wgrad compute is only supported with transformer_engine "
            "implementation')"
        )
    if not training.ep_overlap:
        return
    flag = "--overlap-moe-expert-parallel-comm"
    rules = (
        (layout.pp > 1 and layout.vpp is None,
         f"with --pp {layout.pp} needs a virtual pipeline (--num-virtual-stages-per-pipeline-rank): "
         "'virtual_pipeline_model_parallel_size must be specified when "
         "pipeline_model_parallel_size > 1'"),
        (layout.ep <= 1, "needs expert parallelism (--expert-model-parallel-size above 1)"),
        (training.moe_token_dispatcher_type not in ("alltoall", "flex"),
         f"needs --moe-token-dispatcher-type alltoall or flex, not "
         f"{training.moe_token_dispatcher_type}"),
        (training.recompute == "full", "does not run with --recompute-granularity full"),
        (not (model.bf16 or model.fp16), "needs --bf16 or --fp16"),
        ((model.mtp_num_layers or 0) > 1,
         f"runs with at most 1 MTP layer, not --mtp-num-layers {model.mtp_num_layers}"),
        (model.mtp_num_layers == 1 and layout.pp == 1,
         "with an MTP layer needs --pipeline-model-parallel-size above 1"),
    )  # fmt: skip
    for broken, why in rules:
        if broken:
            raise ConfigError(f"{flag} {why} (megatron-core's TransformerConfig)")
