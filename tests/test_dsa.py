"""DeepSeek sparse attention (DSA): the fast_hadamard_transform stand-in, which megatron-core
builds it (0.18+; 0.16-0.17 have the modules, Megatron-LM cannot build them), and DSA jobs."""

from __future__ import annotations

import inspect
import json

import pytest

from inspector.job.dsa import DSA_BUILT_SINCE, DSA_MODULES_SINCE, DSA_WORKLOAD_SINCE
from inspector.job.versions import megatron_version

VERSION = megatron_version()
builds = pytest.mark.skipif(VERSION < DSA_BUILT_SINCE, reason="megatron-core 0.18+ builds DSA")
# `workload` writes DSA as megatron-core 0.19 builds it (report/workload_dsa.py)
writes = pytest.mark.skipif(VERSION < DSA_WORKLOAD_SINCE, reason="workload: megatron-core 0.19+'s DSA")

# Megatron-LM's functional test gpt3_mcore_te_tp2_pp2_dsa (its model_config.yaml), 2 layers, tp 1
DSA = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
       "--multi-latent-attention", "--q-lora-rank", "192", "--kv-lora-rank", "64",
       "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
       "--experimental-attention-variant", "dsa", "--disable-bias-linear",
       "--dsa-indexer-n-heads", "64", "--dsa-indexer-head-dim", "128", "--dsa-indexer-topk", "2048",
       "--dsa-indexer-loss-coeff", "0.01", "--transformer-impl", "transformer_engine", "--bf16"]  # fmt: skip


def _megatron():
    from inspector.world.setup import megatron

    return megatron()


def _transform():
    _megatron()  # installs the stand-ins before megatron-core, as every build does
    import fast_hadamard_transform

    assert fast_hadamard_transform.__stand_in__
    return fast_hadamard_transform.hadamard_transform


@pytest.mark.parametrize("dim", [128, 100])
def test_hadamard_stand_in_keeps_shape_dtype_and_saves_no_tensor(dim):
    import torch

    x = torch.empty(16, 2, 4, dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = _transform()(x, scale=dim**-0.5)
    # fast_hadamard_transform.cpp: one empty_like output of x's shape and dtype (a dim not a
    # multiple of 8 padded, then sliced off); HadamardTransformFn keeps only the scale
    assert (out.shape, out.dtype) == (x.shape, torch.bfloat16) and packed == []
    (grad,) = torch.autograd.grad(out, x, torch.empty_like(out))
    assert grad.shape == x.shape and grad.dtype == torch.bfloat16


def test_hadamard_stand_in_refuses_what_the_kernel_refuses():
    import torch

    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        _transform()(torch.empty(4, 8, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="at most 32768"):
        _transform()(torch.empty(2, 32769, device="meta"))


@pytest.mark.skipif(VERSION < DSA_MODULES_SINCE, reason="megatron-core 0.16 added dsa.py")
def test_megatrons_rotate_activation_runs_on_the_stand_in():
    import torch

    _megatron()
    from megatron.core.transformer.experimental_attention_variant import dsa

    q = torch.empty(32, 1, 64, 128, dtype=torch.bfloat16, device="meta")
    assert dsa.rotate_activation(q).shape == q.shape


def test_megatron_builds_dsa_from_its_specs_only_from_0_18():
    # the version facts job/dsa.py refuses by: 0.13-0.15 have no dsa.py; 0.16-0.17's
    # get_experimental_attention_variant_module_spec knows gated_delta_net alone
    _megatron()
    try:
        from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    except ImportError:
        assert VERSION < DSA_MODULES_SINCE
        return
    source = inspect.getsource(specs.get_experimental_attention_variant_module_spec)
    assert ('== "dsa"' in source) == (VERSION >= DSA_BUILT_SINCE)
    assert VERSION >= DSA_MODULES_SINCE


@pytest.mark.skipif(VERSION >= DSA_BUILT_SINCE, reason="megatron-core 0.18+ builds DSA")
def test_dsa_is_refused_by_name_with_the_version(cli):
    result = cli("params", *DSA)
    assert result.code == 2 and "--experimental-attention-variant dsa: megatron-core 0." in result.err
    assert ("gated_delta_net" in result.err) == (VERSION >= DSA_MODULES_SINCE)
def test_indexer_flags_need_the_variant(cli):
    result = cli("params", "--transformer-impl", "transformer_engine", "--dsa-indexer-topk", "8")
    assert result.code == 2
    assert result.err == "Error: --dsa-indexer-topk needs --experimental-attention-variant dsa\n"


@builds
def test_indexer_parameters_are_megatrons(cli):
    result = cli("params", *DSA, "--format", "json")
    assert result.code == 0, result.err
    rows = {p["name"]: p for p in json.loads(result.out)["parameters"]}
    indexer = "decoder.layers.0.self_attention.core_attention.indexer."
    # DeepSeek-V3.2-Exp inference/model.py `Indexer`: wq_b q_lora -> heads x head, wk h -> head,
    # k_norm LayerNorm(head), weights_proj h -> heads; duplicated on every tensor-parallel rank
    assert {k[len(indexer):]: tuple(v["shape"]) for k, v in rows.items() if k.startswith(indexer)} == {
        "linear_wq_b.weight": (64 * 128, 192), "linear_wk.weight": (128, 512),
        "k_norm.weight": (128,), "k_norm.bias": (128,), "linear_weights_proj.weight": (64, 512)}


def _peak(cli, heads: int, seq: int) -> int:
    result = cli("memory", *DSA, "--dsa-indexer-n-heads", str(heads), "--micro-batch-size", "1",
                 "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    activations = json.loads(result.out)["stages"][0]["activations"]
    assert activations["moment"].endswith("core_attention: FusedDSAIndexerLossBackward")
    return activations["total"]


@builds
def test_memory_holds_the_indexer_backwards_scores(cli):
    # The peak is megatron's recomputing indexer backward (dsa.py `bwd_fused_indexer_loss_naive`
    # at 0.19.2): at `grad_scores * relu_mask.float()` four [s, b, heads, s] tensors live per
    # indexer head: grad_scores fp32 (4 bytes), relu_mask bool (1), relu_mask.float() (4) and
    # the product (4), the relu'd fp32 scores deleted just before: 13 bytes per head, query and
    # key. Halving the heads (64 -> 32) takes 13 x 32 x s^2 off the peak, plus terms linear in s
    # (the saved q and weights); two sequence lengths separate the two.
    small, large = 2048, 4096
    d_small = _peak(cli, 64, small) - _peak(cli, 32, small)
    d_large = _peak(cli, 64, large) - _peak(cli, 32, large)
    quadratic = (d_large - 2 * d_small) / (large**2 - 2 * small**2)
    assert quadratic == 13 * 32


@builds
def test_memory_refuses_what_megatrons_dsa_refuses(cli):
    fused = cli("memory", *DSA, "--position-embedding-type", "rope", "--micro-batch-size", "1")
    assert fused.code == 2 and "needs --no-rope-fusion" in fused.err
    fp32 = [a for a in DSA if a != "--bf16"]
    result = cli("memory", *fp32, "--micro-batch-size", "1")
    assert result.code == 2 and result.err == (
        "Error: --experimental-attention-variant dsa needs --bf16: megatron's DSA indexer rotates "
        "bf16 inputs only (dsa.py rotate_activation)\n")


@builds
def test_dsa_with_context_parallelism_is_megatrons_refusal(cli):
    # megatron-core's TransformerConfig refuses DSA with context parallelism (0.18: any; 0.19: all
    # but cp_comm_type allgather): an error, not a job the tool leaves unmodelled
    result = cli("params", *DSA, "--context-parallel-size", "2", "--dp", "1")
    assert result.code == 2 and "refuse" in result.err and "megatron-core" in result.err
    assert "not modelled" not in result.err


@pytest.mark.skipif(VERSION < (0, 19), reason="megatron-core 0.19 takes DSA with all-gather CP")
@pytest.mark.parametrize("comm", [None, "p2p", "allgather"])
def test_megatrons_dsa_config_takes_all_gather_context_parallelism_only(comm):
    # the refusal above is megatron's own: Megatron-LM's default p2p and Bridge's None fail
    _megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    def config():
        return MLATransformerConfig(
            num_layers=2, hidden_size=512, num_attention_heads=8,
            experimental_attention_variant="dsa", dsa_indexer_n_heads=8, dsa_indexer_head_dim=64,
            dsa_indexer_topk=16, add_bias_linear=False, apply_rope_fusion=False,
            context_parallel_size=2, cp_comm_type=comm)  # fmt: skip

    if comm == "allgather":
        assert config().context_parallel_size == 2
    else:
        with pytest.raises(AssertionError, match="cp_comm_type=allgather only"):
            config()


@pytest.mark.skipif(VERSION < (0, 19), reason="megatron-core 0.19 added DSA's fused kernels")
def test_the_default_dsa_runs_megatrons_pytorch_path():
    # megatron-core 0.19's DSA tries TileLang or cuDNN kernels only with --dsa-kernel-backend
    # (TransformerConfig default "none"; the tool refuses the others): what runs is dsa.py's own
    _megatron()
    from types import SimpleNamespace

    from megatron.core.transformer.experimental_attention_variant import dsa_kernels

    config = SimpleNamespace(attention_backend="auto", dsa_kernel_backend="none")
    assert dsa_kernels.use_fused_dsa_kernels(config) is False


TP2 = ("--tp", "2", "--sequence-parallel", "--micro-batch-size", "1", "--seq-length", "256",
       "--max-position-embeddings", "256")  # fmt: skip


def _workload_rows(cli, *flags: str) -> list[list[str]]:
    result = cli("workload", *DSA, *TP2, *flags, "--gpu", "h100", "--stage", "0")
    assert result.code == 0, result.err
    return [line.split("\t") for line in result.out.splitlines()[2:]]


def _collectives(row: list[str]) -> tuple[str, int, str, int]:
    return row[3], int(row[4]), row[6], int(row[7])


@writes
def test_workload_writes_the_indexers_collectives(cli):
    rows = _workload_rows(cli)
    names = [row[0] for row in rows]
    layer = names[names.index("attention_column"):names.index("attention_row") + 1]
    assert layer == ["attention_column", "dsa_indexer_gather", "dsa_indexer_loss", "attention_row"]
    found = {row[0]: _collectives(row) for row in rows}
    # x (h = 512) and q's latent (192) of all 256 tokens in bf16, forward only (detached inputs);
    # the loss's (b, s, s) fp32 attention probabilities, forward and the backward's recompute
    assert found["dsa_indexer_gather"] == ("ALLGATHER", 2 * 256 * (512 + 192), "NONE", 0)
    assert found["dsa_indexer_loss"] == ("ALLREDUCE", 4 * 256 * 256, "ALLREDUCE", 4 * 256 * 256)
    # AbsorbedMLA gathers q's and kv's latents and the RoPE key, as MLA does
    assert found["attention_column"][:2] == ("ALLGATHER", 2 * 256 * (192 + 64 + 8))


@writes
def test_workload_without_the_indexer_loss_has_no_loss_all_reduce(cli):
    flags = [f for f in DSA if f not in ("--dsa-indexer-loss-coeff", "0.01")]
    result = cli("workload", *flags, *TP2, "--gpu", "h100", "--stage", "0")
    assert result.code == 0, result.err
    assert "dsa_indexer_gather" in result.out and "dsa_indexer_loss" not in result.out


@builds
@pytest.mark.skipif(VERSION >= DSA_WORKLOAD_SINCE, reason="megatron-core 0.19+: workload writes it")
def test_workload_names_the_release_where_megatron_builds_dsa_otherwise(cli):
    # version fact: megatron-core 0.18 builds DSA inside plain MLA, its MTP layers without the
    # indexer; 0.19 inside AbsorbedMLASelfAttention, the indexer in the MTP layers too
    result = cli("workload", *DSA, *TP2, "--gpu", "h100", "--stage", "0")
    assert (result.code, result.out) == (2, "")
    assert "megatron-core 0.18 builds it otherwise" in result.err, result.err


def _megatrons_indexer_collectives(cli, monkeypatch) -> list[tuple[str, str, int]]:
    """Run megatron's DSA forward and backward (`memory`) and record each collective a frame of
    dsa.py calls: (its dsa.py function, the collective, its whole buffer's bytes)."""
    import traceback

    import torch

    _megatron()
    from megatron.core.tensor_parallel import mappings

    calls: list[tuple[str, str, int]] = []

    def caller() -> str | None:
        frames = [f.name for f in traceback.extract_stack() if f.filename.endswith("/dsa.py")]
        return frames[-1] if frames else None

    def spy(name: str, real, buffer_of):
        def call(*args, **kwargs):
            if (where := caller()) is not None:
                tensor = buffer_of(args)
                calls.append((where, name, tensor.numel() * tensor.element_size()))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(mappings, "dist_all_gather_func",
                        spy("ALLGATHER", mappings.dist_all_gather_func, lambda a: a[0]))  # fmt: skip
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        spy("ALLREDUCE", torch.distributed.all_reduce, lambda a: a[0]))  # fmt: skip
    result = cli("memory", *DSA, *TP2, "--num-layers", "1", "--format", "json")
    assert result.code == 0, result.err
    return calls


@builds
def test_the_records_are_the_collectives_megatrons_dsa_runs(cli, monkeypatch):
    calls = _megatrons_indexer_collectives(cli, monkeypatch)
    gather, loss = 2 * 256 * (512 + 192), 4 * 256 * 256
    # the indexer gathers x and qr; the loss all-reduces forward and in its recomputing backward
    assert sorted(set(calls)) == sorted({
        ("forward_before_topk", "ALLGATHER", 2 * 256 * 512),
        ("forward_before_topk", "ALLGATHER", 2 * 256 * 192),
        ("compute_dsa_indexer_loss", "ALLREDUCE", loss),
        ("bwd_fused_indexer_loss_naive", "ALLREDUCE", loss)})  # fmt: skip
    assert sum(b for where, op, b in set(calls) if op == "ALLGATHER") == gather


@pytest.mark.skipif(not DSA_BUILT_SINCE <= VERSION < (0, 19), reason="megatron-core 0.18's DSA")
def test_0_18_needs_the_indexer_loss_weight(cli):
    # megatron-core 0.18's DSAttention runs the indexer loss in every training step and fails on
    # `kl_div * None` (dsa.py compute_dsa_indexer_loss): named, not megatron's TypeError
    args = [a for a in DSA if a not in ("--dsa-indexer-loss-coeff", "0.01")]
    result = cli("memory", *args, "--micro-batch-size", "1")
    assert result.code == 2 and "needs --dsa-indexer-loss-coeff" in result.err, result.err
    assert "megatron-core 0.18" in result.err


@builds
def test_mtp_layers_take_the_indexer_from_0_19(cli):
    # Megatron-LM's gpt_builders.py gives the MTP layers the last decoder layer's spec: core_v0.19.0
    # the experimental-attention one (with the indexer), core_v0.18.2 plain MLA's
    result = cli("params", *DSA, "--mtp-num-layers", "1", "--position-embedding-type", "none",
                 "--format", "json")  # fmt: skip
    assert result.code == 0, result.err
    names = [p["name"] for p in json.loads(result.out)["parameters"]]
    mtp = "mtp.layers.0.mtp_model_layer.self_attention.core_attention.indexer.linear_wk.weight"
    assert (mtp in names) == (VERSION >= (0, 19))


# HybridModel's D layers (megatron-core 0.18+): Megatron-LM turns MLA and DSA on from the pattern
HYBRID = [a for a in DSA if a not in ("--multi-latent-attention", "--experimental-attention-variant",
                                      "dsa")]  # fmt: skip
HYBRID[HYBRID.index("--num-layers") + 1] = "4"


def test_hybrid_d_layers_need_megatron_core_0_18(cli):
    result = cli("params", *HYBRID, "--hybrid-override-pattern", "MD-D", "--multi-latent-attention")
    if VERSION >= DSA_BUILT_SINCE:
        assert result.code == 0, result.err
        assert result.out.count("core_attention.indexer.linear_wk.weight") == 2
        assert "hybrid: 1 Mamba, 2 DSA, 1 MLP" in cli("memory", *HYBRID, "--hybrid-override-pattern",
                                                       "MD-D", "--micro-batch-size", "1").out
    else:
        assert result.code == 2 and "D (DeepSeek sparse attention, megatron-core 0.18+) layers are " \
            "not modelled yet" in result.err


@builds
def test_hybrid_d_layers_refuse_attention_beside_them(cli):
    result = cli("params", *HYBRID, "--hybrid-override-pattern", "M*-D")
    assert result.code == 2 and result.err == (
        "Error: --hybrid-layer-pattern M*-D: megatron-core builds no attention (*) beside DSA (D) "
        "layers (\"Not supported to have both Attention and MLA/DSA in one model\")\n")


@builds
def test_hybrid_d_layers_run_in_memory_and_count_no_flops(cli):
    from inspector.formulas.hybrid_flops import hybrid_layer_flops
    from inspector.job.job import Job
    from inspector.job.model_args import make_model_config

    # Megatron-LM core_v0.19.0's hybrid FLOPs formula counts no D layer
    model = make_model_config({"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                               "hybrid_override_pattern": "MD-D", "q_lora_rank": 192,
                               "kv_lora_rank": 64, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8,
                               "v_head_dim": 16, "disable_bias_linear": True, "bf16": True,
                               "dsa_indexer_n_heads": 64, "dsa_indexer_head_dim": 128,
                               "dsa_indexer_topk": 2048, "transformer_impl": "transformer_engine"})  # fmt: skip
    assert model.dsa and model.multi_latent_attention
    assert hybrid_layer_flops(model, Job(model=model).dims(), "D", 1) == 0
    result = cli("memory", *HYBRID, "--hybrid-override-pattern", "MD-D", "--micro-batch-size", "1",
                 "--format", "json")  # fmt: skip
    assert result.code == 0, result.err


@builds
def test_memory_is_the_same_run_after_run(cli):
    # megatron keeps DSA's loss scale and loss tracker on its classes (world/dsa.py
    # fresh_dsa_state): without a fresh start a second run in the process would skip the scale's
    # allocation, or index a tracker sized for another model's layers
    args = (*DSA, "--dsa-indexer-loss-coeff", "0.01", "--micro-batch-size", "1", "--format", "json")
    first = cli("memory", *args)
    assert first.code == 0 and first.out == cli("memory", *args).out
    persistent = json.loads(first.out)["stages"][0]["buffers"]["persistent"]
    assert ["layer 0 self_attention.core_attention", 512] in persistent  # the scale, one scalar


@writes
def test_workload_gives_hybrid_d_layers_and_mtp_layers_the_indexer(cli):
    # each D of a hybrid pattern is a DSA layer; megatron-core 0.19's MTP layers hold the indexer
    hybrid = cli("workload", *HYBRID, "--hybrid-override-pattern", "MD-D", *TP2, "--gpu", "h100",
                 "--stage", "0")  # fmt: skip
    assert hybrid.code == 0, hybrid.err
    assert hybrid.out.count("\ndsa_indexer_gather\t") == 2
    mtp = ("--mtp-num-layers", "1", "--position-embedding-type", "none")
    names = [row[0] for row in _workload_rows(cli, *mtp)]
    assert names.count("dsa_indexer_gather") == 2 and "mtp1_dsa_indexer_gather" in names
