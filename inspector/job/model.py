"""The model to build: its architecture (ModelConfig), resolved from presets, files and flags.

Argument names and defaults follow Megatron-LM (`megatron/training/arguments.py`); the default model
is GPT-2 small as Megatron-LM trains it. The parallel layout lives in topology.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from inspector.job import fp4, fp8
from inspector.job.lora import LORA_TARGETS


@dataclass(frozen=True)
class ModelConfig:
    """A GPT model's architecture in Megatron-LM's terms (defaults: GPT-2 small)."""

    num_layers: int = 12
    hidden_size: int = 768
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 12
    group_query_attention: bool = False
    num_query_groups: int | None = None
    kv_channels: int | None = None
    seq_length: int = 1024
    max_position_embeddings: int | None = None
    vocab_size: int = 50257
    make_vocab_size_divisible_by: int = 128
    # Megatron-LM 0.18+'s --padded-vocab-size: the embedding rows as given (None: pad vocab_size)
    padded_vocab_size: int | None = None
    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    bf16: bool = False
    fp16: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_latent_size: int | None = None  # LatentMoE's routed-expert width (moe_layer.py)
    moe_grouped_gemm: bool = False
    multi_latent_attention: bool = False
    transformer_impl: str = "local"
    # FP8 through Transformer Engine (inspector/job/fp8.py); None: no fp8
    fp8_format: str | None = None
    fp8_recipe: str = fp8.DEFAULT_RECIPE
    fp8_amax_history_len: int = fp8.DEFAULT_AMAX_HISTORY_LEN
    fp8_param_gather: bool = False  # TE's fp8 parameters (TransformerConfig.fp8_param)
    # attention in fp8 (job/fp8_attention.py), TransformerConfig's field
    fp8_dot_product_attention: bool = False
    # MXFP8 weights all-gathered through the grad buffer (DDP and OptimizerConfig's flag)
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    # NVFP4 through Transformer Engine (inspector/job/fp4.py); None: no fp4
    fp4_format: str | None = None
    fp4_recipe: str = fp4.FP4_RECIPES[0]
    fp4_param_gather: bool = False  # TE's NVFP4 parameters (TransformerConfig.fp4_param)
    # the first and last layers in 16 bits under fp8 or fp4 (TransformerConfig's fields)
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = fp4.DEFAULT_BF16_LAYERS
    num_layers_at_end_in_bf16: int = fp4.DEFAULT_BF16_LAYERS
    # None: simulate apex where megatron can use it (LayerNorm models); see docs/how-it-works.md, "apex".
    apex: bool | None = None
    # Multi-latent attention (None: Megatron-LM's default, see `mla_args`).
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    rotary_scaling_factor: float | None = None
    rope_type: str | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    mtp_num_layers: int | None = None
    mtp_use_repeated_layer: bool = False  # one MTP layer run at each depth (TransformerConfig's)
    # Megatron-Bridge's LoRA (job/lora.py): the adapters' rank (None: no adapters, nothing frozen)
    # and the linears they wrap; in `to_args` only when set
    lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: str = "aux_loss"  # TransformerConfig's default
    moe_router_pre_softmax: bool = False
    # the router's logits and routing dtype (router.py `gating`: fp32 or fp64; None: the input's)
    moe_router_dtype: str | None = None
    # --moe-permute-fusion: TE's fused permutation (moe_utils.py permute/unpermute/sort_chunks_by_idxs
    # `fused=True`: world/te/kernels/permutation.py) in place of megatron's torch ops
    moe_permute_fusion: bool = False
    # node-limited routing (moe_utils.py group_limited_topk); None: every expert open to a token
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # Hybrid models (megatron-core's MambaModel, HybridModel from 0.18): the layer pattern or the
    # ratios Megatron-LM's pretrain_mamba.py passes, and the Mamba mixers' sizes (None: megatron's
    # TransformerConfig defaults). Left out of `to_args` while unset (HYBRID_FIELDS).
    hybrid_override_pattern: str | None = None
    hybrid_attention_ratio: float | None = None
    hybrid_mlp_ratio: float | None = None
    is_hybrid_model: bool = False
    mamba_state_dim: int | None = None
    mamba_head_dim: int | None = None
    mamba_num_groups: int | None = None
    mamba_num_heads: int | None = None
    # TransformerConfig's experimental attention variant: "dsa" (DeepSeek-V3.2's sparse attention
    # on MLA layers, megatron-core 0.18+ builds it) or "gated_delta_net" (below). DSA's fields
    # are left out of `to_args` while unset (DSA_FIELDS).
    experimental_attention_variant: str | None = None
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    dsa_indexer_loss_coeff: float | None = None
    dsa_indexer_use_sparse_loss: bool = False
    # megatron-core 0.19's IndexShare (None: TransformerConfig's 1 and 0, no sharing)
    dsa_indexer_topk_freq: int | None = None
    dsa_indexer_skip_topk_offset: int | None = None

    @property
    def dsa(self) -> bool:
        """Return whether the attention layers are DeepSeek sparse attention (DSA)."""
        return self.experimental_attention_variant == "dsa"

    @property
    def hybrid(self) -> bool:
        """Return whether megatron builds this model as a hybrid (MambaModel / HybridModel)."""
        ratios = (self.hybrid_attention_ratio or 0.0) + (self.hybrid_mlp_ratio or 0.0)
        return self.is_hybrid_model or self.hybrid_override_pattern is not None or ratios > 0
    # gpt-oss: quick-GELU gated MLP, attention sinks, sliding-window layers (model_args.py parses)
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    softmax_type: str = "vanilla"
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    # Gated delta net (GDN): megatron-core 0.16+'s experimental attention variant gated_delta_net
    # in GPTModel, `G` layers of a 0.17+ hybrid pattern; the linear-attention sizes (None:
    # TransformerConfig's defaults, job/gdn.py) and Qwen3-Next's gated attention. Left out of
    # `to_args` while unset (GDN_FIELDS).
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    attention_output_gate: bool = False

    @property
    def gdn(self) -> bool:
        """Return whether megatron builds gated delta net layers: GPTModel's experimental
        attention variant, or `G` in a hybrid pattern."""
        pattern = self.hybrid_override_pattern or ""
        return self.experimental_attention_variant == "gated_delta_net" or "G" in pattern

    @property
    def ffn_size(self) -> int:
        """Return the MLP hidden size with Megatron-LM's default rules applied."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron-LM arguments.py: "Reduce the dimension for MLP since projections happens on
            # two linear layers. This keeps the number of parameters in the same ballpark".
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Return the number of key/value groups (= heads without grouped-query attention)."""
        if self.group_query_attention and self.num_query_groups is not None:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Return the projection size per head (Megatron-LM's kv_channels default)."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """Return the learned position table size (Megatron-LM defaults it to seq_length)."""
        return self.max_position_embeddings or self.seq_length

    @property
    def use_apex(self) -> bool:
        """Return whether norms are apex's FusedLayerNorm, as on a cluster with apex."""
        if self.apex is None:
            return self.normalization == "LayerNorm"
        return self.apex

    @property
    def dtype_name(self) -> str:
        """Return the parameter dtype's name as Megatron-LM picks it from --bf16/--fp16."""
        return "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"

    def mla_args(self) -> dict[str, Any]:
        """Return MLATransformerConfig's fields with Megatron-LM's argument defaults filled in.

        Megatron-LM `arguments.py` `_add_mla_args` (--q-lora-rank None, --kv-lora-rank 32,
        --qk-head-dim 128, --qk-pos-emb-head-dim 64, --v-head-dim 128, --rotary-scaling-factor
        1.0, --mscale 1.0, --mscale-all-dim 0.0); `core_transformer_config_from_args` copies them
        all and leaves `rope_type` to MLATransformerConfig ("yarn") when --rope-type is not given.
        """
        values: dict[str, Any] = {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": _default(self.kv_lora_rank, 32),
            "qk_head_dim": _default(self.qk_head_dim, 128),
            "qk_pos_emb_head_dim": _default(self.qk_pos_emb_head_dim, 64),
            "v_head_dim": _default(self.v_head_dim, 128),
            "rotary_scaling_factor": _default(self.rotary_scaling_factor, 1.0),
            "mscale": _default(self.mscale, 1.0),
            "mscale_all_dim": _default(self.mscale_all_dim, 0.0),
        }
        if self.rope_type is not None:
            values["rope_type"] = self.rope_type
        return values

    def transformer_fields(self) -> dict[str, Any]:
        """Return the architecture as megatron-core's TransformerConfig fields, defaults applied.

        The one map from this record to megatron's names: world/config.py adds the layout and
        torch's dtypes to it to build TransformerConfig, and ModelDims (job/dims.py) takes the
        fields it names, so a new model field is mapped here once. As Megatron-LM
        `core_transformer_config_from_args` does: the arguments TransformerConfig shares are
        copied, --num-experts becomes `num_moe_experts`, --swiglu a gated linear unit (SiLU),
        --disable-bias-linear `add_bias_linear` False; MoE fields only with experts, MTP where set.
        """
        fields: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.query_groups,
            kv_channels=self.head_dim,
            normalization=self.normalization,
            add_bias_linear=not self.disable_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            qk_layernorm=self.qk_layernorm,
            bf16=self.bf16,
            fp16=self.fp16,
        )
        if self.swiglu or self.quick_geglu:
            fields["gated_linear_unit"] = True
        fields.update(self._gpt_oss_fields())
        fields.update(
            fp8.fp8_fields(
                self.fp8_format, self.fp8_recipe, self.fp8_amax_history_len, self.fp8_param_gather
            )
        )
        if self.fp8_dot_product_attention:
            fields["fp8_dot_product_attention"] = True
        fields.update(fp4.fp4_fields(self.fp4_format, self.fp4_recipe, self.fp4_param_gather, (
            self.first_last_layers_bf16, self.num_layers_at_start_in_bf16,
            self.num_layers_at_end_in_bf16,
        )))  # fmt: skip
        fields.update(self._moe_fields())
        if self.mtp_num_layers is not None:
            fields["mtp_num_layers"] = self.mtp_num_layers
        if self.mtp_use_repeated_layer:
            fields["mtp_use_repeated_layer"] = True
        for name in HYBRID_FIELDS:
            if name.startswith(("mamba_", "is_")) and getattr(self, name):
                fields[name] = getattr(self, name)
        for name in GDN_FIELDS:
            value = getattr(self, name)
            if value:  # a tuple pattern here; megatron takes a list (world/config.py)
                fields[name] = value
        if self.multi_latent_attention:
            # --multi-latent-attention picks MLATransformerConfig, which takes the MLA arguments.
            fields.update(multi_latent_attention=True, **self.mla_args())
        fields.update({name: getattr(self, name) for name in DSA_FIELDS if getattr(self, name)})
        return fields

    def yarn_attributes(self) -> dict[str, Any]:
        """Return the `yarn_*` attributes GPTModel's yarn branch reads off its config (none
        unless --position-embedding-type yarn without MLA), as Megatron-LM 0.19 sets them
        (argument_utils.py `_apply_yarn_config_from_args`: --rotary-scaling-factor, --mscale,
        --mscale-all-dim, and the --yarn-* numerics at their defaults)."""
        if self.position_embedding_type != "yarn" or self.multi_latent_attention:
            return {}
        return {
            "yarn_rotary_scaling_factor": _default(self.rotary_scaling_factor, 1.0),
            "yarn_original_max_position_embeddings": 4096,
            "yarn_beta_fast": 32.0,
            "yarn_beta_slow": 1.0,
            "yarn_mscale": _default(self.mscale, 1.0),
            "yarn_mscale_all_dim": _default(self.mscale_all_dim, 0.0),
            "yarn_correction_range_round_to_int": True,
        }

    def _gpt_oss_fields(self) -> dict[str, Any]:
        """Return gpt-oss's TransformerConfig fields where set (older megatron-core lacks them).

        Megatron-LM reads --glu-linear-offset, --activation-func-clamp-value, --softmax-type,
        --window-size and --window-attn-skip-freq as TransformerConfig's own fields (arguments.py
        `ArgumentGroupFactory(TransformerConfig)`); --quick-geglu's activation is added with
        torch's (world/config.py)."""
        fields: dict[str, Any] = {}
        if self.glu_linear_offset:
            fields["glu_linear_offset"] = self.glu_linear_offset
        if self.activation_func_clamp_value is not None:
            fields["activation_func_clamp_value"] = self.activation_func_clamp_value
        if self.softmax_type != "vanilla":
            fields["softmax_type"] = self.softmax_type
        if self.window_size is not None:
            fields["window_size"] = self.window_size
            freq = self.window_attn_skip_freq
            fields["window_attn_skip_freq"] = list(freq) if isinstance(freq, tuple) else freq
        return fields

    def _moe_fields(self) -> dict[str, Any]:
        """Return TransformerConfig's MoE fields (none without --num-experts)."""
        if self.num_experts is None:
            return {}
        fields: dict[str, Any] = dict(
            num_moe_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size or self.ffn_size,
            moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
            moe_grouped_gemm=self.moe_grouped_gemm,
            moe_layer_freq=self.moe_layer_freq,  # a tuple here; megatron takes a list
            moe_router_score_function=self.moe_router_score_function,
            moe_router_enable_expert_bias=self.moe_router_enable_expert_bias,
            moe_router_load_balancing_type=self.moe_router_load_balancing_type,
            moe_router_pre_softmax=self.moe_router_pre_softmax,
        )
        if self.moe_shared_expert_gate:
            fields["moe_shared_expert_gate"] = True
        if self.moe_latent_size is not None:
            fields["moe_latent_size"] = self.moe_latent_size
        if self.moe_router_dtype is not None:
            fields["moe_router_dtype"] = self.moe_router_dtype
        if self.moe_permute_fusion:
            fields["moe_permute_fusion"] = True
        for name in ("moe_router_num_groups", "moe_router_group_topk"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields

    def is_moe_layer(self, layer: int) -> bool:
        """Return whether 0-based `layer` has an MoE MLP (megatron's `moe_layer_freq` rule)."""
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return bool(self.moe_layer_freq[layer])
        return layer % self.moe_layer_freq == 0

    def every_layer_moe(self) -> bool:
        """Return whether every layer has an MoE MLP (`is_moe_layer` of each, without the loop
        where `moe_layer_freq` is a number: only 1 makes every layer MoE)."""
        if self.num_experts is None:
            return False
        if isinstance(self.moe_layer_freq, tuple):
            return all(self.moe_layer_freq[i] for i in range(self.num_layers))
        return all(i % self.moe_layer_freq == 0 for i in range(min(self.num_layers, 2)))

    def embedding_rows(self, tensor_parallel_size: int) -> int:
        """Return the vocabulary padded as Megatron-LM does for this tensor-parallel size.

        Megatron-LM `megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding`: pad up to a
        multiple of make_vocab_size_divisible_by * tensor_model_parallel_size. megatron-core has no
        such function (padding happens in Megatron-LM's training code), so this is the one formula
        standing in for it. A given --padded-vocab-size is taken as it is (Megatron-LM 0.18+,
        megatron/core/tokenizers/utils/build_tokenizer.py `_set_padded_vocab_size`: padding only
        "if None").
        """
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def to_args(self) -> dict[str, Any]:
        """Return the fields as Megatron-LM arguments (for headers and caches); --padded-vocab-size,
        --moe-latent-size and the hybrid fields only where they are given, gpt-oss's layer fields
        only away from their defaults (and the low-precision ones of job/fp4.py and
        job/fp8_attention.py), so a job without them reads as before."""
        optional = ("padded_vocab_size", "moe_latent_size", "moe_router_dtype", "moe_permute_fusion",
                    *HYBRID_FIELDS,
                    *DSA_FIELDS, *GDN_FIELDS)  # fmt: skip
        when_set = (*GPT_OSS_FIELDS, *LOW_PRECISION_FIELDS, "mtp_use_repeated_layer", "lora_rank",
                    "lora_target_modules")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if (f.name not in optional or getattr(self, f.name))
                and (f.name not in when_set or getattr(self, f.name) != f.default)}  # fmt: skip


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
HYBRID_FIELDS = (
    "hybrid_override_pattern", "hybrid_attention_ratio", "hybrid_mlp_ratio", "is_hybrid_model",
    "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
)
LOW_PRECISION_FIELDS = (
    "fp8_dot_product_attention", "reuse_grad_buf_for_mxfp8_param_ag", "fp4_format", "fp4_recipe",
    "fp4_param_gather",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
)
DSA_FIELDS = (
    "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
    "dsa_indexer_topk", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss",
    "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset",
)
GDN_FIELDS = (
    "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "attention_output_gate",
)
GPT_OSS_FIELDS = (
    "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type",
    "window_size", "window_attn_skip_freq",
)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value
