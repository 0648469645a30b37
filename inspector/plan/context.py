"""Context parallelism's exposed time in `plan`: ring attention's K/V exchange (cost.py's context term)."""

from __future__ import annotations

from inspector.job.dims import ModelDims
from inspector.job.layout import Layout
from inspector.plan.network import Network


def ring_attention(
    dims: ModelDims, lay: Layout, net: Network, tokens: float, attention: float, forwards: int
) -> float:
    """Return the exposed seconds of ring attention's K/V exchange, one layer and micro-batch.

    Megatron-core's context parallelism runs Transformer Engine's `AttnFuncWithCPAndKVP2P`
    (`cp_comm_type` "p2p", the default; transformer_engine/pytorch/attention/dot_product_attention/
    context_parallel.py): the sequence is cut in 2c chunks, each rank holding two (causal load
    balance), and attention runs in c steps. At each of the first c - 1 steps a rank sends the
    K and V block it holds to the next rank of the ring and receives the previous rank's, while
    its kernel computes attention on the block in hand: only what a transfer takes beyond one
    step's kernel (1/c of the rank's core attention) is exposed. Backward circulates K, V and
    their gradients (twice the bytes) against the backward kernels (two thirds of the core
    attention FLOPs, Megatron-LM's 3x GEMM accounting). A K or V block is (s/c) b (g/t) d
    elements. The ring's hops cross nodes as soon as t x c ranks span more than a node
    (megatron orders tp, cp, dp, pp: the cp group strides over t ranks), and a ring step waits
    for its slowest hop. `forwards`: 2 when recomputation repeats the forward.
    """
    c = lay.cp
    block = 2 * tokens * max(dims.query_groups // lay.tp, 1) * dims.head_dim * dims.activation_bytes
    alpha, bandwidth = net.link(lay.tp * lay.cp)
    step_forward = attention / 3 / c
    forward = (c - 1) * max(0.0, alpha + block / bandwidth - step_forward)
    backward = (c - 1) * max(0.0, alpha + 2 * block / bandwidth - 2 * step_forward)
    return forwards * forward + backward
