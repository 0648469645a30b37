"""Property tests over random configurations: valid ones keep every invariant, invalid ones fail cleanly.

The number of examples per run is set by the hypothesis profile (`ci`: 300 valid configurations).
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.counting import parameter_count

pytestmark = pytest.mark.slow  # hypothesis over random jobs: ~22 s of CPU

settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def valid_configs(draw) -> dict:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([4, 8]))
    gqa = draw(st.booleans()) and heads > 1
    groups = draw(st.sampled_from(divisors(heads)[:-1])) if gqa else heads
    tp = draw(st.sampled_from(divisors(groups)))
    pp = draw(st.integers(1, 4))
    per_stage = draw(st.integers(1, 3))
    vpp = draw(st.sampled_from([None, 2])) if pp > 1 else None
    layers = pp * per_stage * (vpp or 1)
    dp = draw(st.sampled_from([1, 2, 4]))
    moe = draw(st.booleans())
    swiglu = draw(st.booleans())
    ffn = draw(st.sampled_from([None, 24, 40]))
    if swiglu and ffn is None and heads * head_dim < 24:
        ffn = 24  # Megatron-LM's SwiGLU size rule rounds small models down to 0
    c = dict(
        layers=layers,
        heads=heads,
        groups=groups,
        gqa=gqa,
        hidden=heads * head_dim,
        tp=tp,
        pp=pp,
        vpp=vpp,
        dp=dp,
        vocab=draw(st.integers(tp, 3000)),
        seq=draw(st.sampled_from([8, 32])),
        untie=draw(st.booleans()),
        bias=draw(st.booleans()),
        swiglu=swiglu,
        rms=draw(st.booleans()),
        rope=draw(st.booleans()),
        ffn=ffn,
        experts=None,
        ep=1,
    )
    if moe:
        c["experts"] = draw(st.sampled_from([2, 4]))
        c["ep"] = draw(st.sampled_from([e for e in divisors(c["experts"]) if (tp * dp) % e == 0]))
        c["moe_ffn"] = draw(st.sampled_from([8, 16]))
        # portable across megatron-core 0.13-0.16: 0.13 refuses MoE biases, and expert parallelism
        # with tensor parallelism without sequence parallelism (which needs apex's LayerNorm)
        c["bias"] = False
        if c["ep"] > 1 and tp > 1:
            c["rms"], c["sp"] = False, True
    return c


def flags(c: dict) -> list[str]:
    f = [
        "--num-layers",
        c["layers"],
        "--hidden-size",
        c["hidden"],
        "--num-attention-heads",
        c["heads"],
        "--seq-length",
        c["seq"],
        "--vocab-size",
        c["vocab"],
        "--tp",
        c["tp"],
        "--pp",
        c["pp"],
        "--dp",
        c["dp"],
    ]
    if c["gqa"]:
        f += ["--group-query-attention", "--num-query-groups", c["groups"]]
    if c["vpp"]:
        f += ["--num-virtual-stages-per-pipeline-rank", c["vpp"]]
    if c["ffn"]:
        f += ["--ffn-hidden-size", c["ffn"]]
    for key, flag in (("untie", "--untie-embeddings-and-output-weights"), ("swiglu", "--swiglu")):
        if c[key]:
            f.append(flag)
    if not c["bias"]:
        f.append("--disable-bias-linear")
    if c["rms"]:
        f += ["--normalization", "RMSNorm"]
    if c["rope"]:
        f += ["--position-embedding-type", "rope"]
    if c.get("sp"):
        f.append("--sequence-parallel")
    if c["experts"]:
        # expert tensor parallel 1: megatron supports MoE biases only there
        f += [
            "--num-experts",
            c["experts"],
            "--moe-ffn-hidden-size",
            c["moe_ffn"],
            "--ep",
            c["ep"],
            "--expert-tensor-parallel-size",
            "1",
        ]
    return [str(x) for x in f]


def expected_count(c: dict) -> int:
    """Total parameters of the model, from the architecture alone (tests/counting.py)."""
    args = {
        "num_layers": c["layers"], "hidden_size": c["hidden"], "num_attention_heads": c["heads"],
        "group_query_attention": True, "num_query_groups": c["groups"], "seq_length": c["seq"],
        "vocab_size": c["vocab"], "ffn_hidden_size": c["ffn"], "disable_bias_linear": not c["bias"],
        "swiglu": c["swiglu"], "normalization": "RMSNorm" if c["rms"] else "LayerNorm",
        "position_embedding_type": "rope" if c["rope"] else "learned_absolute",
        "untie_embeddings_and_output_weights": c["untie"], "num_experts": c["experts"],
        "moe_ffn_hidden_size": c.get("moe_ffn"),
    }  # fmt: skip
    return parameter_count(args, tp=c["tp"])


@given(valid_configs())
def test_valid_configs_keep_every_invariant(cli, c):
    args = flags(c)
    result = cli("params", *args, "--format", "json")
    assert result.code == 0, (args, result.err)
    rows = json.loads(result.out)["parameters"]
    # conservation: the unsharded sizes add up to the architecture's parameter count
    assert sum(math.prod(r["global_shape"]) for r in rows if not r["tied"]) == expected_count(c)
    layer_homes: dict[int, set] = {}
    for r in rows:
        m = re.match(r"decoder\.layers\.(\d+)\.", r["name"])
        if m:
            layer_homes.setdefault(int(m.group(1)), set()).add((r["stage"], r["chunk"]))
        # owners are data-parallel ranks, at least one per row
        assert r["partitioning_ranks"] and all(0 <= o < c["dp"] for o in r["partitioning_ranks"])
        # precs: one [d, d] per dimension, none for 1-D parameters and embedding tables
        embedding = r["name"].startswith("embedding.") or r["tied"]
        want = [] if len(r["shape"]) < 2 or embedding else [[d, d] for d in r["shape"]]
        assert r["precs"] == want, r["name"]
    assert sorted(layer_homes) == list(range(c["layers"]))
    assert all(len(h) == 1 for h in layer_homes.values())
    assert len({r["name"] for r in rows}) == len(rows)
    # byte-identical output from run to run
    assert cli("params", *args, "--format", "json").out == result.out


@st.composite
def invalid_configs(draw) -> list[str]:
    base = {
        "--num-layers": "4",
        "--hidden-size": "32",
        "--num-attention-heads": "4",
        "--vocab-size": "100",
    }
    flag = draw(
        st.sampled_from(
            [
                "--num-layers",
                "--hidden-size",
                "--num-attention-heads",
                "--tp",
                "--pp",
                "--dp",
                "--vocab-size",
                "--num-query-groups",
                "--num-experts",
                "--ep",
                "--stage",
                "--rank",
                "--block-size",
                "--num-virtual-stages-per-pipeline-rank",
                "--decoder-first-pipeline-num-layers",
                "--seq-length",
                "--max-position-embeddings",
                "--ffn-hidden-size",
                "--kv-channels",
            ]
        )
    )
    value = draw(
        st.one_of(
            st.integers(-3, 0),
            st.integers(3, 7).map(lambda v: v * 13),
            st.sampled_from(["x", "1.5", "", "-"]),
        )
    )
    base[flag] = str(value)
    if flag == "--num-query-groups":
        base["--group-query-attention"] = ""
    args = []
    for k, v in base.items():
        args += [k] if v == "" and k == "--group-query-attention" else [k, v]
    return args


@settings(max_examples=150)
@given(invalid_configs())
def test_invalid_configs_fail_cleanly(cli, args):
    result = cli("params", *args)
    if result.code == 0:
        return  # some random values happen to be valid
    assert result.code == 2, (args, result.err)
    assert result.out == ""
    assert result.err.startswith("Error: ") and result.err.count("\n") == 1, result.err
    assert "Traceback" not in result.err
