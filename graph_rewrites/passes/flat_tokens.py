"""Activations whose rows are the token layout flattened row-major (OPT's ``[B*S, H]``).

OPT reshapes ``[B, S, H]`` to ``[B*S, H]`` before ``fc1``/``fc2``.  Row-major
flattening keeps the tokens in the mapping's own order, so such a site reads
the same token indices as a site on ``[B, S]``.  That holds only where the
graph proves it: a node is marked when it is a reshape/view that merges the
layout's dims of a tensor on the layout (and keeps its feature dims), or a
row-wise op (each output row computed from the same row of its inputs) whose
every token-sized input is marked.  A transpose or any op that moves rows
leaves its result, and everything computed from it, unmarked.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Set

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import fx_utils
from ..fx_values import size_expr
from ..transposes import reorders_dims

_RESHAPES = {"reshape", "view", torch.reshape}
# Row-wise ops: output row i is computed from row i of every token-sized tensor input.
ROW_WISE = {
    torch._C._nn.linear, F.linear, F.layer_norm, F.rms_norm, F.relu, torch.relu, F.gelu, F.silu, F.mish,
    torch.tanh, torch.sigmoid, F.dropout, operator.add, operator.sub, operator.mul, operator.truediv,
    operator.neg, torch.add, torch.sub, torch.mul, torch.div, torch.neg,
    "to", "type", "float", "half", "bfloat16", "contiguous", "relu", "gelu", "tanh", "sigmoid", "add", "sub",
    "mul", "div", "neg",
}


def _expr(d):
    return sympy.sympify(size_expr(d))


def _same(a: Sequence, b: Sequence) -> bool:
    """Dims equal as canonical sympy expressions (no shape guards)."""
    return len(a) == len(b) and all(_expr(x) == _expr(y) for x, y in zip(a, b))


def _shape(node) -> Optional[tuple]:
    value = fx_utils.example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _flattens_layout(node: fx.Node, layout: Sequence) -> bool:
    """``node`` is ``source.reshape(B*S, *features)`` with ``source`` on ``[B, S, *features]``."""
    if node.target not in _RESHAPES or not node.args:
        return False
    source = node.args[0]
    shape, source_shape = _shape(node), _shape(source)
    if shape is None or source_shape is None or len(source_shape) <= len(layout):
        return False
    if reorders_dims(source):  # a transposed or permuted source is not in token order
        return False
    flat = sympy.Mul(*(_expr(d) for d in layout))
    return (_same(source_shape[: len(layout)], layout) and sympy.expand(_expr(shape[0])) == sympy.expand(flat)
            and _same(shape[1:], source_shape[len(layout):]))


def row_wise_inputs(node: fx.Node) -> list:
    """The token-sized inputs (same rank, same row count) of a row-wise op; [] for any other node."""
    if node.op not in ("call_function", "call_method") or node.target not in ROW_WISE:
        return []
    shape = _shape(node)
    if not shape:
        return []
    if node.target in (torch._C._nn.linear, F.linear, F.layer_norm, F.rms_norm):
        return [node.args[0]]  # weight and bias are per feature, whatever their sizes
    return [a for a in node.all_input_nodes if (s := _shape(a)) is not None and len(s) == len(shape)
            and _same(s[:1], shape[:1])]


def _row_wise_of_marked(node: fx.Node, marked: Set[fx.Node]) -> bool:
    """A row-wise op whose token-sized inputs are all marked, at least one."""
    token_inputs = row_wise_inputs(node)
    return bool(token_inputs) and all(a in marked for a in token_inputs)


def flat_token_nodes(gm: fx.GraphModule, layout: Optional[Sequence]) -> Set[fx.Node]:
    """Every node whose rows are ``layout`` flattened row-major, as the graph's own ops prove it."""
    marked: Set[fx.Node] = set()
    if not layout or len(layout) < 2:
        return marked
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if _flattens_layout(node, layout) or _row_wise_of_marked(node, marked):
            marked.add(node)
    return marked
