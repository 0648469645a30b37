"""The installed megatron-core's version, read from package metadata (no torch import), and the
Megatron-LM meanings that depend on it; tests/test_versions.py checks each against megatron itself."""

from __future__ import annotations

import importlib.metadata
import re
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
