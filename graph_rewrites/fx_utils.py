"""Small FX helpers shared by the patterns."""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from .annotations import LORA_INPUT, GraphInputRequest
from .fx_values import VALUE_KEY, example_value


def _graph_cache(graph: fx.Graph) -> dict:
    """Per-graph memo (fake mode, added inputs), so each new node costs O(1), not O(placeholders)."""
    cache = getattr(graph, "_xla_lora_cache", None)
    if cache is None:
        cache = graph._xla_lora_cache = {}
    return cache


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's example values, or None for a graph traced without them."""
    cache = _graph_cache(graph)
    if "fake_mode" not in cache:
        # Read it off the values themselves: detect_fake_mode would also consult the
        # ambient tracing context, which belongs to whichever frame Dynamo is in.
        cache["fake_mode"] = next(
            (m for m in (getattr(n.meta.get(VALUE_KEY), "fake_mode", None)
                         for n in graph.find_nodes(op="placeholder")) if m is not None), None)
    return cache["fake_mode"]


def shape_of(node: Any):
    """The node's example shape as a tuple (None without a tensor value), for the report."""
    value = example_value(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def propagate_value(node: fx.Node) -> None:
    """Fill ``node.meta`` by running its target on the fake values of its inputs."""
    mode = fake_mode_of(node.graph)
    if mode is None:
        return
    if any(example_value(n) is None for n in node.all_input_nodes):
        return
    args = fx.node.map_arg(node.args, example_value)
    kwargs = fx.node.map_arg(node.kwargs, example_value)
    with mode:
        if node.op == "call_method":
            self_arg, *rest = args
            node.meta[VALUE_KEY] = getattr(self_arg, node.target)(*rest, **kwargs)
        else:
            node.meta[VALUE_KEY] = node.target(*args, **kwargs)


def get_or_add_input(graph: fx.Graph, name: str, request: GraphInputRequest, device) -> fx.Node:
    """The placeholder for ``request``, added after the last placeholder if missing.

    New inputs go last so the caller appends their tensors to the original args.
    """
    added = _graph_cache(graph).setdefault("inputs", {})
    node = added.get(request)
    if node is not None and not node._erased:  # the fused shrink erases per-site A inputs
        return node
    last = next(iter(reversed(graph.find_nodes(op="placeholder"))), None)
    with graph.inserting_after(last) if last is not None else graph.inserting_before():
        node = graph.placeholder(name)
    added[request] = node
    node.meta[LORA_INPUT] = request
    # aot_autograd asserts every placeholder of a Dynamo graph has a source; ours has none.
    node._dynamo_source = None
    mode = fake_mode_of(graph)
    if mode is not None:
        with mode:
            node.meta[VALUE_KEY] = torch.empty(request.shape, dtype=request.dtype, device=device)
    return node


def call(graph: fx.Graph, op: str, target, *args, **kwargs) -> fx.Node:
    """Create a node (call_function or call_method) and fill its fake value."""
    node = graph.create_node(op, target, args, kwargs)
    propagate_value(node)
    return node


def erase_dead(nodes: Iterable[fx.Node]) -> int:
    """Erase the given compute nodes that have no users left (users first); returns how many went."""
    pending = [n for n in nodes if n.op in ("call_function", "call_method")]
    erased, progress = 0, True
    while progress:  # a few rounds over a site's handful of nodes: no walk over the whole graph
        progress = False
        for node in list(pending):
            if not node.users:
                node.graph.erase_node(node)
                pending.remove(node)
                erased += 1
                progress = True
    return erased
