"""A job is checked once (job/job.py `_CHECKED`): the memo is keyed by every setting."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inspector.errors import ConfigError
from inspector.job import job as job_module
from inspector.job.job import Job, Training
from inspector.job.model import ModelConfig


def test_a_job_differing_in_one_setting_is_checked_afresh() -> None:
    """A bf16 job with flash attention passes and is remembered; the same job in fp32 (only the
    model's precision differs) must still be refused."""
    good = Job(model=ModelConfig(bf16=True), training=Training(flash_attention=True))
    assert (good.model, good.layout, good.training) in job_module._CHECKED
    with pytest.raises(ConfigError, match="--use-flash-attn"):
        replace(good, model=replace(good.model, bf16=False))
    with pytest.raises(ConfigError, match="--use-flash-attn"):  # refused every time, never kept
        replace(good, model=replace(good.model, bf16=False))
