"""inspector.world.fastimport and sympy_free: building and `memory` import neither DTensor, dynamo, sympy nor DCP.

Counts, not timings: each command runs in a fresh interpreter, which reports the heavy modules it
imported. The golden-file tests prove the shortcuts change no shape.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fresh interpreter per command: ~28 s of CPU

HEAVY = [
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed.checkpoint",
    "sympy",
]

PROBE = f"""
import json, sys
HEAVY = {HEAVY!r}
from inspector.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stdout = sys.__stdout__
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps(dict(heavy=heavy, megatron="megatron.core" in sys.modules)))
"""

COMMANDS = [
    "params --model llama3-70b --tp 8 --pp 4 --bf16",
    "params --model gpt3-175b --tp 8 --pp 16",
    "params --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --tp 2 --pp 2 --num-virtual-stages-per-pipeline-rank 2",
    "memory --model llama3-70b --tp 8 --pp 4 --dp 8 --use-distributed-optimizer "
    "--micro-batch-size 1 --seq-length 8192",
    # the local spec, MoE (balanced routing's dispatch mode), torch's foreach AdamW
    "memory --model mixtral-8x7b --transformer-impl local --num-layers 4 --hidden-size 256 "
    "--ffn-hidden-size 512 --num-attention-heads 4 --num-query-groups 2 --seq-length 128 --pp 2 "
    "--ep 2 --dp 2 --bf16 --micro-batch-size 1 --global-batch-size 4",
    "tree --model mixtral-8x7b --ep 8 --dp 8 --pp 2",
    "params --model qwen1.5-moe-a2.7b --ep 4 --dp 4 --pp 2 --moe-grouped-gemm",
    "params --model llama3-70b --tp 8 --pp 4 --bf16 --transformer-impl transformer_engine "
    "--sequence-parallel",
]


def _heavy(command: str) -> list[str]:
    """Return the heavy modules `command` imports in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *command.split(), "--no-cache"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["megatron"], done.stderr
    return report["heavy"]


@pytest.mark.parametrize("command", COMMANDS)
def test_build_imports_no_heavy_module(command):
    # memory runs megatron's forward, backward and optimizer step on meta tensors (the engine):
    # torch's Python meta kernels' type promotion, torch.sym_not and torch's shape-reasoning
    # module are answered without sympy for plain values, the engine's dispatch modes are not
    # wrapped for dynamo, torch.optim's wrappers are seeded, and megatron's
    # fsdp_dtensor_checkpoint (DCP, DTensor) is imported only if one of its functions is called.
    heavy = _heavy(command)
    if "mixtral" in command and command.startswith("memory"):
        # left: the local MoE's token sums convert their dtype through torch's Python meta
        # kernel, whose density check imports torch.utils._sympy (and sympy) directly
        assert "sympy" in heavy
        heavy = [module for module in heavy if module != "sympy"]
    assert heavy == []


def test_multi_latent_attention_build_imports_no_dynamo():
    # MLA's YaRN rotary embedding takes 1 / tensor on meta (torch._refs.reciprocal, whose dynamo
    # wrapper only a closure holds). Its torch.arange on meta still imports sympy (torch._refs'
    # arange checks its layout through torch._check), which this test leaves aside.
    command = (
        "params --model deepseek-v3 --num-layers 4 --moe-layer-freq [0,1,1,1] --num-experts 16 "
        "--moe-router-topk 2 --tp 2 --ep 2 --dp 2 --pp 2 --sequence-parallel --bf16"
    )
    assert "torch._dynamo" not in _heavy(command)


def test_engine_dispatch_modes_run_unwrapped():
    """torch wraps a TorchDispatchMode's __torch_dispatch__ in torch._disable_dynamo unless the
    class says to skip it; the wrapper's first call imports dynamo (torch/utils/_python_dispatch.py)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from inspector.memory.engine.allocator import Tracker
    from inspector.memory.engine.moe import _HostValues
    from inspector.memory.engine.optimizer import _GpuTracker

    class Plain(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert hasattr(vars(Plain)["__torch_dispatch__"], "__wrapped__")  # what torch does by default
    for mode in (Tracker, _GpuTracker, _HostValues):
        assert not hasattr(vars(mode)["__torch_dispatch__"], "__wrapped__"), mode


def test_torch_optim_wrappers_are_seeded():
    """Optimizer.add_param_group and zero_grad are torch._disable_dynamo wrappers (torch/optim/
    optimizer.py); once megatron is imported, calling them imports no dynamo."""
    import torch

    from inspector.world.fastimport import _seed_dynamo_disable
    from inspector.world.setup import megatron

    megatron()
    _seed_dynamo_disable()
    for method in (torch.optim.Optimizer.add_param_group, torch.optim.Optimizer.zero_grad):
        wrapped = method.__wrapped__
        assert getattr(wrapped, "__dynamo_disable") is wrapped


CALLED_LATER = """
import json, sys
from inspector.world.setup import megatron
megatron()
from megatron.core.optimizer import distrib_optimizer
name = "megatron.core.transformer.fsdp_dtensor_checkpoint"
report = dict(imported=name in sys.modules, dcp="torch.distributed.checkpoint" in sys.modules)
if report["imported"]:  # megatron-core 0.15+: optimizer/ imports two of its functions by name
    stand_in = sys.modules[name]
    expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    # megatron's own function, called through the name distrib_optimizer holds
    report["out"] = distrib_optimizer.handle_experts_in_state_dict({expert: 1}, None)
    real = sys.modules[name]
    report["real"] = real is not stand_in and hasattr(real, "default_planner")
    report["dcp_after"] = "torch.distributed.checkpoint" in sys.modules
print(json.dumps(report))
"""


def test_fsdp_dtensor_checkpoint_is_imported_only_when_called():
    done = subprocess.run(
        [sys.executable, "-c", CALLED_LATER], capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dcp"] is False
    if report["imported"]:
        from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

        expert = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
        assert report["out"] == handle_experts_in_state_dict({expert: 1}, None)  # in this process
        assert report["real"] and report["dcp_after"]


def _kinds():
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND

    return list(ELEMENTWISE_TYPE_PROMOTION_KIND)


def test_type_promotion_without_sympy_is_torchs():
    """`_promotion` answers as torch._prims_common.elementwise_dtypes itself, over every dtype
    pair, 0-dim and n-dim tensors, Python numbers and every promotion kind."""
    import itertools

    import torch
    from torch import _prims_common

    from inspector.world.sympy_free import _promotion

    real = getattr(_prims_common.elementwise_dtypes, "real", _prims_common.elementwise_dtypes)
    fast = _promotion(real)
    dtypes = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
              torch.float32, torch.float64, torch.complex64]  # fmt: skip
    values = [torch.empty(shape, dtype=d, device="meta") for d in dtypes for shape in ((), (2,))]
    values += [True, 3, 0.5, 1j, None]
    compared = 0
    for kind in _kinds():
        for count in (1, 2, 3):
            for args in (
                itertools.product(values, repeat=count)
                if count < 3
                else zip(values, reversed(values), values[3:] + values[:3])
            ):
                try:
                    want = real(*args, type_promotion_kind=kind)
                except Exception as exc:  # torch's error is kept
                    with pytest.raises(type(exc)):
                        fast(*args, type_promotion_kind=kind)
                    continue
                assert fast(*args, type_promotion_kind=kind) == want, (args, kind)
                compared += 1
    assert compared > 1000


def test_sym_not_without_sympy_is_torchs():
    import torch

    from inspector.world.sympy_free import _sym_not

    real = getattr(torch.sym_not, "real", torch.sym_not)
    fast = _sym_not(real)
    for value in (True, False, 0, 1, torch.tensor(True)):
        assert fast(value) == real(value), value
        assert type(fast(value)) is type(real(value)), value


def test_symbolic_shapes_stand_in_answers_as_torch():
    """Each function `_SymbolicShapes` answers for plain values equals torch's own; the names it
    hands out as later calls are functions of torch's module; other names are torch's."""
    import torch

    from inspector.world.sympy_free import _IMPORTED_UNCALLED, _SymbolicShapes

    stand_in = _SymbolicShapes()
    real = _SymbolicShapes()._real()  # torch's module, whether or not megatron() put one in place
    assert not isinstance(real, _SymbolicShapes) and hasattr(real, "ShapeEnv")
    bools, ints = (True, False), (0, 1, 7)
    calls = [
        *[(name, (b,)) for b in bools for name in (
            "expect_true", "guard_or_false", "guard_or_true", "guard_size_oblivious",
            "statically_known_true", "guarding_hint_or_throw", "has_guarding_hint")],
        *[(name, (i,)) for i in ints for name in ("guarding_hint_or_throw", "is_nested_int",
                                                   "has_guarding_hint")],
        *[(name, args) for name in ("sym_and", "sym_or") for args in (
            (True,), (True, False), (True, True, True), (1, 3), (False, 0))],
        *[("sym_eq", args) for args in (
            (1, 1), (1, 2), ((1, 2), (1, 2)), ((1, 2), [1, 2]), ((1, 2), (1, 3)), ((1,), (1, 2)),
            (torch.Size([2, 3]), (2, 3)), ((), ()))],
    ]  # fmt: skip
    for name, args in calls:
        want = getattr(real, name)(*args)
        got = getattr(stand_in, name)(*args)
        assert got == want and type(got) is type(want), (name, args)
    assert stand_in._real_module is None  # all answered without torch's module
    for name in _IMPORTED_UNCALLED:
        assert callable(getattr(real, name)) and type(getattr(real, name)).__name__ == "function"
    # a SymInt-free value it does not answer goes to torch's function (its error here)
    with pytest.raises(AssertionError):
        stand_in.expect_true(1)
    assert stand_in._real_module is real
    assert stand_in.ShapeEnv is real.ShapeEnv
