"""Megatron-Bridge's LoRA (--lora-rank): adapters on a frozen megatron model (world/lora.py).

Shapes and placements are re-derived by hand from Bridge's source (src/megatron/bridge/peft/,
the checkout this project reads): `get_adapter_attributes_from_linear` (peft/utils.py 549-679)
gives a column-parallel base in_features = its input, out_features = its local output x tp, and
a row-parallel base in_features = its local input x tp, out_features = its output;
`ParallelLinearAdapter` (1025-1065) builds linear_in = ColumnParallelLinear(in, dim) (weight
(dim / tp, in)) after a column-parallel base and RowParallelLinear(in, dim) (weight
(dim, in / tp)) after a row-parallel one, and linear_out = ColumnParallelLinear(dim, out)
(weight (out / tp, dim)) in both.
"""

from __future__ import annotations

import json

import pytest

H, HEADS, FFN, RANK, TP = 64, 4, 256, 8, 2
SMALL = ("--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
         "--ffn-hidden-size", str(FFN), "--seq-length", "64", "--vocab-size", "1000",
         "--tp", str(TP), "--bf16")  # fmt: skip
LORA = ("--lora-rank", str(RANK))
QKV = 3 * H  # no grouped-query attention: q, k and v of HEADS heads


def _rows(cli, *extra):
    result = cli("params", *SMALL, *extra, "--format", "json")
    assert result.code == 0, result.err
    return {p["name"]: p for p in json.loads(result.out)["parameters"]}


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_adapter_shapes_and_placement_follow_bridge_for_tp_2(cli, impl):
    rows = _rows(cli, *LORA, "--transformer-impl", impl)
    layer = "decoder.layers.1."
    expected = {
        # column-parallel bases: linear_in splits the rank, linear_out the base's output
        "self_attention.linear_qkv": ((RANK // TP, H), (QKV // TP, RANK)),
        "mlp.linear_fc1": ((RANK // TP, H), (FFN // TP, RANK)),
        # row-parallel bases: linear_in splits the base's input, linear_out the hidden size
        "self_attention.linear_proj": ((RANK, H // TP), (H // TP, RANK)),
        "mlp.linear_fc2": ((RANK, FFN // TP), (H // TP, RANK)),
    }
    for base, (linear_in, linear_out) in expected.items():
        got_in = rows[f"{layer}{base}.adapter.linear_in.weight"]
        got_out = rows[f"{layer}{base}.adapter.linear_out.weight"]
        assert (tuple(got_in["shape"]), tuple(got_out["shape"])) == (linear_in, linear_out), base
        kind = "RowParallelLinear" if base.endswith(("proj", "fc2")) else "ColumnParallelLinear"
        assert got_in["module"].startswith(kind) and got_out["module"].startswith(
            "ColumnParallelLinear"), base  # fmt: skip
        # the base keeps its own shape under `to_wrap`, as Bridge's LoRALinear registers it
        assert f"{layer}{base}.to_wrap.weight" in rows and f"{layer}{base}.weight" not in rows
        assert got_in["dtype"] == got_out["dtype"] == "bfloat16"  # cast with the model


def test_target_modules_pick_the_wrapped_linears(cli):
    rows = _rows(cli, *LORA, "--lora-target-modules", "linear_qkv")
    adapters = sorted(n for n in rows if ".adapter." in n)
    assert adapters == [f"decoder.layers.{i}.self_attention.linear_qkv.adapter.linear_{w}.weight"
                        for i in (0, 1) for w in ("in", "out")]  # fmt: skip


def _built(*extra: str):
    from inspector.job.job import make_job
    from inspector.world.build import build, select_view

    args = {"num_layers": 2, "hidden_size": H, "num_attention_heads": HEADS, "ffn_hidden_size": FFN,
            "seq_length": 64, "vocab_size": 1000, "tensor_model_parallel_size": TP, "bf16": True,
            "transformer_impl": "transformer_engine", "data_parallel_size": 2,
            "use_distributed_optimizer": True, "lora_rank": RANK}  # fmt: skip
    job = make_job(args)
    return build(job, select_view(job)).stages[0].chunks[0]


def test_frozen_parameters_have_no_grad_buffer_and_no_optimizer_state():
    chunk = _built()
    params = dict(chunk.module.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable == {n for n in params if ".adapter." in n} and len(trainable) == 16
    # megatron's DDP laid out only the adapters: the buffers' parameter elements are theirs
    buffers = chunk.buffers()
    assert sum(b.numel_unpadded for b in buffers) == sum(params[n].numel() for n in trainable)
    # the distributed optimizer's shards cover those elements once, nothing of the frozen model
    owned = sum(sum(b.owned_numel) for b in buffers)
    assert owned == sum(params[n].numel() for n in trainable)


def test_memory_counts_the_frozen_weights_and_only_the_adapters_state(cli):
    common = (*SMALL, "--micro-batch-size", "1", "--dp", "1", "--format", "json")
    full = json.loads(cli("memory", *common).out)["stages"][0]
    result = cli("memory", *common, *LORA)
    assert result.code == 0, result.err
    lora = json.loads(result.out)["stages"][0]
    adapters = 2 * (RANK // TP * H + QKV // TP * RANK + RANK * H // TP + H // TP * RANK
                    + RANK // TP * H + FFN // TP * RANK + RANK * FFN // TP + H // TP * RANK)  # fmt: skip
    # every weight stays on the GPU in bf16; gradients (fp32, Megatron-LM's default) and Adam's
    # fp32 master copy and two moments only for the adapters
    assert lora["weights"] == full["weights"] + 2 * adapters
    assert lora["gradients"] == 4 * adapters
    assert lora["optimizer"] == 12 * adapters
    assert lora["parameters"] == full["parameters"] + adapters


def test_layernorm_linear_returns_its_norm_output_as_bridge_asks():
    # Bridge sets return_layernorm_output (and, under sequence parallelism,
    # return_layernorm_output_gathered: peft/utils.py 620-643) on TELayerNormColumnParallelLinear;
    # TE 2.20.2 layernorm_linear.py 283-288 and 619-625 return the norm output, gathered over tp
    # in high precision (s x tp rows), and do not save it for a frozen weight (502)
    from tests.test_te_engine import OUT, B, S, _functions, _meta, _setup

    f = _functions()
    x, frozen, empty = _meta(S, B, H), _meta(OUT, H, grad=False), _meta(0, grad=False)
    for ret, rows in ((f.RETURN_LOCAL, S), (f.RETURN_GATHERED, S * TP)):
        out, ln_out = f.LayerNormLinearFunction.apply(x, _meta(H), _meta(H), frozen, empty,
                                                      _setup(sp=True), ret)  # fmt: skip
        assert tuple(ln_out.shape) == (rows, B, H) and tuple(out.shape) == (S * TP, B, OUT)
        saved = [t for t in out.grad_fn.saved_tensors if t is not None]
        assert all(t.shape != (S * B, H) or t is not ln_out for t in saved)
        assert out.grad_fn.saved_tensors[5] is None  # ln_out: not for a frozen weight


@pytest.mark.parametrize(("extra", "message"), [
    # megatron's ColumnParallelLinear divides linear_in's output (the rank) by --tp
    (("--lora-rank", "3"), "--lora-rank 3 is not divisible by --tp 2 (3 % 2 = 1)"),
    (("--lora-target-modules", "linear_qkv"), "--lora-target-modules needs --lora-rank"),
    (("--lora-rank", "4", "--lora-target-modules", "output_layer"),
     "--lora-target-modules output_layer is not one of: linear_qkv, linear_proj, linear_fc1"),
    (("--lora-rank", "0"), "--lora-rank 0 must be at least 1"),
    (("--lora-rank", "4", "--num-experts", "4"), "--lora-rank is modelled for dense GPT models"),
])  # fmt: skip
def test_bad_lora_flags_name_the_flag(cli, extra, message):
    result = cli("params", *SMALL, *extra)
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("Error: ") and message in result.err, result.err


def test_frozen_rows_have_no_owner_and_no_preconditioner_and_read_back(cli, tmp_path):
    # megatron's buffers and optimizer hold no frozen parameter: nobody owns its optimizer work
    rows = _rows(cli, *LORA, "--dp", "2")
    frozen = rows["decoder.layers.0.self_attention.linear_qkv.to_wrap.weight"]
    adapter = rows["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"]
    assert (frozen["partitioning_ranks"], frozen["precs"]) == ([], [])
    assert adapter["partitioning_ranks"] == [0] and adapter["precs"] == [[RANK // TP] * 2, [H, H]]
    table = tmp_path / "lora.csv"
    assert cli("params", *SMALL, *LORA, "--dp", "2", "-o", str(table)).code == 0
    assert "linear_qkv.to_wrap.weight;TELayerNormColumnParallelLinear" in table.read_text()
    assert f";({QKV // TP}, {H});;[]\n" in table.read_text()
    again = cli("params", *SMALL, *LORA, "--dp", "2", "--check", str(table))
    assert again.code == 0, again.err


def test_plan_refuses_lora_by_name(cli):
    # the planner composes a stage's memory from trained pieces: no frozen weights in it
    result = cli("plan", "--gpus", "8", "--global-batch-size", "16", *SMALL[:-3], *LORA)
    assert (result.code, result.out) == (2, "")
    assert result.err.startswith("Error: plan does not price --lora-rank")
