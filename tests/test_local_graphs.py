"""memory/engine/local_graphs.py: megatron-core's own per-layer CUDA graphs (`--cuda-graph-impl
local`, CudaGraphManager), against hand counts from transformer/cuda_graphs.py."""

from __future__ import annotations

import json

import pytest

from inspector.job.versions import megatron_version
from tests.test_cuda_graphs import HIDDEN_BYTES, MASK_BYTES, ROPE_BYTES, _job, needs_graphs
from tests.test_versions import LOCAL_GRAPH_INPUTS_IN_POOL

SAMPLE = HIDDEN_BYTES + MASK_BYTES + ROPE_BYTES  # the first layer's hidden states, mask, rope


def _kept(run, start):
    return next(size for what, size in run.persistent if what.startswith(f"CUDA graphs' {start}"))


@pytest.mark.parametrize(("pp", "graphs"), [(1, 4), (2, 2 * 8)])
@needs_graphs
def test_the_reuse_pool_holds_one_samples_buffers(pp, graphs):
    from inspector.memory.engine.local_graphs import local_static_inputs

    # a runner per layer without a pipeline (reuse_cudagraphs), per (layer, micro-batch) with
    # one; the first layer's hidden states, the mask and the rope table from TensorReusePool,
    # each later layer reading the previous graph's output in place
    got = local_static_inputs(_job(pipeline_model_parallel_size=pp, cuda_graph_impl="local"), 0)
    assert (got.graphs, got.buffers, got.bytes) == (graphs, 3, SAMPLE)
    assert got.in_pool == LOCAL_GRAPH_INPUTS_IN_POOL


@needs_graphs
def test_memory_keeps_one_sample_and_transformer_engines_pool():
    from inspector.memory.engine.run import run_memory

    local = run_memory(_job(pipeline_model_parallel_size=2, cuda_graph_impl="local"), 0)
    te = run_memory(_job(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine"), 0)
    # no static grad outputs of its own: the last layer's takes a returned input buffer (0.16)
    # or a pool block (0.19)
    assert not [what for what, _ in local.persistent if "grad outputs" in what]
    # captured in the schedule's order into one pool, as Transformer Engine's graphs
    if LOCAL_GRAPH_INPUTS_IN_POOL:  # one sample per micro-batch in flight (2 on stage 0)
        assert not [what for what, _ in local.persistent if "static inputs" in what]
        assert _kept(local, "memory pool") == _kept(te, "memory pool") + 2 * SAMPLE
    else:  # TensorReusePool's buffers, beside the pool
        assert _kept(local, "static inputs") == SAMPLE
        assert _kept(local, "memory pool") == _kept(te, "memory pool") > 0
    assert "CUDA graphs' memory pool" in local.peak.moment


@needs_graphs
def test_the_first_iteration_runs_eagerly_whatever_the_warm_up_steps():
    from inspector.memory.engine.run import run_memory

    # record_graph_capture runs the first iteration eagerly; cuda_graph_warmup_steps is how
    # often each runner reruns its layer before its capture (create_fwd_graph)
    runs = [run_memory(_job(cuda_graph_impl="local", cuda_graph_warmup_steps=steps), 0)
            for steps in (0, 3)]  # fmt: skip
    assert runs[0].peak == runs[1].peak and runs[0].allocated_peak == runs[1].allocated_peak
    # that eager iteration and the capture at its end (create_cudagraphs) come before the first
    # optimizer step makes Adam's moments, as Transformer Engine's graphs without warm-up steps;
    # with warm-up steps Transformer Engine captures after them
    te = [run_memory(_job(cuda_graph_impl="transformer_engine", cuda_graph_warmup_steps=steps), 0)
          for steps in (0, 3)]  # fmt: skip
    assert te[0].allocated_peak == runs[0].allocated_peak < te[1].allocated_peak


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--num-experts", "8"],
         "Error: --cuda-graph-impl local with MoE layers of dynamic shapes is not modelled"),
        (["--num-experts", "8", "--moe-expert-capacity-factor", "1"],  # dropping, not padded
         "Error: --cuda-graph-impl local with MoE layers of dynamic shapes is not modelled"),
        (["--cuda-graph-scope", "mamba"],
         "Error: --cuda-graph-impl local with --cuda-graph-scope mamba is not modelled"),
    ],
)  # fmt: skip
@needs_graphs
def test_partial_scopes_and_moe_layers_stay_refused(flags, error):
    from tests.conftest import run_cli

    result = run_cli("memory", "--model", "llama3-8b", "--micro-batch-size", "1", "--bf16",
                     "--no-cache", "--cuda-graph-impl", "local", *flags)  # fmt: skip
    assert result.code == 2 and result.err.startswith(error) and result.out == ""


def test_a_scripts_local_graphs_of_moe_layers_are_refused_beside_its_other_refusals():
    from inspector.inputs.refusals import validate_args_refusals

    args = {"cuda_graph_impl": "local", "num_experts": 8}
    found = validate_args_refusals(["--cuda-graph-impl"], "train.sh", args)
    assert [r.argument for r in found] == ["--cuda-graph-impl local with MoE layers of dynamic shapes"]
    # padded to capacity, or HybridEP's budget a rank: the layer's shapes stay on the GPU
    for static in ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
                   {"moe_expert_rank_capacity_factor": 1.5}):  # fmt: skip
        assert validate_args_refusals(["--cuda-graph-impl"], "train.sh", {**args, **static}) == ()


# drop-and-pad MoE layers (alltoall): megatron-core graphs them whole (TransformerConfig: "moe
# cuda graph is only supported with drop-padding MoE"), their token counts made on the host
PADDED_MOE = dict(num_experts=4, moe_router_topk=2, moe_expert_capacity_factor=1.0,
                  moe_pad_expert_input_to_capacity=True, moe_token_dispatcher_type="alltoall",
                  moe_grouped_gemm=True)  # fmt: skip


@pytest.mark.parametrize(("pp", "graphs", "in_flight"), [(1, 4, 1), (2, 2 * 8, 2)])
@needs_graphs
def test_padded_moe_layers_are_graphed_whole_as_dense_ones(pp, graphs, in_flight):
    from inspector.memory.engine.local_graphs import local_static_inputs
    from inspector.memory.engine.run import run_memory

    # every MoETransformerLayer gets the whole-layer CudaGraphManager (no scope): its sample is
    # a dense layer's (hidden states, mask, rope), each later layer reading the previous output
    job = _job(pipeline_model_parallel_size=pp, cuda_graph_impl="local", **PADDED_MOE)
    got = local_static_inputs(job, 0)
    assert (got.graphs, got.buffers, got.bytes) == (graphs, 3, SAMPLE)
    local = run_memory(job, 0)
    te = run_memory(_job(pipeline_model_parallel_size=pp, cuda_graph_impl="transformer_engine",
                         **PADDED_MOE), 0)  # fmt: skip
    # the experts' blocks are captured into the pool, as Transformer Engine's whole-layer graphs
    assert "mlp.experts" in local.peak.moment
    if LOCAL_GRAPH_INPUTS_IN_POOL:  # one sample per micro-batch in flight
        assert _kept(local, "memory pool") == _kept(te, "memory pool") + in_flight * SAMPLE
    else:
        assert _kept(local, "static inputs") == SAMPLE
        assert _kept(local, "memory pool") == _kept(te, "memory pool") > 0


@needs_graphs
def test_memory_graphs_a_hybrid_s_layers_whole(cli):
    # every TransformerLayer and MambaLayer gets a CudaGraphManager (GraphableMegatronModule);
    # a Mamba layer's input is the hidden states, the attention layer's adds the mask
    result = cli("memory", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
                 "--seq-length", "256", "--max-position-embeddings", "256", "--vocab-size", "1000",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
                 "--hybrid-override-pattern", "M*M-", "--position-embedding-type", "none",
                 "--mamba-num-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear",
                 "--cuda-graph-impl", "local", "--no-cache", "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    kept = dict(json.loads(result.out)["stages"][0]["buffers"]["persistent"])
    pool = next(size for what, size in kept.items() if what.startswith("CUDA graphs' memory pool"))
    assert pool > 0
    if not LOCAL_GRAPH_INPUTS_IN_POOL:
        assert kept["CUDA graphs' static inputs (2 tensors for 4 graphs)"] == HIDDEN_BYTES + MASK_BYTES


def test_enable_cuda_graph_is_read_as_megatron_cores_own_graphs(tmp_path):
    from inspector.inputs.resolve import Sources, merge_sources
    from tests.conftest import run_cli

    # Megatron-LM's validate_args: '--enable-cuda-graph is deprecated, use
    # --cuda-graph-impl=local instead.' (args.cuda_graph_impl = "local")
    config = tmp_path / "model_config.yaml"
    config.write_text("MODEL_ARGS:\n  --enable-cuda-graph: true\n")
    args = merge_sources(Sources(config_file=str(config)), ("training",)).args
    assert args["cuda_graph_impl"] == "local" and "enable_cuda_graph" not in args
    result = run_cli("memory", "--model", "llama3-8b", "--micro-batch-size", "1", "--bf16",
                     "--enable-cuda-graph", "--external-cuda-graph")  # fmt: skip
    assert (result.code, result.out) == (2, "")
    assert result.err.strip() == (
        "Error: --enable-cuda-graph with --external-cuda-graph: Megatron-LM refuses it "
        "(validate_args: '--enable-cuda-graph and --external-cuda-graph cannot be enabled at the "
        "same time.')")  # fmt: skip


@pytest.mark.skipif(megatron_version() < (0, 18), reason="--moe-expert-rank-capacity-factor: 0.18+")
@needs_graphs
def test_hybridep_rank_capacity_moe_layers_are_graphed_whole():
    from inspector.memory.engine.run import run_memory

    # HybridEP's fixed budget of permuted tokens a rank, run by the op fuser's MXFP8 grouped MLP
    # (Megatron-Bridge's gpt-oss recipes): no token count reaches the host, the layer is graphed
    moe = dict(num_experts=8, moe_router_topk=2, moe_token_dispatcher_type="flex",
               moe_flex_dispatcher_backend="hybridep", moe_expert_rank_capacity_factor=1.5,
               use_transformer_engine_op_fuser=True, fp8_format="e4m3", fp8_recipe="mxfp8",
               moe_mlp_glu_interleave_size=32, hidden_size=256, moe_ffn_hidden_size=256,
               moe_router_padding_for_quantization=True, moe_grouped_gemm=True,
               expert_model_parallel_size=2, data_parallel_size=2,
               moe_router_force_load_balancing=True)  # fmt: skip
    run = run_memory(_job(cuda_graph_impl="local", **moe), 0)
    assert "_OperationFuserFunctionBackward" in _pool_row(run) and _kept(run, "memory pool") > 0


def _pool_row(run):
    return next(what for what, _ in run.persistent if what.startswith("CUDA graphs' memory pool"))
