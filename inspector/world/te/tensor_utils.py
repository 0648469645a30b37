"""TE's `pytorch/tensor/utils.py`: the functions megatron's DDP and DistributedOptimizer call on
quantized weights, dispatched to the weight's class as TE dispatches them.

`replace_raw_data` (v2.11 25-50, v2.14 27-72), `cast_master_weights_to_fp8` (v2.11 54-155),
`quantize_master_weights` (v2.14 74-227: what megatron-core 0.17+ casts NVFP4 weights with) and
`post_all_gather_processing` (v2.11 602-624, v2.14 981-1016). Float8Tensor: float8_tensor.py;
Float8BlockwiseQTensor: blockwise_tensor.py; NVFP4Tensor (TE 2.14 only): nvfp4_tensor.py.
"""

from __future__ import annotations

from typing import Any

import torch

from inspector.world.te import blockwise_tensor, float8_tensor, nvfp4_tensor
from inspector.world.te.blockwise_tensor import Float8BlockwiseQTensor
from inspector.world.te.nvfp4_tensor import NVFP4Tensor


def replace_raw_data(tensor: Any, new_raw_data: torch.Tensor) -> None:
    """Point a quantized weight's row-wise data at `new_raw_data` (after copying): a
    Float8Tensor's `_data`, a Float8BlockwiseQTensor's `_rowwise_data` (v2.11 42-47), and from
    TE 2.14 an NVFP4Tensor's packed bytes (58-66); TE refuses any other."""
    if isinstance(tensor, Float8BlockwiseQTensor) or (
            isinstance(tensor, NVFP4Tensor) and nvfp4_tensor.helpers()):  # fmt: skip
        old = tensor._rowwise_data
        if old is None or old.dtype != new_raw_data.dtype:
            raise ValueError("The data types of raw data don't match")
        new_raw_data.detach().copy_(old)
        tensor._rowwise_data = new_raw_data
        return
    float8_tensor.replace_raw_data(tensor, new_raw_data)


def cast_master_weights_to_fp8(
    model_weights: list[Any], master_weights: list[Any], start_offsets: list[Any], group: Any,
    fsdp_shard_model_weights: Any = None, manual_post_all_gather_processing: bool = False,
) -> None:  # fmt: skip
    """Cast each rank's fp32 main shard into its fp8 weights: Float8Tensors in float8_tensor.py,
    block-scaled weights after their shards are cast to 16 bits (118-127, kept in the
    per-recipe lists until the call returns)."""
    blockwise = [isinstance(w, Float8BlockwiseQTensor) for w in model_weights]
    if not any(blockwise):
        float8_tensor.cast_master_weights_to_fp8(
            model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights,
            manual_post_all_gather_processing,
        )  # fmt: skip
        return
    if not all(blockwise) or fsdp_shard_model_weights is not None:
        raise NotImplementedError("block-scaled fp8 weights beside others, or under FSDP, are "
                                  "not simulated")  # fmt: skip
    copies = [None if master is None else master.to(weight.dtype)
              for weight, master in zip(model_weights, master_weights, strict=True)]  # fmt: skip
    work = blockwise_tensor.cast_master_weights(
        model_weights, copies, start_offsets, manual_post_all_gather_processing
    )
    del copies, work


def post_all_gather_processing(model_weights: Any) -> None:
    """After the all-gather: a Float8Tensor's transpose (float8_tensor.py), a block-scaled
    weight's column-wise copy (`_create_columnwise`), and from TE 2.14 every NVFP4Tensor's
    column-wise copy, batched."""
    weights = model_weights if isinstance(model_weights, list) else [model_weights]
    nvfp4 = [w for w in weights if isinstance(w, NVFP4Tensor) and nvfp4_tensor.helpers()]
    rest = [w for w in weights if not any(w is n for n in nvfp4)]
    for weight in rest:
        if isinstance(weight, Float8BlockwiseQTensor):
            weight._create_columnwise()
    float8_tensor.post_all_gather_processing(
        [w for w in rest if not isinstance(w, Float8BlockwiseQTensor)]
    )
    nvfp4_tensor.make_columnwise(nvfp4)


UTILS = {
    "replace_raw_data": replace_raw_data,
    "cast_master_weights_to_fp8": cast_master_weights_to_fp8,
    "post_all_gather_processing": post_all_gather_processing,
    # TE 2.14 (tensor/utils.py 74): what megatron-core 0.17+ casts NVFP4 weights with
    **({"quantize_master_weights": nvfp4_tensor.quantize_master_weights}
       if nvfp4_tensor.helpers() else {}),  # fmt: skip
}
