"""megatron-core's flex token dispatcher (`--moe-token-dispatcher-type flex`): which jobs it accepts.

MoEFlexTokenDispatcher (transformer/moe/token_dispatcher.py) exchanges tokens over one group of
expert-tensor-parallel x expert-parallel ranks with DeepEP's fused kernels (the `deepep`
backend, `--moe-flex-dispatcher-backend`, or `--moe-enable-deepep` in Megatron-LM before 0.14) or
HybridEP's. DeepEP's `Buffer.get_dispatch_config` knows only some group sizes (deep_ep/buffer.py).
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError

# deep_ep/buffer.py `Buffer.get_dispatch_config` / `get_combine_config`: the group sizes they hold
DEEPEP_GROUP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


def flex_group_size(layout: Any) -> int:
    """The flex dispatcher's group: expert tensor parallel x expert parallel ranks
    (token_dispatcher.py MoEFlexTokenDispatcher: `tp_ep_group`, `tp_size * ep_size`)."""
    return int(layout.expert_tp * layout.ep)


def check_flex(model: Any, layout: Any, training: Any) -> None:
    """Raise ConfigError where megatron-core (0.13-0.16) or DeepEP refuse the flex dispatcher."""
    if training.moe_token_dispatcher_type != "flex":
        if training.moe_enable_deepep:
            raise ConfigError(
                "--moe-enable-deepep needs --moe-token-dispatcher-type flex (megatron-core's "
                "TransformerConfig: 'DeepEP backend is only supported with flex token dispatcher.')"
            )
        return
    if model.num_experts is None:
        return  # megatron builds no dispatcher without experts
    if training.moe_enable_deepep and training.moe_flex_backend == "hybridep":
        raise ConfigError(
            "--moe-enable-deepep with --moe-flex-dispatcher-backend hybridep: megatron-core's "
            "TransformerConfig: 'Only one backend is supported for flex token dispatcher.'"
        )
    size = flex_group_size(layout)
    if size <= 1:
        raise ConfigError(
            f"--moe-token-dispatcher-type flex needs expert parallelism: --etp {layout.expert_tp} x "
            f"--ep {layout.ep} = 1 (megatron-core's MoEFlexTokenDispatcher: 'Flex token "
            "dispatcher requires TPxEP > 1')"
        )
    if training.moe_pad_expert_input_to_capacity and training.moe_flex_backend == "deepep":
        raise ConfigError(
            "--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's DeepEP "
            "backend (megatron-core's TransformerConfig: 'Flex token dispatcher with deepep "
            "backend does not support moe_pad_expert_input_to_capacity')"
        )
    if training.moe_flex_backend == "deepep" and size not in DEEPEP_GROUP_SIZES:
        raise ConfigError(
            f"--moe-token-dispatcher-type flex: DeepEP has no configuration for --etp "
            f"{layout.expert_tp} x --ep {layout.ep} = {size} ranks (deep_ep Buffer.get_dispatch_config "
            f"knows {', '.join(map(str, DEEPEP_GROUP_SIZES))})"
        )
    if training.moe_deepep_num_sms % 2:
        raise ConfigError(
            f"--moe-deepep-num-sms {training.moe_deepep_num_sms} must be even (DeepEP's "
            "Buffer.set_num_sms: 'The SM count must be even')"
        )
