"""`plan` for GPT models with gated delta nets (`--experimental-attention-variant
gated_delta_net`, megatron-core 0.16+): each GDN layer priced by its kernels, the plan `memory`
measures."""

from __future__ import annotations

import pytest

from tests.test_gdn import GDN_IN_GPT
from tests.test_plan_hybrid import MODEL, assert_memory_measures_the_plans

GDN = ("--swiglu", "--experimental-attention-variant", "gated_delta_net", "--linear-num-key-heads",
       "4", "--linear-num-value-heads", "8", "--linear-key-head-dim", "64", "--linear-value-head-dim",
       "64", "--transformer-impl", "transformer_engine")  # fmt: skip
MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "([1]*1+[0]*1)*4")
CASES = {"dense, every 4th attention": ("--linear-attention-freq", "4", "--pp", "2"),
         "MoE mixed, a list": ("--linear-attention-freq", "([1]*3+[0]*1)*2", *MOE, "--pp", "2")}


@pytest.mark.slow
@pytest.mark.skipif(not GDN_IN_GPT, reason="GDN needs megatron-core 0.16")
@pytest.mark.parametrize("extra", list(CASES.values()), ids=list(CASES))
def test_memory_measures_the_plans_plan_prints(extra: tuple[str, ...]) -> None:
    # the plan's state from small builds of each (mixer, MLP) kind, its activations measured
    found = assert_memory_measures_the_plans((*MODEL, "--num-layers", "8", *GDN, *extra))
    assert all(any("chunked delta rule" in note for note in p["notes"]) for p in found["plans"])


@pytest.mark.skipif(not GDN_IN_GPT, reason="GDN needs megatron-core 0.16")
def test_a_gdn_layer_is_a_gdn_then_the_mlp_half() -> None:
    from inspector.formulas.ops import Shard
    from inspector.memory.closed.activations import layer_activations
    from inspector.plan.hybrid import gdn_layer_ops
    from inspector.plan.price import job_dims
    from tests.test_plan_hybrid import _job

    job = _job("", hybrid_override_pattern=None, num_layers=4, swiglu=True,
               experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
               linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
               linear_value_head_dim=64)  # fmt: skip
    dims = job_dims(job)
    assert [dims.layer_kind(i) for i in range(4)] == ["G-", "G-", "G-", "*-"]
    names = [op.name for op in gdn_layer_ops(dims, Shard(tp=2, micro_batch=1), False).forward]
    assert names.index("delta rule Q S") < names.index("out_proj") < names.index("pre-MLP norm")
    gdn, attention = (layer_activations(dims, job.layout, i, 1, "none", True) for i in (0, 3))
    assert gdn.core_attention == 0 < attention.core_attention and gdn.attention != attention.attention
