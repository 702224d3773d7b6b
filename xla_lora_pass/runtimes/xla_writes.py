"""In-place writes as one XLA program compiled once, run without tracing: what a pool swap is on XLA.

A lazy tensor's ops are traced again on every call, even when the program
they make is cached: a swap's ``narrow`` / ``view`` / ``index_copy_`` for each
of 22 stacks took most of its 2.2 ms at hidden 256 (``bench/adapter_pool.py``).
Here the write function is traced once into an FX graph (``make_fx`` over
fake tensors) and handed to torch_xla's Dynamo bridge, which compiles it and
runs the cached program on each call's device data.  The written tensors are
marked as buffer donors while the program is compiled, so it writes them in
place; without that it returned new stacks and copied them in (slower than
the lazy write at hidden 2048).  The marks are taken off right after: a graph
compiled later with a stack marked may reuse the stack's buffer for an output
of its shape.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def compile_writes(write: Callable[..., None], args: Sequence[torch.Tensor], written: Sequence[int]) -> Callable:
    """``write(*args)`` (in place into ``args[i]`` for ``i`` in ``written``, all on one XLA device) as a
    callable that runs its compiled program on arguments of the same shapes, dtypes and layouts."""
    import torch_xla
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_xla._dynamo.dynamo_bridge import extract_internal

    graph = make_fx(write, tracing_mode="fake")(*args)
    # The bridge traces the graph on the real tensors, then drops the pending computation of every live
    # tensor on the device: nothing may be pending but what it traces (its own Dynamo entry syncs first too).
    torch_xla.sync(wait=True)
    donors = [args[i] for i in written]
    for tensor in donors:
        torch_xla._XLAC._set_buffer_donation(tensor, True)
    try:
        graph.xla_args = list(args)
        return extract_internal(graph)
    finally:
        for tensor in donors:
            torch_xla._XLAC._set_buffer_donation(tensor, False)


__all__ = ["compile_writes"]
