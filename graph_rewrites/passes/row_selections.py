"""Activations computed row by row from a row selection of the token layout.

BERT's pooler takes ``hidden[:, 0]`` (one token per row), then a dense
layer, ``tanh`` and the classifier: the classifier's ``[B, H]`` input is
not a selection itself, but its row b is computed from row b of
``hidden[:, 0]`` alone, so it reads the same token indices.  The graph must
prove it: a node is recorded when it is a selection (``getitem``) of a
tensor whose leading dims are the layout, or a row-wise op
(``flat_tokens.ROW_WISE``) whose token-sized inputs all trace back to one
and the same selection.  Anything else (a transpose, a reduction, two
selections combined) ends the chain, and a site after it is left alone.
"""
from __future__ import annotations

import operator
from typing import Dict, Optional, Sequence

import torch
import torch.fx as fx

from .. import fx_utils
from ..site_inputs import dims_key
from .flat_tokens import row_wise_inputs


def _selects_from_layout(node: fx.Node, layout: Sequence) -> bool:
    """``node`` is ``source[index]`` with ``source``'s leading dims the layout (site_inputs checks the index)."""
    if node.op != "call_function" or node.target is not operator.getitem or not node.args:
        return False
    source = fx_utils.example_value(node.args[0])
    return (isinstance(source, torch.Tensor) and source.dim() > len(layout)
            and dims_key(source.shape[: len(layout)]) == dims_key(layout))


def row_selections(gm: fx.GraphModule, layout: Optional[Sequence]) -> Dict[fx.Node, fx.Node]:
    """``{node: selection}``: each node whose rows are those of one row ``selection`` of the layout (itself
    for a selection)."""
    found: Dict[fx.Node, fx.Node] = {}
    if not layout:
        return found
    for node in gm.graph.nodes:
        if _selects_from_layout(node, layout):
            found[node] = node
            continue
        picks = {found.get(a) for a in row_wise_inputs(node)}
        if len(picks) == 1 and None not in picks:
            found[node] = picks.pop()
    return found
