"""megatron-core's rules for the flex dispatcher, in one home (job/flex.py) that `memory`'s Job and
`plan`'s request both call, by the installed version; and `plan` confirming a DeepEP job as built,
DeepEP's buffers outside PyTorch's allocator counted as `memory` counts them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from inspector.errors import ConfigError
from inspector.job.flex import BACKEND_SINCE, check_flex, megatron_version
from inspector.job.job import Training
from inspector.job.layout import Layout
from tests.conftest import run_cli

NEW, OLD = (0, 16), (0, 13)
INSTALLED_NEW = megatron_version() >= BACKEND_SINCE
OLD_DEEPEP = () if INSTALLED_NEW else ("--moe-enable-deepep",)
MIB = 1 << 20
GIB = 1 << 30

# a small Mixtral: 8 experts, top-2, hidden 256 (tests/test_flex_memory.py)
TINY = ("--model", "mixtral-8x7b", "--num-layers", "2", "--hidden-size", "256",
        "--ffn-hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "8",
        "--seq-length", "128", "--max-position-embeddings", "128", "--bf16",
        "--micro-batch-size", "1")  # fmt: skip


def _check(version, experts=8, **training) -> None:
    # the fields HybridEP's checks read (job/hybrid_ep.py): a bf16 model, hidden 256, 128 tokens
    model = SimpleNamespace(num_experts=experts, bf16=True, fp16=False, hidden_size=256, seq_length=128)
    check_flex(model, Layout(dp=2, ep=2), Training(moe_token_dispatcher_type="flex", **training), version)


# ---- the versions differ: what megatron-core 0.13-0.15 and 0.16 take ----


@pytest.mark.parametrize(("version", "training", "message"), [
    # 0.13-0.15: MoEFlexTokenDispatcher.__init__ asserts moe_enable_deepep
    (OLD, {}, "--moe-token-dispatcher-type flex needs --moe-enable-deepep in megatron-core 0.13 "
              "(MoEFlexTokenDispatcher: 'DeepEP is not enabled. Please set --moe-enable-deepep to "
              "use DeepEP backend.')"),
    (OLD, {"moe_enable_deepep": True}, None),
    (NEW, {}, None),  # 0.16: the deepep backend by default
    (NEW, {"moe_enable_deepep": True}, None),  # 0.16: deprecated, still DeepEP
    # 0.13-0.15 have no backend to name: Megatron-LM's argparse stops on the flag
    (OLD, {"moe_enable_deepep": True, "moe_flex_backend": "hybridep"},
     "--moe-flex-dispatcher-backend is not an argument of Megatron-LM 0.13 (the installed "
     "megatron-core; added in 0.16): its flex dispatcher runs DeepEP, with --moe-enable-deepep"),
    (NEW, {"moe_flex_backend": "hybridep"}, None),
    # TransformerConfig refuses padding to capacity with DeepEP, in each version's words
    (OLD, {"moe_enable_deepep": True, "moe_pad_expert_input_to_capacity": True,
           "moe_expert_capacity_factor": 1.0},
     "--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's DeepEP backend "
     "(megatron-core's TransformerConfig: 'Flex token dispatcher does not support "
     "moe_pad_expert_input_to_capacity')"),
    (NEW, {"moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0},
     "--moe-pad-expert-input-to-capacity does not run with the flex dispatcher's DeepEP backend "
     "(megatron-core's TransformerConfig: 'Flex token dispatcher with deepep backend does not "
     "support moe_pad_expert_input_to_capacity')"),
    (NEW, {"moe_flex_backend": "hybridep", "moe_pad_expert_input_to_capacity": True,
           "moe_expert_capacity_factor": 1.0}, None),  # HybridEP pads
])  # fmt: skip
def test_a_jobs_flex_rules_follow_the_megatron_core_version(version, training, message) -> None:
    if message is None:
        _check(version, **training)
        return
    with pytest.raises(ConfigError) as caught:
        _check(version, **training)
    assert str(caught.value) == message


def test_without_experts_no_dispatcher_asserts() -> None:
    # megatron builds no MoEFlexTokenDispatcher for a dense model: 0.13's moe_enable_deepep assert
    # and the TPxEP one do not run (TransformerConfig's own checks still do)
    _check(OLD, experts=None)
    check_flex(SimpleNamespace(num_experts=None), Layout(dp=2),
               Training(moe_token_dispatcher_type="flex"), NEW)  # fmt: skip


@pytest.mark.slow
def test_the_installed_version_decides_what_memory_and_plan_take() -> None:
    # flex without --moe-enable-deepep: megatron-core 0.16 runs DeepEP by default, 0.13-0.15 stop
    memory = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", "--global-batch-size", "2",
                     "--moe-token-dispatcher-type", "flex")  # fmt: skip
    plan = run_cli("plan", *TINY, "--gpus", "2", "--global-batch-size", "2", "--tp", "1", "--pp", "1",
                   "--ep", "2", "--moe-token-dispatcher-type", "flex")  # fmt: skip
    if INSTALLED_NEW:
        assert (memory.code, plan.code) == (0, 0), memory.err + plan.err
    else:
        dotted = "{}.{}".format(*megatron_version())
        error = (f"Error: --moe-token-dispatcher-type flex needs --moe-enable-deepep in megatron-core "
                 f"{dotted} (MoEFlexTokenDispatcher: 'DeepEP is not enabled. Please set "
                 "--moe-enable-deepep to use DeepEP backend.')\n")  # fmt: skip
        assert (memory.code, memory.err) == (2, error)
        assert (plan.code, plan.err) == (2, error)


# ---- one message for one input, whichever command reads it ----


@pytest.mark.parametrize(("memory_flags", "plan_flags"), [
    # TPxEP = 1
    (("--ep", "1", "--dp", "2", *OLD_DEEPEP), ("--ep", "1", "--expert-tensor-parallel-size", "1", *OLD_DEEPEP)),
    # padding to capacity with DeepEP
    (("--ep", "2", "--dp", "2", "--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity",
      *OLD_DEEPEP),
     ("--ep", "2", "--moe-expert-capacity-factor", "1", "--moe-pad-expert-input-to-capacity", *OLD_DEEPEP)),
    # a group DeepEP has no configuration for
    (("--num-experts", "12", "--ep", "6", "--dp", "6", *OLD_DEEPEP),
     ("--num-experts", "12", "--ep", "6", "--expert-tensor-parallel-size", "1", *OLD_DEEPEP)),
], ids=["tpxep", "pad", "group"])  # fmt: skip
def test_memory_and_plan_refuse_a_flex_job_in_the_same_words(memory_flags, plan_flags) -> None:
    memory = run_cli("memory", *TINY, "--global-batch-size", "12", "--moe-token-dispatcher-type",
                     "flex", *memory_flags)  # fmt: skip
    plan = run_cli("plan", *TINY, "--gpus", "12", "--global-batch-size", "12", "--tp", "1", "--pp", "1",
                   "--cp", "1", "--moe-token-dispatcher-type", "flex", *plan_flags)  # fmt: skip
    assert memory.code == 2 and memory.err.startswith("Error: --moe-")
    assert (plan.code, plan.err) == (memory.code, memory.err)


def test_deepep_without_flex_is_refused_in_the_same_words() -> None:
    flags = ("--moe-token-dispatcher-type", "alltoall", "--moe-enable-deepep", "--global-batch-size", "4")
    memory = run_cli("memory", *TINY, "--ep", "2", "--dp", "2", *flags)
    plan = run_cli("plan", *TINY, "--gpus", "4", *flags)
    assert memory.code == 2 and memory.err == (
        "Error: --moe-enable-deepep needs --moe-token-dispatcher-type flex, not alltoall "
        "(megatron-core's TransformerConfig: 'DeepEP backend is only supported with flex token "
        "dispatcher.')\n")
    assert (plan.code, plan.err) == (memory.code, memory.err)


# ---- plan confirms a DeepEP job as built: DeepEP's buffers in its peak ----


def _nvl_bytes(hidden_bytes: int, ranks: int, recv: int, sms: int = 20) -> int:
    """DeepEP csrc/config.hpp get_nvl_buffer_size_hint for one NVLink domain, aligned to 128, plus
    what csrc/deep_ep.cpp Buffer::Buffer allocates beside it: 8 barrier ints, two arrays of 8
    pointers (160 bytes)."""
    channels = sms // 2
    queue = channels * ranks * recv  # the NVLink receive queue, tokens
    # counters; token, SourceMeta (8 B), 128 int64 top-k indices, 128 fp32 weights, 128 fp32 scales
    raw = channels * ranks * (2 * 1 + 3) * 4 + queue * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return -(-raw // 128) * 128 + 8 * 4 + 2 * 8 * 8


@pytest.mark.slow
@pytest.mark.parametrize(("pp", "ep"), [(1, 4), (2, 2)])
def test_plan_prints_the_peak_memory_measures_for_a_deepep_job(pp: int, ep: int) -> None:
    dp = 4 // pp
    asked = ("plan", *TINY, "--tp", "1", "--pp", str(pp), "--ep", str(ep), "--gpus", "4",
             "--global-batch-size", "8", "--cp", "1", "--expert-tensor-parallel-size", "1",
             "--recompute-granularity", "none", "--no-use-distributed-optimizer",
             "--moe-token-dispatcher-type", "flex", *OLD_DEEPEP, "--top", "1")  # fmt: skip
    plan = run_cli(*asked, "--format", "json")
    assert plan.code == 0, plan.err
    best = json.loads(plan.out)["plans"][0]
    # the same job as `memory` reads it: plan 1's Megatron-LM flags (split, flash attention, ...)
    flags = [word for flag in best["flags"] for word in flag.split()]
    assert "--moe-token-dispatcher-type" in flags
    memory = run_cli("memory", *TINY, *flags, "--dp", str(dp), "--format", "json")
    assert memory.code == 0, memory.err
    stages = json.loads(memory.out)["stages"]
    # DeepEP's buffers by hand: hidden 256 in bf16 (512 bytes a token), the NVLink receive queue of
    # 256 tokens (get_dispatch_config's for 2-8 ranks), the 32 MiB workspace; no RDMA within 8 GPUs
    hand = [["DeepEP NVLink buffer", _nvl_bytes(512, ep, 256)], ["DeepEP workspace", 32 * MIB]]
    for printed, measured in zip(best["stages"], stages, strict=True):
        assert printed["outside_allocator"] == measured["buffers"]["outside_allocator"] == hand
        assert printed["total"] == measured["total"]
    assert best["peak_bytes"] == max(s["total"] for s in stages)
    text = run_cli(*asked)
    worst = max(best["stages"], key=lambda s: s["total"])
    held = sum(size for _, size in hand)
    assert (f"Plan 1, stage {worst['stage']} (its peak): outside PyTorch's allocator "
            f"{held / GIB:.2f} GiB (DeepEP NVLink buffer {hand[0][1] / GIB:.2f} GiB, DeepEP "
            f"workspace 0.03 GiB): in the activations and the peak, not in what "
            f"torch.cuda.max_memory_allocated reports ({(worst['total'] - held) / GIB:.2f} GiB)."
            ) in text.out  # fmt: skip
