"""The ``normalize`` pass: strip identities the patterns would otherwise need variants for, and find the token layout.

Eval dropout, a None bias, an in-place ``+=`` on a fresh result, any
transpose of a LoRA weight (``.T`` is ``getattr`` or ``aten.numpy_T`` by torch version), ``.T`` / ``.mT`` /
``.H`` / ``.mH`` of any tensor (``getattr`` on torch 2.9, the aten op on newer torch), an embedding's gradient-only
arguments, a store into fresh zeros: each has one canonical form after this
pass, so each pattern is written once.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..fx_utils import call
from ..fx_values import example_value
from ..annotations import LORA_WEIGHT
from ..context import RewriteContext
from ..site_inputs import find_token_layout
from ..transposes import aten_attribute, is_matrix_transpose
from .flat_tokens import flat_token_nodes
from .row_selections import row_selections


def normalize(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Run every canonicalization below, then record the token layout most LoRA sites apply to."""
    removed = remove_eval_dropout(gm)
    changed = (drop_none_bias(gm) + removed + functionalize_fresh_index_puts(gm) + functionalize_fresh_updates(gm)
               + canonicalize_attribute_ops(gm) + canonicalize_weight_transposes(gm)
               + canonicalize_lora_embeddings(gm)) > 0
    ctx.token_layout = ctx.report.token_layout = find_token_layout(gm)
    ctx.flat_token_nodes = frozenset(flat_token_nodes(gm, ctx.token_layout))
    ctx.row_selections = row_selections(gm, ctx.token_layout)
    return changed


def is_eval_dropout(node: fx.Node) -> bool:
    """``F.dropout(x, p, training=False)``: PEFT's lora_dropout in eval mode, an identity."""
    if node.op != "call_function" or node.target is not torch.nn.functional.dropout:
        return False
    training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
    return training is False


def remove_eval_dropout(gm: fx.GraphModule) -> int:
    """Replace eval-mode dropout by its input so patterns need no dropout variant."""
    removed = 0
    for node in list(gm.graph.nodes):
        if is_eval_dropout(node):
            node.replace_all_uses_with(node.args[0] if node.args else node.kwargs["input"])
            gm.graph.erase_node(node)
            removed += 1
    return removed


def drop_none_bias(gm: fx.GraphModule) -> int:
    """``linear(x, w, None)`` -> ``linear(x, w)``: nn.Linear(bias=False) traces with an explicit None."""
    changed = 0
    for node in gm.graph.find_nodes(op="call_function", target=torch._C._nn.linear):
        if len(node.args) == 3 and node.args[2] is None and "bias" not in node.kwargs:
            node.args = node.args[:2]
            changed += 1
        elif node.kwargs.get("bias", 0) is None:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
            changed += 1
    return changed


_IN_PLACE = {operator.iadd: operator.add}


def functionalize_fresh_updates(gm: fx.GraphModule) -> int:
    """``y += d`` -> ``y + d`` where y is an intermediate only this update reads (loralib's ``result += ...``).

    Nothing else can see the mutation then, so the functional form has the
    same value; the patterns are written functionally.
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _IN_PLACE or len(node.args) != 2:
            continue
        target = node.args[0]
        if isinstance(target, fx.Node) and target.op in ("call_function", "call_method") and len(target.users) == 1:
            node.target = _IN_PLACE[node.target]
            changed += 1
    return changed


# Factories whose result is a fresh tensor no other tensor aliases.
_FRESH_METHODS = ("new_zeros", "new_empty", "new_full", "new_ones")


def functionalize_fresh_index_puts(gm: fx.GraphModule) -> int:
    """``z[mask] = v`` on a fresh ``new_zeros`` -> ``z' = torch.index_put(z, (mask,), v)`` (loralib's zero_pad).

    Only when every other reader of ``z`` comes after the store: they then
    read ``z'``, the value they saw, and no alias of ``z`` exists.  The
    patterns are written functionally.
    """
    changed = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.find_nodes(op="call_function", target=operator.setitem)):
        fresh, index, value = node.args
        if not (isinstance(fresh, fx.Node) and fresh.op == "call_method" and fresh.target in _FRESH_METHODS
                and isinstance(index, fx.Node) and isinstance(value, fx.Node) and not node.users):
            continue
        readers = [u for u in fresh.users if u is not node]
        if any(order[u] < order[node] for u in readers):
            continue
        with gm.graph.inserting_before(node):
            stored = call(gm.graph, "call_function", torch.index_put, fresh, (index,), value)
        for user in readers:
            user.replace_input_with(fresh, stored)
        gm.graph.erase_node(node)
        changed += 1
    return changed


def canonicalize_attribute_ops(gm: fx.GraphModule) -> int:
    """``aten.numpy_T(x)`` -> ``getattr(x, "T")`` (and mT, H, mH): newer Dynamo records an attribute read as the
    aten op the attribute calls, torch 2.9 as the read, which is what a pattern traced from ``x.T`` holds (loralib's
    ``MergedLinear`` transposes its padded delta, not a weight).  The same call, so the same value."""
    changed = 0
    for node in gm.graph.nodes:
        attr = aten_attribute(node)
        if attr:
            node.target, node.args = getattr, (node.args[0], attr)
            changed += 1
    return changed


def canonicalize_weight_transposes(gm: fx.GraphModule) -> int:
    """Every transpose of a LoRA weight placeholder -> ``w.t()``: one form for the patterns to match.

    Whatever form the torch version recorded it in (``getattr(w, "T")``, ``aten.numpy_T``, ``aten.mT``,
    ``transpose``, ``permute``, ...: ``transposes.is_matrix_transpose``).
    """
    changed = 0
    for placeholder in gm.graph.find_nodes(op="placeholder"):
        if LORA_WEIGHT not in placeholder.meta:
            continue
        for user in list(placeholder.users):
            if user.args and user.args[0] is placeholder and is_matrix_transpose(user) and not (
                    user.op == "call_method" and user.target == "t"):
                user.op, user.target, user.args, user.kwargs = "call_method", "t", (placeholder,), {}
                changed += 1
    return changed


# embedding's arguments that change only gradients.
_FORWARD_NEUTRAL = {"padding_idx", "norm_type", "scale_grad_by_freq", "sparse"}
# F.embedding's defaults, as the traced pattern records them.
_DEFAULTS = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False}


def canonicalize_lora_embeddings(gm: fx.GraphModule) -> int:
    """``embedding(ids, A.T, padding_idx=p, ...)`` -> the same call with F.embedding's defaults, for LoRA A.

    Those arguments change only gradients, so the forward value is the same;
    ``max_norm`` (which renormalises rows) is kept, and makes a near miss.
    """
    changed = 0
    for node in gm.graph.find_nodes(op="call_function", target=F.embedding):
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        # LoRA weight transposes are all ``.t()`` by now (canonicalize_weight_transposes).
        if not (isinstance(weight, fx.Node) and weight.op == "call_method" and weight.target == "t"
                and LORA_WEIGHT in getattr(weight.args[0], "meta", {})):
            continue
        extra = dict(zip(("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"), node.args[2:]))
        extra.update(node.kwargs)
        if extra.get("max_norm") is not None or not set(extra) <= _FORWARD_NEUTRAL | {"max_norm"}:
            continue
        node.args, node.kwargs = node.args[:2], dict(_DEFAULTS)
        changed += 1
    return changed
