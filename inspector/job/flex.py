"""megatron-core's flex token dispatcher (`--moe-token-dispatcher-type flex`): which jobs it accepts,
by the installed megatron-core's rules. The one home of them: a Job checks itself here
(`check_flex`), and `plan` checks its arguments here before the search (`flex_backend`,
`check_flex_group`), so the same input gets the same message from every command.

MoEFlexTokenDispatcher (transformer/moe/token_dispatcher.py) exchanges tokens over one group of
expert-tensor-parallel x expert-parallel ranks with DeepEP's fused kernels (the `deepep`
backend, `--moe-flex-dispatcher-backend`, or `--moe-enable-deepep` in Megatron-LM before 0.16) or
HybridEP's. DeepEP's `Buffer.get_dispatch_config` knows only some group sizes (deep_ep/buffer.py);
HybridEP's own refusals and buffers live in job/hybrid_ep.py, which `check_flex` and
`check_flex_group` call for that backend.

Where the versions differ (megatron-core core_v0.13.1, core_v0.14.0, core_v0.15.3 against
core_v0.16.0-0.16.1): before 0.16 TransformerConfig has no `moe_flex_dispatcher_backend` (nor
Megatron-LM the flag) and the dispatcher runs DeepEP only, asserting `moe_enable_deepep`; its
refusal of padding to capacity names no backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inspector.errors import ConfigError
from inspector.job.hybrid_ep import check_hybridep, check_hybridep_group
from inspector.job.versions import FLEX_BACKEND_SINCE as BACKEND_SINCE
from inspector.job.versions import HYBRIDEP_ONE_RANK_SINCE, megatron_version

DEFAULT_BACKEND = "deepep"  # TransformerConfig.moe_flex_dispatcher_backend's default (0.16)
# deep_ep/buffer.py `Buffer.get_dispatch_config` / `get_combine_config`: the group sizes they hold
DEEPEP_GROUP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
# TransformerConfig.__post_init__'s refusal of padding to capacity, by version
PAD_REFUSED = {True: "Flex token dispatcher with deepep backend does not support "
                     "moe_pad_expert_input_to_capacity",  # 0.16
               False: "Flex token dispatcher does not support moe_pad_expert_input_to_capacity"}  # fmt: skip


def flex_group_size(layout: Any) -> int:
    """The flex dispatcher's group: expert tensor parallel x expert parallel ranks
    (token_dispatcher.py MoEFlexTokenDispatcher: `tp_ep_group`, `tp_size * ep_size`)."""
    return int(layout.expert_tp * layout.ep)


def flex_backend(args: Mapping[str, Any], version: tuple[int, int] | None = None) -> str | None:
    """Return the backend the flex dispatcher runs (None: another dispatcher), raising megatron's
    refusals of Megatron-LM's arguments `args` as `Error:` lines (`version`: the installed one).

    megatron-core 0.16.1 transformer_config.py `__post_init__` (the `moe_enable_deepep` and flex
    blocks); 0.13.1-0.15.3 the same blocks and MoEFlexTokenDispatcher.__init__'s assert, which
    runs only where megatron builds a dispatcher (an MoE model, `num_experts`).
    """
    version = version or megatron_version()
    dispatcher = args.get("moe_token_dispatcher_type") or "allgather"
    backend, deepep = args.get("moe_flex_dispatcher_backend"), bool(args.get("moe_enable_deepep"))
    dotted, new = f"{version[0]}.{version[1]}", version >= BACKEND_SINCE
    if deepep and dispatcher != "flex":
        raise ConfigError(f"--moe-enable-deepep needs --moe-token-dispatcher-type flex, not "
                          f"{dispatcher} (megatron-core's TransformerConfig: 'DeepEP backend is "
                          "only supported with flex token dispatcher.')")  # fmt: skip
    if backend is not None and not new:
        raise ConfigError(f"--moe-flex-dispatcher-backend is not an argument of Megatron-LM "
                          f"{dotted} (the installed megatron-core; added in 0.16): its flex "
                          "dispatcher runs DeepEP, with --moe-enable-deepep")  # fmt: skip
    if dispatcher != "flex":
        return None
    if not new and not deepep and args.get("num_experts") is not None:
        raise ConfigError(f"--moe-token-dispatcher-type flex needs --moe-enable-deepep in "
                          f"megatron-core {dotted} (MoEFlexTokenDispatcher: 'DeepEP is not "
                          "enabled. Please set --moe-enable-deepep to use DeepEP backend.')")  # fmt: skip
    if deepep and backend == "hybridep":
        raise ConfigError("--moe-enable-deepep with --moe-flex-dispatcher-backend hybridep: "
                          "megatron-core's TransformerConfig allows one ('Only one backend is "
                          "supported for flex token dispatcher.')")  # fmt: skip
    chosen = "deepep" if deepep else backend or DEFAULT_BACKEND
    if args.get("moe_pad_expert_input_to_capacity") and chosen == "deepep":
        raise ConfigError("--moe-pad-expert-input-to-capacity does not run with the flex "
                          "dispatcher's DeepEP backend (megatron-core's TransformerConfig: "
                          f"'{PAD_REFUSED[new]}')")  # fmt: skip
    return chosen


def one_rank_refused(backend: str) -> bool:
    """Return whether MoEFlexTokenDispatcher refuses a group of one rank with this backend: every
    backend before 0.17 ('Flex token dispatcher requires TPxEP > 1', 0.13-0.16), DeepEP only
    from 0.17 ('DeepEP dispatcher requires TPxEP > 1'; HybridEP runs on one rank)."""
    return backend != "hybridep" or megatron_version() < HYBRIDEP_ONE_RANK_SINCE


def check_flex_group(ep: int, expert_tp: int, backend: str) -> None:
    """Raise ConfigError where the flex dispatcher cannot run over expert_tp x ep ranks: one rank
    (`one_rank_refused`), a group size DeepEP has no configuration for, or one HybridEP cannot
    lay over nodes."""
    size = expert_tp * ep
    if size <= 1 and one_rank_refused(backend):
        raise ConfigError(
            "--moe-token-dispatcher-type flex needs expert parallelism: "
            f"--expert-tensor-parallel-size {expert_tp} x --ep {ep} = {size} "
            "(megatron-core's MoEFlexTokenDispatcher: 'Flex token dispatcher requires TPxEP > 1')"
        )
    if backend == "deepep" and size not in DEEPEP_GROUP_SIZES:
        raise ConfigError(
            "--moe-token-dispatcher-type flex: DeepEP has no configuration for "
            f"--expert-tensor-parallel-size {expert_tp} x --ep {ep} = {size} ranks "
            f"(deep_ep Buffer.get_dispatch_config knows {', '.join(map(str, DEEPEP_GROUP_SIZES))})"
        )
    if backend == "hybridep":
        check_hybridep_group(ep, expert_tp)


def job_arguments(model: Any, training: Any, version: tuple[int, int] | None = None) -> dict[str, Any]:
    """Return a Job's flex settings as the Megatron-LM arguments `flex_backend` reads.

    A Training always holds a backend (megatron-core's default, deepep, where none was given):
    before 0.16, where no backend can be named and DeepEP is the only one, deepep stands for none.
    """
    backend: str | None = training.moe_flex_backend
    if (version or megatron_version()) < BACKEND_SINCE and backend == DEFAULT_BACKEND:
        backend = None
    return {"moe_token_dispatcher_type": training.moe_token_dispatcher_type,
            "moe_flex_dispatcher_backend": backend, "moe_enable_deepep": training.moe_enable_deepep,
            "moe_pad_expert_input_to_capacity": training.moe_pad_expert_input_to_capacity,
            "num_experts": model.num_experts}  # fmt: skip


def check_flex(model: Any, layout: Any, training: Any, version: tuple[int, int] | None = None) -> None:
    """Raise ConfigError where megatron-core (0.13-0.16), DeepEP or HybridEP (job/hybrid_ep.py)
    refuse the job's flex dispatcher."""
    backend = flex_backend(job_arguments(model, training, version), version)
    if backend is None or model.num_experts is None:
        return  # megatron builds no dispatcher without experts
    check_flex_group(layout.ep, layout.expert_tp, backend)
    if backend == "hybridep":
        check_hybridep(model, layout, training.micro_batch_size)
    if training.moe_deepep_num_sms % 2:
        raise ConfigError(
            f"--moe-deepep-num-sms {training.moe_deepep_num_sms} must be even (DeepEP's "
            "Buffer.set_num_sms: 'The SM count must be even')"
        )


def runs_deepep(training: Any) -> bool:
    """Return whether a checked job's flex dispatcher runs DeepEP (before 0.16 the only backend)."""
    return training.moe_token_dispatcher_type == "flex" and (
        training.moe_enable_deepep or training.moe_flex_backend == "deepep"
        or megatron_version() < BACKEND_SINCE)  # fmt: skip


def runs_hybridep(training: Any) -> bool:
    """Return whether a checked job's flex dispatcher runs HybridEP (megatron-core 0.16+)."""
    return training.moe_token_dispatcher_type == "flex" and not runs_deepep(training)


def row_padding(training: Any) -> str:
    """Return who pads fp8 experts' rows to the alignment, "" for Transformer Engine's Fp8Padding
    (ModelDims.moe_row_padding): HybridEP's dispatch under fp8 always (token_dispatcher.py
    _HybridEPManager: `pad_multiple` whenever config.fp8); with --moe-router-padding-for-fp8 the
    all-to-all's sender or DeepEP's receiver."""
    if runs_hybridep(training):
        return "destination"
    if training.moe_router_padding:
        return "destination" if training.moe_token_dispatcher_type == "flex" else "source"
    return ""
