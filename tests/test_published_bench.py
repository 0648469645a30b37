"""bench/published.py: each published record's job is the one its authors ran."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"

RECORD = {"model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 256, "arch": "GPT"},
          "precision": "fp16", "gbs": 8}  # fmt: skip


def test_records_before_transformer_engine_use_megatron_s_own_layers(monkeypatch):
    # Narayanan et al. 2021 and Korthikanti et al. 2022 ran megatron's own layers and fused
    # softmax (no flash attention, no Transformer Engine then): pricing them as TE's unfused
    # attention added its causal-mask rebuild to runs that never had it
    monkeypatch.syspath_prepend(str(BENCH))
    import published

    assert published.model_flags(RECORD | {"flash_attention": False})["transformer_impl"] == "local"
    assert "transformer_impl" not in published.model_flags(RECORD | {"flash_attention": True})
