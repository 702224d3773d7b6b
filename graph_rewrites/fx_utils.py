"""Small FX helpers shared by the patterns."""
from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx

from .annotations import LORA_INPUT, GraphInputRequest

VALUE_KEY = "example_value"  # Dynamo-level graphs keep their fake values here


def fake_mode_of(graph: fx.Graph):
    """The fake mode of the graph's example values, or None for a graph traced without them."""
    # Read it off the values themselves: detect_fake_mode would also consult the
    # ambient tracing context, which belongs to whichever frame Dynamo is in.
    for node in graph.find_nodes(op="placeholder"):
        mode = getattr(node.meta.get(VALUE_KEY), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def example_value(node: Any) -> Any:
    """The node's fake value (Dynamo keeps it in ``example_value``); literals pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get(VALUE_KEY, node.meta.get("val"))
    return node


def propagate_value(node: fx.Node) -> None:
    """Fill ``node.meta`` by running its target on the fake values of its inputs."""
    mode = fake_mode_of(node.graph)
    if mode is None:
        return
    args = fx.node.map_arg(node.args, example_value)
    kwargs = fx.node.map_arg(node.kwargs, example_value)
    if any(isinstance(a, fx.Node) for a in fx.node.map_aggregate((args, kwargs), lambda a: a)):
        return
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
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in placeholders:
        if node.meta.get(LORA_INPUT) == request:
            return node
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before():
        node = graph.placeholder(name)
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
    """Erase the given nodes that have no users left, newest first; returns how many went."""
    erased = 0
    for node in sorted(nodes, key=_topo_position, reverse=True):
        if node.op in ("call_function", "call_method") and not node.users:
            node.graph.erase_node(node)
            erased += 1
    return erased


def _topo_position(node: fx.Node) -> int:
    for i, n in enumerate(node.graph.nodes):
        if n is node:
            return i
    raise ValueError(f"{node.format_node()} is not in its graph")


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


def literal_operand(node: fx.Node, other: fx.Node) -> Optional[float]:
    """For a binary ``node`` with one node operand ``other``, the numeric literal beside it."""
    for arg in node.args:
        if arg is not other and isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return float(arg)
    return None


BINARY_MUL = (operator.mul, torch.mul)
BINARY_ADD = (operator.add, torch.add)


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
