"""bench/bridge_recipes.py: a Megatron-Bridge recipe read from its source into Megatron-LM's job.

The Bridge tree here is a small one written for the test, in the forms Bridge's recipes take
(a perf recipe over a base recipe, dataclass defaults, `@register`ed mixed-precision recipes,
AutoBridge.from_hf_pretrained, CommOverlapConfig); nothing of Bridge itself is needed.
"""

from __future__ import annotations

from pathlib import Path
from textwrap import dedent

import pytest

from inspector.inputs.presets import PRESETS
from tests.test_versions import CUDA_GRAPHS_MODELLED

BENCH = Path(__file__).resolve().parents[1] / "bench"

PATTERN_56B = PRESETS["nemotron-h-56b"].args["hybrid_override_pattern"]
PATTERN_NANO = PRESETS["nemotron-3-nano-30b-a3b"].args["hybrid_override_pattern"]

_FILES = {
    "training/config.py": """
        from dataclasses import dataclass, field
        @dataclass
        class TrainingConfig:
            global_batch_size: int = 32
            micro_batch_size: int = 2
        @dataclass
        class DDPConfig:
            use_distributed_optimizer: bool = False
            overlap_grad_reduce: bool = False
            overlap_param_gather: bool = False
            grad_reduce_in_fp32: bool = True
            use_megatron_fsdp: bool = False
        @dataclass
        class CheckpointConfig:
            ckpt_format: str = "torch_dist"
            save: str = None
            load: str = None
        @dataclass
        class TokenizerConfig:
            tokenizer_type: str = None
            vocab_size: int = None
        @dataclass
        class ConfigContainer:
            model: object = None
            tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
            train: TrainingConfig = field(default_factory=TrainingConfig)
            ddp: DDPConfig = field(default_factory=DDPConfig)
            checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
            mixed_precision: object = None
            comm_overlap: object = None
            peft: object = None
    """,
    "training/mixed_precision.py": """
        import torch
        from dataclasses import dataclass
        MIXED_PRECISION_RECIPES = {}
        def register(func):
            MIXED_PRECISION_RECIPES[func.__name__] = func
            return func
        @dataclass
        class MixedPrecisionConfig:
            bf16: bool = False
            fp8: str = None
            fp8_recipe: str = "tensorwise"
            fp8_param_gather: bool = False
            grad_reduce_in_fp32: bool = True
        @register
        def bf16_with_fp8_current_scaling_mixed():
            return MixedPrecisionConfig(bf16=True, fp8="hybrid", fp8_param_gather=True)
        def get_mixed_precision_config(name):
            return MIXED_PRECISION_RECIPES[name.replace("-", "_")]()
    """,
    "training/comm_overlap.py": """
        from dataclasses import dataclass
        @dataclass
        class CommOverlapConfig:
            tp_comm_overlap: bool = None
            overlap_grad_reduce: bool = None
            overlap_param_gather: bool = None
    """,
    "recipes/llama.py": """
        from megatron.bridge.models import AutoBridge
        from megatron.bridge.training.config import ConfigContainer
        SEQ = 8192
        def llama3_70b_pretrain_config():
            cfg = ConfigContainer()
            cfg.model = AutoBridge.from_hf_pretrained("meta-llama/Meta-Llama-3-70B").get_model_config()
            cfg.model.seq_length = SEQ
            cfg.model.cuda_graph_impl = "none"
            cfg.ddp.use_distributed_optimizer = True
            return cfg
    """,
    "perf_recipes/llama/h100/llama3.py": """
        from megatron.bridge.models import AutoBridge
        from megatron.bridge.recipes.llama import llama3_70b_pretrain_config
        from megatron.bridge.training.comm_overlap import CommOverlapConfig
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        def _common(cfg, graphs=None):
            if graphs is not None:
                cfg.model.cuda_graph_impl = graphs
            if not isinstance(cfg.mixed_precision, str):
                cfg.mixed_precision.grad_reduce_in_fp32 = False

        def llama3_70b_pretrain_64gpu_h100_fp8cs_config():
            cfg = llama3_70b_pretrain_config()
            cfg.mixed_precision = get_mixed_precision_config("bf16-with-fp8-current-scaling-mixed")
            cfg.model.tensor_model_parallel_size = 4
            cfg.model.pipeline_model_parallel_size = 4
            cfg.model.virtual_pipeline_model_parallel_size = 5
            cfg.model.sequence_parallel = True
            cfg.train.global_batch_size = 256
            cfg.train.micro_batch_size = 1
            cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=True)
            _common(cfg)
            return cfg

        def llama3_70b_pretrain_64gpu_h100_bf16_config():
            cfg = llama3_70b_pretrain_64gpu_h100_fp8cs_config()
            cfg.mixed_precision.fp8 = None
            _common(cfg, graphs="local")
            return cfg

        def llama3_70b_pretrain_8gpu_h100_bf16_config():
            cfg = llama3_70b_pretrain_config()
            cfg.model = AutoBridge.from_hf_pretrained("zai-org/GLM-4.5-Air").get_model_config()
            return cfg

        def llama3_70b_pretrain_16gpu_h100_bf16_config():
            cfg = llama3_70b_pretrain_config()
            cfg.model = AutoBridge.from_hf_pretrained("deepseek-ai/DeepSeek-V4-Flash").get_model_config()
            return cfg
    """,
    "perf_recipes/glm_moe_dsa/h100/glm5.py": """
        from megatron.bridge.models import AutoBridge
        from megatron.bridge.recipes.llama import llama3_70b_pretrain_config

        def glm52_sft_8gpu_h100_bf16_config():
            cfg = llama3_70b_pretrain_config()
            cfg.model = AutoBridge.from_hf_pretrained("zai-org/GLM-5.2").get_model_config()
            return cfg

        def nemotron_3_ultra_pretrain_8gpu_h100_bf16_config():
            cfg = llama3_70b_pretrain_config()
            cfg.model = AutoBridge.from_hf_pretrained(
                "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16").to_megatron_provider(load_weights=False)
            return cfg
    """,
    "models/hybrid/hybrid_provider.py": """
        from dataclasses import dataclass
        @dataclass
        class HybridModelProvider:
            hybrid_layer_pattern: str = None
            num_layers: int = None
            hidden_size: int = None
            num_moe_experts: int = None
            moe_router_score_function: str = "softmax"
            moe_grouped_gemm: bool = False
            mtp_num_layers: int = 0
            mtp_hybrid_override_pattern: str = None
            mtp_use_repeated_layer: bool = False
            vocab_size: int = None
            make_vocab_size_divisible_by: int = 128
            should_pad_vocab: bool = False
    """,
    "perf_recipes/nemotronh/h100/nemotronh.py": f"""
        from megatron.bridge.models.hybrid.hybrid_provider import HybridModelProvider
        from megatron.bridge.training.config import ConfigContainer, TokenizerConfig
        def nemotronh_56b_pretrain_64gpu_h100_bf16_config():
            cfg = ConfigContainer()
            cfg.model = HybridModelProvider(hybrid_layer_pattern="{PATTERN_56B}", num_layers=118,
                hidden_size=8192, moe_router_score_function="sigmoid", moe_grouped_gemm=True)
            cfg.tokenizer = TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000)
            cfg.model.tensor_model_parallel_size = 8
            cfg.train.global_batch_size = 16
            cfg.train.micro_batch_size = 1
            return cfg
        def nemotron_3_5_lightning_pretrain_8gpu_h100_bf16_config():
            cfg = ConfigContainer()
            cfg.model = HybridModelProvider(hybrid_layer_pattern="{PATTERN_NANO}", num_layers=52,
                num_moe_experts=128, moe_grouped_gemm=True)
            cfg.model.mtp_num_layers = 2
            cfg.model.mtp_hybrid_override_pattern = "*E"
            cfg.model.mtp_use_repeated_layer = True
            return cfg
    """,
    "perf_recipes/deepseek/b200/deepseek.py": """
        import torch
        from megatron.bridge.recipes.llama import llama3_70b_pretrain_config
        from megatron.bridge.training.comm_overlap import CommOverlapConfig
        def _blackwell():
            if not torch.cuda.is_available():
                return False
            major, _minor = torch.cuda.get_device_capability()
            return major >= 10
        def llama3_70b_pretrain_64gpu_b200_fsdp_config():
            cfg = llama3_70b_pretrain_config()
            cfg.ddp.use_megatron_fsdp = True
            cfg.train.global_batch_size = 64
            cfg.train.micro_batch_size = 1
            return cfg
        def llama3_70b_pretrain_64gpu_b200_saves_config():
            cfg = llama3_70b_pretrain_64gpu_b200_fsdp_config()
            cfg.checkpoint.save = "/checkpoints"
            return cfg
        def llama3_70b_pretrain_64gpu_b200_gather_config():
            cfg = llama3_70b_pretrain_config()
            cfg.model.tensor_model_parallel_size = 4
            cfg.model.sequence_parallel = _blackwell()
            cfg.train.micro_batch_size = 1
            cfg.comm_overlap = CommOverlapConfig(overlap_grad_reduce=False)
            return cfg
    """,
    "perf_recipes/gpt_oss/h100/gpt_oss.py": """
        from megatron.bridge.models import AutoBridge
        from megatron.bridge.training.config import ConfigContainer
        def gpt_oss_20b_pretrain_8gpu_h100_bf16_config():
            cfg = ConfigContainer()
            cfg.model = AutoBridge.from_hf_pretrained("openai/gpt-oss-20b").get_model_config()
            cfg.model.cpu_offloading_num_layers = 95
            cfg.model.position_embedding_type = "rope"
            return cfg
    """,
}


@pytest.fixture()
def bridge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "src/megatron/bridge"
    for name, text in _FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dedent(text))
    (root / "models").mkdir(exist_ok=True)
    (root / "models/__init__.py").write_text("from megatron.bridge.models.auto import AutoBridge\n")
    (root / "models/auto.py").write_text("class AutoBridge:\n    pass\n")
    (root / "recipes/__init__.py").write_text("")
    (root / "models/hybrid/__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(BENCH))
    return tmp_path


def test_a_recipe_becomes_megatron_lm_arguments(bridge: Path) -> None:
    import bridge_recipes

    args = bridge_recipes.json.loads(bridge_recipes.show(bridge, "llama3_70b_pretrain_64gpu_h100_fp8cs_config"))
    assert args["preset"] == "llama3-70b" and args["gpus"] == 64 and args["refusals"] == []
    got = args["arguments"]
    # the base recipe's fields, then the perf recipe's; the mixed-precision recipe by its
    # hyphenated name; grad_reduce_in_fp32 False with bf16 is --grad-reduce-in-bf16
    assert got["seq_length"] == 8192 and got["tensor_model_parallel_size"] == 4
    assert got["num_virtual_stages_per_pipeline_rank"] == 5 and got["sequence_parallel"] is True
    assert (got["fp8_format"], got["fp8_recipe"], got["fp8_param_gather"]) == ("hybrid", "tensorwise", True)
    assert got["grad_reduce_in_bf16"] is True and got["global_batch_size"] == 256
    # CommOverlapConfig.setup: dp = 64 / (4 x 4) = 4 > 1 turns both DDP overlaps on
    assert got["overlap_grad_reduce"] is True and got["overlap_param_gather"] is True
    assert got["tp_comm_overlap"] is True
    # Bridge pads the vocabulary only with should_pad_vocab (not set: its default False)
    assert got["make_vocab_size_divisible_by"] == 1
    assert "cuda_graph_impl" not in got  # "none"


def test_the_coverage_names_each_cause(bridge: Path) -> None:
    import bridge_recipes

    outcomes = {o.name: o for o in bridge_recipes.run_all(bridge, run=False, families=("llama",))}
    assert outcomes["llama3_70b_pretrain_64gpu_h100_fp8cs_config"].status == "modelled"
    # megatron-core's own per-layer graphs of a dense model's whole layers are modelled (from
    # megatron-core 0.16 on: job/cuda_graphs.py stops older ones at the job check)
    graphs = outcomes["llama3_70b_pretrain_64gpu_h100_bf16_config"]
    assert graphs.status == ("modelled" if CUDA_GRAPHS_MODELLED else "error")
    unmapped = outcomes["llama3_70b_pretrain_8gpu_h100_bf16_config"]  # GLM-4.5-Air: no preset
    assert unmapped.status == "refused" and unmapped.cause == "model"
    text = bridge_recipes.render(list(outcomes.values()))
    if CUDA_GRAPHS_MODELLED:
        assert "| llama | h100 | 4 | 2 | 2 | 0 | 0 |" in text
        assert "Fully modelled: 2 of 4 (50%)." in text
    else:
        assert "| llama | h100 | 4 | 1 | 2 | 1 | 0 |" in text


def test_deepseek_v4_is_refused_by_what_megatron_core_lacks(bridge: Path) -> None:
    # DeepSeek-V4's bridge builds its layers with megatron-core pieces (deepseek_v4_bridge.py:
    # experimental_attention_variant "dsv4_hybrid", hyper-connections, hash routing) that the
    # installed megatron-core lacks: the cause names them and the version, not "model"
    import dataclasses
    import importlib.metadata

    import bridge_recipes
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {field.name: field for field in dataclasses.fields(TransformerConfig)}
    variant = fields.get("experimental_attention_variant")
    assert variant is None or "dsv4_hybrid" not in str(variant.type)
    assert not {"enable_hyper_connections", "moe_n_hash_layers", "csa_compress_ratios"} & set(fields)
    outcomes = {o.name: o for o in bridge_recipes.run_all(bridge, run=False, families=("llama",))}
    v4 = outcomes["llama3_70b_pretrain_16gpu_h100_bf16_config"]
    version = importlib.metadata.version("megatron-core")
    assert (v4.status, v4.cause) == ("refused", (
        "DeepSeek-V4's compressed sparse attention (DSv4HybridSelfAttention, "
        "experimental_attention_variant dsv4_hybrid), hyper-connections (HyperConnectionModule) "
        f"and hash-routed MoE layers are not in megatron-core {version}"))  # fmt: skip


def _show(bridge: Path, name: str) -> dict:
    import bridge_recipes

    return bridge_recipes.json.loads(bridge_recipes.show(bridge, name))


def test_an_inline_hybrid_provider_is_the_preset_of_its_pattern(bridge: Path) -> None:
    # HybridModelProvider(...) has no HF id: the preset whose pattern it is; a dense provider's
    # MoE defaults are dropped (megatron-core reads none of them without experts); its vocabulary
    # is the NullTokenizer's, padded as Bridge pads it (training/setup.py)
    shown = _show(bridge, "nemotronh_56b_pretrain_64gpu_h100_bf16_config")
    got = shown["arguments"]
    assert shown["preset"] == "nemotron-h-56b" and shown["refusals"] == []
    assert got["hybrid_override_pattern"] == PATTERN_56B and "hybrid_layer_pattern" not in got
    assert (got["vocab_size"], got["make_vocab_size_divisible_by"]) == (32000, 128)
    assert not [name for name in got if name.startswith("moe_")]


def test_a_hybrid_provider_s_mtp_pattern_is_appended_as_bridge_appends_it(bridge: Path) -> None:
    # HybridModelProvider.finalize(): the MTP pattern once per depth after `/` (at least once
    # with the repeated layer); Megatron-LM 0.17+'s --hybrid-layer-pattern takes that string
    shown = _show(bridge, "nemotron_3_5_lightning_pretrain_8gpu_h100_bf16_config")
    got = shown["arguments"]
    assert shown["preset"] == "nemotron-3-nano-30b-a3b"
    assert got["hybrid_layer_pattern"] == PATTERN_NANO + "/*E/*E"
    assert got["mtp_num_layers"] == 2 and got["mtp_use_repeated_layer"] is True
    assert got["num_experts"] == 128


def test_gpt_oss_carries_what_its_bridge_sets(bridge: Path) -> None:
    # gpt_oss_bridge.py turns bias-dropout fusion off (TEGroupedMLP refuses it with expert
    # biases); offloaded layers without offloading and YaRN -> RoPE change no tensor
    shown = _show(bridge, "gpt_oss_20b_pretrain_8gpu_h100_bf16_config")
    got = shown["arguments"]
    assert shown["preset"] == "gpt-oss-20b" and got["no_bias_dropout_fusion"] is True
    assert "cpu_offloading_num_layers" not in got and "position_embedding_type" not in got


def test_the_new_models_outcomes(bridge: Path) -> None:
    import bridge_recipes

    outcomes = {o.name: (o.status, o.cause) for o in bridge_recipes.run_all(
        bridge, run=False, families=("nemotronh", "gpt_oss"))}  # fmt: skip
    from inspector.inputs.versions import MTP_REPEATED_RELEASES, megatron_core_version, within

    # --mtp-use-repeated-layer: TransformerConfig's field from megatron-core 0.17
    repeated = within(MTP_REPEATED_RELEASES, megatron_core_version())
    assert outcomes == {
        "nemotronh_56b_pretrain_64gpu_h100_bf16_config": ("modelled", ""),
        "nemotron_3_5_lightning_pretrain_8gpu_h100_bf16_config": (
            ("modelled", "") if repeated else ("refused", "--mtp-use-repeated-layer")),
        "gpt_oss_20b_pretrain_8gpu_h100_bf16_config": ("modelled", ""),
    }


def test_what_bridge_runs_and_megatron_lm_would_refuse(bridge: Path) -> None:
    import bridge_recipes

    # Megatron-FSDP: Bridge asks for fsdp_dtensor only when it saves or loads (training/config.py);
    # a recipe that does neither never reads its format, so the job is --ckpt-format fsdp_dtensor
    assert _show(bridge, "llama3_70b_pretrain_64gpu_b200_fsdp_config")["arguments"][
        "ckpt_format"] == "fsdp_dtensor"  # fmt: skip
    assert _show(bridge, "llama3_70b_pretrain_64gpu_b200_saves_config")["arguments"][
        "ckpt_format"] == "torch_dist"  # fmt: skip
    # the param all-gather overlapped without the grad reduce: megatron-core runs it, only
    # Megatron-LM's validate_args refuses it, and the tool models neither overlap of the gather
    got = _show(bridge, "llama3_70b_pretrain_64gpu_b200_gather_config")["arguments"]
    assert "overlap_param_gather" not in got and "overlap_grad_reduce" not in got
    # torch.cuda.get_device_capability() is the recipe's GPU's (a B200: 10.0)
    assert got["sequence_parallel"] is True
    outcomes = {o.name: (o.status, o.cause) for o in bridge_recipes.run_all(
        bridge, run=False, families=("deepseek",))}  # fmt: skip
    assert outcomes["llama3_70b_pretrain_64gpu_b200_fsdp_config"] == ("modelled", "")
    assert outcomes["llama3_70b_pretrain_64gpu_b200_gather_config"] == ("modelled", "")
    saves = outcomes["llama3_70b_pretrain_64gpu_b200_saves_config"]
    assert saves[0] == "error" and "fsdp_dtensor" in saves[1]


@pytest.mark.parametrize("optimizer", ["dist_muon", "adam"])
def test_bridge_s_dist_muon_is_the_legacy_layer_wise_path(monkeypatch, optimizer) -> None:
    # Bridge's DDP wrap (Megatron-LM's dist_utils._ddp_wrap) is never asked for the layer-wise
    # parameter layout, so megatron-core 0.18+ builds its dist_muon on the legacy path
    monkeypatch.syspath_prepend(str(BENCH))
    import bridge_job
    from bridge_eval import Record

    from inspector.inputs.versions import megatron_core_version

    args: dict = {}
    bridge_job._optimizer(args, Record("OptimizerConfig", fields={"optimizer": optimizer}))
    legacy = optimizer == "dist_muon" and megatron_core_version() >= (0, 18)
    assert args == {"optimizer": optimizer} | ({"no_use_layer_wise_param_layout": True} if legacy else {})


@pytest.mark.parametrize(("recipe", "preset"), [
    ("glm52_sft_8gpu_h100_bf16_config", "glm-5.2"),
    ("nemotron_3_ultra_pretrain_8gpu_h100_bf16_config", "nemotron-3-ultra-550b-a55b")])
def test_glm_5_2_and_nemotron_3_ultra_are_their_presets(bridge: Path, recipe: str, preset: str) -> None:
    # Bridge loads their HF configs (AutoBridge.from_hf_pretrained): the presets written from them
    shown = _show(bridge, recipe)
    assert (shown["preset"], shown["refusals"]) == (preset, [])


def test_a_lora_recipe_is_the_tools_lora_flags(bridge: Path) -> None:
    # Bridge's LoRA (peft/lora.py 142-157) as the recipes set it: dim 16, linear_qkv only
    from bridge_eval import Record
    from bridge_job import _peft

    args: dict[str, object] = {}
    lora = Record("LoRA", fields={"dim": 16, "alpha": 32, "dropout": 0.0,
                                  "target_modules": ["linear_qkv"]})  # fmt: skip
    assert _peft(args, Record("ConfigContainer", fields={"peft": lora})) == []
    assert args == {"lora_rank": 16, "lora_target_modules": "linear_qkv"}
    dropout = Record("LoRA", fields={"dim": 16, "dropout": 0.1})
    assert _peft({}, Record("ConfigContainer", fields={"peft": dropout})) == [
        "PEFT: LoRA's dropout not modelled"]
    assert _peft({}, Record("ConfigContainer", fields={"peft": Record("DoRA")})) == [
        "PEFT: DoRA (Bridge's peft) is not modelled; LoRA is"]


@pytest.mark.parametrize("args", [
    {"fp8_param_gather": True, "optimizer": "dist_muon"},
    {"fp8_param_gather": True},
    {"fp4_param_gather": True},
    {"fp4_param_gather": True, "optimizer": "dist_muon"},
    {"fp8_param_gather": True, "use_distributed_optimizer": True},
    {"fp8_param_gather": True, "use_megatron_fsdp": True},
])  # fmt: skip
def test_quantized_weights_without_a_sharding_optimizer_are_spelled_as_megatron_lm_runs_them(
        monkeypatch, args) -> None:  # fmt: skip
    # Kimi-K2's fp8cs recipes (dist_muon, no distributed optimizer): Bridge runs no validate_args;
    # megatron-core 0.18+ runs them on the layer-wise optimizer's legacy path, Megatron-LM's
    # `--optimizer muon --use-distributed-optimizer` (--fp8-param-gather is checked before
    # validate_args turns it off). Before 0.18 muon refuses the distributed optimizer, and adam
    # has no such spelling: not modelled. --fp4-param-gather is not checked: as it is.
    monkeypatch.syspath_prepend(str(BENCH))
    import bridge_job

    from inspector.inputs.versions import megatron_core_version

    given = dict(args)
    found = bridge_job._param_gather_refusals(args)
    muon = given.get("optimizer") == "dist_muon" and megatron_core_version() >= (0, 18)
    unsharded = given.get("fp8_param_gather") and not any(k.startswith("use_") for k in given)
    if unsharded and muon:
        assert (found, args) == ([], given | {"optimizer": "muon", "use_distributed_optimizer": True})
    elif unsharded:
        assert [item.split(":")[0] for item in found] == [
            "--fp8-param-gather without --use-distributed-optimizer"]
        assert "Bridge does not check" in found[0] and args == given
    else:
        assert (found, args) == ([], given)
