"""What every pattern's replacement needs: the site's token indices and stacked weights.

The token layout is the leading dims shared by most LoRA sites of the graph
(``[B, S]`` for HF models, ``[T]`` for flattened tokens); the mapping is
row-major over it, so a site on that layout flattened row-major (OPT's
``[B*S, H]``, proven by ``passes/flat_tokens.py``) reads the same indices.  A site whose input is a row selection of a tensor with
that layout (``hidden[:, -k:, :]`` before ``lm_head``), or computed row by
row from one (``passes/row_selections.py``: BERT's classifier after its
pooler), gets the same selection applied to the index grid.
"""
from __future__ import annotations

import collections
import operator
from typing import Optional, Tuple

import torch
import torch.fx as fx

from . import fx_utils
from .annotations import (BASE_WEIGHT, LORA_WEIGHT, ROW_SLOTS, SEGMENT_BLOCK_SLOTS, SEGMENT_PICK, SORTED_BLOCK_SLOTS,
                          SORTED_GATHER, SORTED_INVERSE, TOKEN_INDICES, GraphInputRequest, LoRAWeightRef)
from .fx_values import size_expr
from .context import RewriteContext
from .transposes import is_matrix_transpose


def dims_key(dims) -> Tuple[str, ...]:
    """A hashable key for a tuple of int/SymInt dims that adds no shape guards."""
    return tuple(str(size_expr(d)) for d in dims)


def _shape(node) -> Optional[Tuple]:
    value = fx_utils.example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _activation_dims(x) -> Optional[Tuple]:
    """Leading dims of a linear's activation; of its source when it is a row selection ``h[:, -1:, :]``."""
    if isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem:
        source_shape, shape = _shape(x.args[0]), _shape(x)
        if source_shape and shape and len(source_shape) == len(shape):
            return source_shape[:-1]
    shape = _shape(x)
    return shape[:-1] if shape else None


def _token_dims_of_use(user: fx.Node) -> Optional[Tuple]:
    """Leading (token) dims of the activation a LoRA A weight is applied to."""
    if user.op == "call_function" and user.target in (torch._C._nn.linear, operator.matmul, torch.matmul) and user.args:
        return _activation_dims(user.args[0])
    if user.op == "call_function" and user.target is torch.nn.functional.embedding:
        return _shape(user.args[0])
    if is_matrix_transpose(user):
        for inner in user.users:
            dims = _token_dims_of_use(inner)
            if dims is not None:
                return dims
    return None


def _depends_on_inputs(node: fx.Node, memo: dict) -> bool:
    """Whether ``node`` is computed from a graph input (DoRA applies A to a constant ``eye``)."""
    if node in memo:
        return memo[node]
    memo[node] = False  # cycles cannot happen; this only stops re-walking shared ancestors
    memo[node] = node.op == "placeholder" or any(_depends_on_inputs(a, memo) for a in node.all_input_nodes)
    return memo[node]


def find_token_layout(gm: fx.GraphModule) -> Optional[Tuple]:
    """The leading dims most LoRA sites apply to, or None when the graph has no registered site."""
    seen = collections.Counter()
    first = {}
    memo: dict = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        # A registered site's A weight, or its base weight (the site may have no LoRA branch in the graph;
        # BASE_WEIGHT holds a ref per site reading the tensor).
        ref = node.meta.get(LORA_WEIGHT)
        if (ref is None or ref.role != "A") and not node.meta.get(BASE_WEIGHT):
            continue
        for user in node.users:
            activation = next((a for a in user.all_input_nodes if a is not node), None)
            if is_matrix_transpose(user):
                activation = next((a for u in user.users for a in u.all_input_nodes if a is not user), None)
            if activation is None or not _depends_on_inputs(activation, memo):
                continue
            dims = _token_dims_of_use(user)
            if dims is not None:
                seen[dims_key(dims)] += 1
                first.setdefault(dims_key(dims), dims)
    if not seen:
        return None
    best = max(seen.values())
    return next(first[k] for k in first if seen[k] == best)  # ties: first in graph order


def _shared_indices(graph: fx.Graph, ctx: RewriteContext, device) -> fx.Node:
    return fx_utils.get_or_add_input(
        graph, "lora_token_indices", GraphInputRequest(TOKEN_INDICES, None, (ctx.max_num_tokens,)), device)


def site_indices(graph: fx.Graph, ctx: RewriteContext, tokens: fx.Node, flat: fx.Node, n_feature_dims: int,
                 device) -> Tuple[Optional[fx.Node], Optional[str]]:
    """The int32 ``[T_site]`` indices for a site whose activation is ``tokens``.

    ``tokens`` has the token dims then ``n_feature_dims`` feature dims;
    ``flat`` is it with the token dims flattened into one.  Returns (node,
    None), or (None, reason) when the site's tokens cannot be tied to the
    mapping.  Insert point: the caller's.
    """
    shape = _shape(tokens)
    layout = ctx.token_layout
    if shape is None or layout is None:
        return None, "no fake shapes on the graph to tie the site's tokens to the mapping"
    lead = shape[: len(shape) - n_feature_dims]
    idx = _shared_indices(graph, ctx, device)
    # Row-major [B*S] (passes/flat_tokens.py): the same token order as the layout, so the same indices.
    if dims_key(lead) == dims_key(layout) or tokens in ctx.flat_token_nodes:
        count = fx_utils.call(graph, "call_method", "size", flat, 0)
        return fx_utils.call(graph, "call_method", "narrow", idx, 0, 0, count), None
    picked = ctx.row_selections.get(tokens, tokens)  # a selection, or row-wise ops of one
    picked_shape = _shape(picked)
    selection = None
    if picked_shape is not None and len(picked_shape) == len(shape) and dims_key(picked_shape[: len(lead)]) == \
            dims_key(lead):
        selection = _row_selection(picked, layout, n_feature_dims)
    if selection is None:
        return None, (f"its token dims {list(dims_key(lead))} are neither the graph's token layout "
                      f"{list(dims_key(layout))}, a row selection of it (or computed row by row from one), nor (by "
                      "the graph's own reshapes) that layout flattened row-major")
    source, index = selection
    sizes = [fx_utils.call(graph, "call_method", "size", source, d) for d in range(len(layout))]
    total = sizes[0]
    for s in sizes[1:]:
        total = fx_utils.call(graph, "call_function", operator.mul, total, s)
    grid = fx_utils.call(graph, "call_method", "view",
                         fx_utils.call(graph, "call_method", "narrow", idx, 0, 0, total), *sizes)
    picked = fx_utils.call(graph, "call_function", operator.getitem, grid, index)
    return fx_utils.call(graph, "call_method", "reshape", picked, -1), None


def _row_selection(tokens: fx.Node, layout, n_feature_dims: int):
    """(source, index over the token dims) if ``tokens`` is ``source[index..., :]`` with source on the layout."""
    if tokens.op != "call_function" or tokens.target is not operator.getitem:
        return None
    source, index = tokens.args
    source_shape = _shape(source)
    if source_shape is None or dims_key(source_shape[: len(layout)]) != dims_key(layout):
        return None
    if isinstance(index, (int, slice)):
        index = (index,)
    if len(source_shape) != len(layout) + n_feature_dims or not isinstance(index, tuple):
        return None
    if len(index) > len(source_shape):
        return None
    index = index + (slice(None),) * (len(source_shape) - len(index))  # hidden[:, 0] is hidden[:, 0, :]
    token_part, feature_part = index[: len(layout)], index[len(layout):]
    if any(p != slice(None, None, None) for p in feature_part):
        return None
    if not all(isinstance(p, (int, slice)) for p in token_part):
        return None
    if any(isinstance(p, slice) and not all(v is None or isinstance(v, int) for v in (p.start, p.stop, p.step))
           for p in token_part):
        return None
    return source, token_part


def _on_token_layout(ctx: RewriteContext, tokens: fx.Node, n_feature_dims: int) -> bool:
    """Whether the site's token dims are the graph's token layout."""
    shape = _shape(tokens)
    if shape is None or ctx.token_layout is None:
        return False
    return dims_key(shape[: len(shape) - n_feature_dims]) == dims_key(ctx.token_layout)


def site_segment_layout(graph: fx.Graph, ctx: RewriteContext, tokens: fx.Node, flat: fx.Node, n_feature_dims: int,
                        device) -> Optional[Tuple[fx.Node, fx.Node]]:
    """The segment kernel's (block_slots ``[NB, K]``, pick ``[T]``) for a site on the graph's token layout.

    None when the site's tokens are not the
    layout's (a row selection keeps the token indices).  Any layout, flat
    ``[T]`` included: blocks run over the flattened tokens.  The inputs are
    fixed-size buffers the graph narrows to ``ceil(T / block_tokens)`` blocks
    and T tokens (``xla_lora_pass/kernels/segments.py``, ``segment_blocks``).
    """
    if not _on_token_layout(ctx, tokens, n_feature_dims):
        return None
    bt, k = ctx.kernel.params  # block tokens, slots per block
    max_blocks = -(-ctx.max_num_tokens // bt)
    block_slots = fx_utils.get_or_add_input(
        graph, f"lora_{SEGMENT_BLOCK_SLOTS}", GraphInputRequest(SEGMENT_BLOCK_SLOTS, None, (max_blocks, k),
                                                                 blocks=(bt, k)), device)
    pick = fx_utils.get_or_add_input(
        graph, f"lora_{SEGMENT_PICK}", GraphInputRequest(SEGMENT_PICK, None, (ctx.max_num_tokens,), blocks=(bt, k)),
        device)
    count = fx_utils.call(graph, "call_method", "size", flat, 0)
    blocks = fx_utils.call(graph, "call_function", operator.floordiv,
                           fx_utils.call(graph, "call_function", operator.add, count, bt - 1), bt)
    return (fx_utils.call(graph, "call_method", "narrow", block_slots, 0, 0, blocks),
            fx_utils.call(graph, "call_method", "narrow", pick, 0, 0, count))


def site_sorted_layout(graph: fx.Graph, ctx: RewriteContext, tokens: fx.Node, flat: fx.Node, n_feature_dims: int,
                       device) -> Optional[Tuple[fx.Node, fx.Node, fx.Node]]:
    """The sorted kernel's (gather ``[NB * BS]``, block_slots ``[NB]``, inverse ``[T]``) for a site on the graph's
    token layout, else None (a row selection keeps the token indices).

    Any layout, flat ``[T]`` included.  The inputs are fixed-size buffers
    the graph narrows to ``NB = (T + G * (BS - 1)) // BS`` blocks for G =
    ``ctx.num_slots + 1`` groups (``xla_lora_pass/kernels/sorted_tokens.py``, ``sorted_blocks``) and T tokens.
    """
    if not _on_token_layout(ctx, tokens, n_feature_dims):
        return None
    (bs,), groups = ctx.kernel.params, ctx.num_slots + 1  # block tokens; the slots and the base
    max_blocks = (ctx.max_num_tokens + groups * (bs - 1)) // bs
    blocks_arg = (bs, groups)
    gather = fx_utils.get_or_add_input(graph, f"lora_{SORTED_GATHER}", GraphInputRequest(
        SORTED_GATHER, None, (max_blocks * bs,), blocks=blocks_arg), device)
    block_slots = fx_utils.get_or_add_input(graph, f"lora_{SORTED_BLOCK_SLOTS}", GraphInputRequest(
        SORTED_BLOCK_SLOTS, None, (max_blocks,), blocks=blocks_arg), device)
    inverse = fx_utils.get_or_add_input(graph, f"lora_{SORTED_INVERSE}", GraphInputRequest(
        SORTED_INVERSE, None, (ctx.max_num_tokens,), blocks=blocks_arg), device)
    count = fx_utils.call(graph, "call_method", "size", flat, 0)
    blocks = fx_utils.call(graph, "call_function", operator.floordiv,
                           fx_utils.call(graph, "call_function", operator.add, count, groups * (bs - 1)), bs)
    rows = fx_utils.call(graph, "call_function", operator.mul, blocks, bs)
    return (fx_utils.call(graph, "call_method", "narrow", gather, 0, 0, rows),
            fx_utils.call(graph, "call_method", "narrow", block_slots, 0, 0, blocks),
            fx_utils.call(graph, "call_method", "narrow", inverse, 0, 0, count))


def site_row_slots(graph: fx.Graph, ctx: RewriteContext, tokens: fx.Node, flat: fx.Node, n_feature_dims: int,
                   device) -> Optional[Tuple[fx.Node]]:
    """The row kernel's int32 ``[B]`` row slots (a 1-tuple) for a site on the graph's token layout, else None.

    A row is the innermost token dim (S of ``[B, S]``); B is the product of
    the outer ones, read off ``tokens`` so it follows the bucket.  None when
    the layout is flat (``[T]``: no rows to tie the
    tokens to requests), rows are a static length under
    the kernel's minimum row length (1 by default: the decode step's ``[B, 1]``
    graph takes the row kernel too), or the site's tokens are neither the
    layout's nor another stack of the same rows (a row selection keeps the
    token indices).  The input is a ``[max_num_tokens]`` buffer the graph
    narrows to B.
    """
    shape = _shape(tokens)
    layout = ctx.token_layout
    if shape is None or layout is None or len(layout) < 2:
        return None
    if not isinstance(layout[-1], torch.SymInt) and int(layout[-1]) < ctx.kernel.params[0]:
        return None
    lead = shape[: len(shape) - n_feature_dims]
    if dims_key(lead) != dims_key(layout) and not _other_stack(tokens, lead, layout, n_feature_dims):
        return None
    slots = fx_utils.get_or_add_input(graph, f"lora_{ROW_SLOTS}", GraphInputRequest(ROW_SLOTS, None,
                                                                                   (ctx.max_num_tokens,)), device)
    rows = fx_utils.call(graph, "call_method", "size", tokens, 0)
    for d in range(1, len(layout) - 1):
        rows = fx_utils.call(graph, "call_function", operator.mul, rows,
                             fx_utils.call(graph, "call_method", "size", tokens, d))
    return (fx_utils.call(graph, "call_method", "narrow", slots, 0, 0, rows),)


def _other_stack(tokens: fx.Node, lead, layout, n_feature_dims: int) -> bool:
    """Whether a site's tokens are the layout's rows at another length: ``[B, S2]`` or a pooled ``[B]``.

    An encoder and a decoder of different lengths in one graph (T5), or a
    head on one pooled token per row.  Row b of such a site belongs to the
    same request as row b of the layout, so the row kernel gives it that
    row's slot; a row selection of the layout (``h[:, -1:]``) is not one.
    """
    if len(layout) < 2 or len(lead) not in (len(layout) - 1, len(layout)):
        return False
    if dims_key(lead[: len(layout) - 1]) != dims_key(layout[:-1]):
        return False
    return _row_selection(tokens, layout, n_feature_dims) is None


def stacked_input(graph: fx.Graph, ref: LoRAWeightRef, kind: str, shape, device) -> fx.Node:
    """The placeholder for one of a site's stacked tensors (A, B or bias), shared across its uses."""
    name = f"lora_{kind.replace('stacked_', '')}_{ref.site.replace('.', '_')}"
    return fx_utils.get_or_add_input(graph, name, GraphInputRequest(kind, ref.site, tuple(shape), ref.dtype), device)


def device_of(node: fx.Node):
    value = fx_utils.example_value(node)
    return value.device if isinstance(value, torch.Tensor) else None
