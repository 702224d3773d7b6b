"""The graph side of a BGMV kernel: what the pass needs to emit one.

A kernel is a shrink/expand pair of ``torch.ops.xla_lora`` ops with one
calling convention::

    t = bgmv_shrink<suffix>(x2d, stacked_A, *inputs, 1.0)
    y = bgmv_expand<suffix>(t, stacked_B, base2d, *inputs, True)

where ``inputs`` are its per-step index tensors.  The table of kernels lives
with the ops and the metadata that feed them (``xla_lora_pass.kernels.table``)
and reaches the passes through ``RewriteContext.kernels`` /
``RewriteContext.kernel``: this package names no kernel.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch
import torch.fx as fx

from .annotations import STACKED_A, STACKED_A_T, STACKED_B, STACKED_B_T

# (graph, ctx: the RewriteContext, which holds the specs, tokens, flat, n_feature_dims, device) -> the kernel's
# per-step input nodes for the site, or None when the kernel does not apply to it (the insert point is the caller's).
SiteInputs = Callable[[fx.Graph, object, fx.Node, fx.Node, int, object], Optional[tuple]]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What the graph pass needs to emit one kernel."""

    name: str
    shrink: str  # op names in torch.ops.xla_lora
    expand: str
    # Weight layout: False reads A [N, R, in] / B [N, out, R]; True the stacks with their last two dims
    # swapped (A [N, in, R] / B [N, R, out]), for kernels whose batched matmuls multiply in that layout.
    transposed: bool
    # The site's per-step inputs; None: the token indices, which every site can get (the fallback kernel).
    site_inputs: Optional[SiteInputs] = None
    input_kinds: Tuple[str, ...] = ()  # the GraphInputRequest kinds site_inputs adds
    # The kernel's own sizes, bound from the caller's settings, read by its site_inputs: the row kernel's
    # (min row tokens,), the segment kernel's (block tokens, slots per block), the sorted kernel's (block tokens,).
    params: Tuple[int, ...] = ()

    @property
    def shrink_op(self):
        return getattr(torch.ops.xla_lora, self.shrink).default

    @property
    def expand_op(self):
        return getattr(torch.ops.xla_lora, self.expand).default

    @property
    def weight_kinds(self) -> Tuple[str, str]:
        """The GraphInputRequest kinds of its A and B stacks."""
        return weight_kinds(self.transposed)

    @property
    def rank_dim(self) -> int:
        """The dim of its A stack that holds the rank (fused shrinks concatenate along it)."""
        return 2 if self.transposed else 1


def weight_kinds(transposed: bool) -> Tuple[str, str]:
    """The GraphInputRequest kinds of a site's A and B stacks in one layout."""
    return (STACKED_A_T, STACKED_B_T) if transposed else (STACKED_A, STACKED_B)


def is_expand(target) -> bool:
    """Whether ``target`` is any kernel's expand: all are ``xla_lora::bgmv_expand*`` and take y third."""
    schema = getattr(target, "_schema", None)
    return schema is not None and schema.name.startswith("xla_lora::bgmv_expand")
