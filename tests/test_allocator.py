"""The engine's allocator finds an ATen call's tensors as torch's pytree does (allocator.tensors_in)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from inspector.memory.engine.allocator import tensors_in

Pair = collections.namedtuple("Pair", "first second")


def _trees() -> list[Any]:
    a, b, c, d = (torch.empty(n, device="meta") for n in (1, 2, 3, 4))
    return [
        ((a, b), {}),
        (([a, 1, None, [b, (c,)]], {"out": d, "dim": 0}), {"dtype": torch.float32}),
        (Pair(a, [b, c]), collections.OrderedDict(x=d, y=a)),
        ((torch.Size([2, 3]), 1.5, True, "mean", torch.device("meta"), slice(0, 2)), {"z": b}),
        collections.deque([a, (b, {"k": c})]),
        (),
    ]


@pytest.mark.parametrize("index", range(len(_trees())))
def test_the_tensors_and_their_order_are_pytree_s(index: int) -> None:
    tree = _trees()[index]
    expected = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    assert [id(t) for t in tensors_in(tree)] == [id(t) for t in expected]
