"""The kernels a linear's bias and an eager bias-dropout-add run (formulas/ops.py prices them).

megatron-core 0.16 without Transformer Engine (local spec: tensor_parallel/layers.py linears,
fusions/fused_bias_dropout.py, fusions/fused_bias_gelu.py), checked against the aten ops megatron
dispatches for one local-spec layer (tests/test_ops_dispatch.py). Bytes per element, 16-bit
activations of `act` bytes; each function returns (forward kernels, backward kernels).
"""

from __future__ import annotations

from inspector.formulas.kernels import Memory

Kernels = tuple[list[Memory], list[Memory]]


def bias_add(name: str, elements: int, act: int, forward: bool) -> Kernels:
    """Return a linear's bias add (when `forward`: not fused elsewhere) and its gradient's sum.

    The add reads and writes the output (2 + 2 bytes per element): ColumnParallelLinear with
    skip_bias_add False runs torch.matmul, then `output + bias` (layers.py
    LinearWithGradAccumulationAndAsyncCommunication.forward), and mlp.py MLP.forward adds fc1's
    bias eagerly without --bias-gelu-fusion. The sum reads the output gradient over the tokens
    (2 bytes): the linear's `grad_output.sum(dim=0)`, or autograd's reduction of a broadcast
    bias (the eager add's, or the [s, b, f] bias gradient fused_bias_gelu.py GeLUFunction.backward
    returns).
    """
    added = [Memory(name + " bias add", "add", elements, 2 * act)] if forward else []
    return added, [Memory(name + " bias gradient", "copy", elements, act)]


def unfused_bias_dropout_add(name: str, elements: int, act: int, mask: int, bias: bool) -> Kernels:
    """Return `_bias_dropout_add_func` run eagerly (--no-bias-dropout-fusion), kernel by kernel.

    Forward: `x + bias` (read 2, write 2 bytes per element), F.dropout (ATen native_dropout on
    CUDA: read 2, write 2 and a `mask`-byte mask; none when the probability is 0, `mask` 0),
    `residual + out` (read 4, write 2). Backward: native_dropout_backward (read 2 and the mask,
    write 2), the bias gradient's sum over the tokens (read 2), and the residual's two gradients
    added (read 4, write 2: the layer's input feeds both the norm and the residual).
    """
    forward, backward = bias_add(name, elements, act, True) if bias else ([], [])
    if mask:
        forward.append(Memory(name + " dropout", "copy", elements, 2 * act + mask))
        backward.append(Memory(name + " dropout backward", "copy", elements, 2 * act + mask))
    forward.append(Memory(name + " residual add", "add", elements, 3 * act))
    backward.append(Memory(name + " residual add backward", "add", elements, 3 * act))
    return forward, backward
