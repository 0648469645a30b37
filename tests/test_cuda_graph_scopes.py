"""memory/engine: Transformer Engine per-layer graphs on models whose layers differ (dense and MoE,
MTP), and Megatron-LM's older spelling of them, against megatron-core's own checks."""

from __future__ import annotations

import pytest

from tests.test_cuda_graphs import MOE, _job, needs_graphs


@needs_graphs
def test_an_mlp_scope_runs_where_only_the_first_layers_are_dense():
    from inspector.memory.engine.run import run_memory

    # Megatron-LM's functional test moe/..._scoped_cudagraph: `--moe-layer-freq ([0]*4+[1]*9)`
    # with `--cuda-graph-modules [attn mlp moe_router moe_preprocess]`. megatron-core checks the
    # scope against the whole model (a dense layer exists); the engine traces a chunk of MoE
    # layers in a smaller model, which megatron-core's check alone would refuse
    scope = ["attn", "mlp", "moe_router", "moe_preprocess"]
    job = _job(**MOE, num_layers=8, pipeline_model_parallel_size=2, moe_layer_freq=[0] + [1] * 7,
               cuda_graph_scope=scope)  # fmt: skip
    pools = [next(size for what, size in run_memory(job, stage).persistent if "memory pool" in what)
             for stage in (0, 1)]  # fmt: skip
    assert all(size > 0 for size in pools)


@needs_graphs
def test_the_mtp_layers_transformer_layer_is_graphed():
    from inspector.memory.engine.cuda_graphs import static_inputs

    # TECudaGraphHelper graphs each MTP layer's transformer layer too (megatron-core 0.19 names
    # it `mtp_model_layer`, 0.16 `transformer_layer`): one more hidden-state input per layer
    plain = static_inputs(_job(cuda_graph_impl="transformer_engine"), 0, ())
    mtp = static_inputs(_job(cuda_graph_impl="transformer_engine", mtp_num_layers=1), 0, ())
    assert mtp.graphs == plain.graphs + 1
