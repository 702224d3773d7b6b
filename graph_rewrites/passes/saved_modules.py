"""Pattern 9: PEFT ``modules_to_save``, every slot's copy in one batch.

PEFT keeps a full copy of a saved module (``lm_head``, ``embed_tokens``, a
classification head) per adapter and runs the active one; Dynamo captures
that copy's ops, its parameters as graph inputs.  This pass finds that
region, duplicates it once per variant (the original module, which serves
the rows on the base model, and each adapter's copy), each duplicate reading
its own variant's tensors as new graph inputs, and selects per token, or per
row for a head that pools each row to one output (``[B, ...]``):

    out = where(idx == s, out_s, ... where(idx == 0, out_0, out_original))

Why it is exact.  The region is the set of nodes whose
``meta["nn_module_stack"]`` holds the wrapper's own key (the module's
identity, recorded by Dynamo as it inlined the wrapper's forward), anchored
by placeholders the caller identified by tensor identity; nothing is guessed
from names.  Every copy is a deep copy of the original module, with the same
code and the same tensor names and shapes (the caller checks that), so
running the traced ops on another variant's tensors is what that variant's
forward computes, op for op, and ``where`` picks each output value as it is.
A region that does not meet the conditions (one output, no side effects, its
users after it, tokens tied to the mapping) is left alone and reported, and
the graph then accepts only a uniform mapping (``unserved_saved_modules``).
"""
from __future__ import annotations

import collections
import operator
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from .. import fx_utils
from ..annotations import POOLED_ROW_SLOTS, SAVED_MODULE_PARAM, SAVED_PARAM, GraphInputRequest, SavedParamRef
from ..context import RewriteContext
from ..report import NearMiss, SiteRewrite
from ..site_inputs import device_of, dims_key, site_indices

PATTERN_NAME = "saved_module"


def saved_param_inputs(gm: fx.GraphModule) -> Dict[str, List[fx.Node]]:
    """Placeholders holding a saved module's tensors that the graph reads, per saved module.

    A tensor is found by identity, so a tied one (the original ``lm_head``'s
    weight is ``embed_tokens``'s) is marked in a graph that reads it only as
    the other module's.  An original module's tensor read only outside the
    module, in a graph whose nodes record the module (it runs a copy, or ran
    one before this pass served it), is not the module's: counted, it stood
    for the original and made a graph running the copy look like one running
    the base model.  A copy's tensor read outside still counts (and
    ``find_region`` refuses it).
    """
    found: Dict[str, List[fx.Node]] = collections.defaultdict(list)
    for node in gm.graph.find_nodes(op="placeholder"):
        ref = node.meta.get(SAVED_PARAM)
        if ref is not None and node.users:
            found[ref.site].append(node)
    recorded = {key for n in gm.graph.nodes if n.op in ("call_function", "call_method")
                for key in (n.meta.get("nn_module_stack") or {})}
    for site, nodes in list(found.items()):
        kept = [n for n in nodes if not _read_only_as_another_modules(n, n.meta[SAVED_PARAM], recorded)]
        if kept:
            found[site] = kept
        else:
            del found[site]
    return dict(found)


def _read_only_as_another_modules(node: fx.Node, ref: SavedParamRef, recorded) -> bool:
    return ref.adapter is None and ref.module_key in recorded and not any(
        _in_module(u, ref.module_key) for u in node.users)


def unserved_saved_modules(gm: fx.GraphModule) -> Dict[str, SavedParamRef]:
    """Saved modules the graph still runs as one variant for every token (variant in ``.adapter``)."""
    return {site: nodes[0].meta[SAVED_PARAM] for site, nodes in saved_param_inputs(gm).items()}


def _in_module(node: fx.Node, key: str) -> bool:
    return key in (node.meta.get("nn_module_stack") or {})


class Region:
    """The traced nodes of one saved module's forward: its compute nodes, inputs and one output."""

    def __init__(self, nodes: List[fx.Node], params: List[fx.Node], activations: List[fx.Node], output: fx.Node):
        self.nodes, self.params, self.activations, self.output = nodes, params, activations, output


def find_region(gm: fx.GraphModule, params: List[fx.Node]) -> Tuple[Optional[Region], Optional[str]]:
    """The region of the saved module whose tensors are ``params``, or (None, why not)."""
    key = params[0].meta[SAVED_PARAM].module_key
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and _in_module(n, key)]
    if not nodes:
        return None, "no node of the graph records the saved module in its nn_module_stack"
    inside = set(nodes)
    for p in params:
        outside = [u for u in p.users if u not in inside]
        if outside:
            return None, f"its tensor {p.name} is also read outside the module by {outside[0].format_node()}"
    param_set = set(params)
    activations, outputs = [], []
    for node in nodes:
        if node.is_impure():
            return None, f"{node.format_node()} has side effects; it cannot run once per variant"
        for a in node.all_input_nodes:
            if a not in inside and a not in param_set and a not in activations:
                activations.append(a)
        if any(u not in inside for u in node.users):
            outputs.append(node)
    if len(outputs) != 1:
        return None, f"the module's region has {len(outputs)} outputs, not one"
    last = nodes[-1]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    late = [u for u in outputs[0].users if order[u] < order[last]]
    if late:
        return None, f"{late[0].format_node()} reads the module's output before the module's last node"
    return Region(nodes, params, activations, outputs[0]), None


def _tensor_activation(region: Region) -> Optional[fx.Node]:
    tensors = [a for a in region.activations if isinstance(fx_utils.example_value(a), torch.Tensor)]
    return tensors[0] if len(tensors) == 1 else None


def _selection_index(graph: fx.Graph, ctx: RewriteContext, region: Region, device):
    """(int32 index, one per row of the flattened output, and a function flattening a variant's output)
    for per-token or per-row selection, or (None, why not)."""
    out = fx_utils.example_value(region.output)
    x = _tensor_activation(region)
    layout = ctx.token_layout
    if not isinstance(out, torch.Tensor) or out.dim() < 1 or x is None or layout is None:
        return None, "its output, its one tensor input or the graph's token layout is unknown"
    x_val = fx_utils.example_value(x)
    # Per token: the output keeps the input's token dims (Linear [.., in] -> [.., out], Embedding ids -> [.., H]).
    for n_features in (1, 0):
        lead = x_val.shape[: x_val.dim() - n_features]
        if len(lead) and out.dim() == len(lead) + 1 and dims_key(out.shape[:-1]) == dims_key(lead):
            flat_x = fx_utils.call(graph, "call_method", "reshape", x, -1, *([x_val.shape[-1]] if n_features else []))
            idx, reason = site_indices(graph, ctx, x, flat_x, n_features, device)
            if idx is None:
                return None, reason
            return idx, lambda y: fx_utils.call(graph, "call_method", "reshape", y, -1, out.shape[-1])
    # Per row: a head that pools each row of a [B, S] layout to one output.
    if len(layout) == 2 and dims_key(out.shape[:1]) == dims_key(layout[:1]):
        slots = fx_utils.get_or_add_input(graph, f"lora_{POOLED_ROW_SLOTS}",
                                          GraphInputRequest(POOLED_ROW_SLOTS, None, (ctx.max_num_tokens,)), device)
        # B read off x (the head's input), which carries the batch dim whether or not the output's is symbolic.
        rows = fx_utils.call(graph, "call_method", "size", x, 0)
        idx = fx_utils.call(graph, "call_method", "narrow", slots, 0, 0, rows)
        return idx, lambda y: fx_utils.call(graph, "call_method", "reshape", y, rows, -1)
    return None, (f"its output {list(dims_key(out.shape))} is neither per token nor per row of the token layout "
                  f"{list(dims_key(layout))}")


def _variant_input(graph: fx.Graph, ref: SavedParamRef, adapter: Optional[str], param: fx.Node, device) -> fx.Node:
    value = fx_utils.example_value(param)
    name = f"lora_saved_{ref.site}_{adapter or 'original'}_{ref.param}".replace(".", "_")
    request = GraphInputRequest(SAVED_MODULE_PARAM, ref.site, tuple(value.shape), value.dtype, (adapter, ref.param))
    return fx_utils.get_or_add_input(graph, name, request, device)


def _copy_region(graph: fx.Graph, region: Region, adapter: Optional[str], device) -> fx.Node:
    """The region's nodes once more, reading ``adapter``'s tensors (None: the original's); returns its output."""
    env = {p: _variant_input(graph, p.meta[SAVED_PARAM], adapter, p, device) for p in region.params}
    for node in region.nodes:
        copy = graph.node_copy(node, lambda n: env.get(n, n))
        fx_utils.propagate_value(copy)
        env[node] = copy
    return env[region.output]


def _serve(gm: fx.GraphModule, ctx: RewriteContext, region: Region, ref: SavedParamRef) -> Optional[str]:
    """Replace the region by one copy per variant and the selection; None, or why not (graph unchanged)."""
    graph = gm.graph
    device = device_of(region.output)
    last = region.nodes[-1]
    anchor = last.next
    with graph.inserting_before(anchor):
        idx, flatten = _selection_index(graph, ctx, region, device)
        if idx is not None:
            original = _copy_region(graph, region, None, device)
            selected = flatten(original)
            column = fx_utils.call(graph, "call_method", "view", idx, -1, 1)
            for slot, adapter in enumerate(ref.slots):
                if adapter is None or adapter not in ref.adapters:
                    continue  # that slot runs the original module, as PEFT does for an adapter without a copy
                hit = fx_utils.call(graph, "call_function", operator.eq, column, slot)
                out = flatten(_copy_region(graph, region, adapter, device))
                selected = fx_utils.call(graph, "call_function", torch.where, hit, out, selected)
            result = fx_utils.call(graph, "call_method", "view_as", selected, original)
    if idx is None:
        made, node = [], last.next
        while node is not anchor:
            made.append(node)
            node = node.next
        for node in reversed(made):  # undo the index nodes made before the failure
            graph.erase_node(node)
        return flatten
    region.output.replace_all_uses_with(result)
    fx_utils.erase_dead(list(reversed(region.nodes)))
    return None


def serve_saved_modules(gm: fx.GraphModule, ctx: RewriteContext) -> bool:
    """Duplicate every saved module's region per variant and select per token or row; record the sites."""
    modified = False
    for site, params in saved_param_inputs(gm).items():
        ref: SavedParamRef = params[0].meta[SAVED_PARAM]
        region, reason = find_region(gm, params)
        if region is not None:
            reason = _serve(gm, ctx, region, ref)
        if reason is not None:
            ctx.report.near_misses.append(NearMiss(site, PATTERN_NAME, reason))
            continue
        ctx.report.sites.append(SiteRewrite(
            site=site, pattern=PATTERN_NAME, adapter=ref.adapter,
            x_shape=None, out_shape=tuple(fx_utils.example_value(region.output).shape), rank=0,
            num_slots=len(ref.slots), replaced=[n.name for n in region.nodes]))
        modified = True
    return modified


__all__ = ["serve_saved_modules", "unserved_saved_modules", "find_region", "PATTERN_NAME"]
