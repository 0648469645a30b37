"""The MoE experts' delayed weight gradients (--delay-wgrad-compute with the op fuser), run when
megatron-core's combined 1F1B step runs them.

With `--delay-wgrad-compute`, TE's op fuser GroupedLinears keep their weight-gradient GEMMs'
operands from the experts' backward (world/te/ops.py `wgrad_store`) until megatron-core 0.19's
TEGroupedMLP.backward_dw (transformer/moe/experts.py) runs and frees them. The combined step
(models/common/model_chunk_schedule_plan.py `TransformerLayerSchedulePlan.run`) calls it through
MoELayer.backward_dw(routed_experts=True) right after the layer's MLP backward and before its
dispatch backward: here megatron's own TEGroupedMLP.backward_dw is called as soon as the experts'
input gradient exists, the same point of the backward, on every layer whose experts take the
fused path (the others' TE modules compute their weight gradients in the backward itself).

The engine builds megatron's TransformerConfig without the all-to-all overlap (stage.py: its small
chunks have no virtual pipeline, which megatron's config would then demand), so without
`delay_wgrad_compute` either; the experts' `delay_wgrad_compute`, which megatron-core's
TEGroupedLinear.__init__ takes from it (extensions/transformer_engine.py 2148-2151) and
_make_fused_ops hands to TE's ops on the first forward (experts.py 457-472), is set here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def _delays(module: Any) -> bool:
    """Whether `module` is megatron's TEGroupedMLP on the op fuser (experts.py `_with_fused_impl`),
    given delayed weight gradients before its TE ops are built (on its first forward)."""
    if not getattr(module, "_with_fused_impl", False):
        return False
    if module._fused_ops is None:
        module.linear_fc1.delay_wgrad_compute = module.linear_fc2.delay_wgrad_compute = True
    return bool(module.linear_fc1.delay_wgrad_compute)


@contextlib.contextmanager
def delayed_wgrad(gpt: Any, delay: bool) -> Iterator[None]:
    """With `delay` (--delay-wgrad-compute), call each fused-experts module's `backward_dw` once
    its input's gradient is computed."""
    handles = []

    def after_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        x = args[0] if args else kwargs["permuted_local_hidden_states"]
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(lambda grad: module.backward_dw())

    for module in gpt.modules() if delay else ():
        if _delays(module):
            handles.append(module.register_forward_hook(after_forward, with_kwargs=True))
    try:
        yield
        if handles:
            _check_emptied(gpt)
    finally:
        for handle in handles:
            handle.remove()


def _check_emptied(gpt: Any) -> None:
    """Stop where a micro-batch ends with weight-gradient operands still kept: megatron would run
    them at its backward_dw, which then was never reached here."""
    for name, module in gpt.named_modules():
        for op in (module._fused_ops[0].children() if getattr(module, "_fused_ops", None) else ()):
            store = getattr(op, "wgrad_store", None)
            if store is not None and store.context:
                raise RuntimeError(f"{name}: the experts' delayed weight gradients were kept past "
                                   "the micro-batch (TEGroupedMLP.backward_dw never ran)")  # fmt: skip
