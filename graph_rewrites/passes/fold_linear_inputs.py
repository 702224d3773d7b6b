"""A ``linear`` on a strided view of its tokens runs as one matmul, not as a batched one with the weight copied.

When aot_autograd traces a graph for XLA, ``linear`` decomposes into
``matmul``, which folds an input of three or more dims into a matrix (one
``mm``) only if its leading dims are laid out contiguously or the weight
requires grad (``should_fold`` in aten's ``LinearAlgebra.cpp``).  Otherwise
it broadcasts the weight to every leading index and calls ``bmm``: a view in
eager, but a real copy on XLA.  HF's ``logits_to_keep=1``, which every
``generate`` prompt step passes, computes ``lm_head(hidden[:, -1:, :])``, whose
strides fail that test, and PEFT freezes ``lm_head``: the prompt step copied
the lm_head weight once per row (``f32[16, 512, 4096]``, 134 MB, at batch 16
of the bench model; docs/benchmarks.md).  The base model, whose weights
require grad, folds.

This pass gives such a ``linear`` a contiguous clone of its input (the few
rows it reads), which folds.  Exact: the same products and sums, as one
``mm`` like the base model's.  It runs last, on the rewritten graph, so the
patterns see the graph as Dynamo traced it.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import fx_utils
from ..fx_values import example_value
from ..context import RewriteContext

LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def folds(value: torch.Tensor) -> bool:
    """Whether ``matmul`` can fold ``value`` (the input of a linear) into a matrix without a copy: its
    leading dims contiguous, ``stride[i] == stride[i + 1] * size[i + 1]`` (aten's test, which size-1 dims
    do not skip).  Unknown (symbolic) counts as no."""
    sizes, strides = value.shape, value.stride()
    return all(statically_known_true(strides[i] == strides[i + 1] * sizes[i + 1]) for i in range(value.dim() - 2))


def fold_linear_inputs(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Clone the input of every linear of three or more dims that ``matmul`` could not fold (module doc)."""
    changed = False
    for target in LINEAR_TARGETS:
        for node in gm.graph.find_nodes(op="call_function", target=target):
            x = node.args[0] if node.args else node.kwargs.get("input")
            value = example_value(x)
            if not isinstance(x, fx.Node) or not isinstance(value, torch.Tensor) or value.dim() < 3 or folds(value):
                continue
            with gm.graph.inserting_before(node):
                dense = fx_utils.call(gm.graph, "call_method", "clone", x, memory_format=torch.contiguous_format)
            node.replace_input_with(x, dense)
            changed = True
    return changed
