"""memory/engine/cuda_graphs.py: Transformer Engine per-layer graphs' capture order and static inputs,
from megatron-core's own TECudaGraphHelper, against hand counts from its source."""

from __future__ import annotations

import re

import pytest

from tests.test_versions import ALLTOALL_GRAPH_RETURNS_PROBS, CUDA_GRAPHS_MODELLED

needs_graphs = pytest.mark.skipif(not CUDA_GRAPHS_MODELLED, reason="refused before 0.16 (test_versions)")

SEQ, HIDDEN, HEAD = 256, 128, 32  # 4 heads of 32


def _job(**flags):
    from inspector.job.job import make_job

    args = dict(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
        max_position_embeddings=SEQ, vocab_size=1000, data_parallel_size=1, micro_batch_size=1,
        global_batch_size=8, bf16=True, transformer_impl="transformer_engine",
        position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True,
    )  # fmt: skip
    return make_job({**args, **flags})


# per (layer, micro-batch) sample (TransformerLayer.get_layer_static_inputs): hidden states
# [s, b, h] in bf16 (megatron makes them bf16 whatever the job's dtype) and, with attention in
# the scope, the causal mask [b, 1, s, s] of bools; one rope table [s, 1, 1, d] in fp32 for all
HIDDEN_BYTES = SEQ * 1 * HIDDEN * 2
MASK_BYTES = SEQ * SEQ
ROPE_BYTES = SEQ * HEAD * 4


@needs_graphs
def test_the_capture_order_is_megatrons_docstring_example():
    from inspector.memory.engine.cuda_graphs import capture_order

    # transformer/cuda_graphs.py convert_schedule_table_to_order: PP2, 5 micro-batches, VP2,
    # groups of 3, 5 warm-up forwards (rank 0: (2 - 0 - 1) * 2 + (2 - 1) * 3)
    assert capture_order(2, 0, 2, 5, group_size=3) == [
        1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]  # fmt: skip


@needs_graphs
def test_without_a_pipeline_one_micro_batch_is_captured_per_layer():
    from inspector.memory.engine.cuda_graphs import static_inputs

    got = static_inputs(_job(pipeline_model_parallel_size=1), 0)
    assert (got.graphs, got.order) == (4, (1, -1))
    assert got.buffers == 4 * 2 + 1
    assert got.bytes == 4 * (HIDDEN_BYTES + MASK_BYTES) + ROPE_BYTES


@needs_graphs
def test_an_mlp_scope_takes_no_mask_and_no_rope():
    from inspector.memory.engine.cuda_graphs import static_inputs

    got = static_inputs(_job(pipeline_model_parallel_size=1), 0, ("mlp",))
    assert (got.buffers, got.bytes) == (4, 4 * HIDDEN_BYTES)


@pytest.mark.parametrize(("stage", "in_flight"), [(0, 2), (1, 1)])
@needs_graphs
def test_a_pipeline_captures_every_micro_batch_and_reuses_finished_ones(stage, in_flight):
    from inspector.memory.engine.cuda_graphs import static_inputs

    # pp 2, 8 micro-batches, 2 layers a stage: every (layer, micro-batch) is captured, but a
    # forward reuses the samples of a micro-batch whose backward ran, so the buffers are the
    # 1F1B schedule's micro-batches in flight (stage 0: one warm-up forward, 2; stage 1: 1)
    got = static_inputs(_job(pipeline_model_parallel_size=2), stage)
    assert got.graphs == 2 * 8
    assert got.buffers == 2 * in_flight * 2 + 1
    assert got.bytes == 2 * in_flight * (HIDDEN_BYTES + MASK_BYTES) + ROPE_BYTES


def _events(*steps):
    from inspector.memory.engine.allocator import Event

    total, out = 0, []
    for size, where, *origin in steps:
        total += size
        out.append(Event(size, total, where, *origin))
    return tuple(out)


def test_a_free_returns_to_the_pool_its_block_came_from():
    from inspector.memory.engine.cuda_graphs import split_trace
    from inspector.memory.engine.microbatch import Trace

    # forward: the embedding's output (normal pool), a layer's two blocks (the graph's pool), the
    # layer frees the embedding's block: a normal-pool free though it happens inside the layer
    forward = _events((100, "embedding"), (10, "decoder.layers.0.self_attention.linear_qkv"),
                      (20, "decoder.layers.0.mlp"), (-100, "decoder.layers.0.mlp", "embedding"))
    backward = _events((5, "layer 3 mlp: SwiGLUFunctionBackward"),
                       (-20, "layer 3 mlp: SwiGLUFunctionBackward", "decoder.layers.0.mlp"))  # fmt: skip
    pool, rest = split_trace(Trace(forward, backward, ()), ())
    assert [e.bytes for e in pool.forward] == [10, 20] and pool.held == 30
    assert [e.bytes for e in rest.forward] == [100, -100] and rest.held == 0
    assert [e.allocated for e in pool.backward] == [35, 15]


def test_an_attention_scope_keeps_the_mlp_and_its_residual_add_outside_the_pool():
    from inspector.memory.engine.cuda_graphs import pool_of

    # TransformerLayer._te_cuda_graph_capture: attn graphs _forward_attention, which ends with
    # the attention's bias-dropout-add (the layer's own op after self_attention); the MLP's add
    # follows the MLP. In the backward the adds run before the part they close.
    forward = _events((1, "decoder.layers.0.self_attention.linear_qkv"), (2, "decoder.layers.0"),
                      (3, "decoder.layers.0.mlp.linear_fc1"), (4, "decoder.layers.0"))  # fmt: skip
    assert pool_of(forward, ("attn",), False) == [True, True, False, False]
    assert pool_of(forward, ("mlp",), False) == [False, False, True, True]
    backward = _events((4, "decoder.layers.0: NativeDropoutBackward0"),
                       (3, "decoder.layers.0.mlp.linear_fc1: LinearFunctionBackward"),
                       (2, "decoder.layers.0: NativeDropoutBackward0"),
                       (1, "decoder.layers.0.self_attention.linear_qkv: LayerNormLinearFunctionBackward"))  # fmt: skip
    assert pool_of(backward, ("attn",), True) == [False, False, True, True]


@needs_graphs
def test_memory_keeps_the_graphs_inputs_grad_outputs_and_pool_beside_the_step():
    from inspector.memory.engine.run import run_memory

    job = _job(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine")
    eager = run_memory(_job(pipeline_model_parallel_size=2), 0)
    graphed = run_memory(job, 0)
    kept = dict(graphed.persistent)
    inputs = next(size for what, size in kept.items() if what.startswith("CUDA graphs' static inputs"))
    assert inputs == 2 * 2 * (HIDDEN_BYTES + MASK_BYTES) + ROPE_BYTES
    # TE graph.py: one empty_like of the layers' output (a bf16 hidden state) for every graph
    assert kept["CUDA graphs' static grad outputs"] == HIDDEN_BYTES
    pool = next(size for what, size in kept.items() if what.startswith("CUDA graphs' memory pool"))
    assert 0 < pool < eager.peak.bytes
    # the graphs' pool and the rest never share blocks: never below the eager iteration
    assert graphed.static + graphed.peak.bytes >= eager.static + eager.peak.bytes + inputs
    assert "CUDA graphs' memory pool" in graphed.peak.moment and "layer 1" in graphed.peak.moment


@needs_graphs
def test_once_captured_the_pool_is_reserved_not_allocated():
    """TE graph.py (`_reuse_graph_input_output_buffers`) frees a forward graph's outputs and saved
    tensors when its backward is captured: PyTorch keeps the blocks reserved for the pool, and
    torch.cuda.memory_allocated (Megatron-LM's mem-allocated-bytes) no longer counts them, so its
    peak is the pool's high-water mark at the capture or the rest of the step's, not their sum."""
    from inspector.memory.engine.run import run_memory

    graphed = run_memory(_job(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine"), 0)
    kept = dict(graphed.persistent)
    pool = next(size for what, size in kept.items() if what.startswith("CUDA graphs' memory pool"))
    assert graphed.graph_pool == pool > 0
    # static inputs and grad outputs stay allocated (the normal pool); the pool does not
    assert graphed.static - graphed.graph_pool == sum(
        size for what, size in graphed.persistent if not what.startswith("CUDA graphs' memory pool")
    ) + graphed.workspaces
    assert graphed.allocated_peak == max(graphed.peak.bytes, pool)
    assert graphed.allocated_peak < graphed.peak.bytes + pool  # what the GPU holds is more
    eager = run_memory(_job(pipeline_model_parallel_size=2), 0)
    assert eager.graph_pool == 0 and eager.allocated_peak is None


@needs_graphs
def test_without_warm_up_steps_the_graphs_are_captured_before_adams_moments_exist():
    """training.py captures at `iteration - start_iteration == cuda_graph_warmup_steps`: with 0,
    before the first train_step, so no eager iteration and no optimizer moments at the capture."""
    from inspector.memory.engine.run import run_memory

    flags = dict(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine")
    warm, cold = run_memory(_job(**flags), 0), run_memory(_job(**flags, cuda_graph_warmup_steps=0), 0)
    assert _job(**flags).training.cuda_graph_warmup_steps == 3  # TransformerConfig's default
    assert cold.optimizer_state == warm.optimizer_state > 0
    assert cold.graph_pool == warm.graph_pool
    assert cold.allocated_peak == max(cold.peak.bytes, cold.graph_pool - cold.optimizer_state)
    assert "eager" not in cold.peak.moment


def test_an_eager_iteration_allocates_what_it_holds():
    from inspector.memory.engine.cuda_graphs import allocated_peak
    from inspector.memory.engine.schedule import Peak

    peak = Peak(100, 0, 1, "somewhere")
    assert allocated_peak(peak, 300, eager=True) == 400  # before capture: all in the normal pool
    assert allocated_peak(peak, 300, eager=False) == 300  # the capture's high-water mark
    assert allocated_peak(peak, 50, eager=False) == 100  # the rest of the step's peak


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--cuda-graph-impl", "local", "--cuda-graph-scope", "attn"],
         "Error: --cuda-graph-impl local with --cuda-graph-scope attn is not modelled: "
         "megatron-core's own per-layer CUDA graphs (CudaGraphManager) are counted for whole "
         "layers only (no --cuda-graph-scope): dense, Mamba, and MoE layers whose shapes stay on "
         "the GPU (--moe-pad-expert-input-to-capacity, or HybridEP's "
         "--moe-expert-rank-capacity-factor; otherwise the dispatcher copies token counts to the "
         "host, which a graph's capture cannot hold); transformer_engine's per-layer graphs and "
         "--cuda-graph-scope full_iteration are counted with these too"),
        (["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration"],
         "Error: --cuda-graph-scope full_iteration with --cuda-graph-impl transformer_engine: "
         "megatron-core refuses it ('To use full iteration cuda graph, please use "
         "cuda_graph_impl=local instead of cuda_graph_impl=transformer_engine.')"),
        # megatron-core TransformerConfig.__post_init__
        (["--cuda-graph-impl", "transformer_engine", "--recompute-granularity", "full",
          "--recompute-method", "uniform"],
         "Error: --recompute-granularity full with --cuda-graph-impl: megatron-core refuses it "
         "('full recompute is only supported with full iteration CUDA graph.')"),
    ],
)  # fmt: skip
@needs_graphs
def test_graphs_memory_does_not_model_are_refused_by_name(flags, error):
    from tests.conftest import run_cli

    result = run_cli("memory", "--model", "llama3-8b", "--micro-batch-size", "1", "--bf16",
                     "--no-cache", *flags)  # fmt: skip
    assert (result.code, result.err.strip(), result.out) == (2, error, "")


@needs_graphs
def test_the_timeline_draws_the_graphs_pool_as_its_own_band(tmp_path):
    from inspector.memory.engine.run import run_memory
    from tests.conftest import run_cli

    job = _job(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine")
    run = run_memory(job, 0)
    # the passes drawn are the rest of the step (the graphed parts live in the pool, a band):
    # their highest point is the peak the report gives when the graphed state is the higher
    highest = max(p.held + max((s[1] for s in p.steps), default=0) for p in run.replay.passes())
    assert highest == run.peak.bytes
    flags = ["memory", "--num-layers", "4", "--hidden-size", str(HIDDEN), "--num-attention-heads",
             "4", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size",
             "1000", "--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
             "--transformer-impl", "transformer_engine", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--no-cache"]  # fmt: skip
    for graphs, bands in (([], 0), (["--cuda-graph-impl", "transformer_engine"], 2)):
        svg = tmp_path / f"t{bands}.svg"
        assert run_cli(*flags, *graphs, "--timeline", str(svg)).code == 0
        assert svg.read_text().count('data-band="graphs"') == bands


def test_before_megatron_core_0_16_the_graphs_are_refused(monkeypatch):
    from inspector.errors import ConfigError
    from inspector.job import cuda_graphs

    # megatron-core 0.13's transformer/cuda_graphs.py has no TECudaGraphHelper._get_sample_arguments
    monkeypatch.setattr(cuda_graphs, "megatron_core_version", lambda: (0, 15))
    with pytest.raises(ConfigError, match=r"modelled with megatron-core 0.16 or later \(the installed 0.15"):
        _job(cuda_graph_impl="transformer_engine")


@needs_graphs
def test_whole_layer_graphs_with_the_moe_overlap_are_megatrons_refusal():
    from inspector.errors import ConfigError

    # transformer_layer.py _te_cuda_graph_replay: the overlap runs the MLP outside the graph
    moe = dict(num_experts=4, moe_router_topk=2, expert_model_parallel_size=2, data_parallel_size=2,
               moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
               overlap_moe_expert_parallel_comm=True, cuda_graph_impl="transformer_engine")  # fmt: skip
    with pytest.raises(ConfigError, match="'EP overlap must be disabled when CUDA graph captures"):
        _job(**moe)


# a MoE model of the same sizes: 4 experts, top 2, all-to-all over ep 2 (every layer MoE)
EXPERTS, TOPK = 4, 2
MOE = dict(num_experts=EXPERTS, moe_router_topk=TOPK, expert_model_parallel_size=2,
           data_parallel_size=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
           no_rope_fusion=True, cuda_graph_impl="transformer_engine")  # fmt: skip


def test_the_router_scope_pools_the_moe_layers_norm_router_and_preprocessing():
    from inspector.memory.engine.cuda_graphs import pool_of

    # TransformerLayer._get_submodules_under_cudagraphs (moe_router: pre_mlp_layernorm, router,
    # shared experts); moe_utils.py returns early after route (or preprocess with
    # moe_preprocess); the dispatch and experts (the MoE layer's own ops) stay outside. Layer 1
    # is dense: its pre_mlp_layernorm is outside (moe_router graphs MoE layers only).
    forward = _events((1, "decoder.layers.0.pre_mlp_layernorm"), (2, "decoder.layers.0.mlp.router"),
                      (3, "decoder.layers.0.mlp.preprocess"), (4, "decoder.layers.0.mlp"),
                      (5, "decoder.layers.0.mlp.experts"), (6, "decoder.layers.0"),
                      (7, "decoder.layers.1.pre_mlp_layernorm"), (8, "decoder.layers.1.mlp"))  # fmt: skip
    router = [True, True, False, False, False, False, False, False]
    assert pool_of(forward, ("moe_router",), False) == router
    assert pool_of(forward, ("moe_router", "moe_preprocess"), False) == [True] * 3 + [False] * 5
    # mlp graphs the dense layer's MLP only (megatron-core: mlp for dense layers, moe for MoE)
    assert pool_of(forward, ("mlp",), False) == [False] * 6 + [True, True]


@pytest.mark.parametrize(
    ("scope", "grad_outputs", "freq"),
    [
        # router graph outputs (moe_utils.py get_early_return_outputs, transformer_layer.py
        # _forward_mlp): the norm's output [s, b, h], probabilities [s*b, experts] (the input's
        # bf16: no --moe-router-dtype), the routing map (bools, no grad), the residual [s, b, h]
        (("attn", "moe_router"), 2 * HIDDEN_BYTES + SEQ * EXPERTS * 2, 1),
        # with preprocess (alltoall dispatch_preprocess permutes): tokens [s*b*topk, h], their
        # probabilities [s*b*topk], the dispatcher's attributes (ints, no grad; from 0.19 also
        # the router's probabilities [s*b, experts], which need one), the residual
        (("attn", "moe_router", "moe_preprocess"),
         SEQ * TOPK * HIDDEN * 2 + SEQ * TOPK * 2 + HIDDEN_BYTES
         + SEQ * EXPERTS * 2 * ALLTOALL_GRAPH_RETURNS_PROBS, 1),
        # a dense first layer: its attention graph's one hidden state is a signature of its own
        (("attn", "moe_router"), HIDDEN_BYTES + 2 * HIDDEN_BYTES + SEQ * EXPERTS * 2, [0, 1, 1, 1]),
    ],
)  # fmt: skip
@needs_graphs
def test_the_router_graphs_static_grad_outputs_are_te_s_one_set_per_signature(scope, grad_outputs,
                                                                              freq):  # fmt: skip
    from inspector.memory.engine.cuda_graphs import static_inputs

    # TE graph.py static_grad_outputs_dict: empty_like of each output needing a gradient, one
    # set for every graph whose outputs have the same shapes
    job = _job(**MOE, cuda_graph_scope=list(scope), moe_layer_freq=freq)
    assert static_inputs(job, 0, scope).grad_output_bytes == grad_outputs


@needs_graphs
def test_memory_runs_the_router_graphs_and_pools_more_with_each_step():
    from inspector.memory.engine.run import run_memory

    pools = []
    for scope in (["attn"], ["attn", "moe_router"], ["attn", "moe_router", "moe_preprocess"]):
        run = run_memory(_job(**MOE, pipeline_model_parallel_size=2, cuda_graph_scope=scope), 0)
        pools.append(next(size for what, size in run.persistent if "memory pool" in what))
    assert pools[0] < pools[1] < pools[2]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ({"cuda_graph_scope": ["moe_preprocess"], **MOE}, "moe_preprocess needs moe_router"),
        ({"cuda_graph_scope": ["moe_router"], "cuda_graph_impl": "transformer_engine"},
         "moe_router needs MoE layers"),
        # megatron-core: the alltoall preprocess with a capacity factor copies to the host
        ({"cuda_graph_scope": ["moe_router", "moe_preprocess"], "moe_expert_capacity_factor": 1.0,
          **MOE}, "DtoH copies and synchronizations in the preprocess step"),
    ],
)  # fmt: skip
@needs_graphs
def test_megatron_cores_router_scope_checks(flags, error):
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        _job(**flags)


def test_megatron_lms_newer_spelling_of_the_scope_is_read(tmp_path):
    """Megatron-LM's arguments.py (with megatron-core 0.19.2) names the scope --cuda-graph-modules
    (nargs='*'); its functional tests spell it so (the attn_cudagraph case): dropped, the tool
    would graph whole layers."""
    from inspector.inputs.megatron_config import read_config
    from inspector.inputs.sources import read_launch_script
    from tests.test_arguments import script

    path = script(tmp_path, "--cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp --lr 1")
    assert read_launch_script(path).args["cuda_graph_scope"] == "attn mlp"
    config = tmp_path / "model_config.yaml"
    config.write_text("MODEL_ARGS:\n  --cuda-graph-impl: transformer_engine\n  --cuda-graph-modules: attn\n")
    assert read_config(str(config)).args["cuda_graph_scope"] == "attn"


@needs_graphs
def test_memory_names_what_torch_cuda_reports_beside_the_pool(cli):
    result = cli("memory", "--num-layers", "4", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
                 "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", "1000",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", "--pp", "2",
                 "--transformer-impl", "transformer_engine", "--cuda-graph-impl", "transformer_engine",
                 "--no-cache")  # fmt: skip
    assert result.code == 0, result.err
    [line] = [line for line in result.out.splitlines() if line.startswith("Stage 0: the CUDA graphs'")]
    assert "is reserved, not allocated, once captured: torch.cuda.memory_allocated reports" in line


def test_a_mamba_scope_pools_the_mamba_layers_whole():
    from inspector.memory.engine.cuda_graphs import pool_of

    # megatron's _layer_is_graphable: a MambaLayer (norm, mixer, its bias-dropout-add) with
    # mamba, whole; a hybrid's attention layer (TransformerLayer) with attn. Mamba's events read
    # as attention's before (it was refused by name)
    forward = _events((1, "decoder.layers.0.norm"), (2, "decoder.layers.0.mixer.in_proj"),
                      (3, "decoder.layers.0"), (4, "decoder.layers.1.self_attention.linear_qkv"),
                      (5, "decoder.layers.1"))  # fmt: skip
    assert pool_of(forward, ("mamba",), False) == [True, True, True, False, False]
    assert pool_of(forward, ("attn",), False) == [False, False, False, True, True]
    backward = _events((5, "decoder.layers.1: NativeDropoutBackward0"),
                       (4, "layer 1 self_attention: LayerNormLinearFunctionBackward"),
                       (3, "decoder.layers.0: NativeDropoutBackward0"),
                       (2, "layer 0 mixer: MambaSplitConv1dScanCombinedFnBackward"))  # fmt: skip
    assert pool_of(backward, ("mamba",), True) == [False, False, True, True]


@needs_graphs
def test_memory_graphs_a_hybrid_s_mamba_layers(cli):
    # Megatron-Bridge's Nemotron-H and Nemotron 3 Nano recipes graph their Mamba layers
    # (--cuda-graph-scope mamba, or attn mamba); the pool fills in a Mamba layer's backward
    result = cli("memory", "--num-layers", "4", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
                 "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", "1000",
                 "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16",
                 "--hybrid-override-pattern", "M*M-", "--position-embedding-type", "none",
                 "--mamba-num-groups", "2",
                 "--normalization", "RMSNorm", "--disable-bias-linear",
                 "--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "mamba",
                 "--no-cache")  # fmt: skip
    assert result.code == 0, result.err
    [line] = [line for line in result.out.splitlines() if "beside the CUDA graphs' memory pool" in line]
    assert re.search(r"reached its size at the graph of the backward of micro-batch \d+: layer [02] mixer", line), line
