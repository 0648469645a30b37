"""Checks of a gated delta net (GDN) model's arguments, before megatron-core builds it.

megatron-core builds GatedDeltaNet (ssm/gated_delta_net.py) in two ways: GPTModel's
`--experimental-attention-variant gated_delta_net` from 0.16 (Megatron-LM's gpt_builders.py
gives it `get_transformer_block_with_experimental_attention_variant_spec`: a GDN layer where
`--linear-attention-freq` says 1, standard attention where it says 0), and the `G` layers of a
hybrid pattern from 0.17. TransformerConfig.__post_init__ asserts the sizes below (core_v0.16.1
transformer_config.py 948-985); these checks say the same in one sentence naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from inspector.errors import ConfigError
from inspector.job.model import ModelConfig
from inspector.job.versions import megatron_version

VARIANT = "gated_delta_net"
GPT_SINCE = (0, 16)  # TransformerConfig.experimental_attention_variant, attention_output_gate
# TransformerConfig's defaults (transformer_config.py core_v0.16.1 and 0.19.2, "linear attention")
DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip


@dataclass(frozen=True)
class GdnShape:
    """GatedDeltaNet's sizes (`__init__`): key/query and value heads and their head sizes."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def in_width(self) -> int:
        """Return in_proj's output: q, k (key heads x key size each), v, gate z (value heads x
        value size each), beta and alpha (one per value head)."""
        qk, v = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        return 2 * qk + 2 * v + 2 * self.value_heads

    @property
    def conv_width(self) -> int:
        """Return the causal convolution's channels: q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def gdn_shape(config: ModelConfig) -> GdnShape:
    """Return GatedDeltaNet's sizes, TransformerConfig's defaults where unset."""
    value = {name: getattr(config, name) or default for name, default in DEFAULTS.items()}
    return GdnShape(value["linear_num_key_heads"], value["linear_num_value_heads"],
                    value["linear_key_head_dim"], value["linear_value_head_dim"],
                    value["linear_conv_kernel_dim"])  # fmt: skip


def gdn_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Return, per decoder layer, whether GPTModel builds a GDN there: megatron's
    `get_linear_attention_pattern` (an int N: every N-th layer standard attention; a list: 1 GDN)."""
    freq = config.linear_attention_freq
    if config.experimental_attention_variant != VARIANT or freq is None:
        return (False,) * config.num_layers
    if isinstance(freq, tuple):
        return tuple(bool(x) for x in freq)
    return tuple((i + 1) % freq != 0 for i in range(config.num_layers))


def validate_gdn(config: ModelConfig, tp: int, cp: int) -> None:
    """Raise ConfigError for GDN arguments megatron would refuse (tp, cp: the tensor- and
    context-parallel sizes)."""
    _validate_version(config)
    given = [name for name in (*DEFAULTS, "linear_attention_freq") if getattr(config, name)]
    if not config.gdn:
        if given:
            raise ConfigError(
                f"--{given[0].replace('_', '-')} has no effect without --experimental-attention-"
                "variant gated_delta_net or G layers in --hybrid-override-pattern"
            )
        return
    if config.experimental_attention_variant == VARIANT:
        _validate_gpt_variant(config)
    if not config.swiglu:
        raise ConfigError(
            "gated delta net layers need --swiglu: GatedDeltaNet's causal convolution runs the "
            "model's activation, and megatron-core asserts it is SiLU (ssm/gated_delta_net.py "
            "forward: `assert self.activation in ['silu', 'swish']`)"
        )
    shape = gdn_shape(config)
    if shape.value_heads % shape.key_heads:
        raise ConfigError(
            f"--linear-num-value-heads {shape.value_heads} is not a multiple of "
            f"--linear-num-key-heads {shape.key_heads} ({shape.value_heads} % {shape.key_heads} "
            f"= {shape.value_heads % shape.key_heads}); megatron-core's TransformerConfig asserts it"
        )
    for flag, heads in (("--linear-num-key-heads", shape.key_heads),
                        ("--linear-num-value-heads", shape.value_heads)):  # fmt: skip
        if heads % tp:
            raise ConfigError(f"{flag} {heads} is not divisible by --tp {tp} ({heads} % {tp} = "
                              f"{heads % tp}); megatron-core's TransformerConfig asserts it")  # fmt: skip
    if cp > 1:
        raise ConfigError(
            f"--context-parallel-size {cp} with gated delta net layers: megatron-core 0.16 and "
            "0.17's TransformerConfig refuses it ('Gated delta net does not support context "
            "parallel for now'), and GDN's own context-parallel all-to-alls of 0.18 and later "
            "are not modelled"
        )


def _validate_version(config: ModelConfig) -> None:
    installed = megatron_version()
    if installed >= GPT_SINCE:
        return
    for flag, used in (("--experimental-attention-variant", config.experimental_attention_variant),
                       ("--attention-output-gate", config.attention_output_gate)):  # fmt: skip
        if used:
            raise ConfigError(
                f"{flag} needs megatron-core 0.16 or newer: {installed[0]}.{installed[1]} has no "
                f"TransformerConfig.{flag[2:].replace('-', '_')} (gated delta net, "
                "ssm/gated_delta_net.py, came in 0.16)"
            )


def _validate_gpt_variant(config: ModelConfig) -> None:
    if config.hybrid:
        raise ConfigError(
            "--experimental-attention-variant gated_delta_net builds GPTModel's GDN layers; a "
            "hybrid model's gated delta nets are the G layers of its pattern: pass one or the other"
        )
    if config.transformer_impl != "transformer_engine":
        raise ConfigError(
            f"--experimental-attention-variant gated_delta_net with --transformer-impl "
            f"{config.transformer_impl}: megatron-core's experimental block spec 'only supports "
            "transformer engine implementation'; drop --transformer-impl"
        )
    freq = config.linear_attention_freq
    if freq is None:
        raise ConfigError(
            "--experimental-attention-variant gated_delta_net needs --linear-attention-freq "
            "(megatron-core: 'linear_attention_freq must be set for linear gated_delta_net')"
        )
    if isinstance(freq, tuple) and len(freq) != config.num_layers:
        raise ConfigError(
            f"--linear-attention-freq has {len(freq)} layers but --num-layers is "
            f"{config.num_layers}; megatron-core needs one 1 (GDN) or 0 (attention) a layer"
        )
    if isinstance(freq, int) and freq < 1:
        raise ConfigError(f"--linear-attention-freq {freq} must be at least 1")
