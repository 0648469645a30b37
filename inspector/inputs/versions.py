"""The installed megatron-core's version, read from package metadata (no torch import), and the
Megatron-LM meanings that depend on it; tests/test_versions.py checks each against megatron itself."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable
from functools import cache


@cache
def megatron_core_version() -> tuple[int, int]:
    """Return the installed megatron-core's (major, minor)."""
    text = importlib.metadata.version("megatron-core")
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def null_tokenizer_adds_eod() -> bool:
    """Whether NullTokenizer reports --vocab-size + 1 (its end-of-document token after the
    vocabulary): up to 0.17; from 0.18 megatron.core.tokenizers' NullTokenizer reports --vocab-size
    with the token inside it (megatron/core/tokenizers/text/libraries/null_tokenizer.py)."""
    return megatron_core_version() < (0, 18)


# The Megatron-LM arguments this tool reads whose presence differs between megatron-core versions:
# flag -> (first version whose Megatron-LM accepts it, first version that no longer does, or None).
# Read off the parser itself (`add_megatron_arguments` in megatron/training/arguments.py) at the
# tags core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0 and main (0.20); 0.13-0.15 by the
# argument's `add_argument` line at core_v0.13.1, core_v0.14.0, core_v0.15.3.
ARGUMENT_VERSIONS: dict[str, tuple[tuple[int, int], tuple[int, int] | None]] = {
    # megatron-core's TransformerConfig grew overlap_moe_expert_parallel_comm in 0.14 (core_v0.14.0)
    "--overlap-moe-expert-parallel-comm": ((0, 14), None),
    # TransformerConfig.moe_flex_dispatcher_backend (HybridEP beside DeepEP) from core_v0.16.0
    "--moe-flex-dispatcher-backend": ((0, 16), None),
    # TransformerConfig.moe_router_padding_for_quantization (0.16; before it only the fp8 name)
    "--moe-router-padding-for-quantization": ((0, 16), None),
    "--inference-dynamic-batching-prefix-caching": ((0, 17), None),
    "--inference-text-gen-server-logging": ((0, 17), None),
    "--num-speculative-tokens": ((0, 17), None),
    "--rl-kv-cache-management-mode": ((0, 17), None),
    "--rl-persist-cuda-graphs": ((0, 17), None),
    "--inference-cuda-graph-all-prefills": ((0, 18), None),
    "--step-batch-size-schedule": ((0, 18), None),
    # training_config.py TokenizerConfig.padded_vocab_size, parsed from it from core_v0.18.0
    "--padded-vocab-size": ((0, 18), None),
    # arguments.py (core_v0.18.0): the layer-wise optimizer's legacy path, without the DDP layout
    "--no-use-layer-wise-param-layout": ((0, 18), None),
    # TransformerConfig's gated delta net fields and --linear-attention-freq (core_v0.16.0)
    "--experimental-attention-variant": ((0, 16), None),
    "--linear-attention-freq": ((0, 16), None),
    "--linear-conv-kernel-dim": ((0, 16), None),
    "--linear-key-head-dim": ((0, 16), None),
    "--linear-value-head-dim": ((0, 16), None),
    "--linear-num-key-heads": ((0, 16), None),
    "--linear-num-value-heads": ((0, 16), None),
    "--attention-output-gate": ((0, 16), None),
    # TransformerConfig's MoE paged stash, HybridEP's static budget and TE's fused operations
    # (core_v0.18.0; none at core_v0.17.0): inputs/paged_stash.py
    **dict.fromkeys(("--moe-paged-stash", "--moe-paged-stash-page-size",
                     "--moe-paged-stash-buffer-size-factor-cuda",
                     "--moe-paged-stash-buffer-size-factor-cpu",
                     "--moe-expert-rank-capacity-factor", "--use-transformer-engine-op-fuser"),
                    ((0, 18), None)),  # fmt: skip
    "--freeze-all-layers": ((0, 19), None),
    "--inference-cuda-graph-max-tokens": ((0, 19), None),
    "--inference-shards": ((0, 19), None),
    "--rl-generation-lag": ((0, 19), None),
    "--rl-max-inflight-requests": ((0, 20), None),
    "--hybrid-attention-ratio": ((0, 13), (0, 17)),  # 0.17: --hybrid-layer-pattern
    "--hybrid-mlp-ratio": ((0, 13), (0, 17)),
    "--legacy-tokenizer": ((0, 15), (0, 17)),  # 0.17 builds megatron.core.tokenizers only
    "--moe-extended-tp": ((0, 13), (0, 17)),
    "--moe-use-legacy-grouped-gemm": ((0, 13), (0, 17)),  # 0.17 removed GroupedMLP
    "--no-async-tensor-model-parallel-allreduce": ((0, 13), (0, 17)),
    "--no-scatter-gather-tensors-in-pipeline": ((0, 13), (0, 18)),
    "--tiktoken-special-tokens": ((0, 13), (0, 18)),
    # 0.18 folded the tokenizer's arguments into TokenizerConfig (commit 40d024bc69)
    "--tokenizer-hf-include-special-tokens": ((0, 16), (0, 18)),
    "--use-legacy-models": ((0, 13), (0, 18)),
}


# Choices of a modelled argument that differ between megatron-core versions: (flag, value) -> the
# first version whose Megatron-LM accepts it (arguments.py's `choices` at core_v0.13.1, core_v0.14.0,
# core_v0.15.0, core_v0.16.0, core_v0.17.0, core_v0.18.0 and main): --optimizer was
# ['adam', 'sgd'] to 0.15; 0.16 added muon and dist_muon, 0.17 lion, 0.18 soap and adaptive_muon.
CHOICE_VERSIONS: dict[tuple[str, str], tuple[int, int]] = {
    ("--optimizer", "muon"): (0, 16),
    ("--optimizer", "dist_muon"): (0, 16),
    ("--optimizer", "lion"): (0, 17),
    ("--optimizer", "soap"): (0, 18),
    ("--optimizer", "adaptive_muon"): (0, 18),
}


# the megatron-core releases whose Muon this tool runs, as [first, stop) ranges: 0.16-0.17's
# optimizer/muon.py, and 0.18-0.19's optimizer/emerging_optimizers.py registry (muon.py a shim
# there). The layer-wise optimizer (dist_muon; from 0.18 also muon with --use-distributed-optimizer)
# as 0.16-0.17 build it, which 0.18+ keep behind --no-use-layer-wise-param-layout: by default 0.18
# lays its matrices out in DDP's buffers (layer_wise_optimizer.py compute_full_param_layout) beside
# a DistributedOptimizer for the other parameters, which this tool does not run yet
# (job/optimizers.py refuses it by name).
MUON_RELEASES = (((0, 16), (0, 20)),)
LAYER_WISE_RELEASES = (((0, 16), (0, 20)),)  # 0.18+: --no-use-layer-wise-param-layout only
MUON_REGISTRY_SINCE = (0, 18)  # optimizer/emerging_optimizers.py builds Muon


def within(ranges: tuple[tuple[tuple[int, int], tuple[int, int]], ...], version: tuple[int, int]) -> bool:
    """Return whether `version` is in one of the [first, stop) `ranges`."""
    return any(first <= version < stop for first, stop in ranges)


def choice_version_fact(flag: str, value: str) -> tuple[str, bool] | None:
    """Return the version fact of a choice some Megatron-LM versions lack ("muon is a choice of
    Megatron-LM 0.16+; this tool builds with megatron-core 0.16"), and whether the installed
    megatron-core's Megatron-LM accepts it; None for a choice every version has."""
    first = CHOICE_VERSIONS.get((flag, value))
    if first is None:
        return None
    installed = megatron_core_version()
    fact = (f"{flag} {value} is a choice of Megatron-LM {_dotted(first)}+; this tool builds with "
            f"megatron-core {_dotted(installed)}")  # fmt: skip
    return fact, installed >= first


def argument_unknown_note(flag: str) -> str | None:
    """Return a note when the installed megatron-core's Megatron-LM does not know `flag`, else None."""
    span = ARGUMENT_VERSIONS.get(flag)
    if span is None:
        return None
    first, gone = span
    installed = megatron_core_version()
    if first <= installed and (gone is None or installed < gone):
        return None
    since = (f"removed in {_dotted(gone)}" if gone is not None and installed >= gone
             else f"added in {_dotted(first)}")  # fmt: skip
    return (f"{flag} is not an argument of Megatron-LM {_dotted(installed)} (the installed "
            f"megatron-core; {since}): its pretrain_gpt.py would stop with 'unrecognized "
            "arguments'")  # fmt: skip


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def unknown_argument_notes(flags: Iterable[str]) -> list[str]:
    """Return one note per flag (each once, in order) the installed Megatron-LM does not know."""
    notes = (argument_unknown_note(flag) for flag in dict.fromkeys(flags))
    return [note for note in notes if note is not None]
