"""torch's NaN fill of new tensors under --deterministic-mode, priced from what megatron allocates.

Under `torch.use_deterministic_algorithms(True)` (Megatron-LM's validate_args with
--deterministic-mode) torch's CUDA `empty` fills each tensor it makes with NaN
(aten/src/ATen/native/cuda/TensorFactories.cu `empty_cuda`: `fill_empty_deterministic_`), while
aten's structured kernels make their outputs past it (torchgen `gen_create_out_helper`:
at::detail::empty_cuda). formulas/determinism.py `nan_fill` prices the outputs Transformer Engine's
C++ allocates with at::empty; here it is checked against every `empty`, `empty_like`,
`empty_strided` and `new_empty` that one layer's forward and backward allocate on the device when
the engine runs megatron's code (the TE stand-in allocates what TE's C++ allocates: the difference
between a 2-layer and a 1-layer model, one micro-batch, the build left out).
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest

from inspector.formulas.determinism import nan_fill
from inspector.formulas.kernels import ops_seconds
from inspector.formulas.ops import Shard, layer_ops
from inspector.job.hardware import GPUS
from inspector.job.job import make_job
from inspector.plan.kernel_seconds import layer_kernels

TE = dict(hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1024,
          pipeline_model_parallel_size=1, tensor_model_parallel_size=2, data_parallel_size=1,
          micro_batch_size=1, global_batch_size=1, bf16=True, use_distributed_optimizer=True,
          transformer_impl="transformer_engine", swiglu=True, disable_bias_linear=True,
          normalization="RMSNorm", position_embedding_type="rope", ffn_hidden_size=512,
          deterministic_mode=True)  # fmt: skip


@functools.cache
def _engine_empty_bytes(layers: int, flags: tuple[tuple[str, Any], ...]) -> int:
    """Return the bytes of every device `empty`-like allocation of one micro-batch's run."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import inspector.memory.engine.stage as stage
    from inspector.world.setup import megatron

    aten = torch.ops.aten
    empty = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
             aten.new_empty.default, aten.new_empty_strided.default}  # fmt: skip
    seen, running = [0], [False]

    class Empties(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if running[0] and func in empty and out.device.type != "cpu":
                seen[0] += out.numel() * out.element_size()
            return out

    real = stage.run_microbatch

    def microbatch(*args: Any, **kwargs: Any) -> Any:  # the run, not the build
        running[0] = True
        try:
            return real(*args, **kwargs)
        finally:
            running[0] = False

    megatron()
    with mock.patch.object(stage, "run_microbatch", microbatch), Empties():
        stage.trace_stage(make_job({**TE, **dict(flags), "num_layers": layers}), 0)
    return seen[0]


def _priced(flags: dict[str, Any]) -> int:
    job = make_job({**TE, **flags, "num_layers": 1})
    dims, lay = job.dims(), job.layout
    shard = Shard(tp=lay.tp, sequence_parallel=lay.sequence_parallel)
    ops = layer_ops(dims, shard, False)
    tokens = dims.seq_length
    local = tokens // lay.tp if lay.sequence_parallel else tokens
    forward, backward = nan_fill(dims, ops.forward, ops.backward, tokens, local, lay.tp, False)
    return int(forward.bytes + backward.bytes)


CASES = {
    "tp2": {},
    "tp2-sequence-parallel": {"sequence_parallel": True},
    "tp1-no-grad-accumulation-fusion": {"tensor_model_parallel_size": 1,
                                        "no_gradient_accumulation_fusion": True},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("flags", CASES.values(), ids=CASES.keys())
def test_the_fill_is_what_megatrons_layer_allocates_through_empty(flags):
    key = tuple(sorted(flags.items()))
    seen = _engine_empty_bytes(2, key) - _engine_empty_bytes(1, key)
    priced = _priced(flags)
    # the norms' fp32 statistics, dgamma, attention's softmax statistics and RNG state: small
    assert 0 <= seen - priced <= 0.01 * seen, (seen, priced)


def test_only_a_deterministic_transformer_engine_layer_pays_the_fill():
    h100 = GPUS["h100"]
    shard = Shard(tp=4)
    on = make_job({**TE, "num_layers": 1, "tensor_model_parallel_size": 4}).dims()
    off = make_job({**TE, "num_layers": 1, "tensor_model_parallel_size": 4,
                    "deterministic_mode": False}).dims()  # fmt: skip
    with_fill, without = layer_kernels(on, shard, False), layer_kernels(off, shard, False)
    assert with_fill.forward[-1].name == "NaN fill of new tensors"
    assert with_fill.backward[0].name == "NaN fill of new tensors backward"
    assert not any(op.name.startswith("NaN fill") for op in (*without.forward, *without.backward))
    extra = ops_seconds(with_fill.forward + with_fill.backward, h100) - ops_seconds(
        without.forward + without.backward, h100)
    assert extra > 0


def test_the_7b_layers_fill_is_about_two_gigabytes_of_writes():
    # gpt3_7b_tp1_pp4_memory_speed's layer (hidden 4096, ffn 11008, 32 heads, 8,192 tokens):
    # the forward's outputs and the backward's gradients, 16-bit, written once more
    flags = dict(hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                 seq_length=4096, micro_batch_size=2, global_batch_size=2,
                 tensor_model_parallel_size=1, no_gradient_accumulation_fusion=True)  # fmt: skip
    job = make_job({**TE, **flags, "num_layers": 1})
    dims = job.dims()
    ops = layer_ops(dims, Shard(micro_batch=2), False)
    forward, backward = nan_fill(dims, ops.forward, ops.backward, 8192, 8192, 1, False)
    assert 1.5e9 < forward.bytes + backward.bytes < 2.5e9
