"""Muon (`--optimizer muon`, `dist_muon`) as megatron-core 0.16 and 0.18-0.19 build it: who owns
which whole matrix, each rank's optimizer bytes, the Emerging-Optimizers stand-in, and the version
refusals. Run with each megatron-core's python (/work/venvs/mc-0.19.2/bin/python -m pytest ...).

The expectations are re-derived from megatron-core 0.16.1's own source, not read from the tool:
optimizer/muon.py `get_megatron_muon_optimizer` gives TensorParallelMuon every 2-D parameter
without `is_embedding_or_output_parameter` (set on the word embeddings and the output layer only,
models/common/language_module), Adam the rest; layer_wise_optimizer.py `shard_params` sorts the
parameters by numel and deals them ping-pong over the data-parallel ranks. Per owned element:
the fp32 master copy of a bf16 weight (4 bytes) and Muon's momentum (4) or Adam's moments (8).
megatron-core 0.18.2 / 0.19.2 take the same parameters through optimizer/emerging_optimizers.py's
`_is_nonlinear_or_embedding` (the same predicate: embedding/output, or not 2-D, go to Adam).
"""

from __future__ import annotations

import json
import typing

import pytest
import torch

from inspector.job.versions import megatron_version, muon_modelled, muon_registry

MODELLED = muon_modelled()
LAYER_WISE = muon_modelled(layer_wise=True)
VERSION = megatron_version()
needs_muon = pytest.mark.skipif(not MODELLED, reason="megatron-core 0.16-0.19's Muon")
needs_layer_wise = pytest.mark.skipif(not LAYER_WISE, reason="megatron-core 0.16-0.19's dist_muon")
# 0.18+: the layer-wise optimizer as 0.16-0.17 build it is Megatron-LM's legacy path behind this flag
LEGACY = ("--no-use-layer-wise-param-layout",) if muon_registry() else ()
MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1000",
         "--bf16")  # fmt: skip


def _params(cli, *flags: str) -> list[dict]:
    result = cli("params", *MODEL, "--partitioning", "distopt", "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["parameters"]


def _memory(cli, *flags: str) -> dict:
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--format", "json", *flags)
    assert result.code == 0, result.err
    return json.loads(result.out)["stages"][0]


def _muon_taken(row: dict) -> bool:
    """muon.py: 2-D, and not the word embeddings or output layer (is_embedding_or_output_parameter)."""
    name = row["name"]
    return len(row["shape"]) == 2 and "word_embeddings" not in name and "output_layer" not in name


def _owned_bytes(row: dict) -> int:
    return row["numel"] * (4 + (4 if _muon_taken(row) else 8))


@needs_layer_wise
def test_dist_muon_deals_whole_matrices_ping_pong(cli):
    # was: "--optimizer dist_muon is not modelled"
    dp = 4
    rows = _params(cli, "--dp", str(dp), "--optimizer", "dist_muon", *LEGACY)
    assert all(len(r["partitioning_ranks"]) == 1 for r in rows)  # one owner, the whole parameter
    deal = list(range(dp)) + list(range(dp))[::-1]  # layer_wise_optimizer.py's ping-pong loop
    dealt = [deal[i % len(deal)] for i in range(len(rows))]
    owners = [r["partitioning_ranks"][0] for r in rows]
    assert sorted(owners) == sorted(dealt)  # as many parameters per rank as the deal gives
    largest = max(rows, key=lambda r: r["numel"])  # unique: sorted last, dealt last
    assert largest["name"] == "embedding.word_embeddings.weight"
    assert sum(r["numel"] == largest["numel"] for r in rows) == 1
    assert largest["partitioning_ranks"] == [dealt[-1]]


@needs_layer_wise
def test_each_ranks_optimizer_bytes_are_its_matrices(cli):
    dp = 4
    rows = _params(cli, "--dp", str(dp), "--optimizer", "dist_muon", *LEGACY)
    expected = {str(rank): 0 for rank in range(dp)}
    for row in rows:
        expected[str(row["partitioning_ranks"][0])] += _owned_bytes(row)
    stage = _memory(cli, "--dp", str(dp), "--optimizer", "dist_muon", *LEGACY)
    assert stage["optimizer_by_rank"] == expected
    assert stage["optimizer"] == max(expected.values())  # the stage's most loaded rank
    owner = next(r for r in rows if r["name"] == "embedding.word_embeddings.weight")
    assert stage["largest_held_by"] == {"embedding.word_embeddings.weight":
                                        owner["partitioning_ranks"][0]}  # fmt: skip


@needs_layer_wise
def test_the_imbalance_is_in_the_report(cli):
    # Megatron-LM #2163: the largest matrices are dealt to the last ranks of the deal
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--dp", "4", "--optimizer", "dist_muon",
                 *LEGACY)  # fmt: skip
    assert result.code == 0, result.err
    line = next(x for x in result.out.splitlines() if "optimizer state" in x)
    assert line.startswith("Stage 0: optimizer state ")
    assert line.endswith("by rank; embedding.word_embeddings.weight on data-parallel rank 3."), line


@needs_muon
def test_plain_muon_keeps_everything_on_every_rank(cli):
    rows = _params(cli, "--dp", "2", "--optimizer", "muon")
    assert all(r["partitioning_ranks"] == [0, 1] for r in rows)
    muon = _memory(cli, "--dp", "2", "--optimizer", "muon")
    adam = _memory(cli, "--dp", "2")
    assert muon["optimizer"] == sum(_owned_bytes(r) for r in rows)
    # Adam's second moment is what Muon does not keep for its matrices
    assert adam["optimizer"] - muon["optimizer"] == 4 * sum(r["numel"] for r in rows if _muon_taken(r))
    assert set(muon["optimizer_by_rank"].values()) == {muon["optimizer"]}
    assert (muon["weights"], muon["gradients"]) == (adam["weights"], adam["gradients"])


@needs_muon
def test_newton_schulz_makes_the_peak_of_a_wide_model(cli):
    result = cli("memory", "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads",
                 "8", "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size",
                 "1000", "--bf16", "--micro-batch-size", "1", "--optimizer", "muon")  # fmt: skip
    assert result.code == 0, result.err
    assert "peak" in result.out and "at the optimizer step: muon " in result.out, result.out


@pytest.mark.skipif(VERSION != (0, 16), reason="Megatron-LM 0.16's checks")
@pytest.mark.parametrize(("flags", "said"), [
    (("--use-distributed-optimizer",), "--optimizer muon with --use-distributed-optimizer is "
     "refused by Megatron-LM 0.16 (validate_args: \"Muon optimizer does not support distributed "
     "optimizer for now.\"); --optimizer dist_muon shards it layer-wise"),
    (("--overlap-grad-reduce",), "--optimizer muon with --overlap-grad-reduce is refused by "
     "Megatron-LM 0.16 (validate_args: \"Muon optimizer does not support overlap grad reduce for "
     "now.\"); --optimizer dist_muon shards it layer-wise"),
])  # fmt: skip
def test_what_megatron_lm_0_16_refuses_with_muon(cli, flags, said):
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--dp", "2", "--optimizer", "muon",
                 *flags)
    assert result.code == 2
    assert result.err.strip() == f"Error: {said}", result.err


@pytest.mark.skipif(VERSION != (0, 17), reason="Megatron-LM 0.17's checks")
@pytest.mark.parametrize(("optimizer", "flag", "said"), [
    ("muon", "--overlap-grad-reduce", "--optimizer muon with --overlap-grad-reduce is refused by "
     "Megatron-LM 0.17 (validate_args: \"Muon optimizer does not support overlap grad reduce. Use "
     "dist_muon instead.\")"),
    ("dist_muon", "--overlap-grad-reduce", "--optimizer dist_muon with --overlap-grad-reduce is not "
     "modelled on megatron-core 0.17 (its layer-wise optimizer's overlapped all-gather)"),
    ("dist_muon", "--use-distributed-optimizer", "--optimizer dist_muon with "
     "--use-distributed-optimizer is refused by Megatron-LM 0.17 (validate_args: \"Muon optimizer "
     "does not support distributed optimizer for now.\"); --optimizer dist_muon shards it "
     "layer-wise"),
])  # fmt: skip
def test_what_megatron_lm_0_17_refuses_with_muon(cli, optimizer, flag, said):
    # core_v0.17.1 validate_args: the overlaps refused for muon only (0.16: for dist_muon too)
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--dp", "2", "--optimizer", optimizer,
                 flag)  # fmt: skip
    assert result.code == 2
    assert result.err.strip() == f"Error: {said}", result.err


@needs_muon
@pytest.mark.skipif(not muon_registry(), reason="Megatron-LM 0.18+'s checks")
def test_megatron_lm_0_18_lets_muon_overlap_the_grad_reduce(cli):
    # 0.16's "Muon optimizer does not support overlap grad reduce for now." is gone in 0.18's
    # validate_args; DDP's overlap is Adam's, the optimizer state Muon's
    plain = _memory(cli, "--dp", "2", "--optimizer", "muon")
    overlapped = _memory(cli, "--dp", "2", "--optimizer", "muon", "--overlap-grad-reduce")
    assert overlapped["optimizer"] == plain["optimizer"]


@needs_muon
@pytest.mark.skipif(not muon_registry(), reason="megatron-core 0.18+")
def test_the_registry_builds_tensor_parallel_muon_from_the_stand_in():
    # optimizer/emerging_optimizers.py subclasses the package's OrthogonalizedOptimizer at import:
    # the stand-in is in sys.modules before megatron-core is imported (world/fastimport.py)
    from inspector.world import emerging, setup

    setup.megatron()
    from megatron.core.optimizer import emerging_optimizers as registry

    assert registry.HAVE_EMERGING_OPTIMIZERS
    assert issubclass(registry.TensorParallelMuon, emerging.OrthogonalizedOptimizer)
    assert registry.get_supported_coefficient_types() == tuple(emerging.COEFFICIENT_STEPS)
    assert set(registry._EMERGING_OPTIMIZERS) == {"muon", "adaptive_muon"}


@pytest.mark.skipif(megatron_version() >= (0, 16), reason="before 0.16 only")
def test_releases_before_muon_refuse_it_as_megatron_lm_does(cli):
    result = cli("memory", *MODEL, "--micro-batch-size", "1", "--optimizer", "muon")
    assert result.code == 2
    assert "--optimizer muon is refused by Megatron-LM: --optimizer muon is a choice of " \
        "Megatron-LM 0.16+" in result.err


# The stand-in against Emerging-Optimizers' source (orthogonalized_optimizers/muon_utils.py,
# orthogonalized_optimizer.py, muon.py): what each allocates, and its one formula.


def test_scale_factor_is_emerging_optimizers_formula():
    from inspector.world.emerging import get_muon_scale_factor

    assert get_muon_scale_factor(512, 128, "spectral") == 512**0.5  # max(out, in) ** 0.5
    assert get_muon_scale_factor(512, 128, "shape_scaling") == 2.0  # max(1, out / in) ** 0.5
    assert get_muon_scale_factor(128, 512, "shape_scaling") == 1.0
    assert get_muon_scale_factor(128, 512, "unit_rms_norm") == 0.5  # (out / in) ** 0.5


class _Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm"):
            self.seen.append((func.overloadpacket.__name__, out.dtype, tuple(out.shape)))
        return out


def test_newton_schulz_iterates_on_the_smaller_side_in_bf16():
    from inspector.world.emerging import fp32_matmul_precision, newton_schulz

    x = torch.zeros(96, 32, device="meta")  # rows > columns: muon_utils.py transposes
    with fp32_matmul_precision("medium"), _Matmuls() as seen:
        out = newton_schulz(x, steps=5)
    assert (out.shape, out.dtype) == (x.shape, torch.float32)
    # per step: A = X @ X.mT (32 x 32), B = addmm(A, A, A), X = addmm(X, B, X) (32 x 96), in bf16
    step = [("mm", torch.bfloat16, (32, 32)), ("addmm", torch.bfloat16, (32, 32)),
            ("addmm", torch.bfloat16, (32, 96))]  # fmt: skip
    assert seen.seen == step * 5
    with fp32_matmul_precision("highest"), _Matmuls() as seen:
        newton_schulz(x, steps=5)
    assert {dtype for _, dtype, _ in seen.seen} == {torch.float32}


def test_orthogonalized_step_keeps_one_fp32_momentum_per_matrix():
    from inspector.world.emerging import OrthogonalizedOptimizer

    weight = torch.nn.Parameter(torch.zeros(8, 4))
    weight.grad = torch.ones(8, 4)
    optimizer = OrthogonalizedOptimizer([weight], lr=0.1, momentum_beta=0.9, use_nesterov=True,
                                        weight_decay=0.01, scaled_orthogonalize_fn=lambda g: g)  # fmt: skip
    optimizer.step()
    (state,) = optimizer.state.values()
    assert list(state) == ["momentum_buffer"]
    assert (state["momentum_buffer"].shape, state["momentum_buffer"].dtype) == ((8, 4), torch.float32)
    bias = torch.nn.Parameter(torch.zeros(4))
    bias.grad = torch.ones(4)
    with pytest.raises(ValueError, match="does not support 1D parameters"):
        OrthogonalizedOptimizer([bias], lr=0.1, momentum_beta=0.9).step()


@needs_layer_wise
def test_expert_matrices_are_dealt_over_the_expert_data_parallel_ranks(cli):
    # layer_wise_optimizer.py: groups with is_expert_parallel go to the expert data-parallel deal;
    # dp 4 with ep 2 leaves 4 / 2 = 2 expert data-parallel ranks
    rows = _params(cli, "--dp", "4", "--num-experts", "4", "--ep", "2", "--moe-ffn-hidden-size",
                   "128", "--swiglu", "--disable-bias-linear", "--optimizer", "dist_muon", *LEGACY)  # fmt: skip
    experts = [r for r in rows if r["expert"] is not None]
    dense = [r for r in rows if r["expert"] is None]
    assert experts and {o for r in experts for o in r["partitioning_ranks"]} == {0, 1}
    assert {o for r in dense for o in r["partitioning_ranks"]} == {0, 1, 2, 3}


def test_the_stand_in_speaks_the_packages_0_2_names():
    # megatron-core 0.17.1 muon.py / 0.19.2 emerging_optimizers.py call, with emerging-optimizers
    # >= 0.2, OrthogonalizedOptimizer.__init__(..., nesterov=...) and newton_schulz_tp(..., tp_mode=...)
    from inspector.world.emerging import NSCoeffT, OrthogonalizedOptimizer, newton_schulz_tp

    weight = torch.nn.Parameter(torch.zeros(8, 4))
    optimizer = OrthogonalizedOptimizer([weight], 0.1, 0.9, nesterov=True, weight_decay=0.01,
                                        weight_decay_method="decoupled")  # fmt: skip
    assert optimizer.param_groups[0]["use_nesterov"] is True
    x = torch.zeros(96, 32, device="meta")
    assert newton_schulz_tp(x, 5, "quintic", None, partition_dim=None, tp_mode="duplicated").shape == x.shape
    assert typing.get_args(NSCoeffT) == ("simple", "quintic", "polar_express", "aol")


@needs_layer_wise
@pytest.mark.skipif(not muon_registry(), reason="Megatron-LM 0.18+'s spelling")
def test_muon_with_the_distributed_optimizer_is_dist_muon_on_its_legacy_path(cli):
    # core_v0.19.2 validate_args: muon with --use-distributed-optimizer sets
    # use_layer_wise_distributed_optimizer and turns use_distributed_optimizer off (Megatron-LM's
    # functional test gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon spells it so)
    spelled = ("--optimizer", "muon", "--use-distributed-optimizer", "--no-use-layer-wise-param-layout")
    legacy = ("--optimizer", "dist_muon", "--no-use-layer-wise-param-layout")
    assert _memory(cli, "--dp", "4", *spelled) == _memory(cli, "--dp", "4", *legacy)
    assert _params(cli, "--dp", "4", *spelled) == _params(cli, "--dp", "4", *legacy)
