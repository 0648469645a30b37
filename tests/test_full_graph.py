"""memory/engine/full_graph.py: full-iteration CUDA graphs (--cuda-graph-impl local --cuda-graph-scope
full_iteration), against hand counts from megatron-core's full_cuda_graph.py and GPTDataset."""

from __future__ import annotations

import pytest

from tests.test_cuda_graphs import SEQ, _job
from tests.test_versions import CUDA_GRAPHS_MODELLED

# before 0.16 every CUDA graph is refused by version (test_cuda_graphs.py
# test_before_megatron_core_0_16_the_graphs_are_refused), full-iteration ones included
pytestmark = pytest.mark.skipif(not CUDA_GRAPHS_MODELLED, reason="refused before 0.16 (test_versions)")

FULL = dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"])
# GPTDataset.__getitem__ (megatron-core datasets/gpt_dataset.py), micro-batch 1: tokens and labels
# int64 [1, s], the causal mask [1, 1, s, s] of bools, loss mask fp32 [1, s], position ids int64
# [1, s]; each its own block (the caching allocator rounds to 512 bytes)
BATCH = 8 * SEQ + 8 * SEQ + SEQ * SEQ + 4 * SEQ + 8 * SEQ


def test_a_batch_is_the_datasets_five_tensors():
    from inspector.memory.engine.full_graph import batch_bytes

    assert batch_bytes(_job(**FULL)) == BATCH


@pytest.mark.parametrize(("pp", "vpp", "stages"), [(1, None, (8,)), (4, None, (8, 0, 0, 8)),
                                                   (2, 2, (8, 8))])  # fmt: skip
def test_the_first_and_last_stages_keep_every_micro_batchs_batch(pp, vpp, stages):
    from inspector.memory.engine.full_graph import static_batches

    # StaticBufferLoader copies each of the 8 micro-batches (global batch 8, dp 1); Megatron-LM
    # builds a data iterator for the first and the last virtual stage only (one chunk each)
    flags = dict(pipeline_model_parallel_size=pp, **FULL)
    if vpp:
        flags["num_virtual_stages_per_pipeline_rank"] = vpp
    job = _job(**flags)
    assert tuple(static_batches(job, s) for s in range(pp)) == tuple(n * BATCH for n in stages)


def test_memory_keeps_the_batches_and_the_pool_beside_the_optimizer_step():
    from inspector.memory.engine.run import run_memory

    eager = run_memory(_job(), 0)
    graphed = run_memory(_job(**FULL), 0)
    kept = dict(graphed.persistent)
    assert kept["CUDA graphs' static inputs (8 micro-batches' batches)"] == 8 * BATCH
    pool = next(size for what, size in kept.items() if "memory pool" in what)
    # the pool is the eager forward-backward without the batch get_batch would copy (its
    # tensors are the static ones): one micro-batch in flight without a pipeline
    assert pool == eager.peak.bytes - BATCH
    assert "optimizer step" in graphed.peak.moment
    assert graphed.static + graphed.peak.bytes == eager.static + pool + 8 * BATCH + graphed.peak.bytes
    # torch.cuda.graph frees the iteration's activations into its pool: reserved, not allocated
    # after the capture, so mem-allocated-bytes leaves the pool out and its peak is the capture's
    assert graphed.graph_pool == pool
    assert graphed.allocated_peak == max(pool, graphed.peak.bytes)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (dict(cuda_graph_impl="local", cuda_graph_scope=["attn"]), "--cuda-graph-impl local with "
         "--cuda-graph-scope attn is not modelled: megatron-core's own per-layer CUDA graphs"),
        (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration", "attn"]),
         "pass full_iteration alone"),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["full_iteration"]),
         "please use cuda_graph_impl=local"),
    ],
)  # fmt: skip
def test_other_local_graphs_are_refused(flags, error):
    from inspector.errors import ConfigError

    with pytest.raises(ConfigError, match=error):
        _job(**flags)


@pytest.mark.parametrize(("scope", "refused"), [(None, False), (["attn"], True),
                                                ("full_iteration", False)])  # fmt: skip
def test_a_scripts_local_graphs_are_refused_beside_its_other_refusals(scope, refused):
    from inspector.inputs.refusals import validate_args_refusals

    # a script's refusals are gathered so one error names them all: local's partial scopes
    # (CudaGraphManager) are one of them, local's whole layers and full_iteration are not
    args = {"cuda_graph_impl": "local", "cuda_graph_scope": scope}
    found = validate_args_refusals(["--cuda-graph-impl"], "train.sh", args)
    named = ["--cuda-graph-impl local with --cuda-graph-scope attn"]
    assert [r.argument for r in found] == (named if refused else [])
