"""Pattern 3: sites that share one input (q/k/v, gate/up) share ONE shrink.

After patterns 1 and 5, each site has its own ``bgmv_shrink(x2d, A_site,
idx)``.  Shrinks whose activation and indices are the same tensor become one
shrink over the sites' A stacks concatenated along the rank dim (the
merged-column form vLLM uses); each site's expand then reads its own
columns of the result.  Exact: the shrink is column-wise independent.
"""
from __future__ import annotations

import collections
import operator
from typing import Dict, List, Tuple

import torch.fx as fx

from .. import fx_utils
from ..annotations import LORA_INPUT, GraphInputRequest
from ..kernel_spec import KernelSpec
from ..context import RewriteContext

PATTERN_NAME = "fuse_shared_shrink"


def _same_value_key(node: fx.Node) -> Tuple:
    """Structural key: two nodes with equal keys compute the same value (reshapes/narrows of one source)."""
    if (node.op == "call_method" and node.target in ("reshape", "narrow", "size")) or (
            node.op == "call_function" and node.target in (operator.add, operator.mul, operator.floordiv)):
        return (node.target, tuple(_same_value_key(a) if isinstance(a, fx.Node) else a for a in node.args))
    return ("node", node)


def _shrink_groups(graph: fx.Graph, ctx: RewriteContext) -> List[Tuple[KernelSpec, List[fx.Node]]]:
    """Shrinks (of any kernel in ``ctx.kernels``) whose arguments other than A are the same values."""
    groups: Dict[Tuple, List[fx.Node]] = collections.defaultdict(list)
    kernels = {}
    for kernel in ctx.kernels:
        target = kernel.shrink_op
        for node in graph.find_nodes(op="call_function", target=target):
            x2d, w, *rest = node.args
            request = w.meta.get(LORA_INPUT)
            if request is None or request.kind != kernel.weight_kinds[0]:
                continue
            key = (target, _same_value_key(x2d), request.dtype,
                   tuple(_same_value_key(a) if isinstance(a, fx.Node) else a for a in rest))
            groups[key].append(node)
            kernels[key] = kernel
    return [(kernels[k], g) for k, g in groups.items() if len(g) > 1]


def fuse_shared_shrinks(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Replace each group of shrinks over one input by one shrink and per-site column slices."""
    graph = gm.graph
    fused_any = False
    for kernel, group in _shrink_groups(graph, ctx):
        order = {n: i for i, n in enumerate(graph.nodes)}
        group.sort(key=order.get)
        first = group[0]
        requests = [n.args[1].meta[LORA_INPUT] for n in group]
        kind = requests[0].kind
        rank_dim = kernel.rank_dim
        ranks = [r.shape[rank_dim] for r in requests]
        shape = list(requests[0].shape)
        shape[rank_dim] = sum(ranks)
        # The fused A input's site is the tuple of its members' sites: the metadata concatenates their A stacks.
        fused_request = GraphInputRequest(kind, tuple(r.site for r in requests), tuple(shape), requests[0].dtype)
        device = fx_utils.example_value(first).device
        fused_w = fx_utils.get_or_add_input(graph, f"lora_a_fused_{ctx.report.shrinks_fused}", fused_request,
                                            device)
        x2d, _, *rest = first.args
        with graph.inserting_before(first):
            fused = fx_utils.call(graph, "call_function", first.target, x2d, fused_w, *rest)
        offset = 0
        for node, rank in zip(group, ranks):
            with graph.inserting_after(fused):
                part = fx_utils.call(graph, "call_method", "narrow", fused, 1, offset, rank)
            node.replace_all_uses_with(part)
            old_x2d, old_w, *old_rest = node.args
            graph.erase_node(node)
            if not old_w.users:
                graph.erase_node(old_w)  # the per-site A input is no longer fed
            if node is not first:
                fx_utils.erase_dead(_producers(old_x2d) + [p for a in old_rest for p in _producers(a)])
            offset += rank
        ctx.report.shrinks_fused += len(group) - 1
        fused_any = True
    return fused_any


def _producers(node) -> List[fx.Node]:
    """``node`` and the reshape/size/narrow/arithmetic nodes that made it (candidates to erase once unused)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in out:
            continue
        if (n.op == "call_method" and n.target in ("reshape", "narrow", "size")) or (
                n.op == "call_function" and n.target in (operator.add, operator.mul, operator.floordiv)):
            out.append(n)
            todo.extend(a for a in n.args[1:] if isinstance(a, fx.Node))
            if n.op == "call_function":
                todo.append(n.args[0])
    return out
