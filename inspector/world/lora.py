"""Megatron-Bridge's LoRA, a small stand-in applied to megatron's real model (job/lora.py).

Megatron-Bridge is not installed here; this mirrors what its `peft` does to a built model chunk
(NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/peft/, the checkout at /work/bridge), before
Float16Module and megatron's DDP wrap it (models/model_provider.py 654-690: the pre-wrap hook):

- `PEFT.__call__` (base.py 115-120): freeze every parameter (`freeze_model`, 187-193:
  requires_grad False), then wrap each target (`LoRA.transform`, lora.py 176-261), then
  `maybe_enable_recompute_inputs_grad` (recompute.py 43-118).
- the wrapper, `LoRALinear` (lora_layers.py 27-88): the base linear runs as before, its
  (layer-norm) output goes through the adapter, whose output is added to the base's.
- the adapter, `ParallelLinearAdapter` (peft/utils.py 923-1279): linear_in and linear_out are
  megatron's own ColumnParallelLinear / RowParallelLinear, built with the model's config while
  its sequence_parallel is off (1018-1019), cast to bf16/fp16 with the model (1067-1071).
- the base's attributes, `get_adapter_attributes_from_linear` (peft/utils.py 549-679).

Parameters, buffers, optimizer state and what each kernel saves then come from megatron's own
code: its DDP lays out only parameters that require a gradient (distributed_data_parallel.py
`if not param.requires_grad: continue`), its optimizer takes only those (optimizer/__init__.py).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from inspector.world.config import _no_values


class ParallelLinearAdapter(torch.nn.Module):
    """Bridge's ParallelLinearAdapter (peft/utils.py 923-1106, forward 1208-1279) with
    activation identity, dropout 0, no expert or all-to-all path (what the recipes build)."""

    def __init__(self, in_features: int, out_features: int, dim: int, alpha: float,
                 input_is_parallel: bool, config: Any, disable_sp_comm: bool,
                 split_swiglu: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.split_swiglu = split_swiglu
        self.dim, self.alpha, self.input_is_parallel = dim, alpha, input_is_parallel
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # 1018: "SP is irrelevant for the lora linear layer"
        # the initial values are the meta device's (none): Bridge's xavier/zero init (1184-1206)
        if input_is_parallel:  # 1025-1035
            self.linear_in: Any = RowParallelLinear(
                in_features, dim, config=config, input_is_parallel=True, skip_bias_add=True,
                bias=False, init_method=_no_values, is_expert=False,
            )
        else:  # 1036-1046
            self.linear_in = ColumnParallelLinear(
                in_features, dim, config=config, bias=False, gather_output=True,
                init_method=_no_values, disable_grad_reduce=sequence_parallel, is_expert=False,
            )
        # 1048-1061: gather_output True after a row-parallel linear_in (a1a off, base parallel)
        self.linear_out = ColumnParallelLinear(
            dim, out_features, config=config, bias=False, gather_output=input_is_parallel,
            init_method=_no_values, is_expert=False,
        )
        if config.bf16:  # 1067-1071: "cast all parameters when using amp O2 training"
            self.bfloat16()
        elif config.fp16:
            self.half()
        config.sequence_parallel = sequence_parallel  # 1078
        # 1079-1085
        self.disable_sequence_parallel_comm = disable_sp_comm or not sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Bridge's forward (1208-1279): gather before a column-parallel linear_in, scatter after a
        row-parallel one (under sequence parallelism), then scale by alpha / dim."""
        if not self.disable_sequence_parallel_comm and not self.input_is_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(x)
        x, _ = self.linear_in(x)
        x, _ = self.linear_out(x)
        if not self.disable_sequence_parallel_comm and self.input_is_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        return x * (self.alpha / self.dim)


    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Any = None) -> dict[str, Any]:  # fmt: skip
        """Bridge's checkpoint map (peft/utils.py 1513-1606): linear_in and linear_out as
        megatron maps them, a SwiGLU fc1's linear_out split in its two halves (1560-1563)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        state = self.linear_in.sharded_state_dict(f"{prefix}linear_in.", sharded_offsets, metadata)
        out = self.linear_out.sharded_state_dict(f"{prefix}linear_out.", sharded_offsets, metadata)
        if self.split_swiglu:
            key = f"{prefix}linear_out.weight"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets)
        return {**state, **out}


class LoRALinear(torch.nn.Module):
    """Bridge's LoRALinear (lora_layers.py 27-88, AdapterWrapper adapter_wrapper.py 121-197):
    `to_wrap` the base linear, `adapter` its ParallelLinearAdapter."""

    def __init__(self, to_wrap: Any, adapter: ParallelLinearAdapter) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The base's output plus the adapter's of the base's (layer-norm) output (lora_layers.py
        64-88, base_linear_forward adapter_wrapper.py 171-197)."""
        out = self.to_wrap(x, *args, **kwargs)
        bias, ln_out = None, x
        if len(out) == 2:
            out, bias = out
            if isinstance(out, tuple) and len(out) == 2:
                out, ln_out = out
        elif len(out) == 3:
            out, bias, ln_out = out
        adapter_out = self.adapter(ln_out.contiguous()).reshape(out.shape)
        return out + adapter_out, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Any = None) -> dict[str, Any]:  # fmt: skip
        """The base's map at the wrapper's prefix, the adapter's under `adapter.`
        (adapter_wrapper.py 232-276)."""
        state = dict(self.to_wrap.sharded_state_dict(prefix, sharded_offsets, metadata))
        state.update(self.adapter.sharded_state_dict(f"{prefix}adapter.", sharded_offsets, metadata))
        return state


def _attributes(module: Any, tp: int) -> tuple[bool, int, int, bool]:
    """Return (input_is_parallel, in_features, out_features, disable_sp_comm) of a base linear as
    `get_adapter_attributes_from_linear` finds them (peft/utils.py 549-679), setting what it sets
    on TELayerNormColumnParallelLinear (620-643)."""
    from megatron.core.extensions import transformer_engine as te

    disable_sp = not module.config.sequence_parallel  # 575
    if isinstance(module, (te.TEColumnParallelLinear, te.TELayerNormColumnParallelLinear)):
        if isinstance(module, te.TELayerNormColumnParallelLinear):
            module.return_layernorm_output = True  # "layernorm output must be returned"
            overlap = getattr(module, "ub_overlap_ag_fprop", False)
            if module.config.sequence_parallel and not overlap:
                module.return_layernorm_output_gathered = True
                # TE 1.5+: TE gathers it, unless the tp overlap is on for qkv (632-643)
                if not module.config.tp_comm_overlap or getattr(
                        module.config, "tp_comm_overlap_disable_qkv", False):  # fmt: skip
                    disable_sp = True
        return False, module.in_features, module.out_features * tp, disable_sp
    if isinstance(module, te.TERowParallelLinear):  # 644-647
        return True, module.in_features * tp, module.out_features, disable_sp
    if isinstance(module, ColumnParallelLinear):  # 653-656
        return False, module.input_size, module.output_size, disable_sp
    if isinstance(module, RowParallelLinear):  # 657-660
        return True, module.input_size, module.output_size, disable_sp
    raise NotImplementedError(f"Layer type is unrecognized for LoRA: {type(module)}")


def apply_lora(model: Any, rank: int, targets: tuple[str, ...]) -> Any:
    """Freeze `model` and wrap its target linears in adapters of `rank` (on meta), as Bridge's
    PEFT.__call__ does (base.py 115-120); alpha = dim (LoRA's scale, the same tensors)."""
    with torch.device("meta"):
        return _apply(model, rank, targets, model.config.tensor_model_parallel_size)


def _apply(model: Any, rank: int, targets: tuple[str, ...], tp: int) -> Any:
    for param in model.parameters():
        param.requires_grad = False  # freeze_model, base.py 187-193
    for parent in list(model.modules()):
        if isinstance(parent, LoRALinear):
            continue
        for name, child in list(parent.named_children()):
            if name not in targets or isinstance(child, LoRALinear):
                continue
            input_parallel, in_features, out_features, disable_sp = _attributes(child, tp)
            swiglu = name == "linear_fc1" and bool(child.config.gated_linear_unit)
            adapter = ParallelLinearAdapter(in_features, out_features, rank, float(rank),
                                            input_parallel, child.config, disable_sp, swiglu)  # fmt: skip
            setattr(parent, name, LoRALinear(child, adapter))
    _recompute_inputs_grad(model)
    return model


def _recompute_inputs_grad(model: Any) -> None:
    """Bridge's `maybe_enable_recompute_inputs_grad` (recompute.py 43-118): with a recompute
    method and only adapters trainable, the TransformerBlock's input is made to require grad, so
    megatron's CheckpointFunction runs its backward."""
    from functools import wraps

    from megatron.core.transformer.transformer_block import TransformerBlock

    if getattr(model.config, "recompute_method", None) is None:
        return
    for module in model.modules():
        if not isinstance(module, TransformerBlock):
            continue
        original: Any = module.forward

        @wraps(original)
        def forward(hidden_states: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if torch.is_tensor(hidden_states) and not hidden_states.requires_grad and \
                    hidden_states.is_floating_point():  # fmt: skip
                hidden_states = hidden_states.detach().requires_grad_(True)
            return _original(hidden_states, *args, **kwargs)

        module.forward = forward
