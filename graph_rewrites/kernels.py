"""The graph side of a BGMV kernel, and the one function every replacement calls to emit a site's delta.

A kernel is a shrink/expand pair of ``torch.ops.xla_lora`` ops with one
calling convention (``xla_lora_pass/ops_common.py``)::

    t = bgmv_shrink<suffix>(x2d, stacked_A, *inputs, 1.0)
    y = bgmv_expand<suffix>(t, stacked_B, base2d, *inputs, True)

where ``inputs`` are its per-step index tensors.  :class:`KernelSpec` says
what the pass needs to emit one; the table of kernels lives with the ops and
the metadata that feed them (``xla_lora_pass/kernels.py``) and reaches the
passes through ``RewriteContext.kernels`` / ``RewriteContext.kernel``:
this package names no kernel.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple, Union

import torch
import torch.fx as fx

from . import fx_utils
from .annotations import STACKED_A, STACKED_A_T, STACKED_B, STACKED_B_T, LoRAWeightRef
from .report import RewriteContext
from .site_inputs import site_indices, stacked_input

# (graph, ctx, tokens, flat, n_feature_dims, device) -> the kernel's per-step input nodes for the site, or
# None when the kernel does not apply to it (the insert point is the caller's).
SiteInputs = Callable[[fx.Graph, RewriteContext, fx.Node, fx.Node, int, object], Optional[tuple]]


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


def stacks_and_base(graph: fx.Graph, m, ref: LoRAWeightRef, device, transposed: bool = False):
    """The site's stacked A and B inputs, and the base output ``m.base`` as ``[T, out]`` in ``m.output``'s dtype.

    ``transposed``: the ``[N, in, R]`` / ``[N, R, out]`` stacks instead (``KernelSpec.transposed``).
    """
    n, r = ref.num_slots, ref.stacked_rank
    kind_a, kind_b = weight_kinds(transposed)
    shape_a, shape_b = ((n, ref.in_features, r), (n, r, ref.out_features)) if transposed else (
        (n, r, ref.in_features), (n, ref.out_features, r))
    stacked_a = stacked_input(graph, ref, kind_a, shape_a, device)
    stacked_b = stacked_input(graph, ref, kind_b, shape_b, device)
    base2d = fx_utils.call(graph, "call_method", "reshape", m.base, -1, ref.out_features)
    out_dtype = fx_utils.example_value(m.output).dtype
    if fx_utils.example_value(m.base).dtype != out_dtype:
        # The eager add promotes (bf16 base + fp32 LoRA -> fp32): keep that dtype.
        base2d = fx_utils.call(graph, "call_method", "to", base2d, out_dtype)
    return stacked_a, stacked_b, base2d


def emit_lora_delta(graph: fx.Graph, ctx: RewriteContext, m, ref: LoRAWeightRef, tokens: fx.Node, x2d: fx.Node,
                    n_feature_dims: int, device, need_indices: bool) -> Union[Tuple[fx.Node, Optional[fx.Node]], str]:
    """``m.base`` plus the site's LoRA delta, through ``ctx.kernel`` where it applies, else the fallback kernel.

    ``tokens`` is the site's activation (token dims then ``n_feature_dims``
    feature dims), ``x2d`` it as ``[T, in]``.  ``need_indices``: the caller
    also reads the token indices (LoRA bias, DoRA).  Returns (expand node,
    token indices or None), or the reason the site cannot be tied to the
    mapping.  Insert point: the caller's.
    """
    kernel, inputs = ctx.kernel, None
    if kernel.site_inputs is not None:
        inputs = kernel.site_inputs(graph, ctx, tokens, x2d, n_feature_dims, device)
        if inputs is None:
            kernel = ctx.fallback
    idx = None
    if inputs is None or need_indices:
        idx, reason = site_indices(graph, ctx, tokens, x2d, n_feature_dims, device)
        if idx is None:
            return reason
    if inputs is None:
        inputs = (idx,)
    stacked_a, stacked_b, base2d = stacks_and_base(graph, m, ref, device, transposed=kernel.transposed)
    shrunk = fx_utils.call(graph, "call_function", kernel.shrink_op, x2d, stacked_a, *inputs, 1.0)
    return fx_utils.call(graph, "call_function", kernel.expand_op, shrunk, stacked_b, base2d, *inputs, True), idx
