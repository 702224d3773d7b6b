"""The padding hazards of state: tensors a graph writes in place, and tensors it holds across calls.

The backend pads a call's inputs (zero-filled copies) and slices its outputs
back; nothing else.  So padding is not exact when:

- an in-place write into a graph input or a held tensor, or into a view of
  one (``cache[:, :n].copy_(x)``), involves a token dim: a tensor with one,
  or a size computed from one (transformers 5's ``StaticLayer`` adds the
  prompt's length to its ``cumulative_length`` tensor, which would count the
  padded tokens); the write lands in a padded copy, or writes what padding
  made;
- an indexed in-place write (``index_copy_``, ``index_put_``, ``scatter_``,
  ``t[idx] = v``), whatever it writes into, takes its indices from a tensor
  with a token dim: a padded index is 0 and overwrites a real position
  (transformers 4.57 makes its static cache in the prompt's graph and writes
  it at ``cache_position``);
- the graph holds a tensor: one lifted into the graph (``get_attr``: torch
  2.9 lifts a static-address tensor it guards on) with a size equal to a
  padded dim's traced size (a held cache of batch 3 would meet a batch
  padded to 4), or a graph input marked static-address
  (``torch._dynamo.mark_static_address``: newer torch passes transformers'
  ``StaticCache`` tensors as inputs so; ``mark_static_inputs`` records which)
  with a dim of a padded symbol: it is one fixed-size tensor kept across calls,
  which padding would replace by a copy.
"""
from __future__ import annotations

import operator
from typing import List, Optional

import torch
import torch.fx as fx

from graph_rewrites.fx_values import example_value, size_expr

# placeholder.meta key: the input is a static-address tensor (transformers' StaticCache), held across calls.
STATIC_ADDRESS = "static_address_input"
# In-place ops that write at positions read from an index tensor, and the argument that holds it.
_INDEXED = {"index_copy_": 2, "index_add_": 2, "index_fill_": 2, "index_reduce_": 2, "scatter_": 2,
            "scatter_add_": 2, "scatter_reduce_": 2, "index_put_": 1, "setitem": 1}
# Ops whose result shares its first argument's storage: a write into it writes that tensor.
_VIEWS = {"getitem", "narrow", "view", "select", "slice", "transpose", "permute", "unsqueeze", "squeeze", "expand",
          "as_strided", "diagonal", "t", "unflatten", "view_as", "unfold", "movedim", "swapaxes", "split", "chunk",
          "unbind"}


def mark_static_inputs(gm: fx.GraphModule, example_inputs) -> None:
    """Record on each placeholder whether its example tensor is marked static-address (either kind of mark:
    guarded or not; ``_dynamo_static_input_type`` is the attribute ``mark_static_address`` sets on both
    torch 2.9 and 2.14)."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, torch.Tensor) and getattr(value, "_dynamo_static_input_type", None):
            node.meta[STATIC_ADDRESS] = True


def op_name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def token_dims(node, symbols) -> Optional[List[bool]]:
    """Per dim of ``node``'s tensor, whether it is (an expression of) a padded symbol; None if not a tensor."""
    value = example_value(node) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return [isinstance(d, torch.SymInt) and bool(size_expr(d).free_symbols & symbols) for d in value.shape]


def _padded_size(node, symbols) -> bool:
    value = example_value(node)
    return isinstance(value, torch.SymInt) and bool(size_expr(value).free_symbols & symbols)


def write_hazard(node: fx.Node, symbols) -> Optional[str]:
    """Why an in-place write at ``node`` makes padding inexact (None if it does not, or is no write)."""
    name = op_name(node)
    if not (name == "setitem" or (name.endswith("_") and not name.startswith("_"))) or not node.args:
        return None
    if name in _INDEXED and len(node.args) > _INDEXED[name]:
        index = node.args[_INDEXED[name]]
        indices = index if isinstance(index, (tuple, list)) else (index,)
        if any(any(token_dims(i, symbols) or ()) for i in indices):
            return "writes in place at indices with a token dim (a padded index is 0: it overwrites a real one)"
    target, involved = node.args[0], list(node.all_input_nodes)
    while isinstance(target, fx.Node) and op_name(target) in _VIEWS and target.args:
        involved += target.all_input_nodes  # a view's own sizes and indices (``cache[:, :n]``) are part of it
        target = target.args[0]
    if isinstance(target, fx.Node) and target.op in ("placeholder", "get_attr") and any(
            any(token_dims(a, symbols) or ()) or _padded_size(a, symbols) for a in involved):
        what = "a graph input" if target.op == "placeholder" else f"the tensor {target.target} the graph holds"
        return f"writes {what} in place with a token dim"
    return None


def held_tensor_hazard(gm: fx.GraphModule, symbols) -> Optional[str]:
    """A held tensor tied to a padded dim: lifted, with a size equal to a padded symbol's traced size (it may be
    that dim, unpadded), or a static-address input with a dim of a padded symbol."""
    for node in gm.graph.find_nodes(op="placeholder"):
        if node.meta.get(STATIC_ADDRESS) and any(token_dims(node, symbols) or ()):
            return (f"the graph input {node.target} is a static-address tensor (held across calls, as "
                    f"transformers' StaticCache), and a dim of it is padded: padding would replace it by a copy")
    held_nodes = gm.graph.find_nodes(op="get_attr")
    if not held_nodes:
        return None
    traced = {}
    for node in gm.graph.nodes:
        value = example_value(node)
        for d in value.shape if isinstance(value, torch.Tensor) else ():
            if isinstance(d, torch.SymInt) and size_expr(d) in symbols and d.node.hint is not None:
                traced.setdefault(size_expr(d), int(d.node.hint))
    for node in held_nodes:
        held = operator.attrgetter(node.target)(gm)  # a dotted path into submodules, or one flat name
        if not isinstance(held, torch.Tensor):
            continue
        tied = sorted(str(s) for s, n in traced.items() if n in tuple(held.shape))
        if tied:
            return (f"the graph holds the tensor {node.target} of size {list(held.shape)}, which padding does not "
                    f"pad, and a size of it equals the traced value of the padded {', '.join(tied)}")
    return None


__all__ = ["STATIC_ADDRESS", "held_tensor_hazard", "mark_static_inputs", "op_name", "token_dims", "write_hazard"]
