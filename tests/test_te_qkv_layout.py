"""The Transformer Engine stand-in takes q, k and v as TE's `get_qkv_layout` leaves them.

Written by hand from TE 2.11's attention/dot_product_attention/utils.py `get_qkv_layout`
(`run_iteratively`: packed sb3hd / sbh3d, q beside a packed kv, three tensors whose k and v
strides agree; anything else copied contiguous), on meta tensors; then what it changes in a
job: the engine's bytes of a RoPE layer equal the closed forms' (activations.py, Korthikanti et
al.), where the QKV linear's whole output was held before.
"""

from __future__ import annotations

import pytest

S, B, A, G, D = 8, 2, 4, 2, 16  # sequence, micro-batch, heads, query groups, head dim


def _layout():
    from inspector.world import te

    te.install()
    from inspector.world.te.attention import qkv_layout

    return qkv_layout


def _storage(t) -> int:
    return t.untyped_storage()._cdata


def test_packed_buffers_and_separate_tensors_pass_as_given() -> None:
    import torch

    layout = _layout()
    packed = torch.empty(S, B, 3, A, D, device="meta")  # sb3hd
    q, k, v = packed.unbind(2)
    assert all(x is y for x, y in zip(layout(q, k, v), (q, k, v), strict=True))
    kv = torch.empty(S, B, G, 2, D, device="meta")  # sbhd_sbh2d
    q = torch.empty(S, B, A, D, device="meta")
    k, v = kv.unbind(3)
    assert all(x is y for x, y in zip(layout(q, k, v), (q, k, v), strict=True))
    three = [torch.empty(S, B, n, D, device="meta") for n in (A, G, G)]  # sbhd_sbhd_sbhd
    assert all(x is y for x, y in zip(layout(*three), three, strict=True))


def test_megatrons_roped_q_and_k_beside_a_view_of_the_qkv_output_are_copied() -> None:
    """megatron-core attention.py `get_query_key_value_tensors`: the QKV linear's output
    [s, b, g, (a / g + 2) d] split on its last dimension; RoPE makes new q and k, v stays a view
    whose strides are not k's: TE copies all three contiguous, the output's storage is let go."""
    import torch

    layout = _layout()
    mixed = torch.empty(S, B, G, (A // G + 2) * D, device="meta")
    _, key, value = torch.split(mixed, [A // G * D, D, D], dim=3)
    q = torch.empty(S, B, A, D, device="meta")  # what the fused RoPE returns
    k = torch.empty_like(key)
    out = layout(q, k, value)
    assert all(t.is_contiguous() for t in out)
    assert _storage(out[2]) != _storage(mixed)
    # without RoPE, k and v both views of the output beside megatron's reshaped q: their strides
    # agree, their offsets fit none of TE's layouts (k starts a / g heads into each group)
    _, key, value = torch.split(mixed, [A // G * D, D, D], dim=3)
    out = layout(q, key, value)
    assert out[0] is q and _storage(out[1]) != _storage(mixed) != _storage(out[2])


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"qk_layernorm": True}], ids=["llama", "qk-norm"])
def test_the_engines_bytes_equal_the_closed_forms(extra) -> None:
    """Llama 3 8B's layer (GQA, RoPE fused, flash attention), one micro-batch, and the same with
    Qwen3's per-head Q and K norms: the engine's bytes per layer (three layers against two) equal
    activations.py's to 1%, and so does the stage's peak above its static memory (the loss's
    16-bit logits beside its fp32 copy: `loss_logits`). Before: the engine held the QKV
    output (1.204 against 1.126 GiB a layer at sequence 8192), the K norm kept it too, the closed
    forms had no Q and K norm inputs and no 16-bit logits."""
    from inspector.inputs.resolve import Sources, merge_sources
    from inspector.job.job import make_job
    from inspector.memory.closed.activations import layer_activations, stage_activations
    from inspector.memory.measure import make_hardware, measure
    from inspector.world.build import build, select_view

    def job(layers: int):
        flags = dict(num_layers=layers, micro_batch_size=1, global_batch_size=8, bf16=True,
                     use_flash_attn=True, seq_length=2048, data_parallel_size=8, **extra)
        return make_job(merge_sources(Sources(preset="llama3-8b", flags=flags),
                                      ("model", "layout", "training")).args)

    def peak(layers: int) -> int:
        one = job(layers)
        stage = measure(build(one, select_view(one, rank=0)),
                        make_hardware(None, None, None, "h100", "bf16")).stages[0]
        return stage.total - stage.static  # above the state and the persistent buffers

    two = job(2)
    closed = layer_activations(two.dims(), two.layout, 0, 1, "none", True).total
    engine = peak(3) - peak(2)
    assert engine == pytest.approx(closed, rel=0.01)
    whole = stage_activations(two.dims(), two.layout, 0, [[0, 1]], 1, 1, "none", True)
    assert whole.loss_logits == 2 * 2048 * two.dims().vocab_size  # bf16 [s, b, v]
    assert peak(2) == pytest.approx(whole.total, rel=0.01)
