"""megatron-core's MoE paged stash (--moe-paged-stash): refused by name for what it needs, its
reasons checked against megatron itself where it has the stash (0.18+), its arguments accepted by
`params` and `tree`, and the stash sizes bench/RESULTS.md records from megatron's own sizing."""

from __future__ import annotations

import importlib.util
import inspect
import math
from pathlib import Path

import pytest

from inspector.inputs.versions import ARGUMENT_VERSIONS, megatron_core_version

HAS_STASH = importlib.util.find_spec("megatron.core.transformer.moe.paged_stash") is not None
needs_stash = pytest.mark.skipif(not HAS_STASH, reason="megatron-core 0.18 added the MoE paged stash")
STASH_SINCE = ARGUMENT_VERSIONS["--moe-paged-stash"][0]

_CONFIG = """\
moe_paged_stash: true
moe_expert_rank_capacity_factor: 1.5
use_transformer_engine_op_fuser: true
moe_token_dispatcher_type: flex
moe_flex_dispatcher_backend: hybridep
"""


def test_the_version_gate_is_where_megatron_core_has_the_stash() -> None:
    # the module exists exactly from the version the argument table says (0.18)
    assert HAS_STASH == (megatron_core_version() >= STASH_SINCE)


@pytest.mark.skipif(HAS_STASH, reason="modelled from 0.18 (tests/test_paged_stash_memory.py)")
def test_memory_refuses_the_stash_before_0_18(cli, tmp_path: Path) -> None:
    config = tmp_path / "stash.yaml"
    config.write_text(_CONFIG)
    done = cli("memory", "--model", "qwen3-30b-a3b", "--config", str(config), "--bf16", "--ep", "8",
               "--dp", "8")  # fmt: skip
    assert done.code == 2 and done.out == ""
    error = done.err.splitlines()[-1]
    assert error.startswith(f"Error: {config}: --moe-paged-stash is not modelled: megatron-core "
                            "0.13-0.17 have no MoE paged stash")  # fmt: skip
    # the op fuser and the budget are refused there too (modelled where megatron-core has them:
    # tests/test_op_fuser.py, tests/test_rank_capacity.py)
    assert "--moe-expert-rank-capacity-factor is not modelled" in error
    assert "--use-transformer-engine-op-fuser is not modelled" in error


def test_params_and_tree_take_the_stash(cli, tmp_path: Path) -> None:
    # the stash and its budget change no parameter: megatron builds the same model
    config = tmp_path / "stash.yaml"
    config.write_text(_CONFIG)
    plain = cli("params", "--model", "qwen3-30b-a3b", "--bf16", "--ep", "8", "--dp", "8")
    for command in ("params", "tree"):
        done = cli(command, "--model", "qwen3-30b-a3b", "--config", str(config), "--bf16", "--ep", "8",
                   "--dp", "8")  # fmt: skip
        assert done.code == 0, done.err
    stash = cli("params", "--model", "qwen3-30b-a3b", "--config", str(config), "--bf16", "--ep", "8",
                "--dp", "8")  # fmt: skip
    assert stash.out.splitlines()[1:] == plain.out.splitlines()[1:] and len(stash.out) > 1000
    # before 0.18 Megatron-LM itself would not take the arguments, and a note says so
    notes = [line for line in stash.err.splitlines() if "added in 0.18" in line]
    assert len(notes) == (0 if HAS_STASH else 3)


def test_default_tuning_values_are_harmless() -> None:
    # without the stash megatron never reads them; their defaults (TransformerConfig) change nothing
    from inspector.inputs.unmodelled import refusal_message

    for flag, default, other in (("--moe-paged-stash-page-size", "64", "128"),
                                 ("--moe-paged-stash-buffer-size-factor-cuda", "1.1", "1.2"),
                                 ("--moe-paged-stash-buffer-size-factor-cpu", "0.0", "1.0")):  # fmt: skip
        assert refusal_message(flag, default) is None
        assert refusal_message(flag, other) == (None if HAS_STASH else (
            f"{flag} {other} is not modelled: sizes megatron-core's MoE paged stash "
            "(--moe-paged-stash), which megatron-core 0.13-0.17 do not have (modelled from 0.18)"))


def _megatron_core() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).parent


@needs_stash
def test_only_te_fused_grouped_mlp_opens_the_stash() -> None:
    # megatron opens the stash's saved-tensor hook in one place, TEGroupedMLP._fused_forward,
    # which it runs only with use_transformer_engine_op_fuser
    callers = []
    for path in sorted(_megatron_core().rglob("*.py")):
        if path.name != "paged_stash.py" and "get_paged_stash_context(" in path.read_text():
            callers.append(path.relative_to(_megatron_core()).as_posix())
    assert callers == ["transformer/moe/experts.py"]
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    assert "get_paged_stash_context(" in inspect.getsource(TEGroupedMLP._fused_forward)
    assert "self._with_fused_impl: bool = self.config.use_transformer_engine_op_fuser" in (
        inspect.getsource(TEGroupedMLP.__init__))
    # and that path runs Transformer Engine 2.14+'s fused operations, which the stand-in runs
    # as TE's basic operations (world/te/ops.py): none of them marks a tensor for the stash
    # (only TE's MXFP8 CuTe DSL kernel does, which is not simulated)
    from inspector.world import te

    te.install()
    import transformer_engine.pytorch.ops as ops

    source = inspect.getsource(TEGroupedMLP._is_fused_impl_supported)
    assert 'is_te_min_version("2.14.0")' in source
    assert "import GroupedLinear, ScaledSwiGLU" in source
    assert hasattr(ops, "GroupedLinear") and hasattr(ops, "ScaledSwiGLU")
    stand_in = (Path(te.__file__).parent / "ops.py").read_text()
    assert "grouped_tensor_scale_inv" not in stand_in and "mark_grouped_tensor(" not in stand_in


@needs_stash
def test_the_stash_pages_only_marked_tensors() -> None:
    import torch
    from megatron.core.transformer.moe.paged_stash import PagedStashManager, PagedTensor

    manager = object.__new__(PagedStashManager)  # its __init__ makes CUDA streams
    manager.max_num_tokens, manager.status, manager.page_size = 8, "captured", 64
    manager.max_tokens_across_vp_stages = {}
    manager.num_tokens_tensor, manager.current_vp_stage, manager._pp_schedule = torch.tensor(8), 0, None
    manager.paged_tensors_to_stash = []
    plain = torch.empty(8, 4)
    assert manager.on_save_for_backward(plain) is plain
    marked = torch.empty(8, 4)
    marked.grouped_tensor_scale_inv = False  # what Transformer Engine's mark_grouped_tensor sets
    assert isinstance(manager.on_save_for_backward(marked), PagedTensor)


@needs_stash
def test_megatron_requires_the_budget_and_the_op_fuser() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                moe_router_topk=2, moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="hybridep", expert_model_parallel_size=1)  # fmt: skip
    with pytest.raises(ValueError, match="moe_paged_stash requires moe_expert_rank_capacity_factor"):
        TransformerConfig(**base, moe_paged_stash=True)
    with pytest.raises(ValueError, match="requires use_transformer_engine_op_fuser"):
        TransformerConfig(**base, moe_paged_stash=True, moe_expert_rank_capacity_factor=1.5)


# bench/RESULTS.md (section stash): qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config, one rank's
# permuted-token budget and the stash megatron would allocate for each marked tensor kind
_TOKENS, _TOPK, _CAPACITY, _LAYERS, _CUDA, _CPU, _PAGE = 4 * 4096, 8, 1.5, 48, 1.2, 1.0, 64
_BUDGET, _AVERAGE, _CUDA_ROWS, _HOST_ROWS = 196_608, 131_072, 7_549_760, 6_291_456


def test_the_recorded_sizes_follow_megatrons_arithmetic() -> None:
    # token_dispatcher.py _HybridEPManager.setup_metadata: int(tokens * topk * factor), rounded
    # up to the op fuser's alignment (moe_utils.py get_align_size_for_quantization: 256);
    # experts.py _fused_forward: avg_num_tokens = int(budget // factor)
    budget = int(_TOKENS * _TOPK * _CAPACITY)
    assert budget + (-budget % 256) == _BUDGET and int(_BUDGET // _CAPACITY) == _AVERAGE
    # pp 1: every MoE layer's marked tensors wait for backward, so the capture's peak is the sum
    pages = math.ceil(int(_LAYERS * _AVERAGE * _CUDA) / _PAGE)
    assert pages * _PAGE == _CUDA_ROWS
    assert math.ceil(int(_LAYERS * _AVERAGE * _CPU) / _PAGE) * _PAGE == _HOST_ROWS


@needs_stash
def test_megatrons_allocation_gives_the_recorded_rows() -> None:
    import torch
    from megatron.core.transformer.moe.paged_stash import PagedStashManager

    manager = object.__new__(PagedStashManager)
    manager.overflow = manager.host_spill = None
    manager.device, manager.page_size = torch.device("meta"), _PAGE
    peak = {(torch.bfloat16, 2048): _LAYERS * _AVERAGE}
    manager.max_avg_tokens_across_vp_stages = manager.max_tokens_across_vp_stages = peak
    manager.allocate_stash_buffers(_CUDA, 0.0)  # the pinned host buffer needs CUDA here
    buffer = manager.stash_buffers[torch.bfloat16][2048]
    assert tuple(buffer.cuda_buffer.shape) == (_CUDA_ROWS, 2048)
    assert buffer.host_buffer is None and tuple(buffer.free_list_cuda.shape) == (_CUDA_ROWS // _PAGE,)


def test_the_bench_passes_the_stash_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from bridge_eval import Record
    from bridge_job import recipe_args

    model = Record("GPTModelProvider", fields={
        "moe_paged_stash": True, "use_transformer_engine_op_fuser": True,
        "moe_expert_rank_capacity_factor": 1.5, "moe_paged_stash_buffer_size_factor_cuda": 1.2})  # fmt: skip
    _, args, _ = recipe_args(Record("ConfigContainer", fields={"model": model}), 8)
    assert args["use_transformer_engine_op_fuser"] is True
    assert (args["moe_expert_rank_capacity_factor"], args["moe_paged_stash_buffer_size_factor_cuda"]) == (1.5, 1.2)
