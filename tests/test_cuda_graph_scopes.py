"""memory/engine: Transformer Engine per-layer graphs on models whose layers differ (dense and MoE,
MTP, the MoE all-to-all overlap), and --external-cuda-graph, against megatron-core's own checks."""

from __future__ import annotations

import re

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


OVERLAP = dict(MOE, num_layers=8, overlap_moe_expert_parallel_comm=True,
               cuda_graph_scope=["attn", "moe_router", "moe_preprocess"])  # fmt: skip


@needs_graphs
def test_the_moe_overlap_captures_layer_by_layer_with_one_more_sample():
    from inspector.memory.engine.cuda_graphs import static_inputs

    job = _job(**OVERLAP)  # no pipeline: 4 micro-batches (8 / dp 2), all captured
    inputs = static_inputs(job, 0, job.training.cuda_graph_scope)
    # get_overlap_moe_expert_parallel_comm_order: micro-batch 0's forward layer by layer, then
    # each forward layer with the backward of the previous micro-batch's mirror layer
    assert inputs.order[:12] == (1, 2, 3, 4, 5, 6, 7, 8, 1, -8, 2, -7)
    assert inputs.graphs == 8 * 4
    # a forward reuses the inputs of a sample whose backward ran (same signature): micro-batch
    # 0's 8 layers, then micro-batch 1's first layer before any backward; each sample a hidden
    # state and a mask, and one rope table
    assert inputs.buffers == 2 * (8 + 1) + 1


@pytest.mark.parametrize(
    ("scope", "error"),
    [
        # TransformerConfig: the overlap runs the MLP in its own node, outside any graph
        (["attn", "mlp"], "--cuda-graph-scope mlp with --overlap-moe-expert-parallel-comm: "
                          "megatron-core refuses it"),
        ([], "'EP overlap must be disabled when CUDA graph captures the whole MLP/MoE part.'"),
    ],
)  # fmt: skip
@needs_graphs
def test_the_scopes_megatron_refuses_with_the_overlap(scope, error):
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(error)):
        _job(**{**OVERLAP, "cuda_graph_scope": scope, "moe_layer_freq": [0] + [1] * 7})


@needs_graphs
def test_memory_runs_the_graphs_with_the_overlap_and_holds_one_more_micro_batch():
    from inspector.memory.engine.run import run_memory

    def pool(**flags):
        run = run_memory(_job(**{**OVERLAP, **flags}), 0)
        return next(size for what, size in run.persistent if "memory pool" in what)

    # the overlap's extra micro-batch in flight is captured into the pool too
    assert pool() > pool(overlap_moe_expert_parallel_comm=False)


def test_external_cuda_graph_is_read_as_transformer_engines_graphs(tmp_path):
    from inspector.inputs.resolve import Sources, merge_sources

    # Megatron-LM's validate_args (arguments.py, 0.19.2; TransformerConfig alike since 0.16):
    # '--external-cuda-graph is deprecated, use --cuda-graph-impl=transformer_engine instead.'
    config = tmp_path / "model_config.yaml"
    config.write_text("MODEL_ARGS:\n  --external-cuda-graph: true\n  --cuda-graph-scope: attn\n")
    args = merge_sources(Sources(config_file=str(config)), ("training",)).args
    assert (args["cuda_graph_impl"], args["cuda_graph_scope"]) == ("transformer_engine", "attn")
    assert "external_cuda_graph" not in args
    config.write_text("MODEL_ARGS:\n  --external-cuda-graph: false\n")
    assert "cuda_graph_impl" not in merge_sources(Sources(config_file=str(config)), ("training",)).args


def test_external_cuda_graph_with_cuda_graph_impl_is_megatron_lms_refusal():
    from tests.conftest import run_cli

    result = run_cli("memory", "--model", "llama3-8b", "--micro-batch-size", "1", "--bf16",
                     "--external-cuda-graph", "--cuda-graph-impl", "local")  # fmt: skip
    assert (result.code, result.out) == (2, "")
    assert result.err.strip() == (
        "Error: --external-cuda-graph with --cuda-graph-impl local: Megatron-LM refuses it "
        "(validate_args: 'Do not use --enable-cuda-graph or --external-cuda-graph with "
        "--cuda-graph-impl.')"
    )
