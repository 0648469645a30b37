"""DeepSeek sparse attention (DSA) jobs: which megatron-core builds them, and what it refuses.

megatron-core 0.16 added DSA's modules (transformer/experimental_attention_variant/dsa.py) and
TransformerConfig's `experimental_attention_variant` and `dsa_indexer_*` fields, which
Megatron-LM reads as arguments. Megatron-LM's gpt_builders.py builds a model with
--experimental-attention-variant through megatron's
`get_transformer_block_with_experimental_attention_variant_spec`, whose
`get_experimental_attention_variant_module_spec` knows "dsa" only from 0.18 (core_v0.16.1 and
core_v0.17.1 build gated_delta_net alone and raise "Invalid experimental attention variant: dsa").
HybridModel's `D` layers (0.18+) are the same layer in a hybrid pattern (`infer_from_pattern`).
"""

from __future__ import annotations

from typing import Any

from inspector.errors import ConfigError
from inspector.job.checks import check_at_least_one
from inspector.job.hybrid_model import DSA_SYMBOL
from inspector.job.model import DSA_FIELDS, ModelConfig
from inspector.job.versions import megatron_version

# first megatron-core with DSA's modules, and first whose layer specs build them from a config
DSA_MODULES_SINCE = (0, 16)
DSA_BUILT_SINCE = (0, 18)


def _installed() -> str:
    major, minor = megatron_version()
    return f"megatron-core {major}.{minor}"


def validate_dsa(config: ModelConfig) -> None:
    """Raise ConfigError for a DSA model this megatron-core (or Megatron-LM) does not build."""
    if not config.dsa:
        if DSA_SYMBOL in (config.hybrid_override_pattern or ""):
            return  # D layers this megatron-core lacks: job/hybrid_model.py names the version
        for name in DSA_FIELDS[1:]:
            if getattr(config, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} needs --experimental-attention-variant dsa")
        return
    if megatron_version() < DSA_MODULES_SINCE:
        raise ConfigError(f"--experimental-attention-variant dsa: {_installed()} has no DeepSeek "
                          "sparse attention (megatron-core 0.16 added it, 0.18 builds it)")  # fmt: skip
    if megatron_version() < DSA_BUILT_SINCE:
        raise ConfigError(
            f"--experimental-attention-variant dsa: {_installed()} has DSA's modules but its "
            "get_experimental_attention_variant_module_spec builds only gated_delta_net, so "
            "Megatron-LM stops (\"Invalid experimental attention variant: dsa\"); megatron-core "
            "0.18 and later build it"
        )
    for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        value = getattr(config, name)
        if value is None:
            raise ConfigError(f"--experimental-attention-variant dsa needs --{name.replace('_', '-')}"
                              " (DSAIndexer's size; megatron-core has no default)")  # fmt: skip
        check_at_least_one("--" + name.replace("_", "-"), value)
    if not config.multi_latent_attention:
        raise ConfigError("--experimental-attention-variant dsa needs --multi-latent-attention "
                          "(megatron-core: \"Currently only MLA supports sparse attention\")")  # fmt: skip
    _validate_indexer_rope(config)
    if not config.disable_bias_linear:
        raise ConfigError(
            "--experimental-attention-variant dsa needs --disable-bias-linear (megatron-core 0.19's "
            "AbsorbedMLASelfAttention requires add_bias_linear False)"
        )
    pattern = config.hybrid_override_pattern or ""
    if config.hybrid and DSA_SYMBOL not in pattern:
        raise ConfigError("--experimental-attention-variant dsa in a hybrid model: its DSA layers "
                          "are D in --hybrid-layer-pattern (megatron-core 0.18+)")  # fmt: skip
    if DSA_SYMBOL in pattern and "*" in pattern.split("/")[0]:
        raise ConfigError(f"--hybrid-layer-pattern {pattern}: megatron-core builds no attention "
                          "(*) beside DSA (D) layers (\"Not supported to have both Attention and "
                          "MLA/DSA in one model\")")  # fmt: skip


def infer_from_pattern(values: dict[str, object]) -> None:
    """Turn MLA and DSA on for a hybrid pattern with D layers, as Megatron-LM 0.18+ does
    (core_v0.19.0 arguments.py `validate_args`: "Infer use of MLA from unified pattern";
    argument_utils.py `core_transformer_config_from_args`: experimental_attention_variant 'dsa')."""
    pattern = values.get("hybrid_override_pattern")
    if isinstance(pattern, str) and DSA_SYMBOL in pattern and megatron_version() >= DSA_BUILT_SINCE:
        values["multi_latent_attention"] = True
        values["experimental_attention_variant"] = "dsa"


def _validate_indexer_rope(config: ModelConfig) -> None:
    """DSAIndexer splits each head into a part without RoPE and `qk_pos_emb_head_dim` with it."""
    rope = config.mla_args()["qk_pos_emb_head_dim"]
    head = config.dsa_indexer_head_dim or 0
    if head < rope:
        raise ConfigError(f"--dsa-indexer-head-dim {head} is smaller than --qk-pos-emb-head-dim "
                          f"{rope}: DSAIndexer splits each head into {head} - {rope} channels "
                          "without RoPE and the RoPE channels")  # fmt: skip


def check_dsa_layout(config: ModelConfig, cp: int) -> None:
    """Raise ConfigError for DSA with context parallelism, which megatron-core refuses as the tool
    runs context parallelism: 0.18's TransformerConfig asserts context_parallel_size 1, 0.19's
    (transformer_config.py __post_init__, 0.19.2) takes all-gather CP only, and the tool runs
    Megatron-LM's default --cp-comm-type p2p (Megatron-Bridge leaves cp_comm_type None, which
    0.19 refuses as well)."""
    if not config.dsa or cp == 1:
        return
    if megatron_version() < DSA_CP_SINCE:
        raise ConfigError(f"--context-parallel-size {cp} with DSA: {_installed()} refuses it "
                          "(TransformerConfig asserts context_parallel_size 1 for DSAttention); "
                          "megatron-core 0.19 takes --cp-comm-type allgather")  # fmt: skip
    raise ConfigError(
        f"--context-parallel-size {cp} with DSA and --cp-comm-type p2p (Megatron-LM's default; "
        "Megatron-Bridge leaves it unset) is refused by megatron-core (TransformerConfig."
        "__post_init__ asserts 'DSAttention context parallelism currently supports "
        "cp_comm_type=allgather only.'); this tool runs context parallelism as p2p, so "
        "--cp-comm-type allgather is not simulated"
    )


# megatron-core 0.19: DSA with context parallelism, all-gather only
DSA_CP_SINCE = (0, 19)


def check_dsa_run(config: ModelConfig, rope_fusion: bool) -> None:
    """Raise ConfigError for a DSA job megatron refuses to run: fused RoPE (TransformerConfig:
    "RoPE fusion is not supported for DSAttention"; Megatron-LM keeps --apply-rope-fusion on with
    --position-embedding-type rope), parameters other than bf16 (dsa.py `rotate_activation`:
    "rotate_activation only support bf16 input"), or 0.18 without the indexer loss's weight."""
    if not config.dsa:
        return
    te_rope = config.transformer_impl == "transformer_engine" and rope_fusion
    if te_rope and config.position_embedding_type == "rope":
        raise ConfigError("--experimental-attention-variant dsa with --position-embedding-type "
                          "rope needs --no-rope-fusion (megatron-core: \"RoPE fusion is not "
                          "supported for DSAttention\")")  # fmt: skip
    if not config.bf16:
        raise ConfigError("--experimental-attention-variant dsa needs --bf16: megatron's DSA "
                          "indexer rotates bf16 inputs only (dsa.py rotate_activation)")  # fmt: skip
    if config.dsa_indexer_loss_coeff is None and megatron_version() < DSA_ABSORBED_SINCE:
        raise ConfigError(
            f"--experimental-attention-variant dsa on {_installed()} needs "
            "--dsa-indexer-loss-coeff: its DSAttention computes the indexer's loss in every "
            "training step and multiplies it by the coefficient (dsa.py compute_dsa_indexer_loss "
            "`kl_div * loss_coeff`, which fails on None; 0.19 skips the loss without it)"
        )


# the megatron-core whose DSA layer `workload` writes (report/workload_dsa.py reads 0.19.2's)
DSA_WORKLOAD_SINCE = (0, 19)


def refuse_dsa(config: ModelConfig, command: str) -> None:
    """Refuse the top-k shared across DSA layers in `plan` and `workload` (`command`), and DSA
    in `workload` before megatron-core 0.19, whose DSA layer report/workload_dsa.py writes."""
    if not config.dsa:
        return
    if (config.dsa_indexer_topk_freq or 1) > 1:
        done = "price" if command == "plan" else "write"
        raise ConfigError(
            f"{command} does not {done} --dsa-indexer-topk-freq {config.dsa_indexer_topk_freq} "
            "yet (it gives every DSA layer an indexer; megatron builds none where the top-k "
            "is reused): tree, params, diff and memory run it"
        )
    if command == "plan":
        return
    if megatron_version() < DSA_WORKLOAD_SINCE:
        raise ConfigError(
            f"workload writes DeepSeek sparse attention as megatron-core 0.19 builds it "
            f"(AbsorbedMLASelfAttention, the indexer in the MTP layers too); {_installed()} "
            "builds it otherwise: tree, params, diff and memory run it"
        )


# megatron-core 0.19: DSAttention inside AbsorbedMLASelfAttention (absorbed_mla.py)
DSA_ABSORBED_SINCE = (0, 19)


def absorbed() -> bool:
    """Return whether the installed megatron-core runs DSA inside absorbed MLA (0.19+): its
    sparse attention `_unfused_absorbed_dsa_fn` on one latent key head, else (0.18)
    `unfused_dsa_fn` on MLA's per-head query, key and value."""
    return megatron_version() >= DSA_ABSORBED_SINCE


def indexer_loss(dims: Any) -> bool:
    """Return whether megatron trains the indexer's KL loss (and so keeps the indexer's tensors
    for backward): 0.18 in every training step (DSAttention.forward, dsa.py:1066-1081 at 0.18.2,
    a coefficient of None failing in megatron's own `kl_div * loss_coeff`), 0.19 with
    --dsa-indexer-loss-coeff above 0 (dsa.py:1888-1894 at 0.19.2)."""
    return not absorbed() or bool(dims.dsa_indexer_loss_coeff)
