"""The one function every replacement calls to emit a site's delta through a kernel (``KernelSpec``)."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch.fx as fx

from . import fx_utils
from .annotations import LoRAWeightRef
from .context import RewriteContext
from .kernel_spec import weight_kinds
from .site_inputs import site_indices, stacked_input

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
