"""The MoE steps a CUDA graph takes that are no module, named in the engine's run.

`--cuda-graph-scope moe_preprocess` graphs MoELayer.preprocess (the dispatcher's
`dispatch_preprocess`; megatron-core moe_layer.py, moe_utils.py
`maybe_skip_or_early_return_by_cudagraph`), a method of the MoE layer whose other steps
(dispatch, experts, combine) stay outside the graph: what it allocates is named
`<layer>.mlp.preprocess` so engine/cuda_graphs.py can give it to the graphs' pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from inspector.job.job import Job

PREPROCESS = "preprocess"


@contextlib.contextmanager
def preprocess_named(job: Job, enter: Callable[[str], None], leave: Callable[[], None],
                     names: dict[Any, str]) -> Iterator[None]:  # fmt: skip
    """Name what MoELayer.preprocess allocates `<layer>.mlp.preprocess` (`enter`/`leave`: the
    tracker's) where moe_preprocess puts it in the graphs: it is a method of the MoE layer, whose
    other steps (dispatch, experts, combine) stay outside."""
    training = job.training
    if (
        training.cuda_graph_impl != "transformer_engine"
        or "moe_preprocess" not in training.cuda_graph_scope
    ):
        yield
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.preprocess

    def named(self: Any, *args: Any, **kwargs: Any) -> Any:
        enter(f"{names[self]}.{PREPROCESS}")
        try:
            return original(self, *args, **kwargs)
        finally:
            leave()

    MoELayer.preprocess = named
    try:
        yield
    finally:
        MoELayer.preprocess = original
